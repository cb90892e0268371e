"""ace as the Gateway API Inference Extension's endpoint picker, end to end: a real Envoy
configured as the extension's standalone chart does (full duplex bodies, ORIGINAL_DST on
``x-gateway-destination-endpoint``, the ext_proc cluster over TLS with a gRPC health
check), ``python -m extproc --protocol epp`` (self-signed certificate) and two recording
upstreams. The subset hint comes from a test header through ``header_to_metadata``
(a real gateway sets the metadata itself)."""
from __future__ import annotations

import json
import ssl

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.extproc.builders import KEYS, upstream, write_state
from tests.support.envoy import run_epp_envoy
from tests.support.upstream import RecordingUpstream
from tools.localstack import extproc_process

ALICE = {"authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"}
SUBSET = "x-test-subset"
LIMIT = 400_000


DUPLEX, BUFFERED = "FULL_DUPLEX_STREAMED", "BUFFERED"


# (server flavour, TLS on the ext_proc port, body mode): the chart's set-up on every flavour,
# then the plaintext switch with BUFFERED bodies (Envoy AI Gateway's per-pool option)
@pytest.fixture(scope="module", params=[("h2", True, DUPLEX), ("aio", True, DUPLEX),
                                        ("threads", True, DUPLEX), ("h2", False, BUFFERED)],
                ids=lambda p: "-".join((p[0], "tls" if p[1] else "plain", p[2].lower())))
def stack(request, tmp_path_factory):
    server, tls, mode = request.param
    tmp = tmp_path_factory.mktemp("epp-" + server)
    with RecordingUpstream() as one, RecordingUpstream() as two:
        state = write_state(tmp, [upstream("one", one.address), upstream("two", two.address)],
                            max_body_bytes=LIMIT)
        args = ["--protocol", "epp", "--server", server, *(() if tls else ("--secure-serving", "false"))]
        with extproc_process(tmp, state, extproc_args=args) as (address, _):
            with run_epp_envoy(tmp, extproc=address, subset_header=SUBSET, tls=tls, body_mode=mode) as port:
                with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15) as http:
                    yield {"http": http, "extproc": address, "ups": {"one": one, "two": two},
                           "tls": tls, "mode": mode}


def assert_length(stack, req):
    """FULL_DUPLEX: Envoy drops Content-Length when the body is mutated (ProcessingMode's
    documentation) and sends the new body chunked, so no stale length reaches the engine.
    BUFFERED: the length ace set, matching the rewritten body."""
    if stack["mode"] == DUPLEX:
        assert "content-length" not in req.headers and req.headers["transfer-encoding"] == "chunked"
    else:
        assert int(req.headers["content-length"]) == len(req.body)


def chat(extra: str = "") -> bytes:
    return json.dumps({"model": "ace-tiny-llama", "lora_name": "code-python",
                       "messages": [{"role": "user", "content": "hi" + extra}]}).encode()


def received(stack):
    """The one request the upstreams received since the last call, and who got it."""
    got = [(name, up.requests.pop()) for name, up in stack["ups"].items() if up.requests]
    assert len(got) == 1, got
    return got[0]


def test_chat_reaches_the_picked_upstream_rewritten_with_its_length(stack):
    r = stack["http"].post("/v1/chat/completions", content=chat(), headers=ALICE)
    assert r.status_code == 200, r.text
    name, req = received(stack)
    assert r.headers["x-ace-served-by"] == name
    body = req.json()
    assert body["model"] == "code-python"                  # the adapter, rewritten by ace
    assert_length(stack, req)
    assert req.headers["x-ace-tenant-id"] == "acme"
    assert r.json()["model"] == "code-python"
    assert "action=adapter_applied" in r.headers["x-ace-trace-multi-lora"]


def test_large_body_is_rewritten_and_arrives_whole(stack):
    filler = "x" * 200_000                                 # > 62,000: several streamed chunks each way
    r = stack["http"].post("/v1/chat/completions", content=chat(filler), headers=ALICE)
    assert r.status_code == 200, r.text
    _, req = received(stack)
    body = req.json()
    assert body["model"] == "code-python" and body["messages"][0]["content"] == "hi" + filler
    assert_length(stack, req)


@pytest.mark.parametrize("target", ["one", "two"])
def test_subset_hint_is_honoured(stack, target):
    address = stack["ups"][target].address
    for _ in range(3):
        r = stack["http"].post("/v1/chat/completions", content=chat(),
                               headers={**ALICE, SUBSET: f"10.255.0.1:80,{address}"})
        assert r.status_code == 200, r.text
        assert received(stack)[0] == target


def test_subset_without_an_eligible_endpoint_is_503_json(stack):
    r = stack["http"].post("/v1/chat/completions", content=chat(),
                           headers={**ALICE, SUBSET: "10.255.0.1:80"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_endpoint"
    assert not any(up.requests for up in stack["ups"].values())


def test_client_cannot_supply_gateway_owned_headers(stack):
    r = stack["http"].post("/v1/chat/completions", content=chat(),
                           headers={**ALICE, "x-ace-hint-prefetch-status": "resident",
                                    "x-gateway-destination-endpoint": "10.255.0.1:80"})
    assert r.status_code == 200, r.text   # the client's pick is overwritten by ace's
    _, req = received(stack)
    assert req.headers["x-ace-tenant-id"] == "acme" and "x-ace-hint-prefetch-status" not in req.headers


def test_bad_key_is_401_json_and_nothing_goes_upstream(stack):
    r = stack["http"].post("/v1/chat/completions", content=chat(),
                           headers={**ALICE, "authorization": "Bearer sk-nope"})
    assert r.status_code == 401
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert not any(up.requests for up in stack["ups"].values())


def test_settings_page_and_api_are_answered_by_the_picker(stack):
    """deploy/kubernetes/components/inference-pool/httproute.yaml sends them to the pool:
    the picker answers them itself, nothing goes upstream."""
    http = stack["http"]
    page = http.get("/settings")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text
    me = http.get("/api/v1/me", headers=ALICE)
    assert me.status_code == 200 and me.json()["key"]["role"] == "admin", me.text
    r = http.post("/api/v1/me/skills", content=json.dumps({"skills": {"multi_lora": "prod"}}), headers=ALICE)
    assert r.status_code == 200, r.text
    assert http.get("/api/v1/usage").status_code == 401
    assert not any(up.requests for up in stack["ups"].values())


def test_stream_passes_through(stack):
    body = json.loads(chat())
    body["stream"] = True
    with stack["http"].stream("POST", "/v1/chat/completions", content=json.dumps(body),
                              headers=ALICE) as r:
        assert r.status_code == 200
        text = b"".join(r.iter_raw())
    assert text.endswith(b"data: [DONE]\n\n") and b"code-python" in text
    received(stack)


def channel(stack):
    if not stack["tls"]:
        return grpc.insecure_channel(stack["extproc"])
    creds = grpc.ssl_channel_credentials(
        root_certificates=ssl.get_server_certificate(tuple_address(stack["extproc"])).encode())
    return grpc.secure_channel(stack["extproc"], creds, options=[("grpc.ssl_target_name_override", "localhost")])


def test_other_paths_are_404_after_the_key_check(stack):
    """(Was: forwarded with a key, the body streamed through.) Default deny, as ace's own
    Envoy (tests/integration/test_edge_gateway.py: every route on both fronts)."""
    body = b'{"prompt": "' + b"y" * 150_000 + b'"}'
    r = stack["http"].post("/tokenize", content=body, headers=ALICE)
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
    r = stack["http"].get("/v1/models", headers=ALICE)
    assert r.status_code == 200 and "globex-secret" not in r.text      # the gateway's list
    assert stack["http"].get("/v1/models").status_code == 401
    assert stack["http"].post("/v1/load_lora_adapter", content=b"{}", headers=ALICE).status_code == 404
    assert stack["http"].post("/v1/load_lora_adapter", content=b"{}").status_code == 401
    assert not any(up.requests for up in stack["ups"].values())


def test_execute_rewrites_path_and_wraps_the_response_with_its_length(stack):
    body = {"input": {"messages": [{"role": "user", "content": "hi"}]}, "target": {"model": "ace-tiny-llama"},
            "extra_body": {"lora_name": "code-python", "max_tokens": 8}}
    r = stack["http"].post("/v1/execute", content=json.dumps(body), headers=ALICE)
    assert r.status_code == 200, r.text
    out = r.json()                                  # the held response body, rewritten by ace
    assert out["output"]["model"] == "code-python" and out["trace"][0]["skill"] == "multi_lora"
    assert int(r.headers.get("content-length", len(r.content))) == len(r.content)
    name, req = received(stack)
    assert req.path == "/v1/chat/completions" and req.json()["max_tokens"] == 8
    assert r.headers["x-ace-served-by"] == name


def test_health_services_answer_serving(stack):
    with channel(stack) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor", ""):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status \
                == health_pb2.HealthCheckResponse.SERVING


def tuple_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)
