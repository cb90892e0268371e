"""bench.pace: the fixed-work probe of the machine's pace (a real process, stopped)."""
import subprocess
import sys
import time

from bench.pace import pace_probe, read_probe


def test_the_probe_runs_beside_a_block_and_its_samples_are_read(tmp_path):
    path = tmp_path / "pace.txt"
    with pace_probe(path, every_s=0.01):
        give_up = time.monotonic() + 120  # only so that a probe that never starts fails the test
        while (read_probe(path) is None or read_probe(path)["samples"] < 3) and time.monotonic() < give_up:
            time.sleep(0.01)  # waits for the event: three samples written
    got = read_probe(path)
    assert got["samples"] >= 3 and got["cpu_ms_p50"] > 0


def test_a_fixed_number_of_samples_and_unreadable_files(tmp_path):
    path = tmp_path / "pace.txt"
    subprocess.run([sys.executable, "-m", "bench.pace", "--out", str(path), "--every-s", "0", "--samples", "5"],
                   check=True, timeout=120)
    assert read_probe(path)["samples"] == 5
    assert read_probe(tmp_path / "missing.txt") is None
    (tmp_path / "bad.txt").write_text("1.0\nnot a number\n")
    assert read_probe(tmp_path / "bad.txt") is None
    (tmp_path / "empty.txt").write_text("")
    assert read_probe(tmp_path / "empty.txt") is None
