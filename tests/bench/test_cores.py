"""bench.cores: the request path's cores apart from the engine hosts'."""
import os
import subprocess
import sys

import pytest

from bench import cores


def test_split_gives_the_request_path_the_lowest_quarter_and_the_hosts_the_rest():
    assert cores.split({0, 1}) == (frozenset({0}), frozenset({1}))
    assert cores.split({3, 1, 2, 0}) == (frozenset({0}), frozenset({1, 2, 3}))
    assert cores.split(range(8)) == (frozenset({0, 1}), frozenset(range(2, 8)))
    assert cores.split({5, 9, 7}) == (frozenset({5}), frozenset({7, 9}))   # whatever the numbers


def test_one_core_is_not_split():
    assert cores.split({4}) is None and cores.split(()) is None


needs_two = pytest.mark.skipif(cores.available() is None or len(cores.available()) < 2,
                               reason="needs Linux affinity and 2 cores")


@needs_two
def test_pinned_moves_the_thread_and_what_it_starts_then_puts_it_back():
    before = os.sched_getaffinity(0)
    one = {min(before)}
    with cores.pinned(one):
        assert os.sched_getaffinity(0) == one
        child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                               capture_output=True, text=True, check=True)
        assert child.stdout.strip() == str(sorted(one))
    assert os.sched_getaffinity(0) == before
    with cores.pinned(None):
        assert os.sched_getaffinity(0) == before


@needs_two
def test_running_starts_a_process_and_its_threads_on_the_cores_asked(tmp_path):
    from tools.localstack import running
    other = {max(os.sched_getaffinity(0))}
    script = ("import os, threading; seen = []; t = threading.Thread(target=lambda: seen.append("
              "sorted(os.sched_getaffinity(0)))); t.start(); t.join(); print(sorted(os.sched_getaffinity(0)), seen[0])")
    log = tmp_path / "child.log"
    with running([sys.executable, "-c", script], log, cpus=other) as proc:
        proc.wait(timeout=60)
    assert log.read_text().strip() == f"{sorted(other)} {sorted(other)}"
