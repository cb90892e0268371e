"""How fast the machine ran during one benchmark run, from a fixed piece of work.

On a shared box the same requests cost more CPU when the box is slower (other tenants,
frequency, cache pressure), and every time-based figure moves with it: on 2026-12-06 one
arm's run of the hundreds scenario found Envoy, the agents and the load generator all using
a quarter more CPU seconds for the same requests (docs/bench-history.md). The processes of
a run do not do the same work in every arm, though (the load generator used 12-17% more
CPU under affinity than under ace at 1 host, in both replays of one run), so the reading
comes from work that is the same in every run: ``pace_probe`` starts a small process on
the hosts' cores that, every ``every_s``, times a fixed loop in its own CPU time (time
spent waiting for a core is not counted: the reading is the core's speed, not its queue).
Its median over the run is ``pace_probe_ms`` in each arm's entry; ``bench.report.
machine_pace`` compares the runs of a fleet with it. About 0.5% of one core.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from bench import cores

__all__ = ["pace_probe", "read_probe"]

EVERY_S = 0.5
WORK = 20_000  # iterations of the fixed loop: ~2 ms of one core here


def fixed_work(n: int = WORK) -> int:
    """The probe's unit of work: pure Python arithmetic, no allocation, no I/O."""
    acc = 0
    for i in range(n):
        acc = (acc + i * i) % 1_000_003
    return acc


def read_probe(path: Path) -> dict | None:
    """``{"samples", "cpu_ms_p50"}`` of a probe's file (one CPU-time sample in ms per
    line); None when it holds none."""
    try:
        samples = [float(line) for line in path.read_text().split() if line]
    except (OSError, ValueError):
        return None
    if not samples:
        return None
    return {"samples": len(samples), "cpu_ms_p50": round(statistics.median(samples), 4)}


@contextlib.contextmanager
def pace_probe(path: Path, cpus: Collection[int] | None = None, every_s: float = EVERY_S) -> Iterator[Path]:
    """The probe process on ``cpus`` (None: wherever this one runs) for the block, writing
    to ``path``; stopped at the block's end (``read_probe(path)`` then reads it)."""
    with cores.pinned(cpus):
        proc = subprocess.Popen([sys.executable, "-m", "bench.pace", "--out", str(path), "--every-s", str(every_s)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield path
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.pace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="file the samples go to (CPU ms per line)")
    ap.add_argument("--every-s", type=float, default=EVERY_S)
    ap.add_argument("--samples", type=int, default=0, help="stop after this many (0: until stopped)")
    args = ap.parse_args(argv)
    n = 0
    with open(args.out, "w", buffering=1) as out:
        while not args.samples or n < args.samples:
            t = time.thread_time()
            fixed_work()
            out.write(f"{(time.thread_time() - t) * 1e3:.4f}\n")
            n += 1
            time.sleep(args.every_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
