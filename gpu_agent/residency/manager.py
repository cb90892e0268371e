"""Where each catalog adapter lives, and the background work that moves it up or down.

Tiers, best first: device (the engine holds it) > host (its bytes in the agent's
memory) > disk (a verified local copy) > remote (only at its URL); `absent` = not in the
catalog. Every tier has a budget (device: a count mirroring the engine's own cache and/or
bytes; host and disk: bytes) and evicts least-recently-used adapters, never a pinned
one, one being loaded, or one the engine reports busy. A budget that cannot be met
without evicting those fails the load; nothing grows past its budget. A prefetch may
name adapters to evict first (``evict``: the victim the gateway's model of this pool
chose): when its load needs device room, those go before the LRU (``hinted_victims``).
One owner per tier. This manager decides what leaves the host and disk tiers, and the
device tier of an engine the agent drives (vLLM, SGLang: the engine only unloads when
told): the plan comes from ``gpu_agent.eviction`` (``plan_evictions``), and every
eviction is counted with its tier and reason (``ace_agent_evictions_total{tier,
reason}``, see ``EvictReason``). An engine that manages its own device memory
(``connector.self_managed``: the builtin engine, whose paged pool sees every request's
load and use) owns its device tier: its pool's owner, ``EngineAdapters``, chooses the
victims (with the same ``gpu_agent.eviction`` functions, on the pool's own record of use)
and enforces the budgets (``--device-max-adapters``, ``--pool-mb``); the agent then keeps
no device budget of its own. It only names victims first (a prefetch's hints, while the
engine says the load ``needs_room``) and mirrors what the engine holds
(``_mirror_engine_device``, and the reconcile), counting each adapter the engine let go
with reason ``engine_gone``.

Prefetches go into a bounded priority queue (duplicates coalesce with the queued or
running load) and are worked off by background tasks; a hint that says how likely it is
(``probability``) is first put to the speculation budget (``gpu_agent.residency.prefetch_budget``,
fed here with measured load times, the queue and the engine's own request loads); `ensure_resident` is the same
load awaited, as a request's (on demand): it goes before every queued prefetch (the
workers take no new prefetch while one is in flight, and a prefetch waits for it, and
for the engine's own request loads, before its device stage), and the engine is told
it is a request's load (the builtin engine then pauses its own prefetch loads for it).
A hinted victim that a request is about to use (the engine reports it busy) is skipped
and counted, never evicted; a priced prefetch (one with a probability: a bet against its
hinted victims) whose hinted victims all are is given up rather than paid for with the
LRU adapter, whose reuse nobody priced. A reconcile loop asks the engine what it holds:
adapters that vanished (engine restart) drop to their lower tier, are announced, and are
loaded again; adapters the engine loaded itself (vLLM's resolver, for a request) are
adopted at the most recently used end and are nobody's victim for ``adopt_grace_s``.
On an engine the agent drives but does not serve requests through (vLLM), the reconcile
also moves what the engine runs or queues now (``busy``) to the most recently used end:
without it the tier's order would be the order of loads, not of use.
Observers subscribe to a stream of `AdapterView` changes, interleaved with the engine's
load (`LoadChange`, measured by `gpu_agent.load.LoadMonitor` every `load_interval_s`).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Callable, Iterable

from gpu_agent.artifacts import WEIGHTS, AdapterSpec, ArtifactStore, Catalog
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineLoad, EngineUnavailable
from gpu_agent.errors import AgentError, DigestMismatch, PoolExhausted
from gpu_agent.eviction import EvictReason, Shortfall, hinted_victims, ordered, plan_evictions
from gpu_agent.load import LoadChange, LoadMonitor
from gpu_agent.metrics import AgentMetrics, Gauge
from gpu_agent.residency.prefetch_budget import (DEFAULT_LINK_BUDGET_MS, DEFAULT_LINK_BYTES_PER_MS, HintBet, HintVerdict,
                                       LinkState, decide_hint)
from gpu_agent.settings import SettingsError
from ace_common.tiers import Tier

__all__ = ["AdapterView", "ResidencyOutcome", "ResidencyResult", "ResidencyManager",
           "ResidencyBudgets", "Subscription"]

log = logging.getLogger(__name__)

MAX_EVICT_HINTS = 16  # names read from one Prefetch's evict list (the gateway sends one)


class ResidencyOutcome(str, Enum):
    """What a prefetch, evict, pin or unpin did. Refusals are outcomes (REJECTED with a
    reason), never exceptions: exceptions are errors (the engine failed, a bug)."""

    ACCEPTED = "accepted"                  # prefetch: queued, or joined a queued/running load
    ALREADY_RESIDENT = "already_resident"  # prefetch: on the device already
    DONE = "done"                          # evict / pin / unpin: done as asked
    REJECTED = "rejected"                  # nothing done; ``reason`` says why


@dataclass(frozen=True)
class ResidencyResult:
    """The one way the manager reports an operation's outcome."""

    outcome: ResidencyOutcome
    reason: str = ""   # REJECTED: unknown_adapter, digest_mismatch, queue_full, pinned, busy,
                       # loading, not_resident; ACCEPTED: coalesced when it joined a load

    @property
    def ok(self) -> bool:
        return self.outcome is not ResidencyOutcome.REJECTED


def _rejected(reason: str) -> ResidencyResult:
    return ResidencyResult(ResidencyOutcome.REJECTED, reason)


_DONE = ResidencyResult(ResidencyOutcome.DONE)


class PrefetchGivenUp(AgentError):
    """A priced prefetch whose hinted victims could not be evicted (``_make_device_room``)."""


@dataclass(frozen=True)
class AdapterView:
    """One adapter's residency as observers see it (immutable)."""

    name: str
    tier: Tier
    cold_load_ms: float | None = None
    bytes: int = 0
    pinned: bool = False
    digest: str = ""
    loading: bool = False
    # Why the adapter is on the device: "prefetch" (a Prefetch signal loaded it and no
    # operator/restart load happened since), "pin", "engine_restart", "request" (an
    # awaited ensure_resident), "engine" (the engine loaded it itself, found by reconcile).
    loaded_by: str = ""


@dataclass(frozen=True)
class ResidencyBudgets:
    # The device tier's budgets, for an engine the agent drives; a self-managed engine
    # (builtin) takes neither: its pool enforces its own (the module docstring).
    device_count: int | None = None     # None: the connector's capacity (vLLM --max-cpu-loras)
    device_bytes: int | None = None     # None: no byte budget on the device tier
    host_bytes: int = 0                 # 0: no host tier (the engine reads files itself)
    queue_size: int = 64                # pending prefetches; beyond this they are rejected
    workers: int = 1                    # concurrent background loads
    reconcile_interval_s: float = 2.0
    load_interval_s: float = 0.5        # engine load measurements; 0: none (always unknown)
    link_budget_ms: float = DEFAULT_LINK_BUDGET_MS  # load work queued ahead of a hint with a probability
    # An adapter the engine loaded itself (found by reconcile) is nobody's victim for this
    # long: it was loaded for a request that may still be queued (the engine's busy gauge
    # lags), and unloading it then fails that request (docs/engine.md, "Unloading an adapter
    # a queued request uses kills vLLM 0.32's engine"). The tier may exceed its count budget
    # meanwhile; the next reconcile after it shrinks it back.
    adopt_grace_s: float = 2.0


@dataclass
class _State:
    spec: AdapterSpec
    pinned: bool = False
    cold_load_ms: float | None = None
    loading: bool = False
    loaded_by: str = ""
    pending_reason: str = ""   # reason of the queued prefetch that will load it
    pending_evict: tuple[str, ...] = ()  # adapters to evict first if its load needs room
    engine_loaded_at: float | None = None  # when reconcile found the engine had loaded it itself
    priced: bool = False  # the queued prefetch is a bet (it came with a probability) against its hinted victims


class Subscription:
    """An observer's queue of changes (`AdapterView`, `LoadChange`; None when the manager
    closes); closed (and ends) when it falls too far behind."""

    def __init__(self, manager: "ResidencyManager", maxsize: int):
        self._manager = manager
        self.queue: asyncio.Queue[AdapterView | LoadChange | None] = asyncio.Queue(maxsize)
        self.overflowed = False

    def push(self, view: AdapterView | LoadChange) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(view)
        except asyncio.QueueFull:
            self.overflowed = True  # the client reconnects and gets a fresh snapshot

    def close(self) -> None:
        self._manager._subs.discard(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> AdapterView | LoadChange | None:
        if self.overflowed and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()


class ResidencyManager:
    def __init__(self, catalog: Catalog, store: ArtifactStore, connector: EngineConnector,
                 budgets: ResidencyBudgets = ResidencyBudgets(), metrics: AgentMetrics | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.catalog = catalog
        self.clock = clock
        self.store = store
        self.connector = connector
        self.budgets = budgets
        self.metrics = metrics or AgentMetrics()
        if connector.self_managed and (budgets.device_count is not None or budgets.device_bytes is not None):
            raise SettingsError(f"the {connector.kind} engine owns its device tier: give its pool the budgets "
                                "(max_adapters, pool bytes), not the agent's ResidencyBudgets")
        self.device_count = budgets.device_count if budgets.device_count is not None else connector.capacity
        self._states = {spec.name: _State(spec) for spec in catalog}
        self._device: OrderedDict[str, int] = OrderedDict()   # name -> bytes, LRU first
        self._host: OrderedDict[str, bytes] = OrderedDict()
        self._inflight: dict[str, asyncio.Task] = {}
        self._queue: list[tuple[int, int, str]] = []
        self._queued: set[str] = set()
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()
        self._device_lock = asyncio.Lock()
        self._demand: dict[str, int] = {}       # requests' loads (ensure_resident) in flight
        self._demand_changed = asyncio.Event()  # replaced on every change
        self._link_bytes_per_ms = DEFAULT_LINK_BYTES_PER_MS  # measured loads, averaged (EWMA)
        self._subs: set[Subscription] = set()
        self._tasks: list[asyncio.Task] = []
        self.engine_up = True
        self.version = 0
        self.base_model_bytes = _weights_bytes(catalog.base_model_path)
        self.load_monitor = LoadMonitor(connector, budgets.load_interval_s, self._publish_load,
                                        on_failure=lambda: self.metrics.inc("ace_agent_load_read_failures_total"))
        self.metrics.add_gauges(self._gauges)
        self.metrics.add_collector(self._collect_engine_counters)
        # every disk-cache eviction (the engine's own fetches included) spares what we protect
        store.protect_with(self._protected_digests)
        store.on_eviction(lambda spec, reason: self._evicted(spec.name, Tier.DISK, reason))

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await self.connector.start()
        await self.reconcile()
        for _ in range(max(1, self.budgets.workers)):
            self._tasks.append(asyncio.create_task(self._worker()))
        if self.budgets.reconcile_interval_s > 0:
            self._tasks.append(asyncio.create_task(self._reconcile_loop()))
        if self.budgets.load_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.load_monitor.run()))

    async def close(self) -> None:
        for task in self._tasks + list(self._inflight.values()):
            task.cancel()
        await asyncio.gather(*self._tasks, *self._inflight.values(), return_exceptions=True)
        self._tasks.clear()
        for sub in list(self._subs):
            sub.push(None)  # type: ignore[arg-type]
        await self.connector.close()
        await self.store.aclose()

    # ---- reads -----------------------------------------------------------------------
    def view(self, name: str) -> AdapterView:
        state = self._states.get(name) if self.catalog.get(name) else None
        if state is None:
            return AdapterView(name=name, tier=Tier.ABSENT)
        spec = state.spec
        if name in self._device:
            tier = Tier.DEVICE
        elif name in self._host or self.connector.in_host(name):
            tier = Tier.HOST
        elif self.store.local_path(spec) is not None or not spec.is_remote:
            tier = Tier.DISK
        else:
            tier = Tier.REMOTE
        return AdapterView(name=name, tier=tier, cold_load_ms=state.cold_load_ms,
                           bytes=spec.size_bytes, pinned=state.pinned, digest=spec.sha256,
                           loading=name in self._inflight or name in self._queued,
                           loaded_by=state.loaded_by if tier is Tier.DEVICE else "")

    def snapshot(self) -> list[AdapterView]:
        return [self.view(name) for name in self._states]

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        return sub

    @property
    def engine_load(self) -> EngineLoad | None:
        """The engine's load as last measured (None = unknown)."""
        return self.load_monitor.current

    def _publish_load(self, load: EngineLoad | None) -> None:
        change = LoadChange(load)
        for sub in list(self._subs):
            sub.push(change)

    def _publish(self, name: str) -> None:
        self.version += 1
        view = self.view(name)
        for sub in list(self._subs):
            sub.push(view)

    # ---- prefetch --------------------------------------------------------------------
    def prefetch(self, name: str, digest: str = "", priority: int = 0, reason: str = "",
                 evict: Iterable[str] = (), *, probability: float | None = None,
                 victim_reuse_probability: float | None = None) -> ResidencyResult:
        """Decide at once; the load itself runs in the background.

        ``evict``: adapters to evict first should the load need device room (catalog
        names only; others are ignored). A duplicate of a still-queued prefetch replaces
        the queued hints with its own when it has any. ``probability`` (the sender's
        chance that a request needs it here; None: an older sender, taken as before) and
        ``victim_reuse_probability`` feed the speculation budget
        (``gpu_agent.residency.prefetch_budget``): a hint it refuses is REJECTED with its verdict."""
        spec = self.catalog.get(name)
        if spec is None:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_unknown")
            return _rejected("unknown_adapter")
        if digest and digest.lower() != spec.sha256:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_digest")
            return _rejected("digest_mismatch")
        if name in self._device:
            self._device.move_to_end(name)
            self.metrics.inc("ace_agent_prefetch_total", outcome="already_resident")
            return ResidencyResult(ResidencyOutcome.ALREADY_RESIDENT)
        hints = self._known_hints(name, evict)
        if name in self._inflight or name in self._queued:
            if hints and name not in self._inflight:
                self._states[name].pending_evict = hints
            self.metrics.inc("ace_agent_prefetch_total", outcome="coalesced")
            return ResidencyResult(ResidencyOutcome.ACCEPTED, "coalesced")
        verdict = decide_hint(self._bet(spec, hints, probability, victim_reuse_probability), self._link())
        if verdict is not HintVerdict.ACCEPT:
            self.metrics.inc("ace_agent_prefetch_total", outcome=f"rejected_{verdict.value}")
            return _rejected(verdict.value)
        if len(self._queued) >= self.budgets.queue_size:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_queue_full")
            return _rejected("queue_full")
        heapq.heappush(self._queue, (-priority, next(self._seq), name))
        self._queued.add(name)
        self._states[name].pending_reason = reason
        self._states[name].pending_evict = hints
        self._states[name].priced = probability is not None
        self._wakeup.set()
        self.metrics.inc("ace_agent_prefetch_total", outcome="accepted")
        self._publish(name)
        return ResidencyResult(ResidencyOutcome.ACCEPTED)

    def _known_hints(self, name: str, evict: Iterable[str]) -> tuple[str, ...]:
        """The hinted names that are catalog adapters (looked up, never used as paths)."""
        out: list[str] = []
        for hint in itertools.islice(evict, MAX_EVICT_HINTS):
            if hint != name and hint not in out and self.catalog.get(hint) is not None:
                out.append(hint)
        return tuple(out)

    # ---- the speculation budget's inputs -----------------------------------------------
    def _load_ms(self, spec: AdapterSpec) -> float:
        """Expected load time: the adapter's last measured cold load, else its bytes over
        the link's measured rate."""
        measured = self._states[spec.name].cold_load_ms
        return measured if measured is not None else spec.size_bytes / self._link_bytes_per_ms

    def _link(self) -> LinkState:
        ahead = self._queued | set(self._inflight)
        return LinkState(demand_loads=len(self._demand) + self.connector.demand_loads(),
                         busy_ms=sum(self._load_ms(self._states[n].spec) for n in ahead),
                         budget_ms=self.budgets.link_budget_ms)

    def _bet(self, spec: AdapterSpec, hints: tuple[str, ...], probability: float | None,
             victim_reuse_probability: float | None) -> HintBet:
        if probability is None:
            return HintBet(None, 0.0)
        victim = self._likely_victim(spec, hints)
        if victim is None:
            return HintBet(probability, self._load_ms(spec))
        return HintBet(probability, self._load_ms(spec), victim_reuse_probability or 0.0,
                       self._load_ms(self._states[victim].spec))

    def _likely_victim(self, spec: AdapterSpec, hints: tuple[str, ...]) -> str | None:
        """The adapter loading `spec` would displace now: None when there is room, else
        the first hinted resident one, else the device tier's least recently used."""
        room = self.connector.has_room(spec)
        if room is None:  # the agent's own device budgets decide
            room = self._device_shortfall(spec.size_bytes).met
        if room:
            return None
        evictable = [n for n in self._device if not self._states[n].pinned and n not in self._inflight]
        return next((h for h in hints if h in evictable), evictable[0] if evictable else None)

    async def _worker(self) -> None:
        while True:
            while not self._queue:
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._no_demand()  # a request's load goes before any queued prefetch
            if not self._queue:
                continue
            _, _, name = heapq.heappop(self._queue)
            try:
                await self.ensure_resident(name, _by=self._load_origin(name))
            except asyncio.CancelledError:
                raise
            except PrefetchGivenUp as exc:
                log.info("%s: given up", exc)
            except Exception as exc:  # a failed prefetch is logged and counted, never fatal
                log.warning("prefetch of %s failed: %s", name, exc)

    # ---- loading ---------------------------------------------------------------------
    def _load_origin(self, name: str) -> str:
        reason = self._states[name].pending_reason
        return reason if reason in ("pin", "engine_restart") else "prefetch"

    async def _no_demand(self, name: str = "") -> bool:
        """Wait until no request's load (of another adapter than `name`: a request that
        joined this load promotes it) is in flight; True when it had to wait."""
        waited = False
        while any(n != name for n in self._demand):
            waited = True
            changed = self._demand_changed
            await changed.wait()
        return waited

    def _demand_step(self, name: str, delta: int) -> None:
        n = self._demand.get(name, 0) + delta
        if n > 0:
            self._demand[name] = n
        else:
            self._demand.pop(name, None)
        self._demand_changed.set()
        self._demand_changed = asyncio.Event()

    async def ensure_resident(self, name: str, _by: str = "request") -> AdapterView:
        """Load `name` to the device tier (coalesced with any load already running).
        Called directly, it is a request's load: it goes before queued prefetches."""
        if _by == "request":
            self._demand_step(name, +1)
            try:
                return await self._ensure_resident(name, _by)
            finally:
                self._demand_step(name, -1)
        return await self._ensure_resident(name, _by)

    async def _ensure_resident(self, name: str, _by: str) -> AdapterView:
        spec = self.catalog.get(name)
        if spec is None:
            raise AgentError(f"unknown adapter {name!r}")
        if name in self._device:
            self._device.move_to_end(name)
            self.metrics.inc("ace_agent_tier_hits_total", tier="device")
            self._queued.discard(name)
            return self.view(name)
        task = self._inflight.get(name)
        if task is None:
            task = asyncio.create_task(self._load(spec, _by))
            self._inflight[name] = task
            task.add_done_callback(lambda _t, n=name: self._load_done(n))
        self._queued.discard(name)
        await asyncio.shield(task)
        return self.view(name)

    def _load_done(self, name: str) -> None:
        self._inflight.pop(name, None)
        self._publish(name)

    def _protected_digests(self) -> set[str]:
        names = set(self._device) | set(self._inflight) | {n for n, s in self._states.items() if s.pinned}
        return {self._states[n].spec.sha256 for n in names if n in self._states}

    async def _load(self, spec: AdapterSpec, by: str) -> None:
        name = spec.name
        hints, self._states[name].pending_evict = self._states[name].pending_evict, ()
        priced, self._states[name].priced = self._states[name].priced and by == "prefetch", False
        t0 = time.perf_counter()
        start_tier = self.view(name).tier
        self.metrics.inc("ace_agent_tier_misses_total", tier="device")
        if start_tier is Tier.HOST:
            self.metrics.inc("ace_agent_tier_hits_total", tier="host")
        else:
            self.metrics.inc("ace_agent_tier_misses_total", tier="host")
            self.metrics.inc("ace_agent_tier_hits_total" if start_tier is Tier.DISK else "ace_agent_tier_misses_total", tier="disk")
            if start_tier is Tier.REMOTE:
                self.metrics.inc("ace_agent_tier_hits_total", tier="remote")
        self._publish(name)
        try:
            t = time.perf_counter()
            was_local = self.store.local_path(spec) is not None
            path, fetched = await self.store.ensure_local(spec, self._protected_digests())
            if not was_local:  # fetched from remote, or a local source hashed the first time
                stage = "fetch" if fetched else "verify"
                self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage=stage)
            if fetched:
                self._publish(name)
            if self.budgets.host_bytes > 0 and name not in self._host:
                t = time.perf_counter()
                blob = await asyncio.to_thread((path / WEIGHTS).read_bytes)
                self._admit_host(name, blob)
                self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage="read")
            # a prefetch waits for requests' loads (the agent's, then the engine's own)
            # before it takes the device lock, so it never holds the lock while it waits
            # (a pin is an operator's explicit load: it goes as a request's does)
            if by not in ("request", "pin"):
                waited = await self._no_demand(name)
                waited = await self.connector.prefetch_turn() or waited
                if waited:
                    self.metrics.inc("ace_agent_prefetch_preemptions_total", stage="agent")
            demand = by in ("request", "pin") or name in self._demand  # or a request joined it
            async with self._device_lock:
                if name not in self._device:
                    await self._make_device_room(spec, hints, bet=priced and name not in self._demand)
                    t = time.perf_counter()
                    pinned = self._states[name].pinned
                    await self.connector.load(spec, path, pinned=pinned, demand=demand)
                    if self._states[name].pinned != pinned:  # (un)pinned while it loaded
                        try:
                            self.connector.set_pinned(name, self._states[name].pinned)
                        except AgentError as exc:
                            log.warning("could not (un)pin %s after its load: %s", name, exc)
                    self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage="device")
                    self._device[name] = spec.size_bytes
                    self.engine_up = True
        except PrefetchGivenUp:
            raise  # counted where it was given up; not a failed load
        except DigestMismatch:
            self.metrics.inc("ace_agent_load_failures_total", reason="digest_mismatch")
            raise
        except EngineUnavailable:
            self.metrics.inc("ace_agent_load_failures_total", reason="engine_unavailable")
            raise
        except Exception as exc:
            self.metrics.inc("ace_agent_load_failures_total", reason=type(exc).__name__)
            raise
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        self._states[name].cold_load_ms = elapsed_ms
        if spec.size_bytes > 0 and elapsed_ms > 0:
            self._link_bytes_per_ms += 0.2 * (spec.size_bytes / elapsed_ms - self._link_bytes_per_ms)
        self._states[name].loaded_by = by
        self._states[name].engine_loaded_at = None
        self.metrics.observe("ace_agent_load_seconds", elapsed_ms / 1000.0, stage="cold")
        log.info("adapter %s resident on device in %.1f ms (from %s)", name, elapsed_ms, start_tier.value)

    def _admit_host(self, name: str, blob: bytes) -> None:
        budget = self.budgets.host_bytes
        if len(blob) > budget:
            return  # larger than the whole tier: skip it rather than evict everything
        used = sum(len(b) for b in self._host.values())
        short = Shortfall(size=used + len(blob) - budget)
        for victim in plan_evictions(ordered(self._host, lambda n: len(self._host[n]),
                                             lambda n: not self._states[n].pinned and n not in self._inflight),
                                     short):
            used -= len(self._host.pop(victim))
            self._evicted(victim, Tier.HOST, EvictReason.BUDGET)
        if used + len(blob) <= budget:
            self._host[name] = blob

    def host_bytes(self, name: str) -> bytes | None:
        return self._host.get(name)

    def _device_shortfall(self, incoming: int | None) -> Shortfall:
        """How far the device tier is over its budgets with an adapter of `incoming` bytes
        (None: none incoming, the budgets as they are)."""
        extra = 0 if incoming is None else 1
        count = 0 if self.device_count is None else len(self._device) + extra - self.device_count
        nbytes = (0 if self.budgets.device_bytes is None
                  else sum(self._device.values()) + (incoming or 0) - self.budgets.device_bytes)
        return Shortfall(count=count, size=nbytes)

    async def _make_device_room(self, spec: AdapterSpec, hints: tuple[str, ...] = (), bet: bool = False) -> None:
        """``bet``: a speculative prefetch priced against its hinted victims (the sender's
        ``victim_reuse_probability``): when they cannot go (a request is about to use
        them), it is given up, not paid for with the LRU adapter, whose reuse nobody
        priced (``ace_agent_prefetch_cancelled_total{reason="victim_in_use"}``)."""
        def over() -> bool:
            return not self._device_shortfall(spec.size_bytes).met

        if hints:
            await self._evict_hinted(spec, hints, over)
        if not over():   # always, with a self-managed engine: its pool makes the rest of the room
            return
        if bet and hints:
            self.metrics.inc("ace_agent_prefetch_cancelled_total", reason="victim_in_use")
            raise PrefetchGivenUp(f"prefetch of {spec.name}: its hinted victim(s) {', '.join(hints)} are in use")
        busy = await self.connector.busy() | self._just_adopted()
        victims = plan_evictions(
            ordered(self._device, self._device.__getitem__,
                    lambda n: not self._states[n].pinned and n not in busy),
            self._device_shortfall(spec.size_bytes))
        for victim in victims:
            await self._unload(victim, EvictReason.BUDGET)
        if over():
            raise PoolExhausted(f"device tier full of pinned or busy adapters; cannot load {spec.name}")

    def _just_adopted(self) -> set[str]:
        """Adapters the engine loaded itself within ``adopt_grace_s``: no eviction takes them."""
        now, grace = self.clock(), self.budgets.adopt_grace_s
        return {n for n in self._device
                if (at := self._states[n].engine_loaded_at) is not None and now - at < grace}

    async def _unload(self, name: str, reason: EvictReason) -> None:
        """Take `name` off the device (the engine unloads it) and count why."""
        await self.connector.unload(name)
        self._device.pop(name, None)
        self._evicted(name, Tier.DEVICE, reason)

    def _evicted(self, name: str, tier: Tier, reason: EvictReason, publish: bool = True) -> None:
        """Every eviction of every tier is counted here, with its reason."""
        self.metrics.inc("ace_agent_evictions_total", tier=tier.value, reason=reason.value)
        if publish:
            self._publish(name)

    async def _mirror_engine_device(self) -> None:
        """A self-managed engine evicts by itself: drop from our view of its device tier
        what it no longer holds (counted ``engine_gone``), so hints name only live adapters."""
        loaded = await self.connector.loaded()
        gone = [n for n in self._device if n not in loaded]
        for n in gone:
            self._device.pop(n, None)
            self._evicted(n, Tier.DEVICE, EvictReason.ENGINE_GONE)

    async def _evict_hinted(self, spec: AdapterSpec, hints: tuple[str, ...],
                            over: Callable[[], bool]) -> None:
        """Evict the caller's named adapters first, one at a time, while the load of
        `spec` still needs room: over our budgets, or (an engine with its own pool) over
        the engine's. What is still missing afterwards comes from the LRU, as always."""
        protected = ({n for n in hints if n in self._states and self._states[n].pinned} | set(self._inflight)
                     | self._just_adopted())
        victims = hinted_victims(hints, spec.name, resident=self._device, protected=protected)
        if not victims:
            return
        if self.connector.self_managed:
            await self._mirror_engine_device()
        busy = await self.connector.busy()
        in_use = [v for v in victims if v in busy and v in self._device]
        if in_use:  # a request is about to use it (or uses it): never the prefetch's victim
            self.metrics.inc("ace_agent_prefetch_victims_skipped_total", float(len(in_use)), reason="in_use")
            log.info("prefetch of %s: hinted victim(s) %s in use, skipped", spec.name, ", ".join(in_use))
        victims = hinted_victims(victims, spec.name, resident=self._device, protected=protected | busy)
        for victim in victims:
            if not over() and not await self.connector.needs_room(spec):
                return
            try:
                await self._unload(victim, EvictReason.HINT)
            except EngineUnavailable:
                raise
            except ConnectorError as exc:  # it became busy meanwhile: the next hint, or LRU
                log.info("hinted eviction of %s for %s refused: %s", victim, spec.name, exc)
                self.metrics.inc("ace_agent_prefetch_victims_skipped_total", reason="in_use")
                continue

    # ---- operator actions ------------------------------------------------------------
    async def evict(self, name: str, down_to: Tier = Tier.DISK) -> ResidencyResult:
        """Drop `name` from every tier above `down_to`. Pinned adapters are refused.
        Raises only when the engine fails the unload (ConnectorError)."""
        spec = self.catalog.get(name)
        if spec is None:
            return _rejected("unknown_adapter")
        state = self._states[name]
        if state.pinned:
            return _rejected("pinned")
        if name in self._inflight:
            return _rejected("loading")
        evicted = False
        async with self._device_lock:
            if name in self._device:
                if name in await self.connector.busy():
                    return _rejected("busy")
                await self.connector.unload(name)
                self._device.pop(name, None)
                self._evicted(name, Tier.DEVICE, EvictReason.OPERATOR, publish=False)
                evicted = True
        if down_to in (Tier.DISK, Tier.REMOTE) and self._host.pop(name, None) is not None:
            self._evicted(name, Tier.HOST, EvictReason.OPERATOR, publish=False)
            evicted = True
        if down_to is Tier.REMOTE and self.store.forget_local(spec):
            self._evicted(name, Tier.DISK, EvictReason.OPERATOR, publish=False)
            evicted = True
        self._publish(name)
        return _DONE if evicted else _rejected("not_resident")

    def pin(self, name: str) -> ResidencyResult:
        """Never evict `name`; it is also loaded (at top priority) if it is not resident."""
        if self.catalog.get(name) is None:
            return _rejected("unknown_adapter")
        self._states[name].pinned = True
        if name in self._device:
            try:  # an engine that evicts by itself must know too (builtin pool)
                self.connector.set_pinned(name, True)
            except AgentError:  # it left the engine meanwhile: load (and pin) it again
                self._device.pop(name, None)
        if name not in self._device:
            result = self.prefetch(name, priority=1 << 30, reason="pin")
            if not result.ok:
                self._states[name].pinned = False
                return result
        self._publish(name)
        return _DONE

    def unpin(self, name: str) -> ResidencyResult:
        if self.catalog.get(name) is None:
            return _rejected("unknown_adapter")
        self._states[name].pinned = False
        if name in self._device:
            try:
                self.connector.set_pinned(name, False)
            except AgentError:
                pass  # not resident any more: nothing to unpin
        self._publish(name)
        return _DONE

    # ---- engine reconciliation -------------------------------------------------------
    async def _reconcile_loop(self) -> None:
        while True:
            await asyncio.sleep(self.budgets.reconcile_interval_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reconcile failed: %s", exc)

    async def reconcile(self) -> None:
        """Align the device tier with what the engine holds; rebuild after a restart."""
        async with self._device_lock:
            try:
                loaded = await self.connector.loaded()
            except EngineUnavailable as exc:
                if self.engine_up:
                    log.warning("engine unavailable: %s", exc)
                    self.engine_up = False
                    self._publish_all()
                return
            was_up, self.engine_up = self.engine_up, True
            lost = [n for n in self._device if n not in loaded and n not in self._inflight]
            for name in lost:
                self._device.pop(name, None)
                self._publish(name)
            adopted = sorted(n for n in loaded if n in self._states and n not in self._device)
            for name in adopted:  # the engine loaded it itself (on demand), or a previous agent run
                # the engine loaded it for a request that is running or waiting now: the most
                # recently used end. At the LRU end the shrink below unloaded it again under that
                # request, and vLLM's engine died of it (docs/engine.md, "Unloading an adapter
                # a queued request uses kills vLLM 0.32's engine")
                self._device[name] = self._states[name].spec.size_bytes
                self._states[name].loaded_by = "engine"
                self._states[name].engine_loaded_at = self.clock()
                self._publish(name)
            if not self.connector.self_managed:
                # the agent sees no request on an engine it does not serve (vLLM): what the
                # engine runs or queues now is its most recently used (its LoRA gauge)
                busy = await self.connector.busy()
                for name in sorted(busy):
                    if name in self._device:
                        self._device.move_to_end(name)
                await self._shrink_device(busy)  # adopted now, or adopted earlier and out of their grace
            if not was_up:
                self._publish_all()
        if lost and self.connector.self_managed:
            for name in lost:  # published above
                self._evicted(name, Tier.DEVICE, EvictReason.ENGINE_GONE, publish=False)
        elif lost:
            self.metrics.inc("ace_agent_engine_resets_total")
            log.warning("engine lost %d adapters (%s); reloading them", len(lost), ", ".join(lost))
            # pinned first, then most recently used first
            recency = {n: i for i, n in enumerate(lost)}  # _device order: LRU first
            lost.sort(key=lambda n: (not self._states[n].pinned, -recency[n]))
            for rank, name in enumerate(lost):
                self.prefetch(name, priority=(1 << 20) - rank, reason="engine_restart")

    async def _shrink_device(self, busy: set[str] | None = None) -> None:
        """Unload LRU adapters (not pinned, not busy) until the device budget holds again."""
        if self.device_count is None or len(self._device) <= self.device_count:
            return
        busy = (await self.connector.busy() if busy is None else busy) | self._just_adopted()
        short = Shortfall(count=len(self._device) - self.device_count)
        evictable = lambda n: not self._states[n].pinned and n not in busy and n not in self._inflight  # noqa: E731
        for victim in plan_evictions(ordered(self._device, self._device.__getitem__, evictable), short):
            await self._unload(victim, EvictReason.BUDGET)

    def _publish_all(self) -> None:
        for name in self._states:
            self._publish(name)

    # ---- metrics ---------------------------------------------------------------------
    def _collect_engine_counters(self) -> None:
        """The engine's own load-order counters (builtin), copied in at every scrape."""
        stats = self.connector.load_order_stats()
        for stage, n in stats.get("preemptions", {}).items():
            self.metrics.set_counter("ace_agent_prefetch_preemptions_total", n, stage=stage)
        for reason, n in stats.get("cancelled", {}).items():
            self.metrics.set_counter("ace_agent_prefetch_cancelled_total", n, reason=reason)

    def _gauges(self) -> list[Gauge]:
        adapters, size = "Adapters resident per tier.", "Adapter bytes resident per tier."
        out: list[Gauge] = [
            ("ace_agent_tier_adapters", adapters, {"tier": "device"}, len(self._device)),
            ("ace_agent_tier_adapters", adapters, {"tier": "host"}, len(self._host)),
            ("ace_agent_tier_bytes", size, {"tier": "device"}, sum(self._device.values())),
            ("ace_agent_tier_bytes", size, {"tier": "host"}, sum(len(b) for b in self._host.values())),
            ("ace_agent_tier_bytes", size, {"tier": "disk"}, self.store.cache.used_bytes),
            ("ace_agent_prefetch_queue_depth", "Prefetches waiting for a worker.", {}, len(self._queued)),
            ("ace_agent_engine_up", "1 when the engine answered the last reconcile.", {}, 1.0 if self.engine_up else 0.0),
        ]
        load = self.engine_load
        if load is not None:
            out.append(("ace_agent_engine_requests_running", "The engine's running requests, as last measured.",
                        {}, float(load.running)))
            out.append(("ace_agent_engine_requests_waiting", "The engine's waiting requests, as last measured.",
                        {}, float(load.waiting)))
        for key, value in self.connector.pool_stats().items():
            out.append((f"ace_agent_pool_{key}", "The engine's adapter pool (builtin paged pool).", {}, float(value)))
        return out

def _weights_bytes(model_dir: Path | None) -> int:
    """Bytes of a checkpoint's weight files (0 when unknown)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return 0
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin")
               for p in Path(model_dir).glob(pattern))
