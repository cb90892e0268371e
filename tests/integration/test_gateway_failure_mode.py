"""Authentication is never bypassed: what the real Envoy does when ext_proc does not answer.

Fail-closed (the default): with no ext_proc answer, every request on the ace routes gets a
503 OpenAI error and nothing reaches an upstream. Fail-open only when rendered so
(``failure_mode_allow=True``), with its documented risk. Availability comes from ext_proc
replicas: two ``python -m extproc`` processes behind Envoy's health-checked cluster, one
of them stopped (SIGTERM) or killed (SIGKILL) under load, and no request fails.
"""
from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.extproc.builders import KEYS, upstream, write_state
from tests.support.envoy import run_envoy
from tests.support.procs import extproc_process, free_port
from tests.support.upstream import RecordingUpstream
from tests.support.wait import scaled, wait_until

ALICE = {"authorization": f"Bearer {KEYS['alice']}"}
CHAT = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}]}


def _err(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def _chunks(body: dict):   # no content-length: the headers-first route (2 ext_proc messages)
    yield json.dumps(body).encode()


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
                    _err(c.post("/v1/chat/completions", content=_chunks(CHAT), headers=headers), 503,
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

def _replica_stats(admin: int) -> dict[str, dict[str, str]]:
    """Envoy's view of each ace_extproc endpoint (admin /clusters)."""
    out: dict[str, dict[str, str]] = {}
    text = httpx.get(f"http://127.0.0.1:{admin}/clusters", timeout=scaled(5)).text
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "ace_extproc":
            out.setdefault(parts[1], {})[parts[2]] = parts[3]
    return out


def _served(admin: int, address: str) -> int:
    return int(_replica_stats(admin).get(address, {}).get("rq_total", "0"))


class Load:
    """``threads`` clients posting until stopped or ``limit`` requests are done; each
    response is recorded as its status, ``decided`` when ext_proc's decision is on it."""

    def __init__(self, port: int, threads: int = 4, limit: int = 3000, chunked_every: int = 0) -> None:
        self.base, self.limit, self.chunked_every = f"http://127.0.0.1:{port}", limit, chunked_every
        self.results: Counter = Counter()
        self.failures: list[str] = []
        self.done = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=scaled(20)) as c:
            n = 0
            while not self.stop.is_set():
                n += 1
                chunked = self.chunked_every and n % self.chunked_every == 0
                try:
                    if chunked:
                        r = c.post("/v1/chat/completions", content=_chunks(CHAT), headers=ALICE)
                    else:
                        r = c.post("/v1/chat/completions", json=CHAT, headers=ALICE)
                    ok = r.status_code == 200 and r.headers.get("x-ace-served-by") == "local-vllm"
                    outcome = "decided" if ok else f"{r.status_code}"
                    detail = "" if ok else r.text[:300]
                except httpx.HTTPError as exc:
                    outcome, detail = type(exc).__name__, str(exc)
                with self.lock:
                    self.results[outcome] += 1
                    if detail:
                        self.failures.append(detail)
                    self.done += 1
                    if self.done >= self.limit:
                        self.stop.set()

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=scaled(30))


@contextlib.contextmanager
def two_replicas(tmp: Path, up: RecordingUpstream):
    """Two ext_proc processes behind one fail-closed Envoy; yields (port, admin, replicas)
    once Envoy's health checks see both serving."""
    state = write_state(tmp, [upstream("local-vllm", up.address)])
    with extproc_process(tmp / "a", state) as a, extproc_process(tmp / "b", state) as b:
        admin = free_port()
        with run_envoy(tmp, extproc=[a[0], b[0]], default_upstream=up.address, admin_port=admin,
                       message_timeout="5s") as port:
            wait_until(lambda: all(_replica_stats(admin).get(addr, {}).get("health_flags") == "healthy"
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
            wait_until(lambda: min(_served(admin, victim), _served(admin, survivor)) >= 20 or load.stop.is_set(),
                       what="both replicas serving under load")
            assert not load.stop.is_set(), load.results
            proc.send_signal(sig)
            at_kill = load.done
            wait_until(lambda: load.done >= at_kill + 300 or load.stop.is_set(), timeout=60,
                       what="300 requests after the stop")
            assert proc.wait(timeout=scaled(15)) == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
        assert load.done >= at_kill + 300, load.results
        assert set(load.results) == {"decided"}, (load.results, load.failures[:5])
        assert len(up.requests) == load.done                  # each one went upstream once
        stats = _replica_stats(admin)
        assert stats[victim]["health_flags"] != "healthy"    # out of the rotation
        assert int(stats[survivor]["rq_total"]) > 300
