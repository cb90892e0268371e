"""`make demo` and `make bench` end to end on a small scale: the same local stack
(tools.localstack.gateway_stack: agent + builtin engine, ext_proc, real Envoy)."""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.support.procs import REPO, python
from tests.support.fixtures import fixtures_dir
from tests.support.wait import scaled, wait_until

pytest.importorskip("torch")


def test_demo_shows_prefetched_and_cold_side_by_side(tmp_path_factory, capsys):
    from tools import demo

    fixtures = fixtures_dir(tmp_path_factory)
    assert demo.main(["--fixtures", str(fixtures), "--work", str(tmp_path_factory.mktemp("demo"))]) == 0
    out = capsys.readouterr().out
    assert "adapter_prefetched_applied" in out and "adapter_cold_loaded" in out
    assert "401" in out and "404" in out and "400" in out
    assert "dedicated instances" in out
    assert re.search(r"settings page: http://127\.0\.0\.1:\d+/settings  \(sign in with sk-ace-demo-acme", out)
    assert "curl it yourself" not in out  # the stack is gone by now: no hint to try it


def test_demo_with_two_replicas_shows_a_change_on_one_enforced_by_the_other(tmp_path_factory, capsys):
    """``make demo REPLICAS=2``: PostgreSQL and two ext_proc replicas, all stopped after."""
    from tests.support.postgres import require_postgres
    from tools import demo

    require_postgres()
    work = tmp_path_factory.mktemp("demo2")
    assert demo.main(["--fixtures", str(fixtures_dir(tmp_path_factory)), "--work", str(work),
                      "--replicas", "2"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("== 5. two gateway replicas"):]
    assert "-> 200" in section and "replica 2: now 'off'" in section, section
    assert "replica 2 answers 401 invalid_api_key" in section and "restored: replica 1 answers 200" in section
    home = re.search(r"data and log: (\S+)\)", out).group(1)
    assert not Path(home).exists()          # the demo's PostgreSQL is stopped and deleted


def _started_at(pid: int) -> str | None:
    """The process's start time in clock ticks (tells a pid from its reuse); None once it
    is gone or a zombie (exited, only waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, *rest = stat.rsplit(")", 1)[1].split()
    return None if state in ("Z", "X") else rest[18]


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid``, with its start time."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            for kid in kids:
                if (started := _started_at(kid)) is not None and kid not in found:
                    found[kid] = started
                    todo.append(kid)
    return found


@contextlib.contextmanager
def _spawned(cmd: list[str], out: Path):
    """``cmd`` running with its output in ``out``; on the way out, whatever the outcome,
    it and every process it started that is still running are killed (``children``, which
    the test fills from ``_descendants`` once they are up)."""
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: dict[int, str] = {}
    try:
        yield proc, children
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for pid, started in children.items():
            if _started_at(pid) == started:
                os.kill(pid, signal.SIGKILL)


def _stop_and_check_every_child_gone(proc: subprocess.Popen, children: dict[int, str], signum: int,
                                     out: Path, rc: int) -> None:
    """Send ``signum``; the process exits with ``rc`` and every one of ``children`` is gone."""
    children.update(_descendants(proc.pid))
    assert len(children) >= 3, children     # the agent, the ext_proc and Envoy
    proc.send_signal(signum)
    assert proc.wait(timeout=scaled(60)) == rc, out.read_text()[-4000:]
    wait_until(lambda: all(_started_at(pid) != started for pid, started in children.items()),
               what="every process it started is gone")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_demo_keep_stops_its_whole_stack_on_a_stop_signal(signum, tmp_path_factory, tmp_path):
    """What a process manager or a closed terminal sends stops Envoy, the ext_proc and the
    agent as Ctrl-C does: none of them is left running, reparented to init."""
    out = tmp_path / "demo.out"
    cmd = [python(), "-m", "tools.demo", "--fixtures", str(fixtures_dir(tmp_path_factory)),
           "--work", str(tmp_path / "work"), "--keep"]
    with _spawned(cmd, out) as (demo, children):
        wait_until(lambda: "stack is up" in out.read_text() or demo.poll() is not None, timeout=300,
                   interval=0.2, what="the demo holds its stack up")
        assert demo.poll() is None, out.read_text()[-4000:]
        assert "curl it yourself" in out.read_text()
        # the settings page stays usable while the stack is held up, with the key it names
        page = re.findall(r"settings page: (\S+)", out.read_text())[-1]
        assert httpx.get(page, timeout=10).status_code == 200
        me = httpx.get(page.replace("/settings", "/api/v1/me"), timeout=10,
                       headers={"Authorization": "Bearer sk-ace-demo-acme"}).json()
        assert (me["tenant"], me["key"]["role"]) == ("acme", "admin")
        _stop_and_check_every_child_gone(demo, children, signum, out, 0)
        assert f"{signal.Signals(signum).name}: stack stopped" in out.read_text()


def test_bench_replays_a_small_trace_and_writes_the_report(tmp_path_factory, tmp_path):
    from bench import multi_lora_eval
    from tests.support.procs import REPO

    trace = json.loads((REPO / "data" / "multi_lora_eval" / "multi_lora_eval_800.json").read_text())
    rows = trace["requests"] if isinstance(trace, dict) else trace
    first_sessions = {(r["tenant"], r["session"]) for r in rows[:3]}
    small = [r for r in rows if (r["tenant"], r["session"]) in first_sessions]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in small))
    out = tmp_path / "report.json"
    rc = multi_lora_eval.main(["--trace", str(path), "--out", str(out), "--speed", "50",
                               "--fixtures", str(fixtures_dir(tmp_path_factory))])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["total"] == len(small)
    assert report["errors"] == {"baseline": 0, "prefetch": 0}
    for run in ("baseline", "prefetch"):
        assert set(report["ttft_ms"][run]) == {"p50", "p90", "p95", "p99"}
    for fleet in report["fleets"].values():   # the pools' evictions, by reason, in every arm
        assert all(isinstance(arm["pool_evictions"], dict) for arm in fleet.values())
    assert (tmp_path / "report.png").exists()


def test_bench_stops_every_process_it_started_on_sigterm(tmp_path_factory, tmp_path):
    """A bench killed mid-replay (a CI timeout, ``kill``) stops its agents, ext_proc and
    Envoy: they run in their own sessions, so nothing else would."""
    trace = json.loads((REPO / "data" / "multi_lora_eval" / "multi_lora_eval_800.json").read_text())
    rows = trace["requests"] if isinstance(trace, dict) else trace
    path = tmp_path / "slow.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows[:40]))
    out = tmp_path / "bench.out"
    cmd = [python(), "-m", "bench.multi_lora_eval", "--trace", str(path), "--out", str(tmp_path / "r.json"),
           "--hosts", "1", "--arms", "affinity", "--speed", "0.01",  # the replay outlasts the test
           "--fixtures", str(fixtures_dir(tmp_path_factory))]
    with _spawned(cmd, out) as (bench, children):
        wait_until(lambda: "replaying" in out.read_text() or bench.poll() is not None, timeout=300,
                   interval=0.2, what="the bench's stack is up and replaying")
        assert bench.poll() is None, out.read_text()[-4000:]
        _stop_and_check_every_child_gone(bench, children, signal.SIGTERM, out, 128 + signal.SIGTERM)
        assert "SIGTERM: stopped" in out.read_text()


def test_a_stop_signal_that_arrives_inside_a_task_group_still_ends_with_its_status():
    """A SIGTERM that lands while anyio's connect runs a task group (under httpx) reaches
    ``run_until_stopped`` wrapped in an exception group: the bench above exited 1, not
    143, once in CI (2026-12-06). The stop is found inside; any other group propagates."""
    from tools.localstack import Stopped, run_until_stopped

    def stopped_in_a_group() -> int:
        raise BaseExceptionGroup("connect", [BaseExceptionGroup("inner", [Stopped(signal.SIGTERM)])])

    def failed_in_a_group() -> int:
        raise BaseExceptionGroup("connect", [ValueError("refused")])

    assert run_until_stopped(stopped_in_a_group) == 128 + signal.SIGTERM
    with pytest.raises(BaseExceptionGroup):
        run_until_stopped(failed_in_a_group)


def test_free_ports_stay_out_of_the_kernels_ephemeral_range_and_never_repeat():
    """A server's port is not one an outgoing connection of the stack can take first
    (that raced: "address already in use" in the bench's 4-host start-up)."""
    from tools import localstack

    low = localstack._ephemeral_low()
    ports = [localstack.free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    if low - localstack._LOWEST_PORT >= 1000:
        assert all(localstack._LOWEST_PORT <= p < low for p in ports)
