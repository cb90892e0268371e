"""Authentication is never bypassed: what the real Envoy does when ext_proc does not answer.

Fail-closed (the default): with no ext_proc answer, every request on the ace routes gets a
503 OpenAI error and nothing reaches an upstream. Fail-open only when rendered so
(``failure_mode_allow=True``), with its documented risk. Availability comes from ext_proc
replicas: two ``python -m extproc`` processes behind Envoy's health-checked cluster, one
of them stopped (SIGTERM) or killed (SIGKILL) under load, and no request fails.
"""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

import httpx
import pytest

from tests.extproc.builders import upstream, write_state
from tests.support.envoy import run_envoy
from tests.support.gateway_load import ALICE, CHAT, Load, chunks, replica_stats, served
from tests.support.procs import extproc_process, free_port
from tests.support.upstream import RecordingUpstream
from tests.support.wait import scaled, wait_until


def _err(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def test_fail_closed_by_default_when_extproc_is_dead(tmp_path):
    """No key, a wrong key, a valid key, chunked, the native and dev-key APIs: all 503 JSON,
    and the upstream receives none of them; nor any other path (they need a key too)."""
    with RecordingUpstream() as up:
        dead = f"127.0.0.1:{free_port()}"
        with run_envoy(tmp_path, extproc=dead, default_upstream=up.address, name="failclosed") as port:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=scaled(10)) as c:
                for headers in ({}, {"authorization": "Bearer sk-wrong"}, ALICE):
                    err = _err(c.post("/v1/chat/completions", json=CHAT, headers=headers), 503,
                               "service_unavailable")
                    assert err["type"] == "service_unavailable"
                    _err(c.post("/v1/completions", json={"model": "m", "prompt": "x"}, headers=headers),
                         503, "service_unavailable")
                    _err(c.post("/v1/chat/completions", content=chunks(CHAT), headers=headers), 503,
                         "service_unavailable")
                _err(c.post("/v1/execute", json={}, headers=ALICE), 503, "service_unavailable")
                _err(c.get("/api/v1/dev_key/skills", headers=ALICE), 503, "service_unavailable")
                assert list(up.requests) == []
                for headers in ({}, ALICE):
                    _err(c.post("/v2/other", content=b"not ace", headers=headers), 503, "service_unavailable")
                assert list(up.requests) == []


def test_fail_open_only_when_asked_and_then_unauthenticated(tmp_path):
    """``failure_mode_allow=True`` (``--fail-open``): the documented risk, exactly. An OpenAI
    request without any key reaches the default upstream unmodified, without the gateway's
    trace headers; the native and dev-key APIs still fail closed."""
    with RecordingUpstream() as up:
        dead = f"127.0.0.1:{free_port()}"
        with run_envoy(tmp_path, extproc=dead, default_upstream=up.address, name="failopen",
                       failure_mode_allow=True) as port:
            base = f"http://127.0.0.1:{port}"
            body = dict(CHAT, lora_name="code-python")
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=scaled(10))   # no key at all
            assert r.status_code == 200, r.text
            got = up.requests[-1]
            assert got.json() == body and "authorization" not in got.headers
            assert got.headers["x-ace-destination-endpoint"] == up.address
            assert "x-ace-served-by" not in r.headers and "x-ace-tenant-id" not in got.headers
            _err(httpx.post(f"{base}/v1/execute", json={}, timeout=scaled(10)), 503, "service_unavailable")
            _err(httpx.get(f"{base}/api/v1/dev_key/skills", headers=ALICE, timeout=scaled(10)), 503,
                 "service_unavailable")


# ---------- replicas: one stopped or killed under load ----------

@contextlib.contextmanager
def two_replicas(tmp: Path, up: RecordingUpstream):
    """Two ext_proc processes behind one fail-closed Envoy; yields (port, admin, replicas)
    once Envoy's health checks see both serving."""
    state = write_state(tmp, [upstream("local-vllm", up.address)])
    with extproc_process(tmp / "a", state) as a, extproc_process(tmp / "b", state) as b:
        admin = free_port()
        with run_envoy(tmp, extproc=[a[0], b[0]], default_upstream=up.address, admin_port=admin,
                       message_timeout="5s") as port:
            wait_until(lambda: all(replica_stats(admin).get(addr, {}).get("health_flags") == "healthy"
                                   for addr in (a[0], b[0])), what="both replicas healthy in Envoy")
            yield port, admin, (a, b)


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_one_of_two_replicas_stops_under_load_and_no_request_fails(tmp_path, how):
    """Load from 4 clients; once both replicas have served requests, one is stopped
    (SIGTERM: it drains) or killed (SIGKILL: its in-flight streams break); the load goes on
    for 300 more requests. Every request is answered 200 with ext_proc's decision on it
    (x-ace-served-by): none failed, none passed undecided. With SIGTERM every fifth request
    is chunked (two ext_proc messages); SIGKILL sends one-message requests only (a chunked
    request between its two messages when its replica is killed is answered 503:
    docs/gateway.md, "Failure mode")."""
    sig = signal.SIGTERM if how == "SIGTERM" else signal.SIGKILL
    with RecordingUpstream() as up, two_replicas(tmp_path, up) as (port, admin, replicas):
        (victim, proc), (survivor, _) = replicas
        with Load(port, chunked_every=5 if sig == signal.SIGTERM else 0) as load:
            wait_until(lambda: min(served(admin, victim), served(admin, survivor)) >= 20 or load.stop.is_set(),
                       what="both replicas serving under load")
            assert not load.stop.is_set(), load.results
            proc.send_signal(sig)
            at_kill = load.done
            wait_until(lambda: load.done >= at_kill + 300 or load.stop.is_set(), timeout=60,
                       what="300 requests after the stop")
            # SIGTERM: it serves on (NOT_SERVING) for the handover, no successor comes, it drains
            assert proc.wait(timeout=scaled(30)) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert load.done >= at_kill + 300, load.results
        assert set(load.results) == {"decided"}, (load.results, load.failures[:5])
        assert len(up.requests) == load.done                  # each one went upstream once
        stats = replica_stats(admin)
        assert stats[victim]["health_flags"] != "healthy"    # out of the rotation
        assert int(stats[survivor]["rq_total"]) > 300
