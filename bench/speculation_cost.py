"""Request-path cost of speculation: ``decide()`` alone vs ``decide()`` + ``observe()``.

    python -m bench.speculation_cost [--n 20000] [--rate 0] [--mode thread|inline-drain]

In-process, on the gateway's test state (tests/extproc/builders.py): every request is a
two-step session (``user`` field). ``thread``: the speculation thread runs beside the
timed loop (what the gateway does); ``inline-drain``: no thread, the planner is drained
outside the timed region (the cost of the hand-off alone). Requests are paced at
``--rate`` per second (the gateway serves ~1,200-1,500 req/s on this machine,
docs/gateway.md; 0 = back to back, the worst case for the thread's GIL holds). Prints
p50/p99 in µs.
"""
from __future__ import annotations

import argparse
import pathlib
import tempfile
import time

from extproc.domain.auth import Principal
from extproc.domain.decision import InferenceRequest, decide
from extproc.domain.headers import session_of
from extproc.fleet.speculation import GatewaySpeculation, SpeculationPlanner
from extproc.state.residency import ResidencyBoard, ResidencySnapshot, SentCounts
from extproc.state.store import Store
from tests.extproc.builders import upstream, write_state


class _Sink:
    def submit(self, signal) -> bool:
        return True


def measure(n: int, mode: str, rate: float = 0.0) -> dict[str, float]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ace-spec-cost-"))
    store = Store(write_state(tmp, [upstream("local-vllm", "127.0.0.1:8000")]), tmp / "gw.sqlite3")
    snap = store.snapshot
    key = next(k for k in snap.keys.values() if k.name == "alice")
    principal = Principal(key=key, tenant=snap.tenants["acme"])
    gs = GatewaySpeculation(store, ResidencyBoard(), _Sink(), SpeculationPlanner())
    if mode == "thread":
        gs.start()
    skills = {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    res, sent = ResidencySnapshot(), SentCounts()
    alone, both = [], []
    interval = 1.0 / rate if rate > 0 else 0.0
    next_at = time.perf_counter()
    try:
        for i in range(n):
            if interval:
                next_at += interval
                pause = next_at - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
            body = {"model": ("code-python", "acme-legal")[i % 2], "user": f"s{i // 2}"}
            t0 = time.perf_counter_ns()
            d = decide(snap, res, sent, InferenceRequest(principal, body, skills))
            t1 = time.perf_counter_ns()
            gs.observe(d, "acme", session_of(None, body))
            t2 = time.perf_counter_ns()
            alone.append(t1 - t0)
            both.append(t2 - t0)
            if mode != "thread":
                gs.drain()
    finally:
        gs.close()
        store.close()
    out = {}
    for name, xs in (("decide", alone), ("decide_observe", both)):
        xs.sort()
        out[f"{name}_p50_us"] = xs[len(xs) // 2] / 1e3
        out[f"{name}_p99_us"] = xs[int(0.99 * len(xs))] / 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.speculation_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=20000, help="requests timed")
    ap.add_argument("--mode", choices=("thread", "inline-drain"), default="thread")
    ap.add_argument("--rate", type=float, default=0.0, help="requests per second (0: back to back)")
    args = ap.parse_args(argv)
    for k, v in measure(args.n, args.mode, args.rate).items():
        print(f"{k:<22}{v:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
