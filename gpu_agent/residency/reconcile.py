"""The reconcile: the device tier aligned with what the engine says it holds.

Every ``reconcile_interval_s`` the engine is asked what it holds. Adapters that vanished
(an engine restart) drop to their lower tier, are announced, and are loaded again (pinned
first, then most recently used first); adapters the engine loaded itself are adopted, at
the most recently used end, and are nobody's victim for ``adopt_grace_s``. On an engine the
agent drives but does not serve requests through (vLLM), the reconcile also moves what the
engine runs or queues now (``busy``) to the most recently used end: without it the tier's
order would be the order of loads, not of use. An
engine that stops answering is announced as down (``engine_up``), and again when it is back.

An engine that tells of its own loads and evictions as they happen
(``EngineConnector.watch_device``: the builtin pool, whose LRU evicts for the requests'
loads it makes itself) has each changed name aligned at once (``follow``), by the same
rules; the interval then only catches what no event told. Before, the agent learned of
those loads and evictions up to one ``reconcile_interval_s`` late, and the gateway's model
of the pool, synced from the agent's view, dropped adapters the engine had just loaded and
named victims it had already let go (docs/bench-history.md, 2026-12-05).
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Mapping

from ace_common.tiers import Tier
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineUnavailable
from gpu_agent.eviction import EvictReason
from gpu_agent.metrics import AgentMetrics
from gpu_agent.residency.holdings import TierHoldings
from gpu_agent.residency.records import AdapterState, ResidencyResult

__all__ = ["Reconciler"]

log = logging.getLogger(__name__)


class Reconciler:
    """``loading``: the loads in flight (never dropped: their load sets the tier).
    ``reload``: queues a prefetch (name, priority, reason) of an adapter the engine lost."""

    def __init__(self, states: Mapping[str, AdapterState], connector: EngineConnector, holdings: TierHoldings,
                 loading: Mapping[str, object], *, metrics: AgentMetrics, publish: Callable[[str], None],
                 reload: Callable[..., ResidencyResult], clock: Callable[[], float] = time.monotonic):
        self._states = states
        self.clock = clock
        self.connector = connector
        self.holdings = holdings
        self._loading = loading
        self.metrics = metrics
        self._publish = publish
        self._reload = reload
        self._changed: set[str] = set()  # names an event said changed, not aligned yet
        self._following: asyncio.Future | None = None
        self._closed = False

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("reconcile failed: %s", exc)

    def publish_all(self) -> None:
        for name in self._states:
            self._publish(name)

    async def reconcile(self) -> None:
        """Align the device tier with what the engine holds; rebuild after a restart."""
        await self._align(None)

    def follow(self, name: str) -> None:
        """The engine's device tier gained or lost ``name`` (``EngineConnector.watch_device``,
        called on the event loop): align that name now rather than at the next interval.
        Names that change while an alignment waits for the device lock go together next."""
        if self._closed:
            return
        self._changed.add(name)
        if self._following is None or self._following.done():
            self._following = asyncio.ensure_future(self._follow())

    async def _follow(self) -> None:
        while self._changed:
            names, self._changed = self._changed, set()
            try:
                await self._align(names)
            except Exception as exc:  # noqa: BLE001 - the next event, or the interval, retries
                log.warning("aligning %s with the engine failed: %s", ", ".join(sorted(names)), exc)

    async def close(self) -> None:
        self._closed = True
        task, self._following = self._following, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _dropped_by_engine(self, lost: list[str]) -> tuple[list[str], list[str]]:
        """(dropped, reset) of the adapters missing from the device tier of an engine that
        keeps names registered (``keeps_registered``): still registered, its cache dropped
        their weights by itself (its own read into a full cache), which is a tier lost;
        the others the engine forgot, which is a reset. A dropped name whose files the
        agent's disk tier may delete is unregistered now (``keeps_name``)."""
        registered = await self.connector.registered()
        dropped = [n for n in lost if n in registered]
        for name in dropped:
            if not self.connector.keeps_name(name):
                try:
                    await self.connector.unload(name)
                except ConnectorError as exc:
                    log.warning("unregistering %s, whose weights vLLM dropped, failed: %s", name, exc)
        return dropped, [n for n in lost if n not in registered]

    async def _align(self, names: set[str] | None) -> None:
        """``names`` None: every adapter (the interval); else only those (an event)."""
        holdings, device = self.holdings, self.holdings.device
        async with holdings.lock:
            try:
                loaded = await self.connector.loaded()
            except EngineUnavailable as exc:
                if holdings.engine_up:
                    log.warning("engine unavailable: %s", exc)
                    holdings.engine_up = False
                    self.publish_all()
                return
            was_up, holdings.engine_up = holdings.engine_up, True
            lost = [n for n in device
                    if n not in loaded and n not in self._loading and (names is None or n in names)]
            dropped: list[str] = []
            if lost and self.connector.keeps_registered:  # unreadable: nothing changes until the next try
                dropped, lost = await self._dropped_by_engine(lost)
            for name in (*dropped, *lost):
                device.pop(name, None)
                self._publish(name)
            adopted = sorted(n for n in (loaded if names is None else loaded & names)
                             if n in self._states and n not in device)
            for name in adopted:  # the engine loaded it itself (on demand), or a previous agent run
                # the engine loaded it for a request that is running or waiting now: the most
                # recently used end. At the LRU end the shrink below unloaded it again under that
                # request, and vLLM's engine died of it (docs/engine.md, "Unloading an adapter
                # a queued request uses kills vLLM 0.32's engine")
                device[name] = self._states[name].spec.size_bytes
                self._states[name].loaded_by = "engine"
                self._states[name].engine_loaded_at = self.clock()
                self._publish(name)
            if not self.connector.self_managed and names is None:
                # the agent sees no request on an engine it does not serve (vLLM): what the
                # engine runs or queues now is its most recently used (its LoRA gauge)
                busy = await self.connector.busy()
                holdings.used(busy)
                for name in sorted(busy):
                    if name in device:
                        device.move_to_end(name)
                await holdings.shrink_device(busy)  # adopted now, or adopted earlier and out of their grace
            if not was_up:
                self.publish_all()
        for name in dropped:  # published above
            holdings.evicted(name, Tier.DEVICE, EvictReason.ENGINE_GONE, publish=False)
        if lost and self.connector.self_managed:
            for name in lost:  # published above
                holdings.evicted(name, Tier.DEVICE, EvictReason.ENGINE_GONE, publish=False)
        elif lost:
            self.metrics.inc("ace_agent_engine_resets_total")
            log.warning("engine lost %d adapters (%s); reloading them", len(lost), ", ".join(lost))
            # pinned first, then most recently used first
            recency = {n: i for i, n in enumerate(lost)}  # device order: LRU first
            lost.sort(key=lambda n: (not self._states[n].pinned, -recency[n]))
            for rank, name in enumerate(lost):
                self._reload(name, priority=(1 << 20) - rank, reason="engine_restart")
