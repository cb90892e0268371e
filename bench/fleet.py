"""The simulator across a fleet: H engine hosts, each with its own pool, side by side arms.

Arms (one run each per budget, same trace, same lead and load times):

- ``round_robin``: requests spread round robin; each host loads a missing adapter on
  demand (LRU), when the request reaches its engine.
- ``affinity``: residency-aware routing (``FleetRouter``: the tiers of
  ``extproc.policy.routing.choose_endpoint`` over the hosts' pools and loads), on-demand
  LRU loads, no prefetch.
- ``ace``: the same routing plus the gateway's speculation loop
  (``extproc.policy.speculator.Speculator.step``: one Speculator per host sharing the
  transition model, ledger, pace, session demand and first-step model, as the gateway's
  ``SpeculationPlanner`` does), predictions offered to the host routing would pick.

Per-pool bounds: for each arm, every host's share of the trace (the requests that arm
routed there) is replayed through Belady's demand optimum (``bench.sim.run_belady``),
and the oracle (``bench.sim.ceiling_bits``: every request but an adapter's first in the
whole trace that no ingress load could serve in time) is counted on it; their sums are
the arm's fleet bounds. No policy may beat the oracle; ``check_bounds`` says when one does.

A host's load is the requests it is running: each request occupies its host from when
the engine starts it for ``service_s`` seconds.
"""

from __future__ import annotations

import heapq
import math
import sys
import time

import numpy as np

from bench.sim import LoadChannel, Progress, ceiling_bits, first_steps, load_times, next_use, run_belady, run_ceiling
from bench.workload import Workload
from extproc.policy.cache import AdapterCache
from extproc.policy.prediction import FirstSteps, PredictionLedger, SessionDemand, StepPace
from extproc.policy.routing import LOAD_FLOOR, ring_walk
from extproc.policy.speculator import SpeculationSettings, Speculator
from gpu_agent.residency.prefetch_budget import HintBet, HintVerdict, LinkState, decide_hint

__all__ = ["ARMS", "FleetRouter", "check_bounds", "run_fleet"]

ARMS = ("round_robin", "affinity", "ace")
TOLERANCE = 1e-3  # hit ratio: a bound may be beaten by this much (ties in float sums)


class FleetRouter:
    """``choose_endpoint``'s tiers over the simulated pools (no staged tier: the sim has
    no host memory): the least loaded host holding the adapter and under the load bound,
    else the first host of the adapter's ring walk under the bound."""

    def __init__(self, hosts: list[str], pools: list, *, load_factor: float = 1.25,
                 min_bound: int = LOAD_FLOOR, walks: dict | None = None) -> None:
        self.hosts = tuple(hosts)
        self.pools = pools  # per host: a mapping whose keys are the adapters in its pool
        self.load = [0] * len(hosts)
        self.total = 0
        self.load_factor, self.min_bound = load_factor, min_bound
        self._walks: dict[int, list[int]] = {} if walks is None else walks  # shared between arms
        self._index = {h: i for i, h in enumerate(hosts)}

    def walk(self, adapter: int) -> list[int]:
        """``routing.ring_walk`` of the adapter's key, as host indices (cached)."""
        w = self._walks.get(adapter)
        if w is None:
            w = self._walks[adapter] = [self._index[h] for h in ring_walk(self.hosts, f"adapter-{adapter}")]
        return w

    def choose(self, adapter: int) -> int:
        load = self.load
        bound = max(1, self.min_bound, math.ceil(self.load_factor * (self.total + 1) / len(load)))
        holders = [h for h, pool in enumerate(self.pools) if adapter in pool]
        best = -1
        for h in holders:  # ties: the first host in name order, as choose_endpoint
            if load[h] + 1 <= bound and (best < 0 or load[h] < load[best]):
                best = h
        if best >= 0:
            return best
        walk = self.walk(adapter)
        for h in walk:
            if load[h] + 1 <= bound:
                return h
        return walk[0]

    def start(self, h: int) -> None:
        self.load[h] += 1
        self.total += 1

    def finish(self, h: int) -> None:
        self.load[h] -= 1
        self.total -= 1


class _Tally:
    __slots__ = ("hits", "resident", "first", "first_hits", "stall_sum")

    def __init__(self) -> None:
        self.hits = self.resident = self.first = self.first_hits = 0
        self.stall_sum = 0.0

    def record(self, ready: float, t: float, s: float, first: bool) -> None:
        if ready <= t:
            self.resident += 1
        if first:
            self.first += 1
        if ready <= s:
            self.hits += 1
            if first:
                self.first_hits += 1
        else:
            self.stall_sum += ready - s

    def summary(self, n: int) -> dict:
        return {"hit_ratio": self.hits / n, "resident_hit_ratio": self.resident / n,
                "mean_stall_ms": 1000 * self.stall_sum / n, "first_steps": self.first,
                "first_step_hits": self.first_hits,
                "first_step_hit_ratio": self.first_hits / self.first if self.first else None}


def run_arm(arm: str, cols, hosts: int, budget: int, channels: int, settings: SpeculationSettings, *,
            service_s: float, max_backlog_s: float, walks: dict | None = None,
            ingress: bool = True, agent_waste_share: float | None = None) -> tuple[dict, list[int]]:
    """One arm over the trace; returns its summary and the host of every request.

    ``ingress``: the ace arm loads a request's missing adapter when the gateway sees it
    (``t``), as a gateway that signals the load at ingress can; False: when the request
    reaches its engine (``s``), as the on-demand arms do and the stack's engines do
    (``bench.sim_stack``).

    ``agent_waste_share``: the ace arm's hosts take a prefetch only as the agents do
    (``gpu_agent.residency.prefetch_budget.decide_hint``, a wasted load charged this share
    of its time): a refused bet leaves the pool model (``AdapterCache.withdraw``), its
    victim stays, its load is taken back off the link; counted in ``refused`` by verdict.
    The hosts' ``Speculator.waste_share`` is that share, as the gateway's is the one its
    agents announce. None: every bet the gateway offers is taken."""
    t, s, ad, tn, ss, L, first = cols
    n = len(t)
    names = [f"host-{h:03d}" for h in range(hosts)]
    chans = [LoadChannel(channels) for _ in range(hosts)]
    if arm == "ace":
        shared = dict(model=settings.transition_model(), ledger=PredictionLedger(),
                      pace=StepPace(settings.horizon_s),
                      expected=SessionDemand(settings.horizon_s, working_set=settings.working_set),
                      first_steps=FirstSteps(settings.half_life_s, idle_timeout_s=settings.idle_timeout_s))
        specs = [Speculator(budget, settings, name=h, **shared) for h in range(hosts)]
        for sp in specs:  # the gateway prices its bets with the share the agents announce
            sp.waste_share = agent_waste_share or 0.0
        pools = [sp.cache for sp in specs]
    else:
        specs = []
        pools = [AdapterCache(budget) for _ in range(hosts)]
    router = FleetRouter(names, [p.entries for p in pools], walks=walks)
    running: list[tuple[float, int]] = []  # (end, host)
    where = [0] * n
    tally = _Tally()
    prog = Progress(f"fleet {arm}@{budget}x{hosts}", n)
    loads = [chan.load for chan in chans]
    on = [0]  # the host whose link the next load of the ace arm uses

    demand_until = [0.0] * hosts  # per host: when its latest demand load completes
    issued: dict = {}  # (host, adapter) -> the link as the prefetch found it
    refused: dict[str, int] = {}

    def load(key: int, at: float) -> float:
        h = on[0]
        busy_ms, before = chans[h].backlog(at) * 1000.0, list(chans[h].free)
        end = loads[h](at, L[key])
        issued[(h, key)] = (busy_ms, demand_until[h] > at, before, end)
        return end

    def demand_load(h: int, at: float, key: int) -> float:
        end = loads[h](at, L[key])
        demand_until[h] = max(demand_until[h], end)
        return end

    def refuse(pf, now: float) -> None:
        """The agent's budget on one prefetch the gateway sent (reverse order of issue)."""
        busy_ms, queued, before, end = issued[(pf.host, pf.adapter)]
        victim_ms = L[pf.victim] * 1000.0 if pf.victim is not None else 0.0
        bet = HintBet(pf.use_probability, L[pf.adapter] * 1000.0, pf.victim_probability, victim_ms,
                      waste_ms=L[pf.adapter] * 1000.0 * agent_waste_share)
        verdict = decide_hint(bet, LinkState(demand_loads=int(queued), busy_ms=busy_ms))
        if verdict is HintVerdict.ACCEPT:
            return
        refused[verdict.value] = refused.get(verdict.value, 0) + 1
        cache = specs[pf.host].cache
        cache.withdraw(pf.adapter, now)
        if pf.victim is not None and pf.victim not in cache:
            cache.admit(pf.victim, now)
        if chans[pf.host].free == [end]:  # its load is the link's last: take it back
            chans[pf.host].free = before

    def place(b: int) -> Speculator:
        on[0] = router.choose(b)  # offer() loads right after: on that host's link
        return specs[on[0]]

    for i in range(n):
        now = t[i]
        while running and running[0][0] <= now:
            router.finish(heapq.heappop(running)[1])
        a = ad[i]
        h = i % hosts if arm == "round_robin" else router.choose(a)
        where[i] = h
        if arm == "ace":
            on[0] = h
            def demand(key: int, at: float, h: int = h, engine_at: float = s[i]) -> float:
                return demand_load(h, at if ingress else engine_at, key)

            res = specs[h].step(tn[i], ss[i], a, now, load=demand, engine_at=s[i], prefetch_load=load,
                                may_load=chans[h].backlog(now) <= max_backlog_s, place=place)
            ready = res.ready_at
            if agent_waste_share is not None:
                for pf in reversed(res.prefetches):
                    refuse(pf, now)
            issued.clear()
        else:
            pool = pools[h]
            if a not in pool:
                pool.admit(a, loads[h](s[i], L[a]))
            ready = pool.get(a).ready_at
            pool.access(a, s[i])
        tally.record(ready, now, s[i], first[i])
        router.start(h)
        heapq.heappush(running, (s[i] + service_s, h))
        prog.tick(i)
    out = tally.summary(n)
    out["loads"] = sum(p.stats.loads for p in pools)
    out["prefetches"] = sum(p.stats.prefetches for p in pools)
    out["prefetch_used"] = sum(p.stats.prefetch_used for p in pools)
    if specs:
        specs[0].ledger.flush()
        st = specs[0].ledger.stats
        out.update(predictions=st.predictions, predictions_used=st.used, predictions_wasted=st.wasted)
        if agent_waste_share is not None:
            out["refused"] = dict(sorted(refused.items()))
    return out, where


def pool_bounds(cols, where: list[int], hosts: int, budget: int, channels: int) -> dict:
    """Belady's demand optimum on every host's share and the oracle's possible hits, summed."""
    by_host = np.asarray(where)
    hits = {"belady": 0, "oracle": 0}
    first_hits = {"belady": 0, "oracle": 0}
    n = len(where)
    L = cols[5]
    possible = ceiling_bits(cols)  # an adapter's first request is first in the whole fleet
    for h in range(hosts):
        idx = np.flatnonzero(by_host == h)
        if not len(idx):
            continue
        sub = tuple([col[j] for j in idx.tolist()] for col in (cols[0], cols[1], cols[2], cols[3], cols[4]))
        sub = (*sub, L, [cols[6][j] for j in idx.tolist()])
        nxt = next_use(np.asarray(sub[2]))
        r = run_belady(sub, nxt, budget, channels, prefetch=False, ingress=False)
        hits["belady"] += round(r["hit_ratio"] * len(idx))
        first_hits["belady"] += r["first_step_hits"]
        r = run_ceiling(sub, [possible[j] for j in idx.tolist()])
        hits["oracle"] += round(r["hit_ratio"] * len(idx))
        first_hits["oracle"] += r["first_step_hits"]
    return {k: {"hit_ratio": hits[k] / n, "first_step_hits": first_hits[k]} for k in hits}


def check_bounds(fleet: dict) -> list[str]:
    """Every broken bound, as a sentence: oracle >= each arm on that arm's own assignment,
    Belady's demand optimum >= the on-demand arms (round_robin, affinity)."""
    broken = []
    for b, arms in fleet.items():
        for arm, r in arms.items():
            bounds = r.get("bounds")
            if not bounds:
                continue
            if r["hit_ratio"] > bounds["oracle"]["hit_ratio"] + TOLERANCE:
                broken.append(f"fleet budget {b}: {arm} {r['hit_ratio']:.4f} beats the oracle "
                              f"{bounds['oracle']['hit_ratio']:.4f} on its own assignment")
            if arm != "ace" and r["hit_ratio"] > bounds["belady"]["hit_ratio"] + TOLERANCE:
                broken.append(f"fleet budget {b}: {arm} {r['hit_ratio']:.4f} beats Belady's demand optimum "
                              f"{bounds['belady']['hit_ratio']:.4f} on its own assignment")
    return broken


def run_fleet(w: Workload, budgets: list[int], hosts: int, settings: SpeculationSettings, args) -> dict:
    """Every arm at every per-host budget, each with its per-pool bounds."""
    rng = np.random.default_rng(args.seed)
    t = w.t.tolist()
    s = (w.t + rng.exponential(args.lead_ms / 1000.0, len(w.t))).tolist()
    cols = (t, s, w.adapter.tolist(), w.tenant.tolist(), w.session.tolist(),
            load_times(w, args.load_base_ms, args.bytes_per_rank, args.gbps), first_steps(w.session))
    out: dict[str, dict] = {}
    walks: dict = {}
    for b in budgets:
        out[str(b)] = {}
        for arm in ARMS:
            t0 = time.monotonic()
            r, where = run_arm(arm, cols, hosts, b, args.channels, settings, service_s=args.service_s,
                               max_backlog_s=args.max_backlog_ms / 1000.0, walks=walks)
            if not args.no_fleet_bounds:
                r["bounds"] = pool_bounds(cols, where, hosts, b, args.channels)
            r["seconds"] = round(time.monotonic() - t0, 2)
            out[str(b)][arm] = r
            print(f"fleet {hosts}x{b:>4} {arm:<12} hit {r['hit_ratio']:.4f} first {r['first_step_hit_ratio'] or 0:.3f}"
                  + (f" belady {r['bounds']['belady']['hit_ratio']:.4f} oracle {r['bounds']['oracle']['hit_ratio']:.4f}"
                     if "bounds" in r else "") + f" ({r['seconds']}s)", file=sys.stderr, flush=True)
    return out


def fleet_targets(fleet: dict, budgets: list[int]) -> dict:
    """At the middle budget: ace >= affinity + 0.10, and ace closes >= half the gap from
    the on-demand arm (affinity, same routing) to the oracle on ace's own assignment
    (computed only when that gap is at least 0.01: a smaller one is noise)."""
    mid = str(budgets[len(budgets) // 2])
    arms = fleet.get(mid, {})
    if not all(a in arms for a in ("affinity", "ace")):
        return {}
    ace, aff = arms["ace"]["hit_ratio"], arms["affinity"]["hit_ratio"]
    out = {"budget": int(mid), "ace_minus_affinity": ace - aff, "ace_minus_affinity_target": 0.10,
           "ace_minus_affinity_met": ace - aff >= 0.10}
    bounds = arms["ace"].get("bounds")
    if bounds:
        gap = bounds["oracle"]["hit_ratio"] - aff
        closed = (ace - aff) / gap if gap >= 0.01 else None
        out.update(oracle=bounds["oracle"]["hit_ratio"], gap_closed=closed, gap_closed_target=0.5,
                   gap_closed_met=closed is not None and closed >= 0.5)
    return out


def plot_fleet(fleet: dict, path) -> None:
    """Hit ratio per arm over the per-host budgets, with the oracle on ace's routing."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = fleet["budgets"]
    res = fleet["results"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm in ARMS:
        ax.plot(budgets, [res[str(b)][arm]["hit_ratio"] for b in budgets], marker="o", label=arm)
    if all("bounds" in res[str(b)]["ace"] for b in budgets):
        for name, style in (("belady", ":"), ("oracle", "--")):
            ax.plot(budgets, [res[str(b)]["ace"]["bounds"][name]["hit_ratio"] for b in budgets],
                    linestyle=style, color="grey", label=f"{name} (ace's routing)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("pool budget per host (adapter slots)")
    ax.set_ylabel("effective hit ratio (no stall)")
    w = fleet["workload"]
    ax.set_title(f"{fleet['hosts']} hosts, {w['requests']:,} requests, {w['adapters']:,} adapters", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
