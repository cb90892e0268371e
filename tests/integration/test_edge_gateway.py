"""Default deny at the edge, end to end: a tenant learns nothing of another tenant on any
route, and no engine route is reached but the ones ace decides (docs/gateway.md, "Routes").

Each test runs through two fronts, in front of the same kind of recording upstream (a
vLLM flavour that allow-lists ``/tokenize``): ace's own Envoy (``python -m extproc``, the
drop-in config) and the endpoint picker's Envoy (``--protocol epp``, configured as the
inference extension's chart does). What the upstream received is read back.
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

import httpx
import pytest

from tests.extproc.builders import KEYS, upstream, write_state
from tests.support.envoy import run_epp_envoy
from tests.support.upstream import RecordingUpstream
from tools.localstack import extproc_process, gateway_front

ACME = {"authorization": f"Bearer {KEYS['alice']}", "content-type": "application/json"}
GLOBEX = {"authorization": f"Bearer {KEYS['bob']}", "content-type": "application/json"}
HIDDEN_FROM_ACME, ABSENT = "globex-secret", "no-such-adapter"


@contextlib.contextmanager
def front(kind: str, tmp: Path, state: Path, up: RecordingUpstream):
    if kind == "envoy":
        with gateway_front(tmp, state, up.address, message_timeout="5s") as port:
            yield port
    else:
        with extproc_process(tmp, state, extproc_args=["--protocol", "epp"]) as (address, _):
            with run_epp_envoy(tmp, extproc=address) as port:
                yield port


def _state(tmp: Path, up: RecordingUpstream, **fields) -> Path:
    return write_state(tmp, [upstream("engine", up.address, "vllm", allow_paths=["/tokenize"])], **fields)


@pytest.fixture(scope="module", params=["envoy", "epp"])
def gw(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("edge-" + request.param)
    with RecordingUpstream() as up:
        with front(request.param, tmp, _state(tmp, up), up) as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15) as http:
                yield {"http": http, "up": up, "kind": request.param}


def _nothing_upstream(gw, before: int) -> None:
    assert len(gw["up"].requests) == before, [r.path for r in list(gw["up"].requests)[before:]]


def _ids(r: httpx.Response) -> list[str]:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    return [m["id"] for m in body["data"]]


# ---------- the model list is the gateway's ----------

def test_model_list_is_per_tenant_and_never_the_engines(gw):
    before = len(gw["up"].requests)
    acme = gw["http"].get("/v1/models", headers=ACME)
    assert _ids(acme) == ["ace-tiny-llama", "acme-legal", "code-python"]
    assert _ids(gw["http"].get("/v1/models", headers=GLOBEX)) == ["ace-tiny-llama", "code-python", "globex-secret"]
    assert all(set(m) <= {"id", "object", "created", "owned_by", "parent"} for m in acme.json()["data"])
    assert gw["http"].get("/v1/models/acme-legal", headers=ACME).json()["owned_by"] == "acme"
    assert gw["http"].get("/v1/models").status_code == 401           # public_model_list off
    _nothing_upstream(gw, before)


# ---------- every route: another tenant's adapter is answered like one that does not exist ----------

ROUTES = {
    "POST /v1/chat/completions": lambda m: {"model": m, "messages": [{"role": "user", "content": "hi"}]},
    "POST /v1/completions": lambda m: {"model": m, "prompt": "hi"},
    "POST /v1/responses": lambda m: {"model": m, "input": "hi"},
    "POST /v1/embeddings": lambda m: {"model": m, "input": "hi"},
    "POST /v1/execute": lambda m: {"input": {"messages": [{"role": "user", "content": "hi"}]},
                                   "extra_body": {"lora_name": m}},
    "POST /tokenize": lambda m: {"model": m, "prompt": "hi"},
    "POST /v1/chat/completions extra_body": lambda m: {"model": "ace-tiny-llama", "extra_body": {"lora_name": m},
                                                       "messages": [{"role": "user", "content": "hi"}]},
    "POST /v1/responses lora_name": lambda m: {"model": "ace-tiny-llama", "lora_name": m, "input": "hi"},
    "GET /v1/models/{model}": None,
}


def _ask(gw, route: str, model: str) -> httpx.Response:
    method, path = route.split(" ")[:2]
    if ROUTES[route] is None:
        return gw["http"].request(method, path.format(model=model), headers=ACME)
    return gw["http"].request(method, path, content=json.dumps(ROUTES[route](model)), headers=ACME)


@pytest.mark.parametrize("route", list(ROUTES))
def test_another_tenants_adapter_is_answered_like_an_absent_one(gw, route):
    """Named by ``lora_name``: 404 alike; named by ``model``: both are names acme's key does
    not know, served by acme's default adapter alike. Either way the same bytes."""
    before = len(gw["up"].requests)
    hidden = _ask(gw, route, HIDDEN_FROM_ACME)
    sent_hidden = list(gw["up"].requests)[before:]
    absent = _ask(gw, route, ABSENT)
    sent_absent = list(gw["up"].requests)[before + len(sent_hidden):]
    assert hidden.status_code == absent.status_code, (hidden.text, absent.text)
    assert [r.body for r in sent_hidden] == [r.body for r in sent_absent]
    assert HIDDEN_FROM_ACME.encode() not in b"".join(r.body for r in sent_hidden)
    if hidden.status_code == 404:
        assert hidden.text.replace(HIDDEN_FROM_ACME, "X") == absent.text.replace(ABSENT, "X")
        assert not sent_hidden
    else:
        assert hidden.status_code == 200 and sent_hidden[0].json()["model"] == "acme-legal"   # acme's default
    same = ("x-ace-trace-multi-lora", "x-ace-trace-dynamic-lora-prefetch", "x-ace-served-by", "content-type")
    assert [hidden.headers.get(h) for h in same] == [absent.headers.get(h) for h in same]
    # and the owner gets through on the same route
    if ROUTES[route] is not None:
        r = gw["http"].request(route.split(" ")[0], route.split(" ")[1],
                               content=json.dumps(ROUTES[route](HIDDEN_FROM_ACME)), headers=GLOBEX)
        assert r.status_code == 200, r.text
        got = gw["up"].requests[-1]
        assert got.headers["x-ace-tenant-id"] == "globex"
        assert got.path == ("/v1/chat/completions" if "execute" in route else route.split(" ")[1])
        if "execute" not in route:
            assert got.json()["model"] == HIDDEN_FROM_ACME


# ---------- everything else: 404 from the gateway, after the key check ----------

@pytest.mark.parametrize("method, path", [
    ("GET", "/metrics"), ("POST", "/v1/load_lora_adapter"), ("POST", "/load_lora_adapter"),
    ("GET", "/v2/whatever"), ("GET", "/version"), ("GET", "/server_info"), ("POST", "/v1/chat/completions/"),
    ("POST", "/detokenize"), ("POST", "/v1/load%5Flora%5Fadapter")])
def test_other_paths_are_404_with_a_key_401_without_and_never_reach_the_engine(gw, method, path):
    before = len(gw["up"].requests)
    r = gw["http"].request(method, path, content=b'{"lora_name": "evil", "lora_path": "/tmp/evil"}', headers=ACME)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "unknown_route" and r.json()["error"]["type"] == "invalid_request_error"
    assert gw["http"].request(method, path, content=b"{}").status_code == 401
    _nothing_upstream(gw, before)


def test_health_is_open_and_reaches_the_engine(gw):
    r = gw["http"].get("/health")
    assert r.status_code == 200 and gw["up"].requests[-1].path == "/health"


def test_allow_listed_route_is_key_checked_rewritten_and_routed(gw):
    r = gw["http"].post("/tokenize", content=json.dumps({"lora_name": "acme-legal", "prompt": "hi"}), headers=ACME)
    assert r.status_code == 200, r.text
    got = gw["up"].requests[-1]
    assert (got.path, got.json()["model"], got.json()["prompt"]) == ("/tokenize", "acme-legal", "hi")
    assert got.headers["x-ace-tenant-id"] == "acme"
    r = gw["http"].get("/tokenize", headers={"authorization": ACME["authorization"]})
    assert r.status_code == 200 and gw["up"].requests[-1].method == "GET"
    assert gw["up"].requests[-1].headers["x-ace-tenant-id"] == "acme"
    assert gw["http"].post("/tokenize", content=b"{}").status_code == 401


def test_responses_is_decided_like_chat_and_streams_through(gw):
    r = gw["http"].post("/v1/responses", content=json.dumps({"model": "code-python", "input": "hi", "stream": True}),
                        headers=ACME)
    assert r.status_code == 200, r.text
    assert "action=adapter_applied,adapter=code-python" in r.headers["x-ace-trace-multi-lora"]
    got = gw["up"].requests[-1]
    assert got.path == "/v1/responses"
    sent = got.json()
    assert (sent["model"], sent["input"], sent["stream"], sent["lora_name"]) == ("code-python", "hi", True,
                                                                                 "code-python")


# ---------- public_model_list: on, the list answers without a key ----------

def test_public_model_list_on_lists_public_adapters_without_a_key(tmp_path):
    with RecordingUpstream() as up:
        with front("envoy", tmp_path, _state(tmp_path, up, public_model_list=True), up) as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=15) as http:
                assert _ids(http.get("/v1/models")) == ["ace-tiny-llama", "code-python"]
                assert http.get("/v1/models/code-python").json()["owned_by"] == "public"
                assert http.get("/v1/models/acme-legal").status_code == 404
                assert "acme-legal" in _ids(http.get("/v1/models", headers=ACME))
                assert http.get("/v1/models", headers={"authorization": "Bearer nope"}).status_code == 401
                assert http.post("/v1/chat/completions", json={"model": "code-python"}).status_code == 401
        assert not up.requests
