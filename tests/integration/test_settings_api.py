"""The settings page and its read API through the real Envoy (fail-closed) + the ext_proc
process + a recording upstream: ext_proc answers every one of these itself, so the
upstream never sees them."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.extproc.builders import KEYS, sha, upstream, write_state
from tests.support.upstream import RecordingUpstream
from tools.localstack import gateway_front

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}     # acme, admin
CAROL = {"authorization": f"Bearer {KEYS['carol']}"}     # acme, developer
BOB = {"authorization": f"Bearer {KEYS['bob']}"}         # globex, developer
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("settings")
    with RecordingUpstream() as up:
        state = write_state(tmp, [upstream("local-vllm", up.address, "vllm", "body")])
        with gateway_front(tmp, state, up.address, message_timeout="5s") as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
                http.up = up
                yield http


def _err(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == code


def test_the_page_and_its_assets_are_served_without_a_key(gw):
    seen = len(gw.up.requests)
    r = gw.get("/settings")
    assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert '<script src="/settings/app.js"' in r.text
    assert gw.get("/settings/app.js").headers["content-type"].startswith("text/javascript")
    assert gw.get("/settings/app.css").status_code == 200
    _err(gw.get("/settings/other"), 401, "missing_api_key")     # only the page's files are open
    assert len(gw.up.requests) == seen            # answered by ext_proc, never forwarded


def test_me_through_envoy_and_401_without_a_valid_key(gw):
    r = gw.get("/api/v1/me", headers=CAROL)
    assert r.status_code == 200
    me = r.json()
    assert me["tenant"] == "acme" and me["key"]["name"] == "carol"
    assert me["key"]["skills"]["multi_lora"]["source"] == "key"
    _err(gw.get("/api/v1/me"), 401, "missing_api_key")
    _err(gw.get("/api/v1/me", headers={"authorization": "Bearer sk-nope"}), 401, "invalid_api_key")


def test_tenant_defaults_admin_only_json_only_same_origin_only(gw):
    body = json.dumps({"skills": {"dynamic_lora_prefetch": "prod"}})
    _err(gw.post("/api/v1/tenant/skills", content=body, headers={**CAROL, **JSON}), 403, "admin_required")
    _err(gw.get("/api/v1/tenant/keys", headers=CAROL), 403, "admin_required")
    _err(gw.post("/api/v1/tenant/skills", content=body, headers={**ALICE, "content-type": "text/plain"}),
         415, "unsupported_media_type")
    _err(gw.post("/api/v1/tenant/skills", content=body,
                 headers={**ALICE, **JSON, "origin": "http://attacker.example"}), 403, "cross_origin")
    before = gw.get("/api/v1/tenant/skills", headers=ALICE).json()
    assert before["skills"]["dynamic_lora_prefetch"] == "shadow"
    origin = str(gw.base_url).rstrip("/")
    r = gw.post("/api/v1/tenant/skills", content=body, headers={**ALICE, **JSON, "origin": origin})
    assert r.status_code == 200 and r.json()["skills"]["dynamic_lora_prefetch"] == "prod"
    # carol sets no prefetch mode on her key: the tenant's new default is hers now
    got = gw.get("/api/v1/me", headers=CAROL).json()["key"]["skills"]["dynamic_lora_prefetch"]
    assert (got["effective"], got["source"]) == ("prod", "tenant")
    keys = gw.get("/api/v1/tenant/keys", headers=ALICE).json()
    assert [k["name"] for k in keys["keys"]] == ["alice", "carol"]


def test_adapters_without_an_agent_are_unknown_and_usage_counts_per_tenant(gw):
    ad = gw.get("/api/v1/adapters", headers=BOB).json()
    assert [a["name"] for a in ad["adapters"]] == ["code-python", "globex-secret"]
    assert ad["adapters"][0]["residency"]["local-vllm"]["tier"] == "unknown"
    before = gw.get("/api/v1/usage?window=300", headers=BOB).json()["adapters"]["code-python"]["totals"]
    chat = {"model": "code-python", "messages": [{"role": "user", "content": "hi"}]}
    r = gw.post("/v1/chat/completions", content=json.dumps(chat), headers={**BOB, **JSON})
    assert r.status_code == 200
    after = gw.get("/api/v1/usage?window=300", headers=BOB).json()
    assert after["window_s"] == 300
    totals = after["adapters"]["code-python"]["totals"]
    assert totals["requests"] == before["requests"] + 1 and totals["unknown"] == before["unknown"] + 1
    acme = gw.get("/api/v1/usage", headers=ALICE).json()
    assert "globex-secret" not in acme["adapters"]
    _err(gw.get("/api/v1/usage?window=7200", headers=BOB), 422, "invalid_value")


def test_a_tenant_admin_issues_rotates_and_expires_keys_through_envoy(tmp_path):
    """Its own gateway: the keys it issues must not change the listings the tests above read."""
    from datetime import datetime, timedelta, timezone

    from tests.support.wait import wait_until
    chat = json.dumps({"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]})
    with RecordingUpstream() as up:
        state = write_state(tmp_path, [upstream("local-vllm", up.address, "vllm", "body")])
        with gateway_front(tmp_path, state, up.address) as port, \
                httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as gw:
            _err(gw.post("/api/v1/tenant/keys", json={"name": "x"}, headers=BOB), 403, "admin_required")
            _err(gw.post("/api/v1/tenant/keys", json={"tenant": "globex"}, headers=ALICE), 403, "tenant_mismatch")
            r = gw.post("/api/v1/tenant/keys", json={"name": "laptop"}, headers=ALICE)
            assert r.status_code == 201, r.text
            secret = r.json()["secret"]
            mine = {"authorization": f"Bearer {secret}", **JSON}
            assert gw.post("/v1/chat/completions", content=chat, headers=mine).status_code == 200
            assert up.requests[-1].headers["x-ace-tenant-id"] == "acme"
            r = gw.post("/api/v1/tenant/keys/rotate", json={"id": r.json()["key"]["id"]}, headers=ALICE)
            assert r.status_code == 201, r.text
            _err(gw.post("/v1/chat/completions", content=chat, headers=mine), 401, "invalid_api_key")
            rotated = {"authorization": f"Bearer {r.json()['secret']}", **JSON}
            assert gw.post("/v1/chat/completions", content=chat, headers=rotated).status_code == 200
            soon = (datetime.now(timezone.utc) + timedelta(seconds=1)).isoformat()
            r = gw.post("/api/v1/tenant/keys", json={"name": "temp", "expires": soon}, headers=ALICE)
            assert r.status_code == 201, r.text
            temp = {"authorization": f"Bearer {r.json()['secret']}", **JSON}
            r = wait_until(lambda: (r := gw.post("/v1/chat/completions", content=chat, headers=temp))
                           .status_code == 401 and r, what="the key expires")
            assert r.json()["error"]["code"] == "expired_api_key" and r.json()["error"]["type"] == "authentication_error"
            listed = gw.get("/api/v1/tenant/keys", headers=ALICE).json()["keys"]
            assert {(k["name"], k["revoked"], k["expired"]) for k in listed} >= {
                ("laptop", True, False), ("laptop", False, False), ("temp", False, True)}
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("gw.sqlite3*")) + (tmp_path / "extproc.log").read_bytes()
    assert secret.encode() not in stored and sha(secret).encode() in stored   # hashed, never logged
