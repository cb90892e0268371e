"""Which engine host serves a request: the gateway's routing policies, in one place.

A routing policy (``RoutePolicy``) is a function
``(upstreams, adapter, residency, sent) -> Upstream``: the configured upstreams, the
selected adapter (None: the base model, or the request may not move), the agents'
residency view (``extproc.state.residency.ResidencySnapshot``) and the requests this
gateway routed to each host (``SentCounts``, the board's, passed beside the snapshot).
``load_policy`` picks one: ``--routing-policy module:function`` when given, else
``route`` (adapter affinity) with several upstreams and ``choose_upstream`` (the first
upstream serving the adapter's base model) with one.

Adapter-affinity routing (``route``, ranked by ``choose_endpoint``) is a pure function
over the residency view and each host's load (``extproc.state.residency.host_load``: the requests
its engine runs and queues as its agent last measured them, plus the requests this
gateway routed there since that measurement arrived); a host whose load is unknown
counts as 0. Hosts absent from the snapshot do not exist for routing: the residency
watcher drops a host whose agent stream is gone, and the next decision no longer sees it.

Score tiers, best first (the first non-empty tier wins):

1. ``resident``: hosts where the adapter is on the device (tier ``device``) and that
   are not overloaded; the least loaded of them.
2. ``staged``: hosts holding it in host memory (tier ``host``), not overloaded: the
   load is a host-to-device copy; the least loaded of them.
3. ``hashed``: consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam
   2018): walk the hosts from the adapter's owner and take the first host under the
   bound, so an adapter keeps landing on the same host instead of thrashing across all
   of them. The owner is its ``place`` ment when the adapters of the fleet are known
   (``adapters``: ``route`` passes every adapter the agents report), else the first host
   of the ring walk from its digest. A hot adapter (``replicas`` > 1) may live on the first
   ``replicas`` hosts of its walk; the least loaded of them is taken. When its resident
   hosts are all overloaded, tier 3 places it on one more host: that is how a hot
   adapter spreads.
4. ``none``: no hosts at all.

Placement (``place``) bounds the *distinct adapters* per host, not only the requests: a
plain hash of 10 adapters over 4 hosts gave 6, 0, 4 and 0 of them to the hosts (with
5-slot pools the 6-adapter host thrashes while two hosts idle). Each adapter, in the
order of its hash, goes to the first host of its ring walk still under its quota; the
quotas split the adapters in proportion to the hosts' pool ``slots`` (equal when
unknown: the agents do not publish their pool size), floor or ceiling of the share, so
with equal pools the counts differ by at most one (3, 3, 2, 2) and no host is given
more adapters than its slots while another has room. Adding or removing a host moves
only the adapters whose walk passes it or whose quota changed.

Placement by demand (``place_by_demand``) balances the requests too: a placement that
gives every host the same number of adapters still gave the hosts of a 200-adapter,
4-host fleet 398, 719, 695 and 588 requests (some hosts drew the hot adapters). From the
requests counted per adapter (the speculation thread's counts), every adapter keeps the
owner it had (``place``'s on an empty fleet: a moved adapter is a cold load), one
carrying over half a host's share gets more owners (``replicas_of``), and while the
busiest host carries over ``1 + BALANCE_TOLERANCE`` times the mean, its largest adapter
that fits the gap moves to the least loaded host. The speculation thread publishes it in
the snapshot (``ResidencySnapshot.placement``). For a placed adapter the owners come
first (tier 0, ``placed``): the owner with the fewest requests in flight, then the
fewest routed so far (``sent``); only when every owner is over the bound do the tiers
below decide.

Overloaded: ``load + 1 > max(min_bound, ceil(load_factor * (total_load + 1) / hosts))``.
``route`` uses ``min_bound = LOAD_FLOOR``: a host carrying fewer requests than that is
never overloaded, since a batching engine takes a few more sequences almost for free and
leaving the resident host costs a cold load elsewhere.
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache
from types import MappingProxyType
from typing import Callable, Iterable, Mapping, Sequence

from extproc.state.catalog import Adapter, Upstream
from extproc.errors import ConfigError
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport, host_load
from ace_common.tiers import Tier

__all__ = ["LOAD_FLOOR", "RoutePolicy", "RoundRobin", "RoutingDecision", "choose_endpoint",
           "choose_upstream", "eligible_upstreams", "load_bound", "load_policy", "pick_order", "place",
           "place_by_demand", "replicas_of",
           "ring_walk", "round_robin", "route"]

RoutePolicy = Callable[[Sequence[Upstream], "Adapter | None", ResidencySnapshot, SentCounts], Upstream]

VNODES = 64
LOAD_FLOOR = 16
BALANCE_TOLERANCE = 0.20  # place_by_demand moves adapters while the busiest host carries over 1.2x the mean
BALANCE_MIN_REQUESTS = 16  # ... once this many requests per host were counted (a handful says nothing)


@dataclass(frozen=True)
class RoutingDecision:
    """Where to send the request and why: ``endpoint`` is the upstream's name (a key of the
    residency snapshot; its ``Upstream.address`` is what ``x-ace-destination-endpoint`` carries)."""

    endpoint: str | None   # an upstream name, None: no candidate
    reason: str  # placed | resident | staged | hashed | none


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@lru_cache(maxsize=64)
def _ring(hosts: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    points = sorted((_hash64(f"{h}#{i}"), h) for h in hosts for i in range(VNODES))
    return tuple(p for p, _ in points), tuple(h for _, h in points)


def ring_walk(hosts: tuple[str, ...], key: str) -> list[str]:
    """All hosts in the order the consistent-hash ring visits them from ``key``'s point."""
    if not hosts:
        return []
    return list(_walk(tuple(sorted(hosts)), key))


@lru_cache(maxsize=8192)
def _walk(hosts: tuple[str, ...], key: str) -> tuple[str, ...]:
    # cached: the hot path asks for the same (hosts, digest) walks again and again; a walk
    # visits up to hosts x VNODES ring points (4,096 at 64 hosts)
    points, owners = _ring(hosts)
    start = bisect.bisect_left(points, _hash64(key))
    seen: dict[str, None] = {}
    n = len(points)
    for i in range(n):
        seen.setdefault(owners[(start + i) % n])
        if len(seen) == len(hosts):
            break
    return tuple(seen)


def place(adapters: Iterable[str], hosts: Iterable[str],
          slots: Mapping[str, int] | None = None) -> dict[str, str]:
    """adapter -> owner host: each adapter (in its hash order) on the first host of its
    ring walk under that host's quota; quotas share the adapters in proportion to
    ``slots`` (missing or None: equal), each host the floor of its share, the first
    hosts to reach it one more until the remainder is given out."""
    return dict(_place(tuple(sorted(set(map(str, adapters)))), tuple(sorted(hosts)),
                       tuple(sorted((slots or {}).items()))))


@lru_cache(maxsize=64)
def _place(adapters: tuple[str, ...], hosts: tuple[str, ...],
           slots: tuple[tuple[str, int], ...]) -> tuple[tuple[str, str], ...]:
    if not hosts:
        return ()
    known = dict(slots)
    weight = {h: max(1, known.get(h, 1)) if known else 1 for h in hosts}
    total_w = sum(weight.values())
    floor = {h: len(adapters) * weight[h] // total_w for h in hosts}
    extra = len(adapters) - sum(floor.values())  # hosts that may take one more
    count = dict.fromkeys(hosts, 0)
    out = []
    for a in sorted(adapters, key=lambda a: (_hash64(a), a)):
        walk = ring_walk(hosts, a)
        owner = next((h for h in walk if count[h] < floor[h]), None)
        if owner is None:  # every host on its walk is at its floor: one of the extras
            owner = next(h for h in walk if count[h] == floor[h]) if extra > 0 else walk[0]
            extra -= 1
        count[owner] += 1
        out.append((a, owner))
    return tuple(out)


def replicas_of(demand: float, total: float, hosts: int, slots: int) -> int:
    """The fewest owners an adapter carrying ``demand`` of ``total`` needs: as many as
    keep each owner's part under half a host's share (one for all but the hottest); at
    most ``hosts``."""
    if total <= 0 or hosts <= 1 or demand < BALANCE_MIN_REQUESTS:
        return 1
    return min(hosts, max(1, math.ceil(2 * demand / total * hosts)))


def place_by_demand(demand: Mapping[str, float], hosts: Iterable[str], *, slots: int | None = 16,
                    adapters: Iterable[str] = (),
                    previous: Mapping[str, tuple[str, ...]] | None = None) -> dict[str, tuple[str, ...]]:
    """adapter -> owner hosts, evening out the demand per host with few moves.

    Every adapter first gets its ``previous`` owners (placement is sticky: a moved adapter
    is a cold load) or, new, ``place``'s owner (count quota over the catalog: where it
    lands on an empty fleet). Only when the catalog is larger than the fleet's pools
    (``hosts x slots``; ``slots`` None: not known to be) an adapter carrying more than half a host's share gets
    ``replicas_of`` owners (the least loaded hosts of its walk), one that no longer does
    keeps its first; then, once ``BALANCE_MIN_REQUESTS`` requests per host were counted
    and while the busiest host carries more than ``1 + BALANCE_TOLERANCE`` times the
    mean demand, its largest single-owner adapter that fits the gap to the least loaded host
    (demand under the difference, so both move toward the mean) moves there. An owner
    is counted ``demand / owners``. A second owner for every hot adapter evened the
    hosts too, but routing splits such an adapter's requests between its owners, each
    pool keeps a copy, and the copies cost more hits than the balance won."""
    hosts_t = tuple(sorted(hosts))
    if not hosts_t:
        return {}
    previous = previous or {}
    n = len(hosts_t)
    catalog = sorted(set(map(str, adapters)) | {a for a, d in demand.items() if d > 0})
    base = place(catalog, hosts_t)
    ranked = sorted((a for a in catalog if demand.get(a, 0) > 0), key=lambda a: (-demand[a], a))
    total = sum(demand[a] for a in ranked)
    # only when the pools cannot hold the catalog: then they thrash anyway and the demand
    # per host is also the pressure per pool; when they can, a copy or a move is a cold
    # load that buys request balance alone, and the load bound (tier 3) already spills
    # a busy host
    crowded = slots is not None and len(catalog) > n * slots
    out: dict[str, list[str]] = {}
    for a in catalog:
        owners = [h for h in previous.get(a, ()) if h in hosts_t] or [base[a]]
        want = replicas_of(demand.get(a, 0.0), total, n, slots) if crowded else 1
        out[a] = owners[:max(1, want)]
    load = dict.fromkeys(hosts_t, 0.0)
    for a in ranked:
        for h in out[a]:
            load[h] += demand[a] / len(out[a])
    for a in ranked if crowded else ():
        want = replicas_of(demand[a], total, n, slots)
        if len(out[a]) >= want:
            continue
        walk = ring_walk(hosts_t, a)
        order = {h: i for i, h in enumerate(walk)}
        for h in out[a]:
            load[h] -= demand[a] / len(out[a])
        while len(out[a]) < want:
            out[a].append(min((h for h in walk if h not in out[a]), key=lambda h: (load[h], order[h])))
        for h in out[a]:
            load[h] += demand[a] / len(out[a])
    if crowded and total >= BALANCE_MIN_REQUESTS * n:
        mean = total / n
        for _ in range(len(ranked)):
            heavy = max(hosts_t, key=lambda h: (load[h], h))
            light = min(hosts_t, key=lambda h: (load[h], h))
            if load[heavy] <= (1.0 + BALANCE_TOLERANCE) * mean:
                break
            gap = load[heavy] - load[light]
            movable = [a for a in ranked if out[a] == [heavy] and demand[a] < gap]
            if not movable:
                break
            a = movable[0]  # ranked hottest first: the largest that fits, the fewest moves
            out[a] = [light]
            load[heavy] -= demand[a]
            load[light] += demand[a]
    return {a: tuple(o) for a, o in out.items()}


def load_bound(loads: Mapping[str, int], hosts: tuple[str, ...], load_factor: float,
               min_bound: int = 1) -> int:
    """The most requests one host may carry, counting the one being placed."""
    total = sum(loads.get(h, 0) for h in hosts)
    return max(1, min_bound, math.ceil(load_factor * (total + 1) / len(hosts)))


_NO_TABLE: Mapping[str, TierReport] = MappingProxyType({})


def choose_endpoint(
    residency: ResidencySnapshot,
    adapter: str,
    digest: str,
    *,
    hosts: Iterable[str] | None = None,
    loads: Mapping[str, int] | None = None,
    load_factor: float = 1.25,
    replicas: int = 1,
    min_bound: int = 1,
    adapters: Iterable[str] | None = None,
    slots: Mapping[str, int] | None = None,
    owners: Sequence[str] = (),
    routed: Mapping[str, int] | None = None,
) -> RoutingDecision:
    """Pick the engine host for ``adapter`` (content ``digest``), by the tiers above.

    ``hosts``: the hosts to choose from (default: every upstream of ``residency``; one the
    view does not know holds nothing); ``loads``: requests per host (missing = 0);
    ``replicas``: how many ring hosts a hot adapter may occupy; ``min_bound``: the load
    bound never goes below it; ``adapters``: every adapter of the fleet, for ``place``
    (with ``slots``: pool slots per host); without it the digest's ring walk decides.
    ``owners``: the adapter's hosts by demand (``place_by_demand``): the one under the
    bound with the fewest requests in flight, then the fewest ``routed`` so far (requests
    sent there since start), wins before any tier (reason ``placed``).
    """
    view = residency.by_upstream
    hosts = tuple(sorted(view if hosts is None else hosts))
    if not hosts:
        return RoutingDecision(None, "none")
    loads = loads or {}
    bound = load_bound(loads, hosts, load_factor, min_bound)

    def ok(h: str) -> bool:
        return loads.get(h, 0) + 1 <= bound

    placed = [h for h in owners if h in hosts and ok(h)]
    if placed:
        routed = routed or {}
        return RoutingDecision(min(placed, key=lambda h: (loads.get(h, 0), routed.get(h, 0), h)), "placed")

    resident: list[str] = []
    staged: list[str] = []
    for h in hosts:
        report = view.get(h, _NO_TABLE).get(adapter)
        if report is None or not ok(h):
            continue
        if report.tier == Tier.DEVICE:
            resident.append(h)
        elif report.tier == Tier.HOST:
            staged.append(h)
    if resident:
        return RoutingDecision(min(resident, key=lambda h: (loads.get(h, 0), h)), "resident")
    if staged:
        return RoutingDecision(min(staged, key=lambda h: (loads.get(h, 0), h)), "staged")

    walk = ring_walk(hosts, digest)
    if adapters is not None:
        owner = place([*adapters, adapter], hosts, slots).get(adapter)
        walk = [owner, *(h for h in ring_walk(hosts, adapter) if h != owner)]
    owners = [h for h in walk if ok(h)][: max(1, replicas)]
    if not owners:  # everyone at the bound (tiny totals): the ring's first choice
        return RoutingDecision(walk[0], "hashed")
    order = {h: i for i, h in enumerate(walk)}
    return RoutingDecision(min(owners, key=lambda h: (loads.get(h, 0), order[h])), "hashed")


class _FleetAdapters:
    """Every adapter the views of ``hosts`` hold, gathered only when iterated:
    ``choose_endpoint`` reads it only for an adapter that is neither placed, resident nor
    staged. Gathered on every call, it was the costliest step of ``route`` (4 hosts x 226
    adapters at hundreds, on the request path and for each of the speculation's offers)."""

    __slots__ = ("view", "hosts")

    def __init__(self, view: Mapping[str, Mapping[str, TierReport]], hosts: tuple[str, ...]):
        self.view, self.hosts = view, hosts

    def __iter__(self):
        return iter({a for name in self.hosts for a in self.view.get(name, _NO_TABLE)})


def route(upstreams: Sequence[Upstream], adapter: Adapter | None, residency: ResidencySnapshot,
          sent: SentCounts) -> Upstream:
    """Adapter-affinity routing: the gateway's ``RoutePolicy`` with several upstreams
    (``--routing-policy extproc.policy.routing:route``).

    Candidates serve the adapter's base model; those the agents' view knows are ranked by
    ``choose_endpoint``; when the view knows none of them (no agent connected yet, or all
    down) it fails open to consistent hashing over every candidate, so traffic never stops
    for want of residency data. A host's load is ``host_load``: its agent's last
    measurement (running + waiting requests, only while fresh) plus the requests this
    gateway routed there since that measurement arrived (``sent``), so a burst shorter
    than the agent's --load-interval-s spreads once the floor is reached instead of
    landing on one host. A host without a measurement counts as 0 and its sends are not
    added either: without a measurement to reset it the count would only grow, so with no
    loads at all the bound is inert, as before agents published them.
    """
    if adapter is None:
        return upstreams[0]
    candidates = [u for u in upstreams if u.base_model == adapter.base_model] or list(upstreams)
    view = residency.by_upstream
    known = {u.name: u for u in candidates if u.name in view}
    if not known:
        known = {u.name: u for u in candidates}
    loads = {}
    for name in known:
        load = host_load(residency, sent, name)
        if load is not None:
            loads[name] = load
    decision = choose_endpoint(residency, adapter.name, adapter.sha256 or adapter.name, hosts=known,
                               loads=loads, min_bound=LOAD_FLOOR, adapters=_FleetAdapters(view, tuple(known)),
                               owners=residency.placement.get(adapter.name, ()),
                               routed={name: sent.value(name) for name in known})
    return known[decision.endpoint]


def choose_upstream(upstreams: Sequence[Upstream], adapter: Adapter | None,
                    residency: ResidencySnapshot, sent: SentCounts) -> Upstream:
    """The policy with one upstream: the first upstream serving the adapter's base model
    (or the first upstream)."""
    if adapter is not None:
        for upstream in upstreams:
            if upstream.base_model == adapter.base_model:
                return upstream
    return upstreams[0]


def load_policy(spec: str | None, upstreams: int = 1) -> RoutePolicy:
    """The gateway's routing policy: ``spec`` (``"pkg.mod:func"``, ``--routing-policy``)
    when given; else ``route`` with several upstreams (or discovered hosts, which come and
    go), ``choose_upstream`` with one."""
    if not spec:
        return route if upstreams > 1 else choose_upstream
    module, sep, name = spec.partition(":")
    if not sep:
        raise ConfigError(f"routing policy must be module:function, got {spec!r}")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"cannot load routing policy {spec}: {exc}") from exc


class RoundRobin:
    """The baseline a plain Service gives: the next candidate host, whatever the adapter
    (``--routing-policy extproc.policy.routing:round_robin``; the bench's ``round_robin``
    arm). One ``itertools.count`` shared by the request threads: ``next`` is atomic."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def __call__(self, upstreams: Sequence[Upstream], adapter: Adapter | None,
                 residency: ResidencySnapshot, sent: SentCounts) -> Upstream:
        candidates = [u for u in upstreams if adapter is None or u.base_model == adapter.base_model]
        candidates = candidates or list(upstreams)
        return candidates[next(self._next) % len(candidates)]


round_robin = RoundRobin()


def eligible_upstreams(upstreams: Sequence[Upstream], subset: tuple[str, ...] | None) -> list[Upstream]:
    """ace's upstreams allowed by a gateway's subset hint (``ip:port``, or a bare ``ip`` for every port)."""
    if subset is None:
        return list(upstreams)
    allowed = set(subset)
    return [u for u in upstreams if u.address in allowed or u.address.rpartition(":")[0] in allowed]


def pick_order(route: RoutePolicy, eligible: Sequence[Upstream], first: Upstream | None,
               adapter: Adapter | None, residency: ResidencySnapshot, sent: SentCounts,
               count: int) -> list[Upstream]:
    """The fallback order (the endpoint picker protocol's pick list): ``first`` (the
    decision's upstream; None: ask ``route``), then the other eligible hosts as ``route``
    would rank them once the earlier ones are gone; ``count`` at most."""
    left = list(eligible)
    order: list[Upstream] = []
    while left and len(order) < count:
        nxt = first if first is not None and not order and first in left else route(left, adapter, residency, sent)
        if nxt not in left:   # a policy that answers outside the list: keep the list's order
            nxt = left[0]
        order.append(nxt)
        left.remove(nxt)
    return order
