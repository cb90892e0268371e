"""What the device and host tiers hold, their budgets, and the evictions that make room.

Every tier has a budget (device: a count mirroring the engine's own cache and/or bytes;
host: bytes; the disk tier's is the artifact store's) and evicts least-recently-used
adapters, never a pinned one, one being loaded, or one the engine reports busy. A budget
that cannot be met without evicting those fails the load; nothing grows past its budget.
A prefetch may name adapters to evict first (``evict``: the victim the gateway's model of
this pool chose): when its load needs device room, those go before the LRU
(``hinted_victims``); a hinted victim that a request is about to use (the engine reports
it busy) is skipped and counted, never evicted; a priced prefetch (one with a probability:
a bet against its hinted victims) whose hinted victims all are is given up
(``PrefetchGivenUp``) rather than paid for with the LRU adapter, whose reuse nobody priced.
An adapter the engine loaded itself (adopted by the reconcile) is nobody's victim for
``adopt_grace_s``: it was loaded for a request that may still be queued (not on a
self-managed engine, whose busy set names such a request's adapter from the start).

One owner per tier. These holdings decide what leaves the host tier, and the device tier
of an engine the agent drives (vLLM, SGLang: the engine only unloads when told): the plan
comes from ``gpu_agent.eviction`` (``plan_evictions``), and every eviction of every tier
is counted here with its tier and reason (``ace_agent_evictions_total{tier, reason}``, see
``EvictReason``). An engine that manages its own device memory (``connector.self_managed``:
the builtin engine, whose paged pool sees every request's load and use) owns its device
tier: its pool's owner, ``EngineAdapters``, chooses the victims (with the same
``gpu_agent.eviction`` functions, on the pool's own record of use) and enforces the budgets
(``--device-max-adapters``, ``--pool-mb``); the agent then keeps no device budget of its
own. It only names victims first (a prefetch's hints, while the engine says the load
``needs_room``) and mirrors what the engine holds (``mirror_engine_device``, and the
reconcile), counting each adapter the engine let go with reason ``engine_gone``.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from typing import Callable, Iterable, Mapping

from ace_common.tiers import Tier
from ace_common.catalog import Adapter
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineUnavailable
from gpu_agent.errors import PoolExhausted, PrefetchGivenUp
from gpu_agent.eviction import EvictReason, Shortfall, hinted_first, hinted_victims, ordered, plan_evictions
from gpu_agent.metrics import AgentMetrics
from gpu_agent.residency.records import AdapterState

__all__ = ["TierHoldings"]

log = logging.getLogger(__name__)


class TierHoldings:
    """The device tier (name -> bytes) and the host tier (name -> weights), LRU first.

    ``loading``: the loads in flight (the pipeline's; read here, never written), whose
    adapters no eviction takes. ``publish``: tells observers that an adapter changed.
    ``lock``: every change of the device tier is made under it."""

    def __init__(self, states: Mapping[str, AdapterState], loading: Mapping[str, object],
                 connector: EngineConnector, *, device_count: int | None, device_bytes: int | None,
                 host_bytes: int, metrics: AgentMetrics, publish: Callable[[str], None],
                 adopt_grace_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self._states = states
        self.adopt_grace_s = adopt_grace_s
        self.clock = clock
        self._loading = loading
        self.connector = connector
        self.device_count = device_count
        self.device_bytes = device_bytes
        self.host_budget = host_bytes
        self.metrics = metrics
        self._publish = publish
        self.device: OrderedDict[str, int] = OrderedDict()
        self.host: OrderedDict[str, bytes] = OrderedDict()
        self.lock = asyncio.Lock()
        self.engine_up = True   # the engine answered the last reconcile (or load)
        self._kept: dict[str, float] = {}   # name -> until (clock): requests were just sent for it
        self._used_at: dict[str, float] = {}  # name -> when (clock) a request was last seen for it
        # the gateway's latest ranking of this pool's victims (a request's signal): (names,
        # until, since) (clock)
        self._ranking: tuple[tuple[str, ...], float, float] = ((), 0.0, 0.0)

    # ---- host tier -------------------------------------------------------------------
    def admit_host(self, name: str, blob: bytes) -> None:
        budget = self.host_budget
        if len(blob) > budget:
            return  # larger than the whole tier: skip it rather than evict everything
        used = sum(len(b) for b in self.host.values())
        short = Shortfall(size=used + len(blob) - budget)
        for victim in plan_evictions(ordered(self.host, lambda n: len(self.host[n]),
                                             lambda n: not self._states[n].pinned and n not in self._loading),
                                     short):
            used -= len(self.host.pop(victim))
            self.evicted(victim, Tier.HOST, EvictReason.BUDGET)
        if used + len(blob) <= budget:
            self.host[name] = blob

    def host_bytes(self, name: str) -> bytes | None:
        return self.host.get(name)

    # ---- device tier -----------------------------------------------------------------
    def shortfall(self, incoming: int | None) -> Shortfall:
        """How far the device tier is over its budgets with an adapter of `incoming` bytes
        (None: none incoming, the budgets as they are)."""
        extra = 0 if incoming is None else 1
        count = 0 if self.device_count is None else len(self.device) + extra - self.device_count
        nbytes = (0 if self.device_bytes is None
                  else sum(self.device.values()) + (incoming or 0) - self.device_bytes)
        return Shortfall(count=count, size=nbytes)

    def has_free_room(self, spec: Adapter) -> bool:
        """Loading `spec` now needs no eviction: the engine's own pool says so (builtin),
        else the agent's device budgets."""
        room = self.connector.has_room(spec)
        return self.shortfall(spec.size_bytes).met if room is None else room

    def likely_victim(self, spec: Adapter, hints: tuple[str, ...]) -> str | None:
        """The adapter loading `spec` would displace now: None when there is room (or
        nothing may go), else the first hinted resident one, else the device tier's least
        recently used."""
        if self.has_free_room(spec):
            return None
        evictable = [n for n in self.device if not self._states[n].pinned and n not in self._loading]
        return next((h for h in hints if h in evictable), evictable[0] if evictable else None)

    async def make_device_room(self, spec: Adapter, hints: tuple[str, ...] = (), bet: bool = False) -> None:
        """``bet``: a speculative prefetch priced against its hinted victims (the sender's
        ``victim_reuse_probability``): when they cannot go (a request is about to use
        them), it is given up, not paid for with the LRU adapter, whose reuse nobody
        priced (``ace_agent_prefetch_cancelled_total{reason="victim_in_use"}``)."""
        def over() -> bool:
            return not self.shortfall(spec.size_bytes).met

        if over():
            await self._unload_dropped(spec, over)
        if hints:
            await self._evict_hinted(spec, hints, over)
        if not over():   # always, with a self-managed engine: its pool makes the rest of the room
            return
        if bet and hints:
            self.metrics.inc("ace_agent_prefetch_cancelled_total", reason="victim_in_use")
            raise PrefetchGivenUp(f"prefetch of {spec.name}: its hinted victim(s) {', '.join(hints)} are in use")
        busy = await self.connector.busy() | self.spared()
        victims = plan_evictions(
            ordered(self.device, self.device.__getitem__,
                    lambda n: not self._states[n].pinned and n not in busy),
            self.shortfall(spec.size_bytes))
        for victim in victims:
            await self.unload(victim, EvictReason.BUDGET, why=f"room for {spec.name}")
        if over():
            raise PoolExhausted(f"device tier full of pinned or busy adapters; cannot load {spec.name}")

    async def evict_ahead(self, spec: Adapter, hints: tuple[str, ...]) -> None:
        """Room for a load the engine will make itself (a request's, through vLLM's
        resolver): while the device tier has none for ``spec``, the hinted victims leave
        now, before that load evicts the engine's own least recently used; never an
        adapter the hints do not name (the engine's load takes its LRU, as it would)."""
        def over() -> bool:
            return not self.shortfall(spec.size_bytes).met

        if spec.name not in self.device and over():
            await self._evict_hinted(spec, hints, over)

    def rank_victims(self, names: tuple[str, ...], *, standing: bool = False) -> None:
        """The gateway's ranking of this pool's victims, coldest first (a request's own
        signal names it: ``Upstream.victim_hints``). A shrink that follows an adapter the
        engine loaded itself evicts by it, before its LRU, for ``adopt_grace_s``; until the
        next ranking when ``standing`` (an engine whose own cache keeps the same ranking
        until the next one, ``EngineConnector.ranks_victims``: its read took the first
        ranked victim's weights, and the shrink after it, however late the reconcile comes,
        must take the same name)."""
        now = self.clock()
        self._ranking = (names, math.inf if standing else now + self.adopt_grace_s, now)

    def ranking(self) -> tuple[str, ...]:
        """The ranking while it holds, without the names a request was seen for since it
        came (``used``; as vLLM's cache skips a ranked adapter used since its ranking)."""
        names, until, since = self._ranking
        if self.clock() >= until:
            return ()
        return tuple(n for n in names if self._used_at.get(n, -math.inf) <= since)

    def used(self, names: Iterable[str]) -> None:
        """Requests for ``names`` were seen now (the gateway's ``keep``, the engine's busy
        set)."""
        now = self.clock()
        for name in names:
            if name in self._states:   # catalog names only: bounded
                self._used_at[name] = now

    def keep(self, names: Iterable[str]) -> None:
        """The gateway just sent requests for ``names`` to this engine (``Prefetch.keep``),
        which may not list them as busy yet: no eviction takes them for ``adopt_grace_s``,
        and on an engine the agent evicts for they become its most recently used."""
        until = self.clock() + self.adopt_grace_s
        names = list(names)
        self.used(names)
        for name in names:
            self._kept[name] = until
            if not self.connector.self_managed and name in self.device:
                self.device.move_to_end(name)   # used now: the engine's own order has it so

    def spared(self) -> set[str]:
        """Adapters no eviction may take now: the engine loaded them itself within
        ``adopt_grace_s`` (for a request that may still be queued), or the gateway said it
        just sent requests for them (``keep``). Not the first on a self-managed engine
        (builtin): its busy set already names every adapter a request holds, claimed or
        waits for, from the moment the engine accepts it, so the grace only kept good
        victims from the gateway's prefetches (each of the engine's own loads, one every
        few requests on a full pool, was nobody's victim for 2 s)."""
        now = self.clock()
        kept = self._kept
        for name in [n for n, until in kept.items() if until <= now]:
            del kept[name]
        if self.connector.self_managed:
            return {n for n in self.device if n in kept}
        return {n for n in self.device
                if n in kept or ((at := self._states[n].engine_loaded_at) is not None and now - at < self.adopt_grace_s)}

    async def shrink_device(self, busy: set[str] | None = None) -> None:
        """Unload LRU adapters (not pinned, not busy, not just adopted) until the device
        budget holds again. ``busy``: the engine's busy set when the caller just read it."""
        if self.device_count is None or len(self.device) <= self.device_count:
            return
        busy = (await self.connector.busy() if busy is None else busy) | self.spared()
        short = Shortfall(count=len(self.device) - self.device_count)
        evictable = lambda n: not self._states[n].pinned and n not in busy and n not in self._loading  # noqa: E731
        dropped = await self._dropped(evictable)
        order = hinted_first(ordered(self.device, self.device.__getitem__, evictable), (*dropped, *self.ranking()))
        for victim in plan_evictions(order, short):
            await self.unload(victim, *((EvictReason.ENGINE_DROPPED, "its weights had left the engine's cache")
                                        if victim in dropped else
                                        (EvictReason.BUDGET, "the device tier is over its budget")))

    async def _dropped(self, evictable: Callable[[str], bool]) -> list[str]:
        """The ``evictable`` adapters the engine still names whose weights its own cache
        dropped (``connector.cached``; vLLM's CPU LRU, on a read the ranking did not steer),
        least recently used first: unregistering one loses no weights (its next request
        reads them either way) where any other victim would. Asked only when the tier is
        over its budget; ``evictable`` must leave out busy adapters (a queued request waits
        for one: vLLM reads it again for that request)."""
        cached = await self.connector.cached()
        return [] if cached is None else [n for n in self.device if n not in cached and evictable(n)]

    async def _unload_dropped(self, spec: Adapter, over: Callable[[], bool]) -> None:
        """Room for the agent's load of `spec` from the adapters whose weights the engine's
        cache already dropped (``_dropped``), before any named victim or the LRU. The busy
        set is read only when there are such adapters."""
        protected = set(self._loading) | self.spared()
        busy: set[str] | None = None

        def evictable(n: str) -> bool:
            return n != spec.name and not self._states[n].pinned and n not in protected

        for name in await self._dropped(evictable):
            if not over():
                return
            if busy is None:
                busy = await self.connector.busy()
            if name not in busy:
                await self._unload_for(spec, name, EvictReason.ENGINE_DROPPED)

    async def _unload_for(self, spec: Adapter, name: str, reason: EvictReason) -> bool:
        """Unload `name` to make room for `spec`; False when the engine refused (it became
        busy meanwhile: the caller goes on to its next victim). An engine that cannot be
        reached fails the load."""
        try:
            await self.unload(name, reason, why=f"room for {spec.name}")
        except EngineUnavailable:
            raise
        except ConnectorError as exc:
            log.info("eviction of %s (%s) for %s refused: %s", name, reason.value, spec.name, exc)
            return False
        return True

    async def unload(self, name: str, reason: EvictReason, publish: bool = True, why: str = "") -> None:
        """Take `name` off the device (the engine unloads it) and count why."""
        await self.connector.unload(name)
        self.device.pop(name, None)
        log.info("unloaded %s (%s%s)", name, reason.value, f": {why}" if why else "")
        self.evicted(name, Tier.DEVICE, reason, publish=publish)

    def evicted(self, name: str, tier: Tier, reason: EvictReason, publish: bool = True) -> None:
        """Every eviction of every tier is counted here, with its reason."""
        self.metrics.inc("ace_agent_evictions_total", tier=tier.value, reason=reason.value)
        if publish:
            self._publish(name)

    async def mirror_engine_device(self) -> None:
        """A self-managed engine evicts by itself: drop from our view of its device tier
        what it no longer holds (counted ``engine_gone``), so hints name only live adapters."""
        loaded = await self.connector.loaded()
        gone = [n for n in self.device if n not in loaded]
        for n in gone:
            self.device.pop(n, None)
            self.evicted(n, Tier.DEVICE, EvictReason.ENGINE_GONE)

    async def _evict_hinted(self, spec: Adapter, hints: tuple[str, ...],
                            over: Callable[[], bool]) -> None:
        """Evict the caller's named adapters first, one at a time, while the load of
        `spec` still needs room: over our budgets, or (an engine with its own pool) over
        the engine's. What is still missing afterwards comes from the LRU, as always."""
        protected = ({n for n in hints if n in self._states and self._states[n].pinned} | set(self._loading)
                     | self.spared())
        victims = hinted_victims(hints, spec.name, resident=self.device, protected=protected)
        if not victims:
            return
        if self.connector.self_managed:
            await self.mirror_engine_device()
        busy = await self.connector.busy()
        in_use = [v for v in victims if v in busy and v in self.device]
        if in_use:  # a request is about to use it (or uses it): never the prefetch's victim
            self.metrics.inc("ace_agent_prefetch_victims_skipped_total", float(len(in_use)), reason="in_use")
            log.info("prefetch of %s: hinted victim(s) %s in use, skipped", spec.name, ", ".join(in_use))
        victims = hinted_victims(victims, spec.name, resident=self.device, protected=protected | busy)
        for victim in victims:
            if not over() and not await self.connector.needs_room(spec):
                return
            if not await self._unload_for(spec, victim, EvictReason.HINT):  # the next hint, or LRU
                self.metrics.inc("ace_agent_prefetch_victims_skipped_total", reason="in_use")
