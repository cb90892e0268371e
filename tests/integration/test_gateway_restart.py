"""Restarts without loss: an ext_proc replica sent SIGTERM and started again on the same
address, under load through the real Envoy, loses no request (extproc/transport/handover.py).

The old process serves on (NOT_SERVING) until its successor listens on the same port
(SO_REUSEPORT), then stops accepting and drains; Envoy's retry_policy covers a connection
caught in the closing listener's queue. Every response is counted: 200 with the gateway's
decision on it (x-ace-served-by), or it is a loss.
"""
from __future__ import annotations

import contextlib
import signal
from pathlib import Path

from tests.extproc.builders import upstream, write_state
from tests.support.envoy import run_envoy
from tests.support.gateway_load import Load, replica_stats
from tests.support.procs import extproc_process, free_port
from tests.support.upstream import RecordingUpstream
from tests.support.wait import scaled, wait_until


def _restart(stack: contextlib.ExitStack, old, work: Path, state: Path, port: int, db: Path, load: Load):
    """SIGTERM to ``old`` (its process), a new process on ``port`` in ``work`` started
    meanwhile (the same state and database); returns it once the old one has exited 0 and
    the new one has served 100 requests."""
    old[1].send_signal(signal.SIGTERM)
    new = stack.enter_context(extproc_process(work, state, port=port, extproc_args=["--db", str(db)]))
    assert old[1].wait(timeout=scaled(30)) == 0
    at_exit = load.done
    wait_until(lambda: load.done >= at_exit + 100 or load.stop.is_set(), timeout=60,
               what="100 requests served by the new process")
    assert load.done >= at_exit + 100, load.results
    return new


def _check(load: Load, up: RecordingUpstream, old_logs: list[Path]) -> None:
    print(f"responses: {dict(load.results)}")
    assert set(load.results) == {"decided"}, (load.results, load.failures[:5])
    assert len(up.requests) == load.done        # each one went upstream once
    for log in old_logs:                        # each old process waited for its successor
        assert "over after" in (text := log.read_text()) and "a successor listens on the port" in text, text[-2000:]


def test_a_single_replica_restarted_under_load_loses_no_request(tmp_path):
    """One replica (the default deployment): SIGTERM, a new process started meanwhile on the
    same port. 4 clients post all along; every response is a decided 200."""
    port, db = free_port(), tmp_path / "gw.sqlite3"
    with RecordingUpstream() as up, contextlib.ExitStack() as stack:
        state = write_state(tmp_path, [upstream("local-vllm", up.address)])
        old = stack.enter_context(extproc_process(tmp_path / "gen1", state, port=port,
                                                  extproc_args=["--db", str(db)]))
        envoy = stack.enter_context(run_envoy(tmp_path, extproc=old[0], default_upstream=up.address,
                                              message_timeout="5s"))
        with Load(envoy, limit=2000) as load:
            wait_until(lambda: load.done >= 50 or load.stop.is_set(), what="load flowing")
            _restart(stack, old, tmp_path / "gen2", state, port, db, load)
        _check(load, up, [tmp_path / "gen1" / "extproc.log"])


def test_a_rolling_restart_of_two_replicas_loses_no_request(tmp_path):
    """Two replicas; A restarted as above, then (once Envoy sees the new A healthy) B."""
    ports, db = (free_port(), free_port()), tmp_path / "gw.sqlite3"
    with RecordingUpstream() as up, contextlib.ExitStack() as stack:
        state = write_state(tmp_path, [upstream("local-vllm", up.address)])
        olds = [stack.enter_context(extproc_process(tmp_path / f"{name}1", state, port=port,
                                                    extproc_args=["--db", str(db)]))
                for name, port in zip("ab", ports)]
        admin = free_port()
        envoy = stack.enter_context(run_envoy(tmp_path, extproc=[a for a, _ in olds], admin_port=admin,
                                              default_upstream=up.address, message_timeout="5s"))

        def healthy(address: str) -> bool:
            return replica_stats(admin).get(address, {}).get("health_flags") == "healthy"

        with Load(envoy, limit=3000) as load:
            wait_until(lambda: all(healthy(a) for a, _ in olds) and load.done >= 50 or load.stop.is_set(),
                       what="both replicas healthy, load flowing")
            for name, port, old in zip("ab", ports, olds):
                new = _restart(stack, old, tmp_path / f"{name}2", state, port, db, load)
                wait_until(lambda: healthy(new[0]) or load.stop.is_set(), what=f"the new {name} healthy")
        _check(load, up, [tmp_path / "a1" / "extproc.log", tmp_path / "b1" / "extproc.log"])
