"""Where each catalog adapter lives, and the background work that moves it up or down:
the residency manager, which wires its parts together and answers the agent's API.

Tiers, best first: device (the engine holds it) > host (its bytes in the agent's
memory) > disk (a verified local copy) > remote (only at its URL); `absent` = not in the
catalog. The parts, one job each (docs/agent.md):

- ``records``: what an operation did, what observers see, the budgets;
- ``holdings``: what the device and host tiers hold, their budgets and evictions;
- ``queue``: the prefetch queue, and the requests' loads that go before it;
- ``pipeline``: one adapter's load through the tiers, and the workers;
- ``admission``: whether a prefetch is taken (the speculation budget's inputs:
  ``prefetch_budget`` decides);
- ``reconcile``: the device tier aligned with what the engine holds;
- ``operations``: the operator's evict, pin and unpin;
- ``observe``: the change stream and the gauges.

Observers subscribe to a stream of `AdapterView` changes, interleaved with the engine's
load (`LoadChange`, measured by `gpu_agent.load.LoadMonitor` every `load_interval_s`).
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable, Iterable

from ace_common.tiers import Tier
from gpu_agent.artifacts import ArtifactStore, Catalog
from gpu_agent.connectors.base import EngineConnector, EngineLoad
from gpu_agent.load import LoadChange, LoadMonitor
from gpu_agent.metrics import AgentMetrics, Gauge
from gpu_agent.residency.admission import PrefetchAdmission
from gpu_agent.residency.holdings import TierHoldings
from gpu_agent.residency.observe import ChangeStream, Subscription, collect_engine_counters, residency_gauges
from gpu_agent.residency.operations import OperatorActions
from gpu_agent.residency.pipeline import LoadPipeline
from gpu_agent.residency.queue import PrefetchQueue
from gpu_agent.residency.reconcile import Reconciler
from gpu_agent.residency.records import (AdapterState, AdapterView, ResidencyBudgets, ResidencyOutcome,
                                         ResidencyResult)
from gpu_agent.settings import SettingsError

__all__ = ["AdapterView", "ResidencyOutcome", "ResidencyResult", "ResidencyManager",
           "ResidencyBudgets", "Subscription"]


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
        # what the residency stream announces as the pool's size (ResidencyEvent.device_slots):
        # the count the agent holds the engine's cache to; 0 where the engine sizes its own
        # pool (builtin: bytes, so the count varies with ranks)
        self.device_slots = 0 if connector.self_managed else (self.device_count or 0)
        self.version = 0
        self.base_model_bytes = _weights_bytes(catalog.base_model_path)
        states = {spec.name: AdapterState(spec) for spec in catalog}
        self._states = states
        inflight: dict[str, asyncio.Task] = {}
        self._changes = ChangeStream()
        self._tasks: list[asyncio.Task] = []
        self.holdings = TierHoldings(states, inflight, connector, device_count=self.device_count,
                                     device_bytes=budgets.device_bytes, host_bytes=budgets.host_bytes,
                                     metrics=self.metrics, publish=self._publish,
                                     adopt_grace_s=budgets.adopt_grace_s, clock=clock)
        self.queue = PrefetchQueue()
        self.pipeline = LoadPipeline(catalog, states, store, connector, self.holdings, self.queue, inflight,
                                     metrics=self.metrics, publish=self._publish, view=self.view)
        self.admission = PrefetchAdmission(self.pipeline, queue_size=budgets.queue_size,
                                           link_budget_ms=budgets.link_budget_ms, metrics=self.metrics,
                                           publish=self._publish, waste_share=budgets.waste_share)
        self.reconciler = Reconciler(states, connector, self.holdings, inflight, metrics=self.metrics,
                                     publish=self._publish, reload=self.admission.prefetch, clock=clock)
        self.operations = OperatorActions(catalog, states, store, connector, self.holdings, inflight,
                                          publish=self._publish, load=self.admission.prefetch)
        self.load_monitor = LoadMonitor(connector, budgets.load_interval_s, self._publish_load,
                                        on_failure=lambda: self.metrics.inc("ace_agent_load_read_failures_total"))
        self.metrics.add_gauges(self._gauges)
        self.metrics.add_collector(lambda: collect_engine_counters(connector, self.metrics))
        # every disk-cache eviction (the engine's own fetches included) spares what we protect
        store.protect_with(self.pipeline.protected_digests)
        store.on_eviction(lambda spec, reason: self.holdings.evicted(spec.name, Tier.DISK, reason))

    @property
    def prefetch_waste_share(self) -> float:
        """The share of a wasted bet's load time the speculation budget charges it, as the
        residency stream announces it (``ResidencyEvent.prefetch_waste_share``): the
        gateway prices its bets with it."""
        return self.admission.waste_share

    @property
    def request_signals_redundant(self) -> bool:
        """Whether the engine brings a request's adapter itself, files included, so the
        gateway need not signal a request's own load (``ResidencyEvent.
        request_signals_redundant``; ``EngineConnector.request_signals_redundant``)."""
        return self.connector.request_signals_redundant

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> None:
        await self.connector.start()
        self.connector.watch_device(self.reconciler.follow)
        await self.reconcile()
        for _ in range(max(1, self.budgets.workers)):
            self._tasks.append(asyncio.create_task(self.pipeline.work_off_queue()))
        if self.budgets.reconcile_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.reconciler.run(self.budgets.reconcile_interval_s)))
        if self.budgets.load_interval_s > 0:
            self._tasks.append(asyncio.create_task(self.load_monitor.run()))

    async def close(self) -> None:
        inflight = list(self.pipeline.inflight.values())
        for task in self._tasks + inflight:
            task.cancel()
        await asyncio.gather(*self._tasks, *inflight, return_exceptions=True)
        self._tasks.clear()
        await self.pipeline.close_ahead()
        await self.reconciler.close()
        self._changes.end()
        await self.connector.close()
        await self.store.aclose()

    # ---- reads -----------------------------------------------------------------------
    @property
    def engine_up(self) -> bool:
        """Whether the engine answered the last reconcile (or load)."""
        return self.holdings.engine_up

    def view(self, name: str) -> AdapterView:
        state = self._states.get(name) if self.catalog.get(name) else None
        if state is None:
            return AdapterView(name=name, tier=Tier.ABSENT)
        spec = state.spec
        if name in self.holdings.device:
            tier = Tier.DEVICE
        elif name in self.holdings.host or self.connector.in_host(name):
            tier = Tier.HOST
        elif self.store.has_local(spec) or not spec.is_remote:
            tier = Tier.DISK
        else:
            tier = Tier.REMOTE
        return AdapterView(name=name, tier=tier, cold_load_ms=state.cold_load_ms,
                           bytes=spec.size_bytes, pinned=state.pinned, digest=spec.sha256,
                           loading=name in self.pipeline.inflight or name in self.queue,
                           loaded_by=state.loaded_by if tier is Tier.DEVICE else "")

    def snapshot(self) -> list[AdapterView]:
        return [self.view(name) for name in self._states]

    def subscribe(self, maxsize: int = 1024) -> Subscription:
        return self._changes.subscribe(maxsize)

    @property
    def engine_load(self) -> EngineLoad | None:
        """The engine's load as last measured (None = unknown)."""
        return self.load_monitor.current

    def host_bytes(self, name: str) -> bytes | None:
        return self.holdings.host_bytes(name)

    def _publish_load(self, load: EngineLoad | None) -> None:
        self._changes.push(LoadChange(load))

    def _publish(self, name: str) -> None:
        self.version += 1
        self._changes.push(self.view(name))

    def _gauges(self) -> list[Gauge]:
        return residency_gauges(self.holdings, self.store, self.connector, len(self.queue), self.engine_load)

    # ---- the API: loads --------------------------------------------------------------
    def prefetch(self, name: str, digest: str = "", priority: int = 0, reason: str = "",
                 evict: Iterable[str] = (), *, probability: float | None = None,
                 victim_reuse_probability: float | None = None, keep: Iterable[str] = (),
                 room_only: bool = False) -> ResidencyResult:
        """Decide at once; the load itself runs in the background
        (``gpu_agent.residency.admission``)."""
        return self.admission.prefetch(name, digest, priority, reason, evict, probability=probability,
                                       victim_reuse_probability=victim_reuse_probability, keep=keep,
                                       room_only=room_only)

    async def ensure_resident(self, name: str, _by: str = "request") -> AdapterView:
        """Load `name` to the device tier (coalesced with any load already running).
        Called directly, it is a request's load: it goes before queued prefetches."""
        return await self.pipeline.ensure_resident(name, _by)

    async def reconcile(self) -> None:
        """Align the device tier with what the engine holds; rebuild after a restart."""
        await self.reconciler.reconcile()

    # ---- the API: the operator's actions -------------------------------------------
    async def evict(self, name: str, down_to: Tier = Tier.DISK) -> ResidencyResult:
        """Drop `name` from every tier above `down_to`; pinned adapters are refused."""
        return await self.operations.evict(name, down_to)

    def pin(self, name: str) -> ResidencyResult:
        """Never evict `name`; it is also loaded (at top priority) if it is not resident."""
        return self.operations.pin(name)

    def unpin(self, name: str) -> ResidencyResult:
        return self.operations.unpin(name)


def _weights_bytes(model_dir: Path | None) -> int:
    """Bytes of a checkpoint's weight files (0 when unknown)."""
    if model_dir is None or not Path(model_dir).is_dir():
        return 0
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin")
               for p in Path(model_dir).glob(pattern))
