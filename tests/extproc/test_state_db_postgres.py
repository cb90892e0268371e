"""Two gateway replicas' stores on one real PostgreSQL (tests/support/postgres.py): a
change on one is applied by the other through NOTIFY; PostgreSQL down -> the snapshot
keeps serving, writes raise StoreUnavailable; back -> writes commit and propagate."""
from __future__ import annotations

import json
import time

import pytest

from extproc import admin
from extproc.domain.auth import authenticate
from extproc.state.db import WATCH_APP
from extproc.errors import ConfigError, StoreUnavailable, Unauthorized
from extproc.state.store import Store
from tests.extproc.builders import KEYS, sha
from tests.support.postgres import real_postgres
from tests.support.wait import wait_until

NO_POLL = 3600.0    # the fallback poll never fires within a test: only NOTIFY can explain a change


@pytest.fixture(scope="module")
def pg():
    with real_postgres() as server:
        yield server


@pytest.fixture
def url(pg, request):
    import psycopg
    name = "t_" + request.node.name.lower().replace("[", "_").replace("]", "")[:50]
    with psycopg.connect(pg.url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return pg.url.rsplit("/", 1)[0] + "/" + name


@pytest.fixture
def replicas(url, state_file):
    a, b = Store(state_file, url, poll_s=NO_POLL), Store(state_file, url, poll_s=NO_POLL)
    yield a, b
    a.close()
    b.close()


def _listening(url: str, n: int) -> bool:
    import psycopg
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                            " AND application_name = %s AND state = 'idle'", (WATCH_APP,)).fetchone()[0] >= n


def test_a_skills_change_on_one_replica_is_applied_by_the_other_via_notify(replicas, url):
    a, b = replicas
    lags: list[float] = []
    b.on_snapshot(lags.append)      # what ace_gateway_store_propagation_seconds observes on B
    wait_until(lambda: _listening(url, 2), timeout=10, what="both replicas LISTEN")
    alice = sha(KEYS["alice"])
    t0 = time.monotonic()
    a.set_key_skills(alice, {"multi_lora": "off"})
    assert a.snapshot.keys[alice].skills["multi_lora"] == "off"      # the writer: at once
    wait_until(lambda: b.snapshot.keys[alice].skills.get("multi_lora") == "off", timeout=10,
               what="replica B applies A's change")
    print(f"propagation lag A -> B: {(time.monotonic() - t0) * 1000:.1f} ms")
    assert b.version == a.version == 1
    wait_until(lambda: lags, timeout=10, what="B reports the write's propagation lag")
    assert len(lags) == 1 and 0 <= lags[0] < 3600      # from A's commit (database clock) to B's swap
    b.set_key_skills(alice, {"dynamic_lora_prefetch": "prod"})        # merged, not replaced
    wait_until(lambda: a.version == 2, timeout=10, what="replica A applies B's change")
    assert dict(a.snapshot.keys[alice].skills) == {"multi_lora": "off", "dynamic_lora_prefetch": "prod"}
    a.set_key_skills(alice, {"multi_lora": None})                     # removed, on both replicas
    wait_until(lambda: b.version == 3, timeout=10, what="replica B applies the removal")
    assert dict(b.snapshot.keys[alice].skills) == {"dynamic_lora_prefetch": "prod"}
    a.set_tenant_skills("acme", {"dynamic_lora_prefetch": None})      # nothing to remove: no row yet
    wait_until(lambda: b.version == 4, timeout=10, what="replica B applies the tenant write")


def test_a_key_revoked_with_the_admin_cli_is_refused_by_every_replica(replicas, url, capsys):
    a, b = replicas
    wait_until(lambda: _listening(url, 2), timeout=10, what="both replicas LISTEN")
    assert admin.main(["revoke-key", "--key-sha256", sha(KEYS["bob"]), "--database-url", url]) == 0
    assert "revoked" in capsys.readouterr().out
    for replica in (a, b):
        wait_until(lambda: sha(KEYS["bob"]) not in replica.snapshot.keys, timeout=10,
                   what="the replica applies the revocation")
        with pytest.raises(Unauthorized):
            authenticate(replica.snapshot, f"Bearer {KEYS['bob']}", None)
    assert admin.main(["restore-key", "--key-sha256", sha(KEYS["bob"]), "--database-url", url]) == 0
    wait_until(lambda: sha(KEYS["bob"]) in b.snapshot.keys, timeout=10, what="the key is restored")


def test_the_fallback_poll_catches_a_change_whose_notify_was_missed(url, state_file):
    """A write that sends no NOTIFY (as if the notification was lost): only the version
    poll can bring it in."""
    import psycopg
    s = Store(state_file, url, poll_s=0.2)
    try:
        with psycopg.connect(url) as conn:
            conn.execute("INSERT INTO ace_revoked_keys (key_sha256) VALUES (%s)", (sha(KEYS["carol"]),))
            conn.execute("UPDATE ace_state_version SET version = version + 1")
        wait_until(lambda: sha(KEYS["carol"]) not in s.snapshot.keys, timeout=10, what="the poll resyncs")
    finally:
        s.close()


def test_postgres_down_serves_the_snapshot_refuses_writes_then_recovers(pg, url, replicas):
    a, b = replicas
    alice, bob = sha(KEYS["alice"]), sha(KEYS["bob"])
    a.set_key_skills(alice, {"multi_lora": "off"})
    wait_until(lambda: b.version == 1, timeout=10, what="B in step before the outage")
    pg.stop()
    try:
        for replica in (a, b):      # reads never touch the database
            assert authenticate(replica.snapshot, f"Bearer {KEYS['alice']}", None).key.skills["multi_lora"] == "off"
        with pytest.raises(StoreUnavailable) as exc:
            a.set_key_skills(bob, {"multi_lora": "off"})
        assert exc.value.status == 503
        assert json.loads(exc.value.to_json())["error"]["code"] == "store_unavailable"
        assert b.snapshot.keys[bob].skills["multi_lora"] == "prod"      # nothing half-written
    finally:
        pg.start()
    # the client retries its 503: the write commits and reaches the other replica
    a.set_key_skills(bob, {"multi_lora": "off"})
    wait_until(lambda: b.snapshot.keys[bob].skills["multi_lora"] == "off", timeout=30,
               what="B reconnects and applies the retried write")
    wait_until(lambda: _listening(url, 2), timeout=30, what="both replicas LISTEN again")


def test_a_replica_does_not_start_without_its_database(pg, state_file):
    with pytest.raises(ConfigError, match="state database postgresql://postgres@127.0.0.1"):
        Store(state_file, f"postgresql://postgres@127.0.0.1:{pg.port + 1}/postgres")


def test_a_tenant_default_change_on_one_replica_is_applied_by_the_other(replicas, url):
    a, b = replicas
    wait_until(lambda: _listening(url, 2), timeout=10, what="both replicas LISTEN")
    a.set_tenant_skills("acme", {"dynamic_lora_prefetch": "prod"})
    assert a.snapshot.tenants["acme"].skills["dynamic_lora_prefetch"] == "prod"
    wait_until(lambda: b.snapshot.tenants["acme"].skills.get("dynamic_lora_prefetch") == "prod", timeout=10,
               what="replica B applies A's tenant default")
    b.set_tenant_skills("acme", {"multi_lora": "off"})
    wait_until(lambda: a.version == 2, timeout=10, what="replica A applies B's change")
    assert dict(a.snapshot.tenants["acme"].skills) == {"multi_lora": "off", "dynamic_lora_prefetch": "prod"}


def test_a_key_created_with_the_cli_on_one_replica_authenticates_on_the_other(replicas, url, state_file, capsys):
    a, b = replicas
    wait_until(lambda: _listening(url, 2), timeout=10, what="both replicas LISTEN")
    t0 = time.monotonic()
    assert admin.main(["create-key", "--tenant", "globex", "--name", "ci", "--expires", "2999-01-01",
                       "--config", str(state_file), "--database-url", url]) == 0
    secret = capsys.readouterr().out.strip()
    for replica in (a, b):
        wait_until(lambda: sha(secret) in replica.snapshot.keys, timeout=10, what="the replica applies the new key")
        assert authenticate(replica.snapshot, f"Bearer {secret}", None).tenant.id == "globex"
    print(f"new key, CLI write -> both replicas: {(time.monotonic() - t0) * 1000:.1f} ms")
    import psycopg
    with psycopg.connect(url) as conn:      # only the digest is stored
        rows = conn.execute("SELECT key_sha256, tenant, name, role, expires_at FROM ace_api_keys").fetchall()
    assert rows == [(sha(secret), "globex", "ci", "developer", 32472144000.0)]
    # rotated on B: the old secret fails on A as soon as A applies it, the new one works there
    old = b.snapshot.keys[sha(secret)]
    from extproc.domain.key_lifecycle import rotation
    new_secret, new = rotation(old, time.time())
    b.add_key(new, revoke=old.sha256)
    wait_until(lambda: sha(new_secret) in a.snapshot.keys, timeout=10, what="A applies the rotation")
    with pytest.raises(Unauthorized):
        authenticate(a.snapshot, f"Bearer {secret}", None)
    assert a.snapshot.keys[sha(new_secret)].expires_at == 32472144000.0
