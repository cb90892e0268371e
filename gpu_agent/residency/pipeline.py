"""The tier pipeline: one adapter's load, remote -> disk -> host -> device, coalesced per
adapter, and the workers that work off the prefetch queue.

A load fetches or verifies the local copy (the artifact store), reads it into the host
tier when there is one, and has the engine load it, after the device tier made room
(``gpu_agent.residency.holdings``). `ensure_resident` is a request's load (on demand): it
goes before every queued prefetch (the workers take no new prefetch while one is in
flight, and a prefetch waits for it, and for the engine's own request loads, before its
device stage), and the engine is told it is a request's load (the builtin engine then
pauses its own prefetch loads for it). Every load is timed per stage
(``ace_agent_load_seconds{stage}``), and its time feeds the expected load times the
speculation budget reads (``load_ms``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping

from ace_common.tiers import Tier
from ace_common.catalog import Adapter
from gpu_agent.artifacts import WEIGHTS, ArtifactStore, Catalog
from gpu_agent.connectors.base import EngineConnector, EngineUnavailable
from gpu_agent.errors import AgentError, DigestMismatch, PrefetchGivenUp
from gpu_agent.metrics import AgentMetrics
from gpu_agent.residency.holdings import TierHoldings
from gpu_agent.residency.prefetch_budget import DEFAULT_LINK_BYTES_PER_MS
from gpu_agent.residency.queue import DemandLoads, PrefetchQueue
from gpu_agent.residency.records import AdapterState, AdapterView

__all__ = ["LoadPipeline"]

log = logging.getLogger(__name__)


class LoadPipeline:
    """``inflight``: the loads running now, by adapter (written here only; the holdings
    read it so that no eviction takes an adapter being loaded). ``demand``: the requests'
    loads among them. ``view``: an adapter's view now (what observers are told)."""

    def __init__(self, catalog: Catalog, states: Mapping[str, AdapterState], store: ArtifactStore,
                 connector: EngineConnector, holdings: TierHoldings, queue: PrefetchQueue,
                 inflight: dict[str, asyncio.Task], *, metrics: AgentMetrics,
                 publish: Callable[[str], None], view: Callable[[str], AdapterView]):
        self.catalog = catalog
        self.states = states
        self.store = store
        self.connector = connector
        self.holdings = holdings
        self.queue = queue
        self.inflight = inflight
        self.demand = DemandLoads()
        self.metrics = metrics
        self._publish = publish
        self._view = view
        self.link_bytes_per_ms = DEFAULT_LINK_BYTES_PER_MS  # measured loads, averaged (EWMA)
        self._ahead: set[asyncio.Task] = set()  # fetches and evictions ahead (kept referenced)

    def load_ms(self, spec: Adapter) -> float:
        """Expected load time: the adapter's last measured cold load, else its bytes over
        the link's measured rate."""
        measured = self.states[spec.name].cold_load_ms
        return measured if measured is not None else spec.size_bytes / self.link_bytes_per_ms

    def protected_digests(self) -> set[str]:
        """What no disk eviction may remove: the device tier's, the loading and the pinned."""
        names = (set(self.holdings.device) | set(self.inflight)
                 | {n for n, s in self.states.items() if s.pinned})
        return {self.states[n].spec.sha256 for n in names if n in self.states}

    def fetch_ahead(self, spec: Adapter) -> bool:
        """Start fetching ``spec``'s files now, for a request the engine will load it for
        itself (the engine's own load joins this fetch in the store); True when started."""
        if self.store.has_local(spec) or spec.name in self.inflight:
            return False

        async def fetch() -> None:
            try:
                await self.store.ensure_local(spec, self.protected_digests())
            except Exception as exc:  # the request's own load fetches again and reports it
                log.info("fetch ahead of %s failed: %s", spec.name, exc)
        self._keep_ahead(fetch())
        return True

    def evict_ahead(self, spec: Adapter, hints: tuple[str, ...]) -> None:
        """The hinted victims leave now, before the engine's own load of ``spec`` (vLLM's
        resolver; ``TierHoldings.evict_ahead``); the signal's answer does not wait."""
        async def evict() -> None:
            try:
                await self.holdings.evict_ahead(spec, hints)
            except Exception as exc:  # the engine's load makes room its own way
                log.info("evicting ahead of %s failed: %s", spec.name, exc)
        self._keep_ahead(evict())

    def _keep_ahead(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._ahead.add(task)
        task.add_done_callback(self._ahead.discard)

    async def close_ahead(self) -> None:
        """Cancel the fetches and evictions ahead still running (before the connector closes)."""
        tasks = list(self._ahead)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- the workers -----------------------------------------------------------------
    async def work_off_queue(self) -> None:
        while True:
            await self.queue.wait_for_work()
            await self.demand.wait_clear()  # a request's load goes before any queued prefetch
            if not self.queue.has_work():
                continue
            name = self.queue.pop()
            try:
                await self.ensure_resident(name, _by=self._load_origin(name))
            except asyncio.CancelledError:
                raise
            except PrefetchGivenUp as exc:  # counted where it was given up
                log.info("%s: given up", exc)
            except Exception as exc:  # a failed prefetch is logged and counted, never fatal
                log.warning("prefetch of %s failed: %s", name, exc)

    def _load_origin(self, name: str) -> str:
        reason = self.states[name].pending_reason
        return reason if reason in ("pin", "engine_restart") else "prefetch"

    # ---- loading ---------------------------------------------------------------------
    async def ensure_resident(self, name: str, _by: str = "request") -> AdapterView:
        """Load `name` to the device tier (coalesced with any load already running).
        Called directly, it is a request's load: it goes before queued prefetches."""
        if _by == "request":
            self.demand.step(name, +1)
            try:
                return await self._ensure_resident(name, _by)
            finally:
                self.demand.step(name, -1)
        return await self._ensure_resident(name, _by)

    async def _ensure_resident(self, name: str, _by: str) -> AdapterView:
        spec = self.catalog.get(name)
        if spec is None:
            raise AgentError(f"unknown adapter {name!r}")
        device = self.holdings.device
        if name in device:
            device.move_to_end(name)
            self.metrics.inc("ace_agent_tier_hits_total", tier="device")
            self.queue.discard(name)
            return self._view(name)
        task = self.inflight.get(name)
        if task is None:
            task = asyncio.create_task(self._load(spec, _by))
            self.inflight[name] = task
            task.add_done_callback(lambda _t, n=name: self._load_done(n))
        self.queue.discard(name)
        await asyncio.shield(task)
        return self._view(name)

    def _give_up_without_room(self, spec: Adapter) -> None:
        """A ``room_only`` prefetch finds the device without free room: given up, nothing
        evicted for it (``ace_agent_prefetch_cancelled_total{reason="no_room"}``)."""
        if not self.holdings.has_free_room(spec):
            self.metrics.inc("ace_agent_prefetch_cancelled_total", reason="no_room")
            raise PrefetchGivenUp(f"prefetch of {spec.name}: loads only into free room, and there is none")

    def _load_done(self, name: str) -> None:
        self.inflight.pop(name, None)
        self._publish(name)

    def _count_start_tier(self, start_tier: Tier) -> None:
        self.metrics.inc("ace_agent_tier_misses_total", tier="device")
        if start_tier is Tier.HOST:
            self.metrics.inc("ace_agent_tier_hits_total", tier="host")
        else:
            self.metrics.inc("ace_agent_tier_misses_total", tier="host")
            self.metrics.inc("ace_agent_tier_hits_total" if start_tier is Tier.DISK else "ace_agent_tier_misses_total", tier="disk")
            if start_tier is Tier.REMOTE:
                self.metrics.inc("ace_agent_tier_hits_total", tier="remote")

    async def _load(self, spec: Adapter, by: str) -> None:
        name = spec.name
        state = self.states[name]
        hints, state.pending_evict = state.pending_evict, ()
        priced, state.priced = state.priced and by == "prefetch", False
        room_only, state.room_only = state.room_only and by == "prefetch", False
        t0 = time.perf_counter()
        start_tier = self._view(name).tier
        self._count_start_tier(start_tier)
        self._publish(name)
        try:
            if room_only:
                self._give_up_without_room(spec)  # before its files are fetched, too
            was_local = self.store.has_local(spec)
            # the download and its hashing run on this event loop: with an engine in this
            # process (builtin), a prefetch's waits for its requests and compute first
            if (by not in ("request", "pin") and not was_local and self.connector.loads_on_demand
                    and await self.connector.prefetch_turn()):
                self.metrics.inc("ace_agent_prefetch_preemptions_total", stage="agent_fetch")
            t = time.perf_counter()
            path, fetched = await self.store.ensure_local(spec, self.protected_digests())
            if not was_local:  # fetched from remote, or a local source hashed the first time
                stage = "fetch" if fetched else "verify"
                self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage=stage)
            if fetched:
                self._publish(name)
            if self.holdings.host_budget > 0 and name not in self.holdings.host:
                t = time.perf_counter()
                blob = await asyncio.to_thread((path / WEIGHTS).read_bytes)
                self.holdings.admit_host(name, blob)
                self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage="read")
            # a prefetch waits for requests' loads (the agent's, then the engine's own)
            # before it takes the device lock, so it never holds the lock while it waits
            # (a pin is an operator's explicit load: it goes as a request's does)
            if by not in ("request", "pin"):
                waited = await self.demand.wait_clear(name)
                waited = await self.connector.prefetch_turn() or waited
                if waited:
                    self.metrics.inc("ace_agent_prefetch_preemptions_total", stage="agent")
            demand = by in ("request", "pin") or name in self.demand  # or a request joined it
            async with self.holdings.lock:
                if name not in self.holdings.device:
                    if room_only and name not in self.demand:
                        self._give_up_without_room(spec)
                    await self.holdings.make_device_room(spec, hints, bet=priced and name not in self.demand)
                    t = time.perf_counter()
                    pinned = state.pinned
                    await self.connector.load(spec, path, pinned=pinned, demand=demand)
                    if state.pinned != pinned:  # (un)pinned while it loaded
                        try:
                            self.connector.set_pinned(name, state.pinned)
                        except AgentError as exc:
                            log.warning("could not (un)pin %s after its load: %s", name, exc)
                    self.metrics.observe("ace_agent_load_seconds", time.perf_counter() - t, stage="device")
                    if self.connector.self_managed:
                        # what the engine's pool let go for this load leaves the view before
                        # the load enters it: a view that showed both (until the next
                        # reconcile) held one adapter more than the pool can, and the
                        # gateway, which learns a pool's size from the most it saw at once,
                        # modelled 6 slots for a pool of 5 and sent bets naming no victim
                        await self.holdings.mirror_engine_device()
                    self.holdings.device[name] = spec.size_bytes
                    self.holdings.engine_up = True
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
        state.cold_load_ms = elapsed_ms
        if spec.size_bytes > 0 and elapsed_ms > 0:
            self.link_bytes_per_ms += 0.2 * (spec.size_bytes / elapsed_ms - self.link_bytes_per_ms)
        state.loaded_by = by
        state.engine_loaded_at = None
        self.metrics.observe("ace_agent_load_seconds", elapsed_ms / 1000.0, stage="cold")
        log.info("adapter %s resident on device in %.1f ms (from %s)", name, elapsed_ms, start_tier.value)
