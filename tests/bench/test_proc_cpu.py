"""bench.proc_cpu: roles from command lines, and CPU seconds per role from /proc."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import proc_cpu


@pytest.mark.parametrize("argv, want", [
    (["/v/bin/python", "-m", "gpu_agent", "serve", "--cache-dir", "/w/4-ace/host-3/agent-cache"], "agent:host-3"),
    (["/v/bin/python", "-m", "gpu_agent", "serve"], "agent"),
    (["/v/bin/python", "-m", "extproc", "--config", "state.yaml"], "ext_proc"),
    (["/v/bin/envoy", "-c", "envoy.yaml"], "envoy"),
    (["/v/bin/python", "-m", "http.server", "8000"], "store"),
    (["/v/bin/vllm-router", "--worker-urls", "x"], "vllm_router"),
    (["vllm::router"], "vllm_router"),
    (["/v/.venv-vllm/bin/python", "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", "m"], "vllm"),
    (["/v/.venv-vllm/bin/vllm", "serve", "m"], "vllm"),
    (["/usr/bin/sleep", "5"], "other:sleep"),
    ([], "other:?"),
])
def test_role_names_each_process_of_a_bench_stack(argv, want):
    assert proc_cpu.role(argv) == want


def test_account_sums_per_role_and_counts_a_new_process_from_zero():
    before = {1: ("client", 2.0), 2: ("agent:host-1", 1.0), 3: ("agent:host-2", 5.0)}
    after = {1: ("client", 2.5), 2: ("agent:host-1", 4.0), 3: ("agent:host-2", 5.25), 4: ("store", 0.75)}
    assert proc_cpu.account(before, after) == {"agent:host-1": 3.0, "agent:host-2": 0.25, "client": 0.5,
                                               "store": 0.75}
    # a pid reused by another program counts from zero too
    assert proc_cpu.account({5: ("store", 9.0)}, {5: ("envoy", 1.0)}) == {"envoy": 1.0}


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_snapshot_sees_a_busy_child_and_its_cpu():
    spin = "import sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n" \
           "print('done', flush=True)\nsys.stdin.read()"
    before = proc_cpu.snapshot()
    proc = subprocess.Popen([sys.executable, "-c", spin], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "done"  # it spent 0.3 s of CPU and is still alive
        after = proc_cpu.snapshot()
        assert after[proc.pid][0] == "other:" + Path(sys.executable).name
        used = proc_cpu.account(before, after)
        assert used["other:" + Path(sys.executable).name] >= 0.25
        assert "client" in used
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads Linux's /proc")
def test_a_child_that_names_no_role_counts_as_its_parents():
    """vLLM's engine core is a child of its API server with a command line of its own:
    its CPU is the engine's. Here a "-m extproc" parent starts a plain python child."""
    child = "import sys\nsys.stdin.read()"
    parent = ("import subprocess, sys\n"
              f"c = subprocess.Popen([sys.executable, '-c', {child!r}], stdin=subprocess.PIPE)\n"
              "print(c.pid, flush=True)\nsys.stdin.read()\nc.stdin.close()\nc.wait()")
    proc = subprocess.Popen([sys.executable, "-c", parent, "-m", "extproc"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        grandchild = int(proc.stdout.readline())
        got = proc_cpu.snapshot()
        assert got[proc.pid][0] == "ext_proc"
        assert got[grandchild][0] == "ext_proc"
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
