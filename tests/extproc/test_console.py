"""extproc.app.console without sockets: the settings page's API on plain objects (the same
Exchange the servers drive), its authorisation and its write guards."""
from __future__ import annotations

import json

from extproc.errors import StoreUnavailable
from extproc.app.context import Gateway
from extproc.app.outcomes import Reply, RequestHead
from extproc.app.routes import ROUTES
from extproc.state.residency import TierReport, ResidencySnapshot
from tests.extproc.builders import KEYS, sha

HOST = "127.0.0.1:8080"


def call(gw: Gateway, path: str, key: str | None = "alice", method: str = "GET", body=None, **headers) -> Reply:
    h = {":path": path, ":method": method, ":authority": HOST, **headers}
    if key:
        h["authorization"] = f"Bearer {KEYS[key]}"
    if body is not None:
        h.setdefault("content-type", "application/json")
    ex = gw.exchange()
    out = ex.on_request_headers(RequestHead(method, path.split("?")[0], h, body is None))
    if body is not None and not isinstance(out, Reply):
        out = ex.on_request_body(json.dumps(body).encode())
    assert isinstance(out, Reply), out
    return out


def ok(reply: Reply) -> dict:
    assert reply.status == 200, reply.body
    assert ("content-type", "application/json") in reply.headers
    return json.loads(reply.body)


def err(reply: Reply, status: int, code: str) -> dict:
    body = json.loads(reply.body)
    assert (reply.status, body["error"]["code"]) == (status, code), reply.body
    return body["error"]


def test_the_page_is_open_without_a_key_and_locked_down(store):
    gw = Gateway(store)
    for path, kind in (("/settings", "text/html"), ("/settings/app.js", "text/javascript"),
                       ("/settings/app.css", "text/css")):
        reply = call(gw, path, key=None)
        headers = dict(reply.headers)
        assert reply.status == 200 and headers["content-type"].startswith(kind) and reply.body
        assert "script-src 'self'" in headers["content-security-policy"]
        assert headers["cache-control"] == "no-store"
    assert call(gw, "/settings", key=None, method="HEAD").body == b""
    err(call(gw, "/settings", key=None, method="POST"), 405, "method_not_allowed")
    page = call(gw, "/settings", key=None).body.decode()
    assert "<script src=\"/settings/app.js\"" in page and "<script>" not in page   # no inline script (CSP)


def test_me_shows_each_skill_with_its_source(store):
    gw = Gateway(store)
    me = ok(call(gw, "/api/v1/me", "carol"))
    assert me["tenant"] == "acme" and me["key"]["role"] == "developer" and me["key"]["id"] == sha(KEYS["carol"])[:12]
    skills = me["key"]["skills"]
    # carol: multi_lora shadow on the key; acme: prefetch shadow on the tenant; default: off
    assert skills["multi_lora"] == {"effective": "shadow", "source": "key", "key": "shadow", "tenant": "prod",
                                    "default": "prod"}
    assert skills["dynamic_lora_prefetch"] == {"effective": "shadow", "source": "tenant", "key": None,
                                               "tenant": "shadow", "default": "off"}
    bob = ok(call(gw, "/api/v1/me", "bob"))["key"]["skills"]["dynamic_lora_prefetch"]
    assert (bob["effective"], bob["source"]) == ("off", "default")
    assert ok(call(gw, "/api/v1/me", "alice"))["key"]["role"] == "admin"


def test_no_key_or_a_bad_one_is_401_on_every_api_path(store):
    gw = Gateway(store)
    for path in ("/api/v1/me", "/api/v1/adapters", "/api/v1/usage", "/api/v1/tenant/skills", "/api/v1/tenant/keys"):
        err(call(gw, path, key=None), 401, "missing_api_key")
        reply = call(gw, path, key=None, authorization="Bearer sk-nope")
        err(reply, 401, "invalid_api_key")


def test_a_key_sets_its_own_skills_and_the_source_follows(store):
    gw = Gateway(store)
    me = ok(call(gw, "/api/v1/me/skills", "carol", "POST", {"skills": {"dynamic_lora_prefetch": "prod"}}))
    assert me["key"]["skills"]["dynamic_lora_prefetch"]["source"] == "key"
    assert store.snapshot.keys[sha(KEYS["carol"])].skills["dynamic_lora_prefetch"] == "prod"
    err(call(gw, "/api/v1/me/skills", "carol", "POST", {"skills": {"multi_lora": "on"}}), 422, "invalid_skill_mode")
    err(call(gw, "/api/v1/me", "carol", "POST", {"skills": {}}), 405, "method_not_allowed")


def test_null_removes_a_runtime_setting_and_the_next_layer_decides(store):
    """The page's "(not set)": ``null`` drops this layer's runtime setting; a value the state
    file gives (acme's tenant defaults) applies again; another skill's setting stays."""
    gw = Gateway(store)
    ok(call(gw, "/api/v1/me/skills", "carol", "POST", {"skills": {"dynamic_lora_prefetch": "prod", "multi_lora": "off"}}))
    me = ok(call(gw, "/api/v1/me/skills", "carol", "POST", {"skills": {"dynamic_lora_prefetch": None}}))
    assert me["key"]["skills"]["dynamic_lora_prefetch"] == {
        "effective": "shadow", "source": "tenant", "key": None, "tenant": "shadow", "default": "off"}
    assert dict(store.snapshot.keys[sha(KEYS["carol"])].skills) == {"multi_lora": "off"}
    ok(call(gw, "/api/v1/tenant/skills", "alice", "POST", {"skills": {"multi_lora": "shadow"}}))
    t = ok(call(gw, "/api/v1/tenant/skills", "alice", "POST", {"skills": {"multi_lora": None}}))
    assert t["skills"]["multi_lora"] == "prod"            # the state file's tenant default again
    # null is a write of the skills APIs only: a request's own overrides still need a mode
    err(call(gw, "/api/v1/me/skills", "carol", "POST", {"skills": {"nope": None}}), 422, "unknown_skill")


def test_only_an_admin_reads_or_writes_tenant_defaults_and_keys(store):
    gw = Gateway(store)
    for path in ("/api/v1/tenant/skills", "/api/v1/tenant/keys"):
        err(call(gw, path, "carol"), 403, "admin_required")
    err(call(gw, "/api/v1/tenant/skills", "carol", "POST", {"skills": {"multi_lora": "off"}}), 403, "admin_required")
    assert store.snapshot.tenants["acme"].skills["multi_lora"] == "prod"
    t = ok(call(gw, "/api/v1/tenant/skills", "alice"))
    assert t == {"tenant": "acme", "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"},
                 "default": {"multi_lora": "prod", "dynamic_lora_prefetch": "off"},
                 "effective": {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}}
    t = ok(call(gw, "/api/v1/tenant/skills", "alice", "POST", {"skills": {"dynamic_lora_prefetch": "prod"}}))
    assert t["effective"]["dynamic_lora_prefetch"] == "prod"
    # alice's own key sets nothing: the tenant's new default is what her requests get
    assert ok(call(gw, "/api/v1/me", "alice"))["key"]["skills"]["dynamic_lora_prefetch"]["effective"] == "prod"
    keys = ok(call(gw, "/api/v1/tenant/keys", "alice"))
    assert keys["tenant"] == "acme" and [k["name"] for k in keys["keys"]] == ["alice", "carol"]   # no globex key


def test_writes_need_json_and_this_origin(store):
    gw = Gateway(store)
    body = {"skills": {"multi_lora": "off"}}
    err(call(gw, "/api/v1/tenant/skills", "alice", "POST", body, **{"content-type": "text/plain"}),
        415, "unsupported_media_type")
    err(call(gw, "/api/v1/me/skills", "alice", "POST", body,
             **{"content-type": "application/x-www-form-urlencoded"}), 415, "unsupported_media_type")
    err(call(gw, "/api/v1/tenant/skills", "alice", "POST", body, origin="http://evil.example"), 403, "cross_origin")
    err(call(gw, "/api/v1/me/skills", "alice", "POST", body, origin="null"), 403, "cross_origin")
    assert store.snapshot.tenants["acme"].skills["multi_lora"] == "prod"      # nothing written
    ok(call(gw, "/api/v1/tenant/skills", "alice", "POST", body, origin=f"http://{HOST}",
            **{"content-type": "application/json; charset=utf-8"}))
    assert store.snapshot.tenants["acme"].skills["multi_lora"] == "off"


def test_store_down_is_503_and_nothing_changes(store, monkeypatch):
    gw = Gateway(store)

    def down(*a, **kw):
        raise StoreUnavailable("state database unreachable: test")
    monkeypatch.setattr(store._db, "set_tenant_skills", down)
    monkeypatch.setattr(store._db, "set_key_skills", down)
    err(call(gw, "/api/v1/tenant/skills", "alice", "POST", {"skills": {"multi_lora": "off"}}), 503, "store_unavailable")
    err(call(gw, "/api/v1/me/skills", "alice", "POST", {"skills": {"multi_lora": "off"}}), 503, "store_unavailable")


def test_a_revoked_key_is_401(store):
    gw = Gateway(store)
    store.revoke_key(sha(KEYS["carol"]))
    err(call(gw, "/api/v1/me", "carol"), 401, "invalid_api_key")


def test_adapters_are_the_visible_ones_with_residency_per_host_or_unknown(store):
    gw = Gateway(store)
    out = ok(call(gw, "/api/v1/adapters", "bob"))          # globex
    assert [a["name"] for a in out["adapters"]] == ["code-python", "globex-secret"]
    assert out["hosts"] == [{"name": "local-vllm", "residency_known": False}]
    assert out["adapters"][0]["residency"] == {"local-vllm": {"tier": "unknown", "cold_load_ms": None,
                                                              "prefetched": False}}
    gw.residency.publish(ResidencySnapshot.build(
        {"local-vllm": {"code-python": TierReport(tier="device", cold_load_ms=4.5, prefetched=True)}}))
    out = ok(call(gw, "/api/v1/adapters", "alice"))        # acme
    assert [a["name"] for a in out["adapters"]] == ["acme-legal", "code-python"]
    by = {a["name"]: a["residency"]["local-vllm"] for a in out["adapters"]}
    assert by["code-python"] == {"tier": "device", "cold_load_ms": 4.5, "prefetched": True}
    assert by["acme-legal"]["tier"] == "none"              # the agent reports it nowhere


def test_usage_counts_this_tenants_requests_only(store):
    gw = Gateway(store)
    gw.residency.publish(ResidencySnapshot.build({"local-vllm": {"code-python": TierReport("device", 4.5)}}))
    chat = {"model": "code-python", "messages": [{"role": "user", "content": "hi"}]}
    for key in ("alice", "alice", "bob"):
        ex = gw.exchange()
        h = {":path": "/v1/chat/completions", ":method": "POST", "authorization": f"Bearer {KEYS[key]}"}
        ex.on_request_headers(RequestHead("POST", "/v1/chat/completions", h, False))
        ex.on_request_body(json.dumps(chat).encode())
    acme = ok(call(gw, "/api/v1/usage?window=600", "alice"))
    assert acme["window_s"] == 600 and set(acme["adapters"]) == {"acme-legal", "code-python"}
    assert acme["adapters"]["code-python"]["totals"]["hits"] == 2
    globex = ok(call(gw, "/api/v1/usage", "bob"))
    assert globex["adapters"]["code-python"]["totals"]["hits"] == 1 and "acme-legal" not in globex["adapters"]
    for bad in ("59", "3601", "x", "-1"):
        err(call(gw, f"/api/v1/usage?window={bad}", "alice"), 422, "invalid_value")


def test_envoy_sends_exactly_the_gateway_api_paths_to_ext_proc_with_their_bodies():
    from extproc.app.console import CONSOLE_ROUTES, SettingsPage
    from extproc.envoy_config import API_PATHS, SETTINGS_PATHS
    assert set(API_PATHS) == {p for p in ROUTES if p.startswith("/api/v1/")}
    assert set(SETTINGS_PATHS) == {p for p, handler in CONSOLE_ROUTES.items() if handler is SettingsPage}
