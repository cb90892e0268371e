"""The gateway end to end: real Envoy + the ext_proc process + a recording upstream.

One stack per module (started once, always stopped). Requests use the real openai SDK
and httpx for the seeds' curl shapes; assertions read what the upstream received.
"""
from __future__ import annotations

import contextlib
import http.client
import json
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.extproc.builders import KEYS, write_state, upstream
from tests.support.procs import extproc_process, python
from tools.localstack import gateway_front
from tests.support.upstream import RecordingUpstream
from tests.support.wait import scaled
from tests.support.seeds import SEED_EXECUTE, SEED_HINTS

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
BOB = {"authorization": f"Bearer {KEYS['bob']}"}
CAROL = {"authorization": f"Bearer {KEYS['carol']}"}


class Stack:
    def __init__(self, base: str, up: RecordingUpstream) -> None:
        self.base, self.up = base, up
        self.port = int(base.rsplit(":", 1)[1])   # Envoy's, for raw HTTP/1 clients
        self.http = httpx.Client(base_url=base, timeout=10)

    def post(self, path: str, body, headers=None, **kw) -> httpx.Response:
        content = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return self.http.post(path, content=content,
                              headers={"content-type": "application/json", **(headers or {})}, **kw)

    def last(self):
        return self.up.requests[-1]

    def sdk(self, key: str = KEYS["alice"]) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=10)


@contextlib.contextmanager
def gateway_stack(tmp: Path, up: RecordingUpstream, flavour: str = "vllm", hints: str = "body"):
    state = write_state(tmp, [upstream("local-" + flavour, up.address, flavour, hints)])
    # a generous message timeout: a busy CI box must not turn into a 503 (fail-closed)
    with gateway_front(tmp, state, up.address, message_timeout="5s") as port:
        s = Stack(f"http://127.0.0.1:{port}", up)
        try:
            yield s
        finally:
            s.http.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with RecordingUpstream(chunk_delay_s=0.2) as up:
        with gateway_stack(tmp_path_factory.mktemp("gateway"), up) as s:
            yield s


CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


# ---------- OpenAI SDK ----------

def test_sdk_extra_body_lora_name_selects_adapter(stack):
    client = stack.sdk()
    raw = client.chat.completions.with_raw_response.create(
        model="ace-tiny-llama", messages=[{"role": "user", "content": "hi"}],
        extra_body={"lora_name": "code-python"})
    resp = raw.parse()
    assert resp.model == "code-python"
    got = stack.last()
    assert got.path == "/v1/chat/completions"
    body = got.json()
    assert body["model"] == "code-python"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["lora_name"] == "code-python" and body["lora_adapter"] == "code-python"
    assert body["prefetch_status"] == "unknown"
    assert got.headers["x-ace-tenant-id"] == "acme"
    assert raw.headers["x-ace-served-by"] == "local-vllm"
    ml = raw.headers["x-ace-trace-multi-lora"]
    assert ml.startswith("mode=prod,action=adapter_applied,adapter=code-python,residency=unknown")
    assert "swap_ms_saved=unknown" in ml
    pf = raw.headers["x-ace-trace-dynamic-lora-prefetch"]
    assert pf.startswith("mode=shadow,action=shadow,adapter=code-python")


def test_sdk_model_names_adapter_and_completions_route(stack):
    client = stack.sdk()
    out = client.completions.create(model="code-python", prompt="def f():", max_tokens=4)
    assert out.model == "code-python"
    got = stack.last()
    assert got.path == "/v1/completions"
    assert got.json()["prompt"] == "def f():" and got.json()["max_tokens"] == 4


@pytest.mark.parametrize("stream", [False, True])
def test_an_engines_404_for_the_chosen_adapter_is_retried_once_on_the_same_host(stack, stream):
    """vLLM can forget an adapter's name (an agent's unload) between its model check and its
    use, and answers 404 for a model the gateway resolved: Envoy sends the same request once
    more to the same host (whose resolver registers the adapter again). Two 404s in a row
    reach the client as the engine's 404."""
    body = {"model": "code-python", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    sent = len(stack.up.requests)
    stack.up.not_found["code-python"] = 1
    r = stack.post("/v1/chat/completions", body, headers=ALICE)
    assert r.status_code == 200, r.text
    arrived = list(stack.up.requests)[sent:]
    assert [q.path for q in arrived] == ["/v1/chat/completions"] * 2
    assert arrived[0].body == arrived[1].body and arrived[1].json()["model"] == "code-python"
    sent = len(stack.up.requests)
    stack.up.not_found["code-python"] = 2
    r = stack.post("/v1/chat/completions", body, headers=ALICE)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    assert len(list(stack.up.requests)[sent:]) == 2
    stack.up.not_found.clear()


def test_sdk_stream_passes_through_unbuffered_with_trace_headers(stack):
    client = stack.sdk()
    with client.chat.completions.with_streaming_response.create(
            model="code-python", messages=[{"role": "user", "content": "hi"}], stream=True) as raw:
        assert raw.headers["x-ace-served-by"] == "local-vllm"
        assert "action=adapter_applied" in raw.headers["x-ace-trace-multi-lora"]
        arrivals, text = [], ""
        for chunk in raw.parse():
            arrivals.append(time.monotonic())
            text += chunk.choices[0].delta.content or ""
    assert text == "Hello from the recording upstream"
    # chunks are 0.2 s apart upstream; buffered delivery would bunch them together
    assert arrivals[-1] - arrivals[0] > 0.5
    assert stack.last().json()["stream"] is True


def test_sdk_tenant_default_adapter(stack):
    out = stack.sdk().chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert out.model == "acme-legal"


def test_sdk_errors_are_openai_errors(stack):
    with pytest.raises(openai.AuthenticationError):
        stack.sdk("sk-wrong").chat.completions.create(model="code-python", messages=[])
    with pytest.raises(openai.NotFoundError) as exc:
        stack.sdk().chat.completions.create(model="x", messages=[], extra_body={"lora_name": "nope"})
    assert exc.value.body["param"] == "lora_name"


# ---------- curl shapes (httpx) ----------

def test_curl_nested_extra_body_chat(stack):
    body = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "extra_body": {"lora_name": "code-python"}, "temperature": 0.5}
    r = stack.post("/v1/chat/completions", body, ALICE)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "code-python"
    sent = stack.last().json()
    assert sent["model"] == "code-python"
    assert sent["extra_body"] == {"lora_name": "code-python"}   # nothing the client sent is lost
    assert sent["temperature"] == 0.5
    assert r.headers["x-ace-served-by"] == "local-vllm"


def test_curl_execute_native(stack):
    body = {"input": {"messages": [{"role": "user", "content": "hi"}]},
            "target": {"model": "ace-tiny-llama"},
            "skill_overrides": {"dynamic_lora_prefetch": "off"},
            "extra_body": {"lora_name": "code-python", "max_tokens": 8}}
    r = stack.post("/v1/execute", body, ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output"]["model"] == "code-python"
    assert out["output"]["object"] == "chat.completion"
    assert [t["skill"] for t in out["trace"]] == ["multi_lora", "dynamic_lora_prefetch"]
    assert out["trace"][0]["action"] == "adapter_applied"
    assert out["trace"][1]["mode"] == "off"
    got = stack.last()
    assert got.path == "/v1/chat/completions"
    sent = got.json()
    assert sent["model"] == "code-python" and sent["max_tokens"] == 8
    assert sent["messages"] == [{"role": "user", "content": "hi"}]
    assert r.headers["x-ace-served-by"] == "local-vllm"


# what the engine must receive instead: the gateway's values (no agent data in this stack)
GATEWAY_HINTS = {"lora_name": "code-python", "lora_adapter": "code-python", "lora_prefetch": False,
                 "enable_lora_prefetch": False, "prefetch_status": "unknown"}


def _hints(sent: dict) -> dict:
    return {k: sent[k] for k in ("lora_name", "lora_adapter", "lora_prefetch", "enable_lora_prefetch",
                                 "prefetch_adapter_id", "vram_allocated_mb", "prefetch_status")
            if k in sent}


def test_seed_execute_object_skills_and_response_shape(stack):
    r = stack.post("/v1/execute", SEED_EXECUTE, ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["id"].startswith("exec-") and out["output"]["id"] == out["id"]
    assert out["upstream_id"] == "cmpl-rec"
    assert out["output"]["object"] == "chat.completion" and out["output"]["model"] == "code-python"
    ml, pf = out["trace"]
    assert (ml["skill"], ml["mode"], ml["action"]) == ("multi_lora", "prod", "adapter_applied")
    assert (pf["skill"], pf["mode"], pf["action"]) == ("dynamic_lora_prefetch", "shadow", "shadow")
    for entry in (ml, pf):
        assert entry["adapter_name"] == "code-python"
        assert entry["is_prefetch_hit"] is False
        assert type(entry["swap_ms_saved"]) in (int, float) and type(entry["vram_mb_saved"]) in (int, float)
        assert "is_prefetch_hit" in entry["unknown"]   # no agent data: 0 / false, and said so
    # the engine got the gateway's hints, not the client's, at the top level and in extra_body
    sent = stack.last().json()
    assert sent["model"] == "code-python"
    assert _hints(sent) == GATEWAY_HINTS
    assert sent["extra_body"] == {"lora_name": "code-python"}
    assert sent["messages"] == SEED_EXECUTE["input"]["messages"]


def test_seed_sdk_extra_body_hints_are_the_gateways(stack):
    raw = stack.sdk().chat.completions.with_raw_response.create(
        model="ace-tiny-llama", messages=[{"role": "user", "content": "Write a python function"}],
        extra_body=SEED_HINTS)
    assert raw.parse().model == "code-python"
    sent = stack.last().json()
    assert _hints(sent) == GATEWAY_HINTS
    assert raw.headers["x-ace-trace-multi-lora"].startswith("mode=prod,action=adapter_applied")


def test_seed_hints_stripped_in_shadow(stack):
    body = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "skill_overrides": {"multi_lora": {"mode": "shadow"}}, "extra_body": SEED_HINTS, **SEED_HINTS}
    r = stack.post("/v1/chat/completions", body, ALICE)
    assert r.status_code == 200, r.text
    assert r.headers["x-ace-trace-multi-lora"].startswith("mode=shadow")
    sent = stack.last().json()
    assert sent == {"model": "ace-tiny-llama", "messages": body["messages"],
                    "skill_overrides": body["skill_overrides"],
                    "extra_body": {"lora_name": "code-python"}, "lora_name": "code-python"}


def test_dev_key_skills_object_form(stack):
    r = stack.post("/api/v1/dev_key/skills", {"skills": {"dynamic_lora_prefetch": {"mode": "shadow"}}}, CAROL)
    assert r.status_code == 200, r.text
    assert r.json()["skills"] == {"multi_lora": "shadow", "dynamic_lora_prefetch": "shadow"}
    err = _err(stack.post("/api/v1/dev_key/skills", {"skills": {"multi_lora": {"mode": "on"}}}, CAROL),
               422, "invalid_skill_mode")
    assert err["param"] == "skills.multi_lora.mode"
    err = _err(stack.post("/v1/execute", dict(SEED_EXECUTE, skill_overrides={"multi_lora": {}}), ALICE),
               422, "invalid_skill_mode")
    assert err["param"] == "skill_overrides.multi_lora.mode"


def test_skill_override_header_beats_body_and_key(stack):
    body = dict(CHAT, lora_name="code-python", skill_overrides={"multi_lora": "prod"})
    r = stack.post("/v1/chat/completions", body,
                   {**CAROL, "x-ace-skill-override": "multi_lora=shadow"})
    assert r.status_code == 200, r.text
    assert r.headers["x-ace-trace-multi-lora"].startswith("mode=shadow,action=shadow,would=adapter_applied")
    assert stack.last().body == json.dumps(body).encode()   # shadow: body untouched, byte for byte


def test_multi_lora_off_is_passthrough(stack):
    body = dict(CHAT, lora_name="code-python")
    raw = json.dumps(body, indent=1).encode()
    r = stack.post("/v1/chat/completions", raw, {**ALICE, "x-ace-skill-override": "multi_lora=off"})
    assert r.status_code == 200
    assert stack.last().body == raw
    assert "action=passthrough" in r.headers["x-ace-trace-multi-lora"]


# ---------- errors through Envoy ----------

def _err(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code:
        assert err["code"] == code
    return err


def test_error_malformed_json_400(stack):
    _err(stack.post("/v1/chat/completions", b'{"model": ', ALICE), 400, "invalid_json")
    _err(stack.post("/v1/chat/completions", b"[1,2]", ALICE), 400, "invalid_json")


def test_error_missing_body_400(stack):
    _err(stack.http.post("/v1/chat/completions", headers=ALICE), 400, "missing_body")


def test_error_missing_or_invalid_key_401(stack):
    _err(stack.post("/v1/chat/completions", CHAT), 401, "missing_api_key")
    _err(stack.post("/v1/chat/completions", CHAT, {"authorization": "Bearer nope"}), 401)
    _err(stack.post("/v1/execute", CHAT, {"authorization": "Basic abc"}), 401)


def test_error_tenant_header_mismatch_403(stack):
    _err(stack.post("/v1/chat/completions", CHAT, {**ALICE, "x-ace-tenant-id": "globex"}), 403)
    r = stack.post("/v1/chat/completions", CHAT, {**ALICE, "x-ace-tenant-id": "acme"})
    assert r.status_code == 200


def test_error_other_tenants_adapter_404_like_unknown(stack):
    other = _err(stack.post("/v1/chat/completions", dict(CHAT, lora_name="globex-secret"), ALICE), 404)
    unknown = _err(stack.post("/v1/chat/completions", dict(CHAT, lora_name="no-such"), ALICE), 404)
    assert other["code"] == unknown["code"] == "adapter_not_found"
    # model naming another tenant's adapter is an unknown name (via execute as well): the
    # engine gets the base model, never that name (it could serve the adapter by it)
    for name in ("acme-legal", "no-such"):
        r = stack.post("/v1/execute", {"input": {"messages": []}, "target": {"model": name}}, BOB)
        assert r.status_code == 200, r.text
        assert stack.last().json()["model"] == "ace-tiny-llama"


def test_error_body_over_limit_413(stack):
    big = dict(CHAT, padding="x" * 70_000)
    _err(stack.post("/v1/chat/completions", big, ALICE), 413, "payload_too_large")

    def chunks():   # chunked: no content-length, caught on the body
        yield json.dumps(big).encode()
    _err(stack.http.post("/v1/chat/completions", content=chunks(), headers=ALICE), 413)
    # beyond Envoy's own buffer (limit + 64 KiB): Envoy answers, still OpenAI-shaped
    _err(stack.post("/v1/chat/completions", dict(CHAT, padding="x" * 200_000), ALICE), 413,
         "payload_too_large")


def test_error_numbers_json_does_not_have_400_and_never_reach_the_engine(stack):
    """NaN, Infinity and 1e400 are what Python's json takes and an engine sampling with them
    fails on (the builtin engine failed the whole batch's forward pass)."""
    before = len(stack.up.requests)
    for raw in (b'{"model": "ace-tiny-llama", "messages": [], "temperature": NaN}',
                b'{"model": "ace-tiny-llama", "messages": [], "top_p": Infinity}',
                b'{"model": "ace-tiny-llama", "messages": [], "temperature": 1e400}'):
        _err(stack.post("/v1/chat/completions", raw, ALICE), 400, "invalid_json")
    assert len(stack.up.requests) == before


def test_error_compressed_body_415(stack):
    """The gateway reads and rewrites the body as JSON: a Content-Encoding beside it is
    refused, not sent on (the engine then failed to decompress the plain body: a 500)."""
    before = len(stack.up.requests)
    err = _err(stack.post("/v1/chat/completions", CHAT, {**ALICE, "content-encoding": "gzip"}), 415,
               "unsupported_content_encoding")
    assert err["param"] == "content-encoding"
    assert len(stack.up.requests) == before
    assert stack.post("/v1/chat/completions", CHAT, {**ALICE, "content-encoding": "identity"}).status_code == 200


def test_error_key_that_is_not_utf8_is_a_400_not_a_503(stack):
    """HTTP/1 lets a header carry any byte; Envoy copies the key into a proto string for the
    ext_proc, which must be UTF-8. The message that does not parse is refused with a 400
    (it was the gRPC call's INTERNAL, which fail-closed Envoy answered 503)."""
    conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=scaled(30))
    try:
        conn.putrequest("POST", "/v1/chat/completions")
        body = json.dumps(CHAT).encode()
        conn.putheader("authorization", b"Bearer \xc3\xa9\xff")
        conn.putheader("content-type", "application/json")
        conn.putheader("content-length", str(len(body)))
        conn.endheaders(body)
        r = conn.getresponse()
        assert (r.status, r.getheader("content-type")) == (400, "application/json")
        assert json.loads(r.read())["error"]["code"] == "invalid_header_encoding"
    finally:
        conn.close()


@pytest.mark.parametrize("raw, status", [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/chat/completions HTTP/1.0\r\nContent-Length: 2\r\n\r\n{}", 426),
], ids=["request line", "chunk size", "HTTP/1.0"])
def test_error_requests_envoy_refuses_are_openai_errors(stack, raw, status):
    """Envoy's HTTP codec answers these itself (they never reach the ext_proc): JSON too."""
    with socket.create_connection(("127.0.0.1", stack.port), timeout=scaled(30)) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()), data[:300]
    assert b"content-type: application/json" in head.lower()
    assert json.loads(body)["error"]["code"] == "malformed_request"


def test_error_headers_over_limit_431_from_envoy(stack):
    """Beyond Envoy's 60 KiB of request headers, Envoy answers 431 itself, OpenAI-shaped (it
    was plain text); below, the request is served."""
    under = {f"x-pad-{i}": "p" * 2000 for i in range(25)}           # ~50 KiB
    r = stack.post("/v1/chat/completions", CHAT, {**ALICE, **under})
    assert r.status_code == 200, r.text
    assert stack.last().headers["x-pad-24"] == "p" * 2000
    over = {f"x-pad-{i}": "p" * 2000 for i in range(35)}            # ~70 KiB
    _err(stack.post("/v1/chat/completions", CHAT, {**ALICE, **over}), 431, "request_headers_too_large")


def _http_client_post(port: int, path: str, body, chunked: bool = False) -> tuple[int, str, bytes]:
    """POST the way urllib/requests do (http.client): the whole body, then the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=scaled(60))
    try:
        conn.request("POST", path, body=body, encode_chunked=chunked,
                     headers={"content-type": "application/json", **ALICE})
        r = conn.getresponse()
        status, ctype, data = r.status, r.getheader("content-type", ""), r.read()
        # the connection is still usable: the next request on it is served
        conn.request("GET", "/api/v1/dev_key/skills", headers=ALICE)
        again = conn.getresponse()
        again.read()
        assert again.status == 200
        return status, ctype, data
    finally:
        conn.close()


def test_error_body_far_over_limit_is_read_then_413(stack):
    """64 MiB and more, with a content-length or chunked: Envoy reads the whole body, then
    answers the OpenAI 413. (It used to answer as soon as its buffer overflowed, stop reading
    and close, so a client still writing got a connection reset, never the 413.)"""
    before = len(stack.up.requests)
    big = b'{"model": "ace-tiny-llama", "padding": "' + b"x" * (64 << 20) + b'"}'

    def chunks(total: int):
        yield b'{"model": "ace-tiny-llama", "padding": "'
        for _ in range(total // (1 << 20)):
            yield b"x" * (1 << 20)
        yield b'"}'

    for path, body, chunked in (("/v1/chat/completions", big, False),
                                ("/v1/chat/completions", chunks(160 << 20), True),
                                ("/v1/execute", big, False)):
        status, ctype, data = _http_client_post(stack.port, path, body, chunked)
        assert (status, ctype) == (413, "application/json"), (path, chunked, status, data[:200])
        assert json.loads(data)["error"]["code"] == "payload_too_large"
    # httpx (the OpenAI SDK's transport) sees the same
    _err(stack.post("/v1/chat/completions", big, ALICE), 413, "payload_too_large")
    assert len(stack.up.requests) == before      # nothing of them went upstream


def test_error_invalid_fields_422(stack):
    _err(stack.post("/v1/chat/completions", dict(CHAT, lora_name="code-python", adapter_rank=16), ALICE),
         422, "adapter_rank_mismatch")
    _err(stack.post("/v1/chat/completions", dict(CHAT, stream="yes"), ALICE), 422)
    _err(stack.post("/v1/chat/completions", dict(CHAT, skill_overrides={"multi_lora": "max"}), ALICE),
         422, "invalid_skill_mode")
    _err(stack.post("/v1/chat/completions", CHAT, {**ALICE, "x-ace-skill-override": "multi_lora"}), 422)
    _err(stack.post("/v1/execute", {"input": {}}, ALICE), 422)
    r = stack.post("/v1/chat/completions", dict(CHAT, lora_name="code-python", adapter_rank=8), ALICE)
    assert r.status_code == 200


def test_error_wrong_method_405(stack):
    _err(stack.http.get("/v1/chat/completions", headers=ALICE), 405)


# ---------- headers, dev-key API, pass-through ----------

def test_client_sent_gateway_headers_are_replaced(stack):
    evil = {**ALICE, "x-ace-destination-endpoint": "10.0.0.1:80", "x-ace-served-by": "evil",
            "x-ace-trace-multi-lora": "mode=evil"}
    r = stack.post("/v1/chat/completions", dict(CHAT, lora_name="code-python"), evil)
    assert r.status_code == 200
    got = stack.last().headers
    assert got["x-ace-destination-endpoint"] == stack.up.address
    assert "x-ace-served-by" not in got and "x-ace-trace-multi-lora" not in got
    assert r.headers["x-ace-served-by"] == "local-vllm"
    assert r.headers["x-ace-trace-multi-lora"].startswith("mode=prod")


def test_dev_key_skills_post_then_get(stack):
    r = stack.http.get("/api/v1/dev_key/skills", headers=BOB)
    assert r.status_code == 200, r.text
    assert r.json()["skills"] == {"multi_lora": "prod"}
    before = r.json()["effective"]
    r = stack.post("/api/v1/dev_key/skills", {"skills": {"dynamic_lora_prefetch": "prod"}}, BOB)
    assert r.status_code == 200, r.text
    assert r.json()["skills"] == {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    r = stack.http.get("/api/v1/dev_key/skills", headers=BOB)
    assert r.json()["effective"]["dynamic_lora_prefetch"] == "prod"
    # the setting now drives requests: the prefetch skill is prod for bob
    r = stack.post("/v1/chat/completions", dict(CHAT, lora_name="code-python"), BOB)
    assert r.headers["x-ace-trace-dynamic-lora-prefetch"].startswith(
        "mode=prod,action=prefetch_signalled,adapter=code-python")
    assert stack.last().json()["lora_prefetch"] is True
    # null removes the runtime setting: the key's file skills and the layers below decide again
    r = stack.post("/api/v1/dev_key/skills", {"skills": {"dynamic_lora_prefetch": None}}, BOB)
    assert r.status_code == 200, r.text
    assert r.json()["skills"] == {"multi_lora": "prod"} and r.json()["effective"] == before
    _err(stack.post("/api/v1/dev_key/skills", {"skills": {"multi_lora": "on"}}, BOB), 422)
    _err(stack.http.get("/api/v1/dev_key/skills"), 401)


def test_other_paths_are_404_after_the_key_check_and_never_reach_the_engine(stack):
    """(Was: any path with a valid key reached the engine: its /v1/models listed every
    tenant's adapters with their paths, /metrics their names.) Default deny: only GET /health
    and the routes ace decides reach it (tests/integration/test_edge_gateway.py: every route)."""
    before = len(stack.up.requests)
    _err(stack.http.post("/v2/whatever", content=b"x", headers={**ALICE, "x-ace-tenant-id": "globex"}), 403,
         "tenant_mismatch")
    _err(stack.http.post("/v2/whatever?x=1", content=b"not json", headers=ALICE), 404, "unknown_route")
    _err(stack.http.get("/metrics", headers=ALICE), 404, "unknown_route")
    _err(stack.http.get("/metrics"), 401)
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/load%5Flora%5Fadapter",
                 "//v1/load_lora_adapter", "/load_lora_adapter"):
        body = {"lora_name": "evil", "lora_path": "/tmp/evil"}
        _err(stack.http.post(path, json=body), 401)
        _err(stack.http.post(path, json=body, headers=ALICE), 404, "unknown_route")
    listed = stack.http.get("/v1/models", headers=ALICE)
    assert listed.status_code == 200 and "globex-secret" not in listed.text and "root" not in listed.text
    assert len(stack.up.requests) == before
    r = stack.http.get("/health")
    assert r.status_code == 200 and stack.last().path == "/health"


def test_chunked_body_takes_the_headers_first_path(stack):
    body = dict(CHAT, lora_name="code-python")

    def chunks():
        yield json.dumps(body).encode()
    r = stack.http.post("/v1/chat/completions", content=chunks(), headers=ALICE)
    assert r.status_code == 200, r.text
    assert r.headers["x-ace-served-by"] == "local-vllm"
    sent = stack.last()
    assert sent.json()["model"] == "code-python"
    assert sent.headers["x-ace-tenant-id"] == "acme"


def test_sglang_upstream_with_header_hints(tmp_path):
    with RecordingUpstream() as up, gateway_stack(tmp_path, up, "sglang", "headers") as s:
        r = s.post("/v1/chat/completions", dict(CHAT, lora_name="code-python"),
                   {**ALICE, "x-ace-hint-lora-name": "spoofed"})
        assert r.status_code == 200, r.text
        got = s.last()
        assert got.json() == dict(CHAT, lora_name="code-python", model="ace-tiny-llama:code-python")
        assert got.headers["x-ace-hint-lora-name"] == "code-python"
        assert got.headers["x-ace-hint-lora-adapter"] == "code-python"
        assert got.headers["x-ace-hint-prefetch-status"] == "unknown"
        assert "x-ace-hint-vram-allocated-mb" not in got.headers   # unknown: not sent
        assert r.headers["x-ace-served-by"] == "local-sglang"


def test_extproc_health_and_graceful_sigterm(tmp_path):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    state = write_state(tmp_path, [upstream()])
    with extproc_process(tmp_path, state) as (address, proc):
        with grpc.insecure_channel(address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for service in ("", "envoy.service.ext_proc.v3.ExternalProcessor"):
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(10)) == 0


def test_bad_config_exits_with_a_message(tmp_path):
    import subprocess
    bad = tmp_path / "state.yaml"
    bad.write_text("upstreams: []\n")
    out = subprocess.run([python(), "-m", "extproc", "--config", str(bad), "--db", str(tmp_path / "db")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "at least one upstream" in out.stderr
