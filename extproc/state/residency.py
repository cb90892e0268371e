"""The gateway's view of where each adapter lives on each upstream, as the agents report it.

``ResidencySnapshot`` is immutable data: a background task (``extproc.fleet.agent_link``)
builds a new one and swaps the reference (``ResidencyBoard.publish``); a request reads
``ResidencyBoard.current`` once. Unknown is a value (``UNKNOWN``), so the trace can say
``unknown`` instead of inventing a number.

Tiers are ``ace_common.tiers.Tier`` values (``device``, ``host``, ``disk``, ``remote``,
``absent``: the agent does not have the adapter in its catalog), plus one state only the
gateway has: ``UNKNOWN_TIER`` (no agent report). What the gateway's clients read
(``TierReport.public_tier``) writes ``absent`` as ``none``, the published word.

A host's load, as routing sees it (``host_load``), is the engine's load (running +
waiting requests) as its agent last measured it (``ResidencySnapshot.loads``, only while
fresh) plus the requests this gateway routed there since that measurement arrived. The
request path counts what it routes in the board's ``SentCounts`` (the one thing it
writes); each snapshot records, as data, where that count stood for the upstream when
its measurement arrived (``sent_at_load``), so a load and its starting point are swapped
in together, and the count moves between snapshots without a new one being built.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Mapping

from ace_common.tiers import Tier

__all__ = ["UNKNOWN", "UNKNOWN_TIER", "ResidencyBoard", "ResidencySnapshot", "SentCounts", "TierReport",
           "host_load", "public_tier"]

UNKNOWN_TIER = "unknown"   # no report from the upstream's agent
#: the gateway's published words that differ from the tier vocabulary's
_PUBLIC = {Tier.ABSENT: "none"}


def public_tier(tier: str) -> str:
    """``tier`` as the gateway's clients read it: ``absent`` is ``none`` there."""
    return _PUBLIC.get(tier, tier)


@dataclass(frozen=True, slots=True)
class TierReport:
    """One adapter on one upstream, as the upstream's agent last reported it."""

    tier: str                      # a Tier or UNKNOWN_TIER
    cold_load_ms: float | None     # measured time to load from where it is; None = unknown
    bytes: int | None = None
    prefetched: bool = False       # on the device because a prefetch put it there (agent's loaded_by)
    base_model_bytes: int | None = None  # the upstream's base weights: what a dedicated instance repeats

    @property
    def known(self) -> bool:
        return self.tier != UNKNOWN_TIER

    @property
    def public_tier(self) -> str:
        """The tier in what the gateway writes (trace, ``/v1/execute``, wire hints, settings API)."""
        return _PUBLIC.get(self.tier, self.tier)


UNKNOWN = TierReport(tier=UNKNOWN_TIER, cold_load_ms=None, bytes=None)
_EMPTY: Mapping[str, TierReport] = MappingProxyType({})


class SentCounts:
    """Requests this gateway routed to each upstream since it started, and when each
    adapter was last routed to each upstream.

    ``record`` is called once per routed request, from any request thread (``--server
    threads`` runs several): the increment holds a lock, so no count is lost. ``value`` is
    one dict read, no lock. ``recent`` names the adapters routed to an upstream lately
    (``clock``: ``time.monotonic``): their requests may be on their way to an engine that
    does not list them as running or waiting yet (vLLM's gauge lags), and no eviction may
    take those adapters (``AgentLink.spare_routed``).
    Bounded: at most ``max_routes`` pairs; past it the older half is forgotten."""

    __slots__ = ("_counts", "_lock", "_routed", "max_routes", "clock")

    def __init__(self, initial: Mapping[str, int] | None = None, *, max_routes: int = 65_536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counts: dict[str, int] = dict(initial or {})
        self._lock = threading.Lock()
        self._routed: dict[tuple[str, str], float] = {}
        self.max_routes = max_routes
        self.clock = clock

    def record(self, upstream: str, adapter: str | None = None) -> None:
        with self._lock:
            self._counts[upstream] = self._counts.get(upstream, 0) + 1
            if adapter:
                routed = self._routed
                routed.pop((upstream, adapter), None)   # insertion order = routing order
                routed[(upstream, adapter)] = self.clock()
                if len(routed) > self.max_routes:
                    for key in list(itertools.islice(routed, len(routed) // 2)):
                        del routed[key]

    def value(self, upstream: str) -> int:
        return self._counts.get(upstream, 0)

    def recent(self, upstream: str, within_s: float, limit: int = 16) -> dict[str, float]:
        """The adapters routed to ``upstream`` in the last ``within_s`` -> seconds ago, newest
        first, at most ``limit`` (and at most 256 routes looked at)."""
        now, out = self.clock(), {}
        with self._lock:
            for (up, adapter), at in itertools.islice(reversed(self._routed.items()), 256):
                if now - at >= within_s or len(out) >= limit:
                    break
                if up == upstream:
                    out[adapter] = now - at
        return out


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    """``by_upstream``: upstream -> adapter -> ``TierReport``; an upstream missing there
    has no agent view (unknown). ``loads``: the engine's load per upstream as its agent
    last measured it, only while fresh. ``sent_at_load``: for the same upstreams, the
    board's ``SentCounts.value`` when that measurement arrived (missing: 0).
    ``placement``: adapter -> the hosts that own it by demand
    (``extproc.policy.routing.place_by_demand``, published by the speculation thread with
    ``ResidencyBoard.place``; an adapter missing there is placed by the ring).
    ``victims``: upstream -> the adapters the speculation's model of that pool would
    evict first (``ResidencyBoard.suggest_victims``): a request's ingress prefetch names
    them, so a demand load evicts by predicted use, not by the agent's LRU. ``slots``:
    upstream -> the most adapters its device tier holds, where its agent announces one
    (``ResidencyEvent.device_slots``: vLLM's, SGLang's cache size; missing: not announced,
    the builtin engine's pool is sized in bytes). ``waste_share``: upstream -> the share of
    a wasted bet's load time its agent's speculation budget charges the bet
    (``ResidencyEvent.prefetch_waste_share``; missing: not announced): the speculation prices
    its bets with it, so that it sends none the agent would refuse."""

    by_upstream: Mapping[str, Mapping[str, TierReport]] = field(
        default_factory=lambda: MappingProxyType({}))
    loads: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    sent_at_load: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    placement: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    victims: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    slots: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    waste_share: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, upstream: str, adapter: str) -> TierReport:
        return self.by_upstream.get(upstream, _EMPTY).get(adapter, UNKNOWN)

    @classmethod
    def build(cls, table: Mapping[str, Mapping[str, TierReport]],
              loads: Mapping[str, int] | None = None,
              sent_at_load: Mapping[str, int] | None = None,
              placement: Mapping[str, tuple[str, ...]] | None = None) -> "ResidencySnapshot":
        return cls(MappingProxyType({u: MappingProxyType(dict(a)) for u, a in table.items()}),
                   MappingProxyType(dict(loads or {})), MappingProxyType(dict(sent_at_load or {})),
                   MappingProxyType(dict(placement or {})))


def host_load(residency: ResidencySnapshot, sent: SentCounts, upstream: str) -> int | None:
    """The upstream's requests as routing counts them: its agent's last measurement plus
    the requests routed there since it arrived; None without a fresh measurement (its
    sends are not counted then: without a measurement to start from, they only grow)."""
    load = residency.loads.get(upstream)
    if load is None:
        return None
    return load + sent.value(upstream) - residency.sent_at_load.get(upstream, 0)


EMPTY = ResidencySnapshot()


class ResidencyBoard:
    """Holds the current snapshot; one reference swap per update, no locks on read.

    ``sent``: the requests the gateway routed to each upstream (``record`` on the request
    path), read beside ``current`` by the routing decision. ``published_at``: when
    ``current`` was published (``time.monotonic``), for its age on /metrics."""

    def __init__(self, initial: ResidencySnapshot = EMPTY) -> None:
        self.current = initial
        self.sent = SentCounts()
        self.published_at = time.monotonic()
        self._publish = threading.Lock()  # two writers (agents' view, placement); readers take none

    def publish(self, snapshot: ResidencySnapshot) -> None:
        """The agents' new view; the placement and victims published last are kept (the
        agents' client does not build them)."""
        with self._publish:
            current = self.current
            if (current.placement or current.victims) and not (snapshot.placement or snapshot.victims):
                snapshot = dataclasses.replace(snapshot, placement=current.placement, victims=current.victims)
            self.current = snapshot
            self.published_at = time.monotonic()

    def suggest_victims(self, victims: Mapping[str, tuple[str, ...]]) -> None:
        """What each pool should lose first, as the speculation thread sees it now."""
        with self._publish:
            self.current = dataclasses.replace(self.current, victims=MappingProxyType(dict(victims)))

    def place(self, placement: Mapping[str, tuple[str, ...]]) -> None:
        """A new placement by demand (the speculation thread); the agents' view is kept."""
        with self._publish:
            self.current = dataclasses.replace(self.current, placement=MappingProxyType(dict(placement)))
