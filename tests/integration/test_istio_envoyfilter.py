"""The Istio EnvoyFilter behaves like the drop-in config, on the real Envoy.

No Istio control plane runs here. The mesh side is a stand-in for an ingress gateway's
Envoy config (what istiod generates: listener, HCM with fault/cors/router, one virtual
host for the ace host and one for another application) with the EnvoyFilter's patches
applied the way istiod applies them (tests/support/istio.py). The same requests then go
through that Envoy and through the drop-in config, in front of the same ext_proc process
and upstream, and must come out the same: one ext_proc message for an OpenAI POST with a
content-length, two when it is chunked, OpenAI JSON for Envoy's own error replies.
Envoy's ext_proc counters (admin /stats) count the messages.
"""
from __future__ import annotations

import contextlib
import http.client
import json
from pathlib import Path
from typing import Iterator

import httpx
import pytest
import yaml

from extproc.envoy_config import render
from tests.extproc.builders import KEYS, upstream, write_state
from tests.support.envoy import envoy_binary
from tests.support.istio import ACE_VHOST, OTHER_VHOST, gateway_with_envoyfilter
from tests.support.procs import extproc_process, free_port, running, wait_http
from tests.support.upstream import RecordingUpstream
from tests.support.wait import scaled

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}
ACE_HOST = ACE_VHOST.split(":")[0]
OTHER_HOST = OTHER_VHOST.split(":")[0]


def config_for(kind: str, *, port: int, admin: int, extproc: str, engine: str, app: str,
               **render_kw) -> dict:
    kw = {"extproc": extproc, "default_upstream": engine, "message_timeout": "5s", **render_kw}
    if kind == "istio":
        return gateway_with_envoyfilter(port=port, admin_port=admin, app=app, **kw)
    return yaml.safe_load(render(listen_port=port, admin_port=admin, listen_address="127.0.0.1", **kw))


@contextlib.contextmanager
def envoy_with(tmp: Path, name: str, config: dict, admin: int) -> Iterator[None]:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = tmp / f"{name}.log"
    cmd = [envoy_binary(), "-c", str(path), "--log-level", "warn", "--concurrency", "1",
           "--base-id", str(admin), "--disable-hot-restart"]
    with running(cmd, log) as proc:
        wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30, proc=proc, log=log)
        yield


class Gateway:
    def __init__(self, kind: str, port: int, admin: int, engine: RecordingUpstream,
                 app: RecordingUpstream) -> None:
        self.kind, self.port = kind, port
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"host": ACE_HOST})
        self.admin = f"http://127.0.0.1:{admin}"
        self.engine, self.app = engine, app

    def ext_proc(self, stat: str = "stream_msgs_sent") -> int:
        text = httpx.get(f"{self.admin}/stats", params={"filter": rf"\.ext_proc\.{stat}$"}, timeout=5).text
        return sum(int(line.rsplit(":", 1)[1]) for line in text.splitlines() if line.strip())

    def messages(self, send) -> tuple[httpx.Response, int]:
        """The response to ``send(client)`` and how many ext_proc messages it took."""
        before = self.ext_proc()
        r = send(self.http)
        return r, self.ext_proc() - before


@pytest.fixture(scope="module")
def backends(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("istio")
    with RecordingUpstream() as engine, RecordingUpstream() as app:
        state = write_state(tmp, [upstream("local-vllm", engine.address)])
        with extproc_process(tmp, state) as (address, _):
            yield tmp, address, engine, app


@pytest.fixture(scope="module", params=["dropin", "istio"])
def gw(request, backends):
    tmp, extproc, engine, app = backends
    port, admin = free_port(), free_port()
    config = config_for(request.param, port=port, admin=admin, extproc=extproc,
                        engine=engine.address, app=app.address)
    with envoy_with(tmp, request.param, config, admin):
        g = Gateway(request.param, port, admin, engine, app)
        try:
            yield g
        finally:
            g.http.close()


def _err(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    return err


def test_openai_post_with_length_is_one_message(gw):
    r, n = gw.messages(lambda c: c.post("/v1/chat/completions", json=dict(CHAT, lora_name="code-python"),
                                        headers={**ALICE, "x-ace-destination-endpoint": "10.0.0.1:80",
                                                 "x-ace-served-by": "evil"}))
    assert r.status_code == 200, r.text
    assert n == 1
    sent = gw.engine.requests[-1]
    assert sent.json()["model"] == "code-python"
    assert sent.headers["x-ace-destination-endpoint"] == gw.engine.address
    assert sent.headers["x-ace-tenant-id"] == "acme" and "x-ace-served-by" not in sent.headers
    assert r.headers["x-ace-served-by"] == "local-vllm"
    assert r.headers["x-ace-trace-multi-lora"].startswith("mode=prod")


def test_chunked_post_takes_the_headers_first_path(gw):
    def chunks():
        yield json.dumps(dict(CHAT, model="gpt-4o")).encode()
    r, n = gw.messages(lambda c: c.post("/v1/chat/completions", content=chunks(), headers=ALICE))
    assert r.status_code == 200, r.text
    assert n == 2
    assert gw.engine.requests[-1].json()["model"] == "acme-legal"   # the tenant's default adapter


def test_errors_are_openai_json(gw):
    r, n = gw.messages(lambda c: c.get("/v1/chat/completions", headers=ALICE))   # ext_proc answers
    _err(r, 405, "method_not_allowed")
    assert n == 1
    _err(gw.http.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"}),
         401, "invalid_api_key")
    # beyond Envoy's buffer (1 MiB + 64 KiB): Envoy answers itself, via local_reply_config,
    # once it has read the whole body (64 MiB here, sent as urllib/requests send it)
    big = dict(CHAT, padding="x" * (1_200_000))
    r, n = gw.messages(lambda c: c.post("/v1/chat/completions", json=big, headers=ALICE))
    _err(r, 413, "payload_too_large")
    assert n == 0
    before = gw.ext_proc()
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=scaled(60))
    try:
        conn.request("POST", "/v1/chat/completions", body=b"x" * (64 << 20),
                     headers={**ALICE, "host": ACE_HOST, "content-type": "application/json"})
        r = conn.getresponse()
        assert (r.status, r.getheader("content-type")) == (413, "application/json")
        assert json.loads(r.read())["error"]["code"] == "payload_too_large"
    finally:
        conn.close()
    assert gw.ext_proc() == before


def test_dev_key_api_is_answered_by_ext_proc(gw):
    r = gw.http.get("/api/v1/dev_key/skills", headers=ALICE)
    assert r.status_code == 200, r.text
    assert r.json()["tenant"] == "acme"


def test_settings_page_and_api_are_answered_by_ext_proc(gw):
    """The settings page (no key) and its API, including a write with its body, in both
    configs: the mesh gets the routes from the drop-in."""
    r = gw.http.get("/settings")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html"), r.text
    me = gw.http.get("/api/v1/me", headers=ALICE)
    assert me.status_code == 200 and me.json()["tenant"] == "acme", me.text
    r = gw.http.post("/api/v1/me/skills", content=json.dumps({"skills": {"multi_lora": "prod"}}),
                     headers={**ALICE, "content-type": "application/json"})
    assert r.status_code == 200 and r.json()["key"]["skills"]["multi_lora"]["source"] == "key", r.text
    assert gw.http.get("/api/v1/adapters").status_code == 401


def test_other_paths(gw):
    """The drop-in's catch-all is default deny (404 after the key check, one headers message,
    nothing upstream); in the mesh, the ace host's own VirtualService route (after ace's
    routes) goes to its application, without ext_proc."""
    headers = {"x-custom": "1", **(ALICE if gw.kind == "dropin" else {})}
    before = len(gw.engine.requests)
    r, n = gw.messages(lambda c: c.post("/v2/other", content=b"not json", headers=headers))
    if gw.kind == "dropin":
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_route"
        assert n == 1 and len(gw.engine.requests) == before
        assert gw.http.post("/v2/other", content=b"x").status_code == 401
        return
    assert r.status_code == 200 and n == 0
    got = gw.app.requests[-1]
    assert (got.path, got.body, got.headers["x-custom"]) == ("/v2/other", b"not json", "1")


def test_mesh_other_hosts_are_untouched(gw):
    if gw.kind != "istio":
        pytest.skip("the mesh gateway only: other applications' hosts")
    headers = {**ALICE, "host": OTHER_HOST, "x-ace-served-by": "app", "content-type": "application/json"}
    r, n = gw.messages(lambda c: c.post("/v1/chat/completions", content=json.dumps(CHAT), headers=headers))
    assert r.status_code == 200 and r.json()["model"] == "ace-tiny-llama"
    assert n == 0
    got = gw.app.requests[-1]
    assert got.json() == CHAT and got.headers["x-ace-served-by"] == "app"
    assert "x-ace-destination-endpoint" not in got.headers and "x-ace-trace-multi-lora" not in r.headers


@pytest.mark.parametrize("kind", ["dropin", "istio"])
def test_dead_ext_proc_fails_closed_as_json(backends, kind):
    """The default: no ext_proc answer, no request through (no key, a wrong key, a valid key)."""
    tmp, _, engine, app = backends
    port, admin = free_port(), free_port()
    config = config_for(kind, port=port, admin=admin, extproc=f"127.0.0.1:{free_port()}",
                        engine=engine.address, app=app.address)
    before = len(engine.requests)
    with envoy_with(tmp, f"{kind}-dead", config, admin):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"host": ACE_HOST}) as c:
            for headers in ({}, {"authorization": "Bearer nope"}, ALICE):
                _err(c.post("/v1/chat/completions", json=CHAT, headers=headers), 503, "service_unavailable")
            _err(c.post("/v1/execute", json={}, headers=ALICE), 503, "service_unavailable")
    assert len(engine.requests) == before


@pytest.mark.parametrize("kind", ["dropin", "istio"])
def test_dead_ext_proc_fails_open_only_when_rendered_so(backends, kind):
    """``failure_mode_allow=True``: OpenAI requests go unauthenticated to the default
    upstream (the documented risk); the native API still fails closed."""
    tmp, _, engine, app = backends
    port, admin = free_port(), free_port()
    config = config_for(kind, port=port, admin=admin, extproc=f"127.0.0.1:{free_port()}",
                        engine=engine.address, app=app.address, failure_mode_allow=True)
    with envoy_with(tmp, f"{kind}-dead-open", config, admin):
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"host": ACE_HOST}) as c:
            body = dict(CHAT, lora_name="code-python")
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            assert engine.requests[-1].json() == body      # unmodified, to the default upstream
            assert "x-ace-served-by" not in r.headers
            _err(c.post("/v1/execute", json={}), 503, "service_unavailable")
