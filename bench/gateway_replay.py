"""Replay a trace through the gateway's own routing and speculation, on simulated hosts.

    python -m bench.gateway_replay --trace FILE [--hosts 4] [--slots 16] [--arms affinity,ace]

What runs is the gateway's code, not a model of it: every request is routed by
``extproc.policy.routing.route`` (the ``RoutePolicy`` the gateway uses with several
upstreams) over a ``ResidencySnapshot`` built from the simulated pools, and in the ``ace``
arm every request is handed to ``extproc.fleet.speculation.SpeculationPlanner.step`` (the
speculation thread's decision), whose ``PrefetchSignal`` s the simulated agents carry
out, hinted victim first. Only the hosts are simulated:

- **pool**: ``--slots`` adapters, a signal's named victims first out, then the least
  recently used (the agent's device tier; ``--engine-lru``: the least recently used
  whatever is named, as vLLM's CPU cache without ace's evicting unload), never an adapter
  a queued or running request needs or one being loaded;
- **load link**: one FIFO link per host (``bench.sim.LoadChannel``), a load of rank r
  taking ``load_base_ms + r * bytes_per_rank / bandwidth`` (``bench.sim.load_times``);
- **agent reports**: each adapter's tier on each host, with a measured load time only
  for the adapters that host's agent loaded (the planner's prefetches); the engine's own
  loads are untimed by the agent, as in the stack (the planner prices those at the
  typical measured load); and the share of a wasted bet's load time the agent charges it
  (``--waste-share``: the builtin engine on the CPU announces 1, on CUDA 0), with which
  the planner prices its bets (``ResidencySnapshot.waste_share``);
- **engine**: ``--batch`` requests at a time, each ``--service-ms``; a request reaches
  it ``--lead-ms`` after the gateway saw it, and waits for a free place and its adapter.

Arms: ``affinity`` (prefetch off: the engine loads a missing adapter when it reaches the
request) and ``ace`` (prefetch on: the gateway's ingress signal loads a cold adapter as
soon as the request is routed, plus the planner's predicted prefetches). Both arms start
cold: no state learned on any trace.

Reported per arm: effective hits (adapter loaded when the engine starts the request),
resident hits (loaded when the gateway saw it), requests per host, loads, prefetches
sent / used / wasted, stall and time-to-start percentiles (queue wait + stall, the part
of TTFT the adapter and the host's load decide), and per host the demand-caching optimum
of that host's realized request sequence (Belady, by count) and its compulsory misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

from bench.bounds import belady_hits, miss_causes
from bench.sim import LoadChannel
from bench.trace import TraceError, load_trace
from extproc.state.catalog import PUBLIC, Adapter, Tenant, Upstream
from extproc.policy.routing import route
from extproc.policy.speculator import SpeculationSettings
from extproc.fleet.speculation import ObservedRequest, SpeculationPlanner, demand_placement, route_by_policy
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.state.skill_modes import OFF, PROD
from extproc.state.store import Snapshot
from ace_common.tiers import Tier

__all__ = ["ARMS", "belady_hits", "replay"]

ARMS = ("affinity", "ace")
BASE = "base"


@dataclass
class Host:
    """One simulated engine host: an LRU pool of ``slots`` adapters, one load link, an engine."""

    name: str
    slots: int
    batch: int
    link: LoadChannel = field(default_factory=lambda: LoadChannel(1))
    pool: OrderedDict = field(default_factory=OrderedDict)  # adapter -> ready_at (LRU first)
    needed: dict = field(default_factory=dict)  # adapter -> until when a request holds it
    free: list = field(default_factory=list)  # the engine's places: when each frees up
    done: list = field(default_factory=list)  # heap of request completion times (its load)
    loads: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    unused: set = field(default_factory=set)  # prefetched, no request used it yet
    changed: bool = True
    honours_hints: bool = True  # False: the engine evicts its own LRU whatever is named (vLLM)

    def __post_init__(self) -> None:
        self.free = [0.0] * self.batch

    def load_at(self, now: float) -> int:
        while self.done and self.done[0] <= now:
            heapq.heappop(self.done)
        return len(self.done)

    def _evictable(self, a: str, now: float) -> bool:
        return self.pool[a] <= now and self.needed.get(a, 0.0) <= now

    def _make_room(self, now: float, hint: tuple[str, ...] = ()) -> bool:
        if len(self.pool) < self.slots:
            return True
        order = [a for a in hint if a in self.pool] * self.honours_hints + list(self.pool)
        for a in order:
            if self._evictable(a, now):
                self._evict(a)
                return True
        return False

    def _evict(self, a: str) -> None:
        del self.pool[a]
        if a in self.unused:
            self.unused.discard(a)
            self.prefetch_wasted += 1
        self.changed = True

    def load(self, a: str, now: float, duration: float, *, hint: tuple[str, ...] = (),
             prefetched: bool = False) -> float | None:
        """Start loading ``a`` at ``now`` (it is absent); None when the pool has no room."""
        if not self._make_room(now, hint):
            return None
        ready = self.link.load(now, duration)
        self.pool[a] = ready
        self.loads += 1
        if prefetched:
            self.prefetches += 1
            self.unused.add(a)
        self.changed = True
        return ready

    def use(self, a: str, until: float) -> None:
        if a not in self.pool:  # loaded beside a pool of busy adapters: served, not kept
            return
        self.pool.move_to_end(a)
        self.needed[a] = max(self.needed.get(a, 0.0), until)
        if a in self.unused:
            self.unused.discard(a)
            self.prefetch_used += 1

    def resident(self, now: float) -> list[str]:
        return [a for a, r in self.pool.items() if r <= now]


def _catalog(trace: list[dict]) -> dict[str, Adapter]:
    owners: dict[str, set[str]] = {}
    ranks: dict[str, int] = {}
    for r in trace:
        owners.setdefault(r["adapter"], set()).add(r["tenant"])
        ranks[r["adapter"]] = r["rank"]
    # an adapter one tenant alone uses is its own; any other is public (the tenants'
    # visibility is what the planner checks before it offers a prediction)
    return {a: Adapter(name=a, base_model=BASE, rank=ranks[a], target_modules=("q_proj",), size_bytes=0,
                       owner=next(iter(o)) if len(o) == 1 else PUBLIC, uri=f"file:///{a}", sha256=a)
            for a, o in owners.items()}


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def replay(trace: list[dict], arm: str, *, hosts: int, slots: int, batch: int = 4, service_ms: float = 40.0,
           lead_ms: float = 5.0, speed: float = 1.0, load_base_ms: float = 25.0,
           bytes_per_rank: int = 2 * 4 * 4096 * 32 * 2, gbps: float = 1.6,
           settings: SpeculationSettings = SpeculationSettings(), place_every_s: float = 5.0,
           ingress_victims: bool = True, keep_rows: bool = False, known_slots: bool = False,
           waste_share: float = 0.0, engine_lru: bool = False) -> dict:
    """One arm over ``trace`` (sorted by ``t``); ``speed`` divides the trace's times;
    ``waste_share``: what every host's agent announces (``ResidencyEvent.prefetch_waste_share``);
    ``engine_lru``: every host's engine evicts its own least recently used adapter, whatever a
    signal names (vLLM's CPU cache)."""
    if arm not in ARMS:
        raise ValueError(f"unknown arm {arm!r}; choose from {ARMS}")
    if not 0.0 <= waste_share <= 1.0:
        raise ValueError(f"waste_share must be within [0, 1], got {waste_share}")
    catalog = _catalog(trace)
    names = [f"host-{h}" for h in range(hosts)]
    upstreams = tuple(Upstream(name=h, address=f"127.0.0.1:{9000 + i}", flavour="builtin", base_model=BASE)
                      for i, h in enumerate(names))
    mode = PROD if arm == "ace" else OFF
    snapshot = Snapshot(adapters=catalog, base_models=frozenset({BASE}),
                        tenants={t: Tenant(t) for t in {r["tenant"] for r in trace}}, keys={},
                        upstreams=upstreams, default_skills={}, max_body_bytes=1 << 20)
    sim = {h: Host(h, slots, batch, honours_hints=not engine_lru) for h in names}
    load_s = {a: (load_base_ms + ad.rank * bytes_per_rank / (gbps * 1e6)) / 1000.0 for a, ad in catalog.items()}
    # what each host's agent reports: the tier, and the load time it measured, which it
    # has only for the adapters it loaded itself there (prefetches; the engine loads the
    # rest on its own, untimed by the agent), as in the stack
    reports = {(tier, False): TierReport(tier=tier.value, cold_load_ms=None) for tier in (Tier.DEVICE, Tier.REMOTE)}
    timed: dict[str, set[str]] = {h: set() for h in names}

    def report(h: str, a: str, on: bool) -> TierReport:
        tier = Tier.DEVICE if on else Tier.REMOTE
        if a not in timed[h]:
            return reports[(tier, False)]
        return TierReport(tier=tier.value, cold_load_ms=1000.0 * load_s[a])
    sent = SentCounts()
    tables: dict[str, dict] = {}
    planner = SpeculationPlanner(settings, route=route_by_policy(route)) if arm == "ace" else None
    # the pools' sizes as the gateway learns them (both arms: placement runs in both),
    # unless ``known_slots``: placement is told the true size
    learner = planner or SpeculationPlanner(settings)
    service = service_ms / 1000.0
    lead = lead_ms / 1000.0
    stalls: list[float] = []
    waits: list[float] = []
    seqs: dict[str, list[str]] = {h: [] for h in names}
    counts: dict[str, float] = {}  # requests per adapter, as the speculation thread counts them
    placement: dict = {}
    placed_at = -math.inf
    shares = MappingProxyType({h: waste_share for h in names})
    seen: set[str] = set()
    misses = {"first_touch": 0, "session_opener": 0, "session_revisit": 0, "later_step": 0}
    used_by: dict[tuple, set] = {}  # (tenant, session) -> adapters it asked for
    hits = resident_hits = 0
    rows: list[dict] = []
    for r in trace:
        now = r["t"] / speed
        a = r["adapter"]
        for h in names:  # the agents' reports: what each pool holds on the device
            host = sim[h]
            if host.changed or h not in tables:
                on = set(host.resident(now))
                tables[h] = {b: report(h, b, b in on) for b in catalog}
                host.changed = False
        loads = {h: sim[h].load_at(now) for h in names}
        if place_every_s and now - placed_at >= place_every_s:  # GatewaySpeculation.place
            placement = demand_placement(counts, ResidencySnapshot.build(tables, placement=placement),
                                         slots if known_slots else learner.placement_slots())
            placed_at = now
        residency = dataclasses.replace(
            ResidencySnapshot.build(tables, loads, {h: sent.value(h) for h in names}, placement), waste_share=shares)
        if planner is not None and ingress_victims:  # GatewaySpeculation.drain publishes them
            residency = dataclasses.replace(residency, victims=planner.victims(now))
        up = route(upstreams, catalog[a], residency, sent).name
        sent.record(up)
        counts[a] = counts.get(a, 0.0) + 1.0
        host = sim[up]
        seqs[up].append(a)
        if a in host.pool and host.pool[a] <= now:
            resident_hits += 1
        in_flight = a in host.pool and host.pool[a] > now  # a prefetch still loading
        if a not in host.pool and arm == "ace":  # the ingress signal (priority 1): load now
            host.load(a, now, load_s[a], hint=residency.victims.get(up, ()))
        learner.sync(residency, now)
        if planner is not None:
            step = ObservedRequest(upstream=up, tenant=r["tenant"], session=str(r["session"]), adapter=a, mode=mode)
            for sig in planner.step(step, snapshot, residency, sent, now):
                target = sim[sig.upstream]
                if sig.adapter not in target.pool:
                    target.load(sig.adapter, now, load_s[sig.adapter], hint=sig.evict, prefetched=True)
                    timed[sig.upstream].add(sig.adapter)
        arrive = now + lead
        i = min(range(batch), key=host.free.__getitem__)
        start = max(arrive, host.free[i])
        if a not in host.pool:  # the engine loads it on demand (a full pool of busy adapters waits)
            ready = host.load(a, start, load_s[a])
            if ready is None:
                ready = host.link.load(start, load_s[a])
                host.loads += 1
        else:
            ready = host.pool[a]
        if ready <= start:
            hits += 1
        else:
            stalls.append(ready - start)
            kind = ("first_touch" if a not in seen else "session_opener" if r.get("step") == 0
                    else "session_revisit" if a in used_by.get((r["tenant"], r["session"]), ()) else "later_step")
            misses[kind] += 1
        rows.append({"id": r.get("id"), "host": up, "adapter": a, "tenant": r["tenant"], "session": r["session"],
                     "step": r.get("step"), "sent_s": now, "hit": ready <= start, "late": in_flight,
                     "wait_ms": 1000.0 * max(0.0, ready - start)})
        seen.add(a)
        used_by.setdefault((r["tenant"], r["session"]), set()).add(a)
        begin = max(start, ready)
        end = begin + service
        host.free[i] = end
        host.use(a, end)
        heapq.heappush(host.done, end)
        waits.append(begin - now)
    n = len(trace)
    per_host = {}
    for h in names:
        seq = seqs[h]
        per_host[h] = {"requests": len(seq), "belady_hits": belady_hits(seq, slots),
                       "compulsory_misses": len(set(seq)), "loads": sim[h].loads}
    out = {
        "requests": n,
        "effective_hits": hits,
        "effective_hit_ratio": hits / n,
        "resident_hit_ratio": resident_hits / n,
        "belady_hit_ratio": sum(p["belady_hits"] for p in per_host.values()) / n,
        "requests_per_host": [per_host[h]["requests"] for h in names],
        "misses": misses,
        "miss_causes": {k: v for k, v in miss_causes(rows, slots, labels={r.get("id"): r.get("workflow", "")
                                                                       for r in trace}).items()
                        if k != "definitions"},
        "loads": sum(s.loads for s in sim.values()),
        "prefetch": {"sent": sum(s.prefetches for s in sim.values()),
                     "used": sum(s.prefetch_used for s in sim.values()),
                     "wasted": sum(s.prefetch_wasted for s in sim.values())},
        "stall_ms": {f"p{q}": round(1000 * _pct(stalls + [0.0] * (n - len(stalls)), q / 100), 2)
                     for q in (50, 90, 95, 99)},
        "start_ms": {f"p{q}": round(1000 * _pct(waits, q / 100), 2) for q in (50, 90, 95, 99)},
        "per_host": per_host,
    }
    if keep_rows:
        out["rows"] = rows
    if planner is not None:
        planner.ledger.flush()
        out["planner"] = planner.counters()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gateway_replay", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", action="append", required=True, help="trace file(s) (docs/trace-format.md)")
    ap.add_argument("--hosts", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16, help="adapters per host pool")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--batch", type=int, default=4, help="requests an engine runs at once")
    ap.add_argument("--service-ms", type=float, default=40.0, help="engine time per request")
    ap.add_argument("--lead-ms", type=float, default=5.0, help="gateway to engine")
    ap.add_argument("--speed", type=float, default=1.0, help="replay speed (trace times are divided by it)")
    ap.add_argument("--load-base-ms", type=float, default=25.0,
                    help="a load's fixed cost (the stack's builtin engine measures ~5)")
    ap.add_argument("--gbps", type=float, default=1.6,
                    help="load link bandwidth, GB/s (a load of rank r adds r x the bytes per rank over it)")
    ap.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="a SpeculationSettings field for the ace arm (e.g. max_inflight=0)")
    ap.add_argument("--place-every-s", type=float, default=5.0,
                    help="placement by demand recomputed this often (trace seconds; 0 = off: the ring's)")
    ap.add_argument("--known-slots", action="store_true",
                    help="placement is told the pools' size (default: the size the gateway learns, "
                         "known once a pool is seen evicting)")
    ap.add_argument("--no-ingress-victims", action="store_true",
                    help="ace: the ingress prefetch names no victims (the agent's LRU makes room)")
    ap.add_argument("--waste-share", type=float, default=0.0,
                    help="the share of a wasted bet's load time every host's agent charges it, as it "
                         "announces it to the gateway (the builtin engine: 1 on the CPU, 0 on CUDA; "
                         "default 0)")
    ap.add_argument("--engine-lru", action="store_true",
                    help="every host's engine evicts its own least recently used adapter, whatever a "
                         "signal names (vLLM's CPU cache; default: named victims go first)")
    ap.add_argument("--out", help="JSON report")
    args = ap.parse_args(argv)
    if not 0.0 <= args.waste_share <= 1.0:
        ap.error(f"--waste-share {args.waste_share}: must be within [0, 1]")
    fields = {f.name: f.type for f in dataclasses.fields(SpeculationSettings)}
    overrides = {}
    for item in args.set:
        name, _, value = item.partition("=")
        if name not in fields:
            ap.error(f"--set {item}: no SpeculationSettings field {name!r}")
        default = getattr(SpeculationSettings(), name)
        overrides[name] = value.lower() in ("1", "true", "yes") if isinstance(default, bool) else type(default)(value)
    settings = SpeculationSettings(**overrides)
    report = {}
    for path in args.trace:
        try:
            trace = load_trace(path)
        except TraceError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        report[path] = {}
        for arm in args.arms.split(","):
            r = replay(trace, arm, hosts=args.hosts, slots=args.slots, batch=args.batch,
                       service_ms=args.service_ms, lead_ms=args.lead_ms, speed=args.speed, settings=settings,
                       load_base_ms=args.load_base_ms, gbps=args.gbps,
                       place_every_s=args.place_every_s, ingress_victims=not args.no_ingress_victims,
                       known_slots=args.known_slots, waste_share=args.waste_share,
                       engine_lru=args.engine_lru)
            report[path][arm] = r
            print(f"{path} {arm:<9} hits {r['effective_hit_ratio']:.4f} belady {r['belady_hit_ratio']:.4f} "
                  f"resident {r['resident_hit_ratio']:.4f} loads {r['loads']} prefetch {r['prefetch']} "
                  f"per-host {r['requests_per_host']} causes {r['miss_causes']['causes']} stall p99 {r['stall_ms']['p99']} "
                  f"start p99 {r['start_ms']['p99']}", file=sys.stderr, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
