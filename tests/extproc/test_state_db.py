"""Runtime changes in the state database (extproc.state.db): SQLite here; PostgreSQL with
several replicas in test_state_db_postgres.py."""
from __future__ import annotations

import pytest

from extproc import admin
from extproc.domain.auth import authenticate
from extproc.errors import Unauthorized
from extproc.state.store import Store
from tests.extproc.builders import KEYS, sha
from tests.support.wait import wait_until


def test_a_revoked_key_is_refused_and_stays_revoked_after_a_restart(tmp_path, state_file):
    db = tmp_path / "gw.sqlite3"
    s = Store(state_file, db, watch=False)
    assert authenticate(s.snapshot, f"Bearer {KEYS['bob']}", None).key.name == "bob"
    s.revoke_key(sha(KEYS["bob"]))
    with pytest.raises(Unauthorized):
        authenticate(s.snapshot, f"Bearer {KEYS['bob']}", None)
    s.close()
    s2 = Store(state_file, db, watch=False)
    with pytest.raises(Unauthorized):
        authenticate(s2.snapshot, f"Bearer {KEYS['bob']}", None)
    assert authenticate(s2.snapshot, f"Bearer {KEYS['alice']}", None).key.name == "alice"
    s2.revoke_key(sha(KEYS["bob"]), revoked=False)
    assert authenticate(s2.snapshot, f"Bearer {KEYS['bob']}", None).key.name == "bob"
    s2.close()


def test_admin_cli_revokes_a_key_a_running_sqlite_gateway_then_refuses(tmp_path, state_file, capsys):
    db = tmp_path / "gw.sqlite3"
    s = Store(state_file, db, poll_s=0.05)
    try:
        assert admin.main(["revoke-key", "--key-sha256", sha(KEYS["alice"]), "--db", str(db)]) == 0
        assert "revoked (state version 1)" in capsys.readouterr().out
        wait_until(lambda: sha(KEYS["alice"]) not in s.snapshot.keys, timeout=10,
                   what="the running gateway applies the CLI's revocation")
        assert s.version == 1
    finally:
        s.close()


def test_admin_cli_refuses_what_is_not_a_sha256(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        admin.main(["revoke-key", "--key-sha256", KEYS["alice"], "--db", str(tmp_path / "db")])
    assert exc.value.code == 2
    assert "never the key" in capsys.readouterr().err


def test_an_older_overlay_never_replaces_a_newer_snapshot(tmp_path, state_file):
    from extproc.state.db import Overlay
    s = Store(state_file, tmp_path / "gw.sqlite3", watch=False)
    s.set_key_skills(sha(KEYS["alice"]), {"multi_lora": "off"})
    newer = s.snapshot
    s._apply(Overlay(version=0))       # a slow reader's result arriving late
    assert s.snapshot is newer
    s.close()


def test_tenant_default_skills_are_merged_over_the_file_and_survive_a_restart(tmp_path, state_file):
    db = tmp_path / "gw.sqlite3"
    s = Store(state_file, db, watch=False)
    assert dict(s.snapshot.tenants["acme"].skills) == {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}
    s.set_tenant_skills("acme", {"dynamic_lora_prefetch": "prod"})
    s.set_tenant_skills("acme", {"multi_lora": "shadow"})          # merged, not replaced
    assert dict(s.snapshot.tenants["acme"].skills) == {"multi_lora": "shadow", "dynamic_lora_prefetch": "prod"}
    assert dict(s.snapshot.tenants["globex"].skills) == {}
    s.set_tenant_skills("acme", {"multi_lora": None})               # the runtime change removed
    assert dict(s.snapshot.tenants["acme"].skills) == {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    s.close()
    s2 = Store(state_file, db, watch=False)
    assert dict(s2.snapshot.tenants["acme"].skills) == {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    s2.close()
