"""What the gateway replicas' separate learned state costs, in hit ratio.

    python -m bench.replica_learning [--requests N] [--budget B] [--trace FILE] --out reports/replica_learning.json

Each gateway replica learns from the traffic it sees (the shared PostgreSQL state holds
keys and skills, not the prediction state: docs/gateway.md, "Shared state"). This replays
the workload of ``bench.sim`` through its ``speculative`` policy (the gateway's
``extproc.policy.speculator.Speculator``) with one engine pool (one ``AdapterCache`` the
replicas' Speculators share) and R replicas, each with its own transition model,
popularity, session pace, session demand and prediction ledger. Requests reach the
replicas round-robin (request i -> replica i mod R) or with session affinity (the
session's hash mod R, a balancer hashing ``x-ace-session-id``). R = 1 is ``bench.sim``'s
``speculative``; ``ingress`` (no learning) is the floor. Same load model and defaults as
``bench.sim``.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.sim import LoadChannel, Result, load_times, parse_args as sim_args, run_lru
from bench.workload import Workload, WorkloadSpec, synthetic
from extproc.policy.cache import AdapterCache
from extproc.policy.speculator import SpeculationSettings, Speculator


def columns(w: Workload, args) -> tuple:
    """The columns ``bench.sim``'s runs take (arrival, engine start, adapter, tenant,
    session, load time), with its lead-time draw."""
    rng = np.random.default_rng(args.seed)
    return (w.t.tolist(), (w.t + rng.exponential(args.lead_ms / 1000.0, len(w.t))).tolist(),
            w.adapter.tolist(), w.tenant.tolist(), w.session.tolist(),
            load_times(w, args.load_base_ms, args.bytes_per_rank, args.gbps))


def run_replicas(cols, budget: int, args, replicas: int, affinity: bool) -> dict:
    t, s, ad, tn, ss, L = cols
    n = len(t)
    settings = SpeculationSettings(k=args.k, min_p=args.min_p, horizon_s=args.horizon_s,
                                   half_life_s=args.half_life_s, window=args.window,
                                   adaptive_horizon=not args.fixed_horizon,
                                   session_demand=not args.no_session_demand, order=args.order)
    pool = AdapterCache(budget)
    specs = [Speculator(budget, settings) for _ in range(replicas)]
    for spec in specs:
        spec.cache = pool          # one engine pool; the learned state is per replica
    chan = LoadChannel(args.channels)
    res = Result(n)

    def load(key, now: float) -> float:
        return chan.load(now, L[key])

    for i in range(n):
        spec = specs[(hash(ss[i]) if affinity else i) % replicas]
        ready = spec.demand(ad[i], t[i], load=load, engine_at=s[i])
        res.record(i, ready, t[i], s[i])
        spec.speculate(tn[i], ss[i], ad[i], t[i], load=load,
                       may_load=chan.backlog(t[i]) <= args.max_backlog_ms / 1000.0)
    for spec in specs:
        spec.ledger.flush()
    return res.summary(n, pool)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--out" not in argv:
        argv += ["--out", "reports/replica_learning.json"]
    if "--requests" not in argv:
        argv += ["--requests", "100000"]
    args = sim_args(argv)
    budget = int(args.budget.split(",")[0]) if args.budget else 32
    spec = WorkloadSpec(requests=args.requests, adapters=args.adapters, tenants=args.tenants,
                        zipf_s=args.zipf, rate_per_s=args.rate, seed=args.seed)
    cols = columns(synthetic(spec), args)
    t0 = time.monotonic()
    arms = {"ingress (no learning)": run_lru(cols, budget, args.channels, ingress=True)}
    for replicas, affinity in ((1, False), (2, False), (2, True), (4, False), (4, True)):
        name = f"{replicas} replica{'s' if replicas > 1 else ''}" + (
            (", session affinity" if affinity else ", round-robin") if replicas > 1 else "")
        arms[name] = run_replicas(cols, budget, args, replicas, affinity)
        print(f"{name:32} hit {arms[name]['hit_ratio']:.4f}", file=sys.stderr, flush=True)
    report = {"workload": {"synthetic": spec.as_dict()}, "budget": budget,
              "metric": "hit_ratio = share of requests whose adapter was loaded when the engine started them",
              "results": {k: {m: round(v, 4) if isinstance(v, float) else v for m, v in r.items()}
                          for k, r in arms.items()},
              "elapsed_s": round(time.monotonic() - t0, 1)}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
