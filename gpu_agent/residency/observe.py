"""What observers see of the residency manager: a stream of changes per subscriber
(``AdapterView`` for an adapter, ``LoadChange`` for the engine's load, None when the
manager closes), and the gauges and engine counters read at every /metrics scrape.
"""
from __future__ import annotations

import asyncio

from gpu_agent.artifacts import ArtifactStore
from gpu_agent.connectors.base import EngineConnector, EngineLoad
from gpu_agent.load import LoadChange
from gpu_agent.metrics import AgentMetrics, Gauge
from gpu_agent.residency.holdings import TierHoldings
from gpu_agent.residency.records import AdapterView

__all__ = ["ChangeStream", "Subscription", "collect_engine_counters", "residency_gauges"]


class Subscription:
    """An observer's queue of changes (`AdapterView`, `LoadChange`; None when the manager
    closes); closed (and ends) when it falls too far behind."""

    def __init__(self, stream: "ChangeStream", maxsize: int):
        self._stream = stream
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
        self._stream.unsubscribe(self)

    def __aiter__(self):
        return self

    async def __anext__(self) -> AdapterView | LoadChange | None:
        if self.overflowed and self.queue.empty():
            raise StopAsyncIteration
        return await self.queue.get()


class ChangeStream:
    """The subscribers, and the one way a change reaches them."""

    def __init__(self) -> None:
        self._subs: set[Subscription] = set()

    def subscribe(self, maxsize: int) -> Subscription:
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        self._subs.discard(sub)

    def push(self, change: AdapterView | LoadChange) -> None:
        for sub in list(self._subs):
            sub.push(change)

    def end(self) -> None:
        """The manager closes: every subscriber's stream ends with None."""
        for sub in list(self._subs):
            sub.push(None)  # type: ignore[arg-type]


def collect_engine_counters(connector: EngineConnector, metrics: AgentMetrics) -> None:
    """The engine's own load-order counters (builtin), copied in at every scrape."""
    stats = connector.load_order_stats()
    for stage, n in stats.get("preemptions", {}).items():
        metrics.set_counter("ace_agent_prefetch_preemptions_total", n, stage=stage)
    for reason, n in stats.get("cancelled", {}).items():
        metrics.set_counter("ace_agent_prefetch_cancelled_total", n, reason=reason)
    for outcome, n in stats.get("compute_waits", {}).items():
        metrics.set_counter("ace_agent_prefetch_compute_waits_total", n, outcome=outcome)
    if "node_waits" in stats:
        metrics.set_counter("ace_agent_prefetch_node_waits_total", stats["node_waits"])


def residency_gauges(holdings: TierHoldings, store: ArtifactStore, connector: EngineConnector,
                     queue_depth: int, load: EngineLoad | None) -> list[Gauge]:
    """The tiers, the prefetch queue and the engine, as gauges."""
    adapters, size = "Adapters resident per tier.", "Adapter bytes resident per tier."
    out: list[Gauge] = [
        ("ace_agent_tier_adapters", adapters, {"tier": "device"}, len(holdings.device)),
        ("ace_agent_tier_adapters", adapters, {"tier": "host"}, len(holdings.host)),
        ("ace_agent_tier_bytes", size, {"tier": "device"}, sum(holdings.device.values())),
        ("ace_agent_tier_bytes", size, {"tier": "host"}, sum(len(b) for b in holdings.host.values())),
        ("ace_agent_tier_bytes", size, {"tier": "disk"}, store.cache.used_bytes),
        ("ace_agent_prefetch_queue_depth", "Prefetches waiting for a worker.", {}, queue_depth),
        ("ace_agent_engine_up", "1 when the engine answered the last reconcile.", {},
         1.0 if holdings.engine_up else 0.0),
    ]
    if load is not None:
        out.append(("ace_agent_engine_requests_running", "The engine's running requests, as last measured.",
                    {}, float(load.running)))
        out.append(("ace_agent_engine_requests_waiting", "The engine's waiting requests, as last measured.",
                    {}, float(load.waiting)))
    for key, value in connector.pool_stats().items():
        out.append((f"ace_agent_pool_{key}", "The engine's adapter pool (builtin paged pool).", {}, float(value)))
    return out
