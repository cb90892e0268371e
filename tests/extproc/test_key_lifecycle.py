"""Keys issued at runtime (extproc.domain.key_lifecycle) on a real SQLite state database: the
admin CLI (any tenant) and the settings API (a tenant admin, its own tenant only), expiry,
rotation, revocation, and never a secret stored or listed. PostgreSQL across replicas:
test_state_db_postgres.py; through Envoy: tests/integration/test_settings_api.py."""
from __future__ import annotations

import json
import time

import pytest

from extproc import admin
from extproc.domain.auth import authenticate
from extproc.errors import Forbidden, InvalidField, Unauthorized
from extproc.domain.key_lifecycle import check_grant, issue, may_grant, parse_expiry
from extproc.app.outcomes import RequestHead
from extproc.app.context import Gateway
from extproc.state.store import Store
from tests.extproc.builders import KEYS, sha
from tests.extproc.test_console import call, err, ok
from tests.support.wait import wait_until


def _tenant(store, secret: str) -> str:
    return authenticate(store.snapshot, f"Bearer {secret}", None).tenant.id


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = admin.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def cli(tmp_path, state_file, capsys):
    db = tmp_path / "gw.sqlite3"
    return lambda *argv: _cli(capsys, *argv, "--config", str(state_file), "--db", str(db))


def test_create_key_prints_the_secret_once_and_stores_only_its_hash(tmp_path, state_file, cli):
    code, out, err_ = cli("create-key", "--tenant", "globex", "--name", "ci-bot")
    assert code == 0
    secret = out.strip()
    assert out.count("\n") == 1 and secret.startswith("sk-ace-") and len(secret) >= 40
    assert secret not in err_ and sha(secret)[:12] in err_
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("gw.sqlite3*"))
    assert secret.encode() not in raw and sha(secret).encode() in raw      # the hash, never the key
    store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    try:
        assert _tenant(store, secret) == "globex"
        key = store.snapshot.keys[sha(secret)]
        assert (key.name, key.role, key.origin, key.expires_at) == ("ci-bot", "developer", "database", None)
    finally:
        store.close()
    code, out, _ = cli("list-keys", "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert secret not in out and sha(secret) not in out            # id only, never the secret or digest
    bot = next(r for r in rows if r["name"] == "ci-bot")
    assert bot["id"] == sha(secret)[:12] and bot["tenant"] == "globex" and bot["role"] == "developer"
    assert bot["created"].endswith("Z") and bot["expires"] is None and bot["revoked"] is False
    assert {r["name"] for r in rows} == {"alice", "bob", "carol", "ci-bot"}   # the state file's too
    assert next(r for r in rows if r["name"] == "alice")["role"] == "admin"


def test_create_key_refuses_an_unknown_tenant_a_past_expiry_and_a_missing_config(tmp_path, cli, capsys):
    code, out, err_ = cli("create-key", "--tenant", "nobody")
    assert code == 1 and out == "" and "unknown tenant nobody" in err_
    code, out, err_ = cli("create-key", "--tenant", "acme", "--expires", "2001-01-01")
    assert code == 1 and out == "" and "not in the future" in err_
    with pytest.raises(SystemExit) as exc:
        admin.main(["create-key", "--tenant", "acme", "--db", str(tmp_path / "db")])
    assert exc.value.code == 2 and "--config" in capsys.readouterr().err


def test_rotate_revokes_the_old_key_at_once_and_keeps_tenant_role_and_skills(tmp_path, state_file, cli):
    _, out, _ = cli("create-key", "--tenant", "acme", "--name", "svc", "--role", "tenant-admin")
    old = out.strip()
    store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    try:
        store.set_key_skills(sha(old), {"dynamic_lora_prefetch": "prod"})
        code, out, err_ = cli("rotate-key", "--key-id", sha(old)[:12])
        assert code == 0 and "revoked now" in err_
        new = out.strip()
        assert new != old
        store.close()
        store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
        with pytest.raises(Unauthorized):
            _tenant(store, old)
        key = store.snapshot.keys[sha(new)]
        assert (key.tenant, key.name, key.role, key.skills["dynamic_lora_prefetch"]) == ("acme", "svc", "admin", "prod")
        _, out, _ = cli("list-keys", "--json", "--tenant", "acme")
        rows = {r["id"]: r for r in map(json.loads, out.splitlines())}
        assert rows[sha(old)[:12]]["revoked"] is True and rows[sha(new)[:12]]["revoked"] is False
        code, _, err_ = cli("rotate-key", "--key-id", sha(old)[:12])
        assert code == 1 and "revoked" in err_
        # a state file key rotates too: the file's key is revoked, the new one lives in the database
        code, out, _ = cli("rotate-key", "--key-id", sha(KEYS["bob"])[:12])
        bob2 = out.strip()
        store.close()
        store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
        assert code == 0 and _tenant(store, bob2) == "globex"
        assert store.snapshot.keys[sha(bob2)].skills == {"multi_lora": "prod"}
        with pytest.raises(Unauthorized):
            _tenant(store, KEYS["bob"])
    finally:
        store.close()


def test_revoke_and_restore_by_id(tmp_path, state_file, cli):
    _, out, _ = cli("create-key", "--tenant", "acme")
    secret = out.strip()
    code, out, _ = cli("revoke-key", "--key-id", sha(secret)[:12])
    assert code == 0 and "revoked" in out
    store = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    with pytest.raises(Unauthorized):
        _tenant(store, secret)
    store.close()
    assert cli("restore-key", "--key-id", sha(secret)[:12])[0] == 0
    code, _, err_ = cli("revoke-key", "--key-id", "0" * 12)
    assert code == 1 and "no key" in err_


def test_an_expired_key_is_401_expired_api_key(store):
    gw = Gateway(store)
    secret, key = issue("acme", "short", "developer", time.time() + 0.5, time.time())
    store.add_key(key)
    assert _tenant(store, secret) == "acme"

    def refused():
        try:
            authenticate(store.snapshot, f"Bearer {secret}", None)
        except Unauthorized as exc:
            return exc
        return None
    exc = wait_until(refused, what="the key expires")
    assert (exc.status, exc.code) == (401, "expired_api_key")
    reply = gw.exchange().on_request_headers(
        RequestHead("GET", "/api/v1/me", {":path": "/api/v1/me", "authorization": f"Bearer {secret}"}, True))
    assert reply.status == 401 and json.loads(reply.body)["error"]["code"] == "expired_api_key"


def test_expiry_parsing():
    now = time.time()
    assert parse_expiry(None, now) is None and parse_expiry("", now) is None
    assert parse_expiry("2999-01-01T00:00:00Z", now) == parse_expiry("2999-01-01", now) == 32472144000.0
    assert parse_expiry("2999-01-01T02:00:00+02:00", now) == 32472144000.0
    for bad in ("tomorrow", "2001-01-01", 5):
        with pytest.raises(InvalidField) as exc:
            parse_expiry(bad, now)
        assert exc.value.param == "expires"


def test_roles_are_granted_downwards_only():
    assert may_grant("admin", "developer") and may_grant("admin", "admin") and may_grant("developer", "developer")
    assert not may_grant("developer", "admin")


# -- the settings API (a tenant admin's key) ---------------------------------------------------

def _created(reply) -> dict:
    assert reply.status == 201, reply.body
    return json.loads(reply.body)


def test_a_tenant_admin_issues_rotates_and_revokes_keys_in_its_own_tenant(store):
    gw = Gateway(store)
    made = _created(call(gw, "/api/v1/tenant/keys", "alice", "POST",
                         {"name": "laptop", "role": "developer", "expires": "2999-01-01T00:00:00Z"}))
    secret = made["secret"]
    assert made["key"] == {"id": sha(secret)[:12], "name": "laptop", "tenant": "acme", "role": "developer",
                           "origin": "database", "created": made["key"]["created"], "expires": "2999-01-01T00:00:00Z",
                           "expired": False, "revoked": False}
    assert _tenant(store, secret) == "acme"
    listed = ok(call(gw, "/api/v1/tenant/keys", "alice"))
    assert secret not in json.dumps(listed) and sha(secret) not in json.dumps(listed)
    assert {k["name"] for k in listed["keys"]} == {"alice", "carol", "laptop"}
    rotated = _created(call(gw, "/api/v1/tenant/keys/rotate", "alice", "POST", {"id": sha(secret)[:12]}))
    assert rotated["replaced"] == sha(secret)[:12] and rotated["key"]["expires"] == "2999-01-01T00:00:00Z"
    with pytest.raises(Unauthorized):
        _tenant(store, secret)
    assert _tenant(store, rotated["secret"]) == "acme"
    gone = ok(call(gw, "/api/v1/tenant/keys/revoke", "alice", "POST", {"id": sha(KEYS["carol"])[:12]}))
    assert gone["revoked"] == sha(KEYS["carol"])[:12]
    assert next(k for k in gone["keys"] if k["name"] == "carol")["revoked"] is True
    err(call(gw, "/api/v1/me", "carol"), 401, "invalid_api_key")
    admin2 = _created(call(gw, "/api/v1/tenant/keys", "alice", "POST", {"role": "tenant-admin"}))
    assert admin2["key"]["role"] == "admin" and store.snapshot.keys[sha(admin2["secret"])].is_admin


def test_a_tenant_admin_cannot_reach_another_tenant_or_escalate(store):
    gw = Gateway(store)
    bob = sha(KEYS["bob"])[:12]
    before = dict(store.snapshot.keys)
    err(call(gw, "/api/v1/tenant/keys", "alice", "POST", {"tenant": "globex"}), 403, "tenant_mismatch")
    err(call(gw, "/api/v1/tenant/keys", "alice", "POST", {"role": "owner"}), 422, "invalid_value")
    err(call(gw, "/api/v1/tenant/keys", "alice", "POST", {"expires": "2001-01-01"}), 422, "invalid_value")
    for name in ("ci\nINFO forged log line", "a\x00b", "x" * 201, 5):   # shown on the page, written in logs
        err(call(gw, "/api/v1/tenant/keys", "alice", "POST", {"name": name}), 422, "invalid_value")
    for path in ("/api/v1/tenant/keys/rotate", "/api/v1/tenant/keys/revoke"):
        err(call(gw, path, "alice", "POST", {"id": bob}), 404, "key_not_found")       # globex's: not found
        err(call(gw, path, "alice", "POST", {"id": "abc"}), 422, "invalid_value")
    for path, body in (("/api/v1/tenant/keys", {"role": "developer"}),
                       ("/api/v1/tenant/keys/rotate", {"id": sha(KEYS["carol"])[:12]}),
                       ("/api/v1/tenant/keys/revoke", {"id": sha(KEYS["alice"])[:12]})):
        err(call(gw, path, "carol", "POST", body), 403, "admin_required")   # a developer: nothing
        err(call(gw, path, "bob", "POST", body), 403, "admin_required")
        err(call(gw, path, "alice", "POST", body, **{"content-type": "text/plain"}), 415, "unsupported_media_type")
        err(call(gw, path, "alice", "POST", body, origin="http://evil.example"), 403, "cross_origin")
    assert dict(store.snapshot.keys) == before and not store.snapshot.revoked_keys
    # a developer key cannot issue an admin key even where the rule is asked directly
    with pytest.raises(Forbidden) as exc:
        check_grant(store.snapshot.keys[sha(KEYS["carol"])], "acme", "admin")
    assert exc.value.code == "role_escalation"
