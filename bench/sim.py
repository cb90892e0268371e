"""Adapter-cache simulator: the gateway's policies over a trace, with a simulated clock.

    python -m bench.sim [--trace FILE] [--budget 8,16,32,64,128] [--requests N] --out reports/sim.json

Replays a trace (a file in the format of ``docs/trace-format.md``, or the default
synthetic workload of ``bench.workload``) through the policy code the gateway runs
(``extproc.policy``: ``AdapterCache``, ``TransitionModel``, ``DecayedPopularity``,
``should_speculate``) for a sweep of pool budgets, and writes the hit ratio of every
policy at every budget (``--out``) and a plot (same name, ``.png``).

Model (also in ``docs/prediction.md``):

- A request reaches the gateway at ``t`` and the engine at ``t + lead`` (gateway hop and
  engine queue; exponential, mean ``--lead-ms``). The budget is in adapter slots, as
  vLLM's ``--max-loras`` (each slot holds any rank).
- A load of an adapter of rank r takes ``load_base_ms + r * bytes_per_rank / bandwidth``
  (defaults: a Llama-7B shape, q/k/v/o in 32 layers of 4096, fp16 = 2 MiB per rank, at
  1.6 GB/s disk/host-to-device: r8 35 ms, r128 193 ms). Loads run in parallel.
- **Effective hit**: the adapter is resident and loaded when the engine starts the
  request (no stall); ``stall`` is how long it waited otherwise. **Resident hit**: it
  was already loaded when the request reached the gateway.

Policies:

- ``lru``: on demand; the engine loads a missing adapter when the request reaches it.
- ``ingress``: LRU, the gateway starts the load as soon as it sees the request.
- ``speculative``: ingress, plus on every session step the transition model predicts the
  next adapter(s); each is prefetched only if ``should_speculate`` says it is likelier
  to be used within ``--horizon-s`` than the LRU victim it would evict.
- ``scored``: ``ingress`` with the speculative policy's eviction (``AdapterCache.coldest``:
  the coldest of the ``--window`` least recent entries by decayed popularity and pending
  predictions) and no speculation: shows what the eviction alone is worth.
- ``belady``: Belady's offline optimum for demand caching: the engine loads a missing
  adapter when the request reaches it and evicts the adapter used furthest in the
  future (optimal for unit-size slots).
- ``belady_ingress``: the same, loading at ingress: the optimum of every policy that
  loads only adapters a request has asked for (``ingress`` included), so beating it
  takes prediction.
- ``lookahead``: an offline prefetcher with the same budget and load model: Belady
  eviction, and at each arrival it loads every upcoming adapter whose next use comes
  before the furthest next use in the cache (Cao et al.'s "aggressive" rule), but only a
  load the link completes before that use. A heuristic, not a bound: online policies
  beat it on a saturated link (scored 0.803 against its 0.654 at budget 150 of a
  200,000-request trace over 1,500 adapters), so it is reported and never checked.
- ``oracle``: the upper bound (``run_ceiling``): the compulsory-miss ceiling where
  prefetch can pre-load anything already named. Every policy here learns only from
  requests it has seen (no catalog, no future), so the first request for an adapter
  can be a hit only if a load started at that request's ingress, on an idle link,
  completes before the engine starts it; every other request may be a hit (a
  prefetcher that knows what comes next can have any adapter it has seen resident in
  time: capacity and link time bind only an online policy's guesses). So the oracle is
  >= every policy on every trace, by construction; ``check_bounds`` still verifies it
  and Belady >= LRU on every run, and the run exits 3 when one breaks.

Also (``--hosts``, default 64): the fleet of ``bench.fleet`` (arms round_robin, affinity,
ace over H hosts, each with its per-pool bounds), and (``--one-host-trace``) the 1-host
check: the 800-request trace at 5 slots, replayed cold. Every run starts from nothing:
no policy is given state learned on the trace it is scored on.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.workload import Workload, WorkloadSpec, encode_trace, synthetic
from extproc.policy.cache import AdapterCache
from extproc.policy.speculator import SpeculationSettings, Speculator

POLICIES = ("lru", "ingress", "scored", "speculative", "belady", "belady_ingress", "lookahead", "oracle")
ONLINE = ("lru", "ingress", "scored", "speculative")
MIN_GAP = 0.01  # least LRU -> oracle gap (hit ratio) a gap_closed is computed over
TOLERANCE = 1e-3  # hit ratio by which a bound may be beaten (float sums), no more
ONE_HOST_TRACE = "data/multi_lora_eval/multi_lora_eval_800.json"


def check_bounds(results: dict) -> list[str]:
    """Every broken bound, as a sentence: the oracle >= every policy, Belady's demand
    optimum >= LRU, at every budget (an upper bound that a policy beats is a bug)."""
    broken = []
    budgets = {b for by in results.values() for b in by}
    for b in sorted(budgets, key=int):
        h = {p: by[b]["hit_ratio"] for p, by in results.items() if b in by}
        if "oracle" in h:
            for p, v in h.items():
                if p not in ("oracle", "lookahead") and v > h["oracle"] + TOLERANCE:  # lookahead knows the future
                    broken.append(f"budget {b}: {p} {v:.4f} beats the oracle {h['oracle']:.4f}")
        if "belady" in h and "lru" in h and h["lru"] > h["belady"] + TOLERANCE:
            broken.append(f"budget {b}: lru {h['lru']:.4f} beats Belady {h['belady']:.4f}")
    return broken


class Progress:
    def __init__(self, label: str, total: int, every: int = 200_000) -> None:
        self.label, self.total, self.every = label, total, every
        self.start = time.monotonic()

    def tick(self, i: int) -> None:
        if i and i % self.every == 0:
            el = time.monotonic() - self.start
            print(f"  {self.label}: {i:,}/{self.total:,} ({el:.0f}s)", file=sys.stderr, flush=True)


class Result:
    __slots__ = ("hits", "resident", "stall_sum", "stalls", "extra", "bits", "first", "first_total", "first_hits")
    keep_bits = False  # tests and analysis: per-request hit bits

    def __init__(self, n: int, first: list[bool] | None = None) -> None:
        self.bits = bytearray(n) if Result.keep_bits else None
        self.first = first  # per request: does it open its session (first_steps)
        self.first_total = self.first_hits = 0
        self.hits = 0
        self.resident = 0
        self.stall_sum = 0.0
        self.stalls: list[float] = []
        self.extra: dict = {}

    def record(self, i: int, ready_at: float, t: float, s: float) -> None:
        if ready_at <= t:
            self.resident += 1
        first = self.first is not None and self.first[i]
        if first:
            self.first_total += 1
        if ready_at <= s:
            self.hits += 1
            if first:
                self.first_hits += 1
            if self.bits is not None:
                self.bits[i] = 1
        else:
            self.stall_sum += ready_at - s
            self.stalls.append(ready_at - s)

    def summary(self, n: int, cache: AdapterCache) -> dict:
        st = sorted(self.stalls)
        p99 = st[int(0.99 * n) - (n - len(st))] if len(st) > n - int(0.99 * n) else 0.0
        return {
            "hit_ratio": self.hits / n,
            "resident_hit_ratio": self.resident / n,
            "mean_stall_ms": 1000 * self.stall_sum / n,
            "first_steps": self.first_total,
            "first_step_hits": self.first_hits,
            "p99_stall_ms": 1000 * p99,
            "loads": cache.stats.loads,
            "prefetches": cache.stats.prefetches,
            "prefetch_used": cache.stats.prefetch_used,
            "prefetch_wasted": cache.stats.prefetch_wasted,
            **self.extra,
            **({"_bits": self.bits} if self.bits is not None else {}),
        }


def load_times(w: Workload, base_ms: float, bytes_per_rank: int, gbps: float) -> list[float]:
    return [(base_ms + r * bytes_per_rank / (gbps * 1e6)) / 1000.0 for r in w.rank_of.tolist()]


def next_use(adapter: np.ndarray) -> list[int]:
    """For each request, the index of the next request for the same adapter (n if none)."""
    n = len(adapter)
    nxt = np.full(n, n, dtype=np.int64)
    order = np.lexsort((np.arange(n), adapter))
    a_sorted = adapter[order]
    same = a_sorted[1:] == a_sorted[:-1]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt.tolist()


class LoadChannel:
    """Loads share ``channels`` links (disk / PCIe), first come first served."""

    __slots__ = ("free",)

    def __init__(self, channels: int) -> None:
        self.free = [0.0] * channels

    def load(self, issue: float, duration: float) -> float:
        """Start a load at ``issue`` (or when a link frees up); returns when it completes."""
        free = self.free
        i = free.index(min(free)) if len(free) > 1 else 0
        start = issue if issue > free[i] else free[i]
        free[i] = start + duration
        return free[i]

    def peek(self, issue: float, duration: float) -> float:
        """When a load started at ``issue`` would complete; nothing changes."""
        free = min(self.free)
        return (issue if issue > free else free) + duration

    def backlog(self, now: float) -> float:
        """Seconds until a link is free (0 when one is idle)."""
        return max(0.0, min(self.free) - now)


def run_lru(cols, budget: int, channels: int, *, ingress: bool) -> dict:
    t, s, ad, _, _, L, first = cols
    n = len(t)
    cache = AdapterCache(budget)
    chan = LoadChannel(channels)
    res = Result(n, first)
    prog = Progress(f"{'ingress' if ingress else 'lru'}@{budget}", n)
    for i in range(n):
        a = ad[i]
        if a not in cache:
            start = t[i] if ingress else s[i]
            cache.admit(a, chan.load(start, L[a]))
        e = cache.get(a)
        cache.access(a, s[i])
        res.record(i, e.ready_at, t[i], s[i])
        prog.tick(i)
    return res.summary(n, cache)


def run_speculative(cols, budget: int, channels: int, settings: SpeculationSettings, *,
                    max_backlog_s: float, speculate: bool = True) -> dict:
    """``extproc.policy.speculator.Speculator`` (the gateway's code) over the trace:
    ingress loads, score-aware eviction and, if ``speculate``, predicted prefetches."""
    t, s, ad, tn, ss, L, first = cols
    n = len(t)
    spec = Speculator(budget, settings)
    chan = LoadChannel(channels)
    res = Result(n, first)
    prog = Progress(f"{'speculative' if speculate else 'scored'}@{budget}", n)

    def load(key: int, now: float) -> float:
        return chan.load(now, L[key])

    for i in range(n):
        now = t[i]
        if speculate:
            # the gateway's loop (Speculator.step); the agent's prefetch queue is bounded:
            # a busy load link drops speculation first
            ready = spec.step(tn[i], ss[i], ad[i], now, load=load, engine_at=s[i],
                              may_load=chan.backlog(now) <= max_backlog_s).ready_at
        else:
            ready = spec.demand(ad[i], now, load=load, engine_at=s[i])
        res.record(i, ready, now, s[i])
        prog.tick(i)
    spec.ledger.flush()
    if speculate:
        c = spec.counters()
        res.extra = {k: c[k] for k in ("predictions", "predictions_used", "predictions_wasted")}
    return res.summary(n, spec.cache)


def _furthest(heap: list, cur: dict) -> int:
    """Pop stale heap entries; the key with the furthest next use (heap holds -next, key)."""
    while True:
        neg, key = heap[0]
        if cur.get(key) == -neg:
            return key
        heapq.heappop(heap)


def run_belady(cols, nxt: list[int], budget: int, channels: int, *, prefetch: bool, ingress: bool) -> dict:
    """Belady's eviction, on demand (``prefetch=False``) or as the ``lookahead`` prefetcher.

    The lookahead loads every upcoming adapter whose next use comes before the furthest next
    use in the pool, in order of use, but only a load that the link completes before the
    engine needs it (a late prefetch would only delay the demand loads queued behind
    it); a request whose adapter is absent is loaded at ingress, evicting the furthest.
    """
    t, s, ad, _, _, L, first = cols
    n = len(t)
    cache = AdapterCache(budget)
    chan = LoadChannel(channels)
    cur: dict[int, int] = {}  # cached key -> its next use index
    heap: list = []
    res = Result(n, first)
    prog = Progress(f"{'lookahead' if prefetch else 'belady'}{'' if ingress else '-demand'}@{budget}", n)
    window = max(256, 8 * budget)
    ptr = 0

    def evict_furthest() -> None:
        victim = _furthest(heap, cur)
        heapq.heappop(heap)
        del cur[victim]
        cache.evict(victim)

    for i in range(n):
        a = ad[i]
        if a not in cache:
            if cache.used + 1 > cache.capacity:
                evict_furthest()
            cache.admit(a, chan.load(t[i] if ingress else s[i], L[a]))
        e = cache.get(a)
        cache.access(a, s[i])
        res.record(i, e.ready_at, t[i], s[i])
        cur[a] = nxt[i]
        heapq.heappush(heap, (-nxt[i], a))
        if prefetch:
            ptr = max(ptr, i + 1)
            while ptr < n and ptr - i <= window:
                b = ad[ptr]
                if b not in cache:
                    if chan.peek(t[i], L[b]) > s[ptr]:
                        break  # it would arrive late: leave the link to the demand loads
                    if cache.used + 1 > cache.capacity:
                        if cur[_furthest(heap, cur)] <= ptr:
                            break  # everything cached is needed before it
                        evict_furthest()
                    cache.admit(b, chan.load(t[i], L[b]), prefetched=True)
                    cur[b] = ptr
                    heapq.heappush(heap, (-ptr, b))
                ptr += 1
        prog.tick(i)
    return res.summary(n, cache)


def ceiling_bits(cols) -> list[bool]:
    """Per request: can any policy that loads only adapters some request named make it
    a hit? Not when it is its adapter's first request and a load from its ingress, on an
    idle link, completes after the engine starts it (``oracle``'s definition above)."""
    t, s, ad, _, _, L, _ = cols
    seen: set[int] = set()
    out = []
    for i in range(len(t)):
        a = ad[i]
        out.append(a in seen or t[i] + L[a] <= s[i])
        seen.add(a)
    return out


def run_ceiling(cols, possible: list[bool] | None = None) -> dict:
    """The oracle: the hit ratio if every request that ``ceiling_bits`` allows were a hit."""
    t, s, ad, _, _, L, first = cols
    bits = ceiling_bits(cols) if possible is None else possible
    n = len(bits)
    hits = sum(bits)
    first_total = sum(1 for f in first if f)
    first_hits = sum(1 for b, f in zip(bits, first) if b and f)
    # resident at ingress: an adapter seen before (a first request's load takes L > 0)
    seen: set[int] = set()
    resident = 0
    for a in ad:
        resident += a in seen
        seen.add(a)
    return {"hit_ratio": hits / n if n else 0.0, "resident_hit_ratio": resident / n if n else 0.0,
            "mean_stall_ms": 0.0, "first_steps": first_total, "first_step_hits": first_hits,
            "p99_stall_ms": 0.0, "loads": len(seen), "prefetches": 0, "prefetch_used": 0, "prefetch_wasted": 0}


def first_steps(session: np.ndarray) -> list[bool]:
    """Per request: is it the first of its session (the trace's order; any trace has it)."""
    first = np.zeros(len(session), dtype=bool)
    _, idx = np.unique(session, return_index=True)
    first[idx] = True
    return first.tolist()


def settings_of(args) -> SpeculationSettings:
    return SpeculationSettings(k=args.k, min_p=args.min_p, horizon_s=args.horizon_s,
                               half_life_s=args.half_life_s, window=args.window,
                               adaptive_horizon=not args.fixed_horizon,
                               session_demand=not args.no_session_demand, order=args.order,
                               first_steps=args.first_steps, context_steps=args.context_steps)


def simulate(w: Workload, budgets: list[int], args) -> dict:
    rng = np.random.default_rng(args.seed)
    t = w.t.tolist()
    s = (w.t + rng.exponential(args.lead_ms / 1000.0, len(w.t))).tolist()
    cols = (t, s, w.adapter.tolist(), w.tenant.tolist(), w.session.tolist(),
            load_times(w, args.load_base_ms, args.bytes_per_rank, args.gbps), first_steps(w.session))
    nxt = next_use(w.adapter)
    results: dict[str, dict[str, dict]] = {p: {} for p in args.policies}
    for b in budgets:
        for p in args.policies:
            t0 = time.monotonic()
            if p in ("lru", "ingress"):
                r = run_lru(cols, b, args.channels, ingress=p == "ingress")
            elif p in ("speculative", "scored"):
                r = run_speculative(cols, b, args.channels, settings_of(args),
                                    max_backlog_s=args.max_backlog_ms / 1000.0, speculate=p == "speculative")
            elif p == "oracle":
                r = run_ceiling(cols)
            else:
                r = run_belady(cols, nxt, b, args.channels, prefetch=p == "lookahead", ingress=p != "belady")
            r["seconds"] = round(time.monotonic() - t0, 2)
            results[p][str(b)] = r
            print(f"budget {b:>5} {p:<12} hit {r['hit_ratio']:.4f} resident {r['resident_hit_ratio']:.4f} "
                  f"stall {r['mean_stall_ms']:.1f} ms ({r['seconds']}s)", file=sys.stderr, flush=True)
    return results


def targets(results: dict, budgets: list[int]) -> dict:
    mid = str(budgets[len(budgets) // 2])
    need = ("lru", "speculative", "oracle", "belady")
    if not all(p in results and mid in results[p] for p in need):
        return {}
    h = {p: results[p][mid]["hit_ratio"] for p in results if mid in results[p]}
    hits = {p: round(v, 4) for p, v in h.items()}
    gap = h["oracle"] - h["lru"]
    # a gap under MIN_GAP is noise (or a broken bound): no ratio is computed from it
    closed = (h["speculative"] - h["lru"]) / gap if gap >= MIN_GAP else None
    out = {
        "budget": int(mid),
        "gap_closed": closed,
        "gap_closed_target": 0.5,
        "gap_closed_met": closed is not None and closed >= 0.5,
        "beats_belady": h["speculative"] > h["belady"],
        "hit_ratio": hits,
    }
    if "belady_ingress" in h:
        out["beats_belady_ingress"] = h["speculative"] > h["belady_ingress"]
    if "ingress" in h and h["oracle"] - h["ingress"] >= MIN_GAP:
        out["gap_closed_vs_ingress"] = (h["speculative"] - h["ingress"]) / (h["oracle"] - h["ingress"])
    return out


def plot(results: dict, budgets: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p, by in results.items():
        xs = [b for b in budgets if str(b) in by]
        ax.plot(xs, [by[str(b)]["hit_ratio"] for b in xs], marker="o", label=p)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("pool budget (adapter slots)")
    ax.set_ylabel("effective hit ratio (no stall)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", help="trace file (JSON array or JSON Lines); default: synthetic workload")
    ap.add_argument("--budget", help="comma-separated pool budgets in adapter slots "
                    "(default 8,16,32,64,128 synthetic; 10-70%% of the trace's adapters)")
    ap.add_argument("--out", default="reports/sim.json", help="JSON report; the plot goes next to it as .png")
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES))
    ap.add_argument("--requests", type=int, default=WorkloadSpec.requests, help="synthetic: number of requests")
    ap.add_argument("--adapters", type=int, default=WorkloadSpec.adapters, help="synthetic: number of adapters")
    ap.add_argument("--tenants", type=int, default=WorkloadSpec.tenants, help="synthetic: tenants over the span")
    ap.add_argument("--zipf", type=float, default=WorkloadSpec.zipf_s, help="synthetic: Zipf exponent")
    ap.add_argument("--rate", type=float, default=WorkloadSpec.rate_per_s, help="synthetic: requests per second")
    ap.add_argument("--seed", type=int, default=7, help="seed (workload and lead times)")
    ap.add_argument("--lead-ms", type=float, default=50.0, help="mean gateway-to-engine lead (hop + queue)")
    ap.add_argument("--load-base-ms", type=float, default=25.0, help="fixed cost of one adapter load")
    ap.add_argument("--bytes-per-rank", type=int, default=2 * 4 * 4096 * 32 * 2, help="adapter bytes per unit of rank")
    ap.add_argument("--gbps", type=float, default=1.6, help="load bandwidth, GB/s")
    ap.add_argument("--channels", type=int, default=1, help="parallel load links per host")
    ap.add_argument("--window", type=int, default=0, help="eviction: LRU entries the score looks at (1 = LRU, 0 = all)")
    ap.add_argument("--half-life-s", type=float, default=600.0, help="popularity: half-life of the decayed rates")
    ap.add_argument("--max-backlog-ms", type=float, default=250.0, help="speculation: skipped while the load link is this busy")
    ap.add_argument("--horizon-s", type=float, default=10.0,
                    help="speculation: horizon of the use probabilities (the start value: it then follows the "
                         "sessions' pace, twice the median step gap, as in the gateway)")
    ap.add_argument("--fixed-horizon", action="store_true", help="speculation: keep --horizon-s fixed")
    ap.add_argument("--no-session-demand", action="store_true",
                    help="speculation: score victims by the latest prediction left on each entry instead of "
                         "what the sessions in progress expect next (the previous rule)")
    ap.add_argument("--order", type=int, default=2, choices=(1, 2),
                    help="speculation: transition model context (1 = last step, 2 = last two, backing off to 1)")
    ap.add_argument("--context-steps", type=int, default=SpeculationSettings.context_steps,
                    help="speculation: the session's steps so far as a context, for sessions of up to this "
                         "many distinct steps (0 = off: the last two steps only)")
    ap.add_argument("--k", type=int, default=2, help="speculation: next adapters considered per step")
    ap.add_argument("--min-p", type=float, default=0.35, help="speculation: least probability worth a load")
    ap.add_argument("--first-steps", type=int, default=SpeculationSettings.first_steps,
                    help="speculation: the tenant's likeliest session openers offered per step (0 = off)")
    ap.add_argument("--hosts", type=int, default=64, help="fleet: engine hosts (0 = no fleet run)")
    ap.add_argument("--fleet-requests", type=int, default=100_000, help="fleet: synthetic requests")
    ap.add_argument("--fleet-adapters", type=int, default=10_000, help="fleet: synthetic adapters")
    ap.add_argument("--fleet-tenants", type=int, default=2_000, help="fleet: synthetic tenants")
    ap.add_argument("--fleet-rate", type=float, default=640.0, help="fleet: requests per second")
    ap.add_argument("--fleet-budget", default="8,16,32", help="fleet: comma-separated per-host pool budgets")
    ap.add_argument("--service-s", type=float, default=1.0, help="fleet: seconds a request occupies its host")
    ap.add_argument("--no-fleet-bounds", action="store_true", help="fleet: skip the per-pool bounds")
    ap.add_argument("--one-host-trace", default=ONE_HOST_TRACE,
                    help="1-host check: trace replayed cold at --one-host-budget ('' = skip)")
    ap.add_argument("--one-host-budget", type=int, default=5, help="1-host check: pool slots")
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in args.policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policies {bad}; choose from {POLICIES}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.trace:
        from bench.trace import TraceError, load_trace

        try:
            w = encode_trace(load_trace(args.trace))
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        workload = {"trace": args.trace}
        n_ad = len(w.rank_of)
        default = sorted({max(1, round(n_ad * f)) for f in (0.1, 0.2, 0.3, 0.5, 0.7)})
    else:
        spec = WorkloadSpec(requests=args.requests, adapters=args.adapters, tenants=args.tenants,
                            zipf_s=args.zipf, rate_per_s=args.rate, seed=args.seed)
        print(f"generating {spec.requests:,} requests over {spec.adapters:,} adapters ...", file=sys.stderr)
        w = synthetic(spec)
        workload = {"synthetic": spec.as_dict()}
        default = [8, 16, 32, 64, 128]
    budgets = [int(b) for b in args.budget.split(",")] if args.budget else default
    results = simulate(w, budgets, args)
    broken = check_bounds(results)
    fleet = fleet_budgets = fleet_spec = None
    if args.hosts > 0:
        from bench.fleet import check_bounds as fleet_check, run_fleet

        fleet_spec = WorkloadSpec(requests=args.fleet_requests, adapters=args.fleet_adapters,
                                  tenants=args.fleet_tenants, zipf_s=args.zipf, rate_per_s=args.fleet_rate,
                                  seed=args.seed)
        print(f"fleet: {args.hosts} hosts, {fleet_spec.requests:,} requests over {fleet_spec.adapters:,} adapters",
              file=sys.stderr)
        fleet_budgets = [int(b) for b in args.fleet_budget.split(",")]
        fleet = run_fleet(synthetic(fleet_spec), fleet_budgets, args.hosts, settings_of(args), args)
        broken += fleet_check(fleet)
    one_host = one_host_check(args) if args.one_host_trace else None
    if one_host is not None:
        broken += [f"1 host: {m}" for m in one_host.pop("broken")]
    report = {
        "workload": workload,
        "requests": len(w),
        "adapters_seen": int(len(np.unique(w.adapter))),
        "tenants_seen": int(len(np.unique(w.tenant))),
        "sessions": int(len(np.unique(w.session))),
        "span_s": float(w.t[-1] - w.t[0]),
        "budgets": budgets,
        "model": {k: getattr(args, k) for k in ("lead_ms", "load_base_ms", "bytes_per_rank", "gbps",
                                                "channels", "window", "half_life_s", "max_backlog_ms", "horizon_s", "fixed_horizon", "no_session_demand", "order", "k", "min_p", "seed")},
        "metric": "hit_ratio = share of requests whose adapter was loaded when the engine started them",
        "results": results,
        "targets": targets(results, budgets),
        "bounds_ok": not broken,
        "bounds_broken": broken,
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    if fleet is not None:
        from bench.fleet import fleet_targets

        report["fleet"] = {"hosts": args.hosts, "workload": fleet_spec.as_dict(), "budgets": fleet_budgets,
                           "service_s": args.service_s, "results": fleet,
                           "targets": fleet_targets(fleet, fleet_budgets)}
    if one_host is not None:
        report["one_host"] = one_host
    report["elapsed_s"] = round(time.monotonic() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    title = (f"{len(w):,} requests, {report['adapters_seen']:,} adapters"
             + (f" ({args.trace})" if args.trace else " (synthetic: Zipf, chains, bursts, churn)"))
    plot(results, budgets, out.with_suffix(".png"), title)
    if fleet is not None:
        from bench.fleet import plot_fleet

        plot_fleet(report["fleet"], out.with_name(out.stem + "_fleet.png"))
    print(json.dumps(report["targets"], indent=2), file=sys.stderr)
    print(f"wrote {out} and {out.with_suffix('.png')} in {report['elapsed_s']}s", file=sys.stderr)
    if broken:
        print("error: the simulator's bounds do not hold (a bug in a bound or a policy):", file=sys.stderr)
        for m in broken:
            print(f"  {m}", file=sys.stderr)
        return 3
    return 0


def one_host_check(args) -> dict | None:
    """The hard case: one host, ``--one-host-budget`` slots, the trace replayed cold (every
    policy starts from nothing and learns online), ace = the speculative policy."""
    from bench.trace import TraceError, load_trace

    try:
        w = encode_trace(load_trace(args.one_host_trace))
    except TraceError as exc:
        print(f"1-host check skipped: {exc}", file=sys.stderr)
        return None
    b = args.one_host_budget
    quiet = argparse.Namespace(**{**vars(args), "policies": ["lru", "belady", "belady_ingress", "speculative", "oracle"]})
    res = simulate(w, [b], quiet)
    h = {p: by[str(b)] for p, by in res.items()}
    first = {p: r["first_step_hits"] for p, r in h.items()}
    return {"trace": args.one_host_trace, "budget": b, "requests": len(w),
            "first_steps": h["lru"]["first_steps"],
            "hit_ratio": {p: r["hit_ratio"] for p, r in h.items()}, "first_step_hits": first,
            "ace_above_belady": h["speculative"]["hit_ratio"] > h["belady"]["hit_ratio"],
            "broken": check_bounds(res)}


if __name__ == "__main__":
    raise SystemExit(main())
