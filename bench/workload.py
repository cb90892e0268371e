"""Synthetic multi-tenant LoRA workload for the simulator, and trace encoding.

The default workload (``synthetic``) is what the issue describes, with every knob a
``WorkloadSpec`` field (printed into ``reports/sim.json``):

- **Zipf popularity**: every adapter draw anywhere (single-shot requests and the
  adapters that make up a tenant's workflows) samples one Zipf(s) law over all adapters.
  Nothing makes workflow adapters special: a chain mixes head and tail adapters as the
  law gives them.
- **Workflow chains**: each tenant has 1-3 habitual chains of 2-4 adapters (code ->
  review -> sql); a session runs one, with a step straying to a random Zipf adapter
  (``p_stray``) or repeating (``p_repeat``); steps are separated by a think time
  (log-normal, median ``think_median_s``).
- **Single-shot sessions** (``p_single``): 1-3 requests to Zipf adapters, no habit.
- **Bursts**: at ``bursts_per_hour`` random times a tenant opens sessions ``burst_x``
  times faster for 30-120 s, and a batch job sends 50-300 requests to one Zipf adapter.
- **Tenant churn**: tenants arrive over the whole span and live an exponential lifetime
  (mean ``tenant_life_frac`` of the span); only live tenants open sessions.

Arrays are returned column-wise (``Workload``); ``encode_trace`` turns a loaded trace
file into the same columns.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass

import numpy as np

__all__ = ["Workload", "WorkloadSpec", "encode_trace", "synthetic", "RANKS"]

RANKS = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class WorkloadSpec:
    requests: int = 1_000_000
    adapters: int = 1200
    tenants: int = 300
    zipf_s: float = 1.0
    rate_per_s: float = 10.0
    p_single: float = 0.4
    p_stray: float = 0.1
    p_repeat: float = 0.15
    think_median_s: float = 2.0
    bursts_per_hour: float = 4.0
    burst_x: float = 10.0
    tenant_life_frac: float = 0.3
    seed: int = 7

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Workload:
    """One request per index, sorted by ``t``; ids are dense integers."""

    t: np.ndarray  # float64 seconds
    tenant: np.ndarray  # int32
    session: np.ndarray  # int64
    adapter: np.ndarray  # int32
    rank_of: np.ndarray  # int32, per adapter id
    names: list[str]  # adapter id -> name

    def __len__(self) -> int:
        return len(self.t)


def synthetic(spec: WorkloadSpec) -> Workload:
    rng = random.Random(spec.seed)
    nprng = np.random.default_rng(spec.seed)
    n_ad = spec.adapters
    weights = 1.0 / np.arange(1, n_ad + 1) ** spec.zipf_s
    cdf = np.cumsum(weights / weights.sum())
    perm = nprng.permutation(n_ad)  # popularity rank -> adapter id

    pool = perm[np.searchsorted(cdf, nprng.random(4 * spec.requests + 10_000))].tolist()
    pool_i = 0

    def zipf() -> int:
        nonlocal pool_i
        pool_i += 1
        return pool[pool_i - 1]

    rank_of = nprng.choice(RANKS, size=n_ad, p=[0.25, 0.25, 0.2, 0.2, 0.1]).astype(np.int32)

    mean_session_len = spec.p_single * 2.0 + (1 - spec.p_single) * 3.0 * (1 + spec.p_repeat)
    span = spec.requests / spec.rate_per_s
    session_rate = spec.rate_per_s / mean_session_len

    life = spec.tenant_life_frac * span
    tenants = []  # (start, end, activity, chains, chain_weights)
    for _ in range(spec.tenants):
        start = rng.uniform(-life, span)
        end = start + rng.expovariate(1.0 / life)
        chains = [[zipf() for _ in range(rng.randint(2, 4))] for _ in range(rng.randint(1, 3))]
        tenants.append((start, end, rng.lognormvariate(0.0, 1.0), chains, [rng.random() + 0.2 for _ in chains]))

    bursts = []  # (start, end, tenant or -1, adapter)
    n_bursts = max(1, int(spec.bursts_per_hour * span / 3600))
    for _ in range(n_bursts):
        s = rng.uniform(0, span)
        bursts.append((s, s + rng.uniform(30, 120), rng.randrange(spec.tenants)))

    ts: list[float] = []
    tn: list[int] = []
    ss: list[int] = []
    ad: list[int] = []
    mu = math.log(spec.think_median_s)

    def emit(t: float, tenant: int, session: int, adapter: int) -> None:
        ts.append(t)
        tn.append(tenant)
        ss.append(session)
        ad.append(adapter)

    # live tenants are re-sampled once per "epoch" (cheap churn bookkeeping)
    epoch = 60.0
    live: list[int] = []
    live_w: list[float] = []
    next_epoch = 0.0
    clock = 0.0
    sid = 0
    target = int(spec.requests * 1.05)
    while len(ts) < target:
        clock += rng.expovariate(session_rate)
        if clock >= next_epoch:
            live = [i for i, tt in enumerate(tenants) if tt[0] <= clock < tt[1]] or [rng.randrange(spec.tenants)]
            live_w = [tenants[i][2] for i in live]
            next_epoch = clock + epoch
            for b_start, b_end, b_tenant in bursts:
                if b_start <= clock < b_end and b_tenant not in live:
                    live.append(b_tenant)
                    live_w.append(tenants[b_tenant][2])
        weights_now = live_w
        for b_start, b_end, b_tenant in bursts:
            if b_start <= clock < b_end:
                weights_now = [w * (spec.burst_x if i == b_tenant else 1.0) for i, w in zip(live, live_w)]
                break
        tenant = rng.choices(live, weights_now)[0]
        sid += 1
        t = clock
        if rng.random() < spec.p_single:
            for _ in range(rng.randint(1, 3)):
                emit(t, tenant, sid, zipf())
                t += rng.lognormvariate(mu, 0.8)
        else:
            _, _, _, chains, cw = tenants[tenant]
            for planned in rng.choices(chains, cw)[0]:
                a = zipf() if rng.random() < spec.p_stray else planned
                for _ in range(2 if rng.random() < spec.p_repeat else 1):
                    emit(t, tenant, sid, a)
                    t += rng.lognormvariate(mu, 0.8)
    # batch-job bursts: many requests to one adapter, each its own session
    for b_start, b_end, b_tenant in bursts:
        a = zipf()
        for _ in range(rng.randint(50, 300)):
            sid += 1
            emit(rng.uniform(b_start, b_end), b_tenant, sid, a)

    t_arr = np.asarray(ts)
    order = np.argsort(t_arr, kind="stable")[: spec.requests]
    return Workload(
        t=t_arr[order],
        tenant=np.asarray(tn, dtype=np.int32)[order],
        session=np.asarray(ss, dtype=np.int64)[order],
        adapter=np.asarray(ad, dtype=np.int32)[order],
        rank_of=rank_of,
        names=[f"adapter-{i:05d}" for i in range(n_ad)],
    )


def encode_trace(requests: list[dict]) -> Workload:
    """A validated trace (``bench.trace.load_trace``) as integer columns."""
    ids: dict[str, int] = {}
    tenants: dict[str, int] = {}
    sessions: dict[tuple[str, object], int] = {}
    ranks: list[int] = []
    t, tn, ss, ad = [], [], [], []
    for r in requests:
        a = ids.get(r["adapter"])
        if a is None:
            a = ids[r["adapter"]] = len(ids)
            ranks.append(int(r["rank"]))
        ten = tenants.setdefault(r["tenant"], len(tenants))
        ses = sessions.setdefault((r["tenant"], r["session"]), len(sessions))
        t.append(float(r["t"]))
        tn.append(ten)
        ss.append(ses)
        ad.append(a)
    return Workload(
        t=np.asarray(t),
        tenant=np.asarray(tn, dtype=np.int32),
        session=np.asarray(ss, dtype=np.int64),
        adapter=np.asarray(ad, dtype=np.int32),
        rank_of=np.asarray(ranks, dtype=np.int32),
        names=list(ids),
    )
