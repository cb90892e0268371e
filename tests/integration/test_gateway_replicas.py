"""Two gateway replicas (``python -m extproc --database-url``) on one real PostgreSQL,
each behind its own real Envoy, in front of one recording upstream: a skills change or a
key revocation on one is enforced by the other; PostgreSQL down -> both keep serving
from their snapshot and a write answers 503 JSON; PostgreSQL back -> the retried write
commits and propagates."""
from __future__ import annotations

import contextlib
import time

import httpx
import pytest

from extproc import admin
from tests.extproc.builders import KEYS, sha, upstream, write_state
from tests.support.postgres import real_postgres
from tests.support.upstream import RecordingUpstream
from tests.support.wait import wait_until
from tools.localstack import extproc_process, run_envoy

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
BOB = {"authorization": f"Bearer {KEYS['bob']}"}
CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    with contextlib.ExitStack() as stack:
        pg = stack.enter_context(real_postgres())
        up = stack.enter_context(RecordingUpstream())
        state = write_state(tmp, [upstream("local-vllm", up.address, "vllm", "body")])
        bases = []
        for name in ("a", "b"):
            work = tmp / name
            work.mkdir()
            address, _ = stack.enter_context(extproc_process(
                work, state, extproc_args=["--database-url", pg.url]))
            port = stack.enter_context(run_envoy(work, extproc=address, default_upstream=up.address,
                                                 message_timeout="5s"))
            bases.append(httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10))
        yield pg, bases[0], bases[1]
        for client in bases:
            client.close()


def _effective(client: httpx.Client, headers: dict) -> dict:
    r = client.get("/api/v1/dev_key/skills", headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["effective"]


def test_a_skills_change_on_replica_a_takes_effect_on_replica_b(replicas):
    _, a, b = replicas
    assert _effective(b, ALICE)["dynamic_lora_prefetch"] == "shadow"      # the tenant's, from the file
    t0 = time.monotonic()
    r = a.post("/api/v1/dev_key/skills", json={"skills": {"dynamic_lora_prefetch": "prod"}}, headers=ALICE)
    assert r.status_code == 200 and r.json()["effective"]["dynamic_lora_prefetch"] == "prod", r.text
    wait_until(lambda: _effective(b, ALICE)["dynamic_lora_prefetch"] == "prod", timeout=10,
               interval=0.02, what="replica B serves A's skills change")
    print(f"skills change A -> B seen through Envoy B after {(time.monotonic() - t0) * 1000:.0f} ms")


def test_a_key_revoked_by_the_admin_cli_gets_401_on_both_replicas(replicas):
    pg, a, b = replicas
    assert b.post("/v1/chat/completions", json=CHAT, headers=BOB).status_code == 200
    assert admin.main(["revoke-key", "--key-sha256", sha(KEYS["bob"]), "--database-url", pg.url]) == 0
    for client in (b, a):
        r = wait_until(lambda: (r := client.post("/v1/chat/completions", json=CHAT, headers=BOB)).status_code == 401
                       and r, timeout=10, interval=0.02, what="the revoked key is refused")
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert a.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200


def test_postgres_down_serves_requests_refuses_writes_with_503_then_recovers(replicas):
    """Alone or after the other tests, in any order: what each replica serves before the
    outage is what it serves during it."""
    pg, a, b = replicas
    before = _effective(a, ALICE)
    wait_until(lambda: _effective(b, ALICE) == before, timeout=10, interval=0.02,
               what="both replicas serve the same skills before the outage")
    change = "prod" if before["multi_lora"] == "shadow" else "shadow"
    pg.stop()
    try:
        for client in (a, b):       # served from the last snapshot
            assert client.post("/v1/chat/completions", json=CHAT, headers=ALICE).status_code == 200
            assert _effective(client, ALICE) == before
        r = a.post("/api/v1/dev_key/skills", json={"skills": {"multi_lora": change}}, headers=ALICE)
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["code"] == "store_unavailable" and error["type"] == "server_error", r.text
        assert _effective(a, ALICE) == before      # the refused write changed nothing
    finally:
        pg.start()
    r = a.post("/api/v1/dev_key/skills", json={"skills": {"multi_lora": change}}, headers=ALICE)
    assert r.status_code == 200, r.text
    wait_until(lambda: _effective(b, ALICE)["multi_lora"] == change, timeout=30, interval=0.05,
               what="replica B reconnects and applies the retried write")


def test_a_key_issued_on_replica_a_is_accepted_by_replica_b_propagation_measured(replicas):
    """A tenant admin issues a key through replica A's settings API; replica B accepts it
    once it has applied the NOTIFY. The time from A's answer to B's first 200 through B's
    Envoy, five keys in a row (docs/gateway.md, "Key lifecycle", quotes it)."""
    _, a, b = replicas
    took = []
    for i in range(5):
        r = a.post("/api/v1/tenant/keys", json={"name": f"replicated-{i}"}, headers=ALICE)
        assert r.status_code == 201, r.text
        t0 = time.monotonic()
        key = {"authorization": f"Bearer {r.json()['secret']}"}
        wait_until(lambda: b.post("/v1/chat/completions", json=CHAT, headers=key).status_code == 200,
                   timeout=10, interval=0.005, what="replica B accepts the key issued on A")
        took.append((time.monotonic() - t0) * 1000)
        assert a.post("/v1/chat/completions", json=CHAT, headers=key).status_code == 200
    took.sort()
    print(f"new key A -> B through Envoy B: min {took[0]:.0f} ms, median {took[2]:.0f} ms, max {took[-1]:.0f} ms")
