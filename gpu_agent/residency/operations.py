"""The operator's actions on one adapter: evict it down to a tier, pin it, unpin it.

A pinned adapter is never evicted, and it is loaded (at top priority) if it is not
resident; an engine that evicts by itself (the builtin pool) is told too. Refusals are
outcomes (``rejected``: unknown_adapter, pinned, loading, busy, not_resident).
"""
from __future__ import annotations

from typing import Callable, Mapping

from ace_common.tiers import Tier
from gpu_agent.artifacts import ArtifactStore, Catalog
from gpu_agent.connectors.base import EngineConnector
from gpu_agent.errors import AgentError
from gpu_agent.eviction import EvictReason
from gpu_agent.residency.holdings import TierHoldings
from gpu_agent.residency.records import DONE, AdapterState, ResidencyResult, rejected

__all__ = ["OperatorActions"]


class OperatorActions:
    """``loading``: the loads in flight (an adapter being loaded is not evicted).
    ``load``: queues a prefetch (name, priority, reason), the load of a pinned adapter."""

    def __init__(self, catalog: Catalog, states: Mapping[str, AdapterState], store: ArtifactStore,
                 connector: EngineConnector, holdings: TierHoldings, loading: Mapping[str, object], *,
                 publish: Callable[[str], None], load: Callable[..., ResidencyResult]):
        self.catalog = catalog
        self._states = states
        self.store = store
        self.connector = connector
        self.holdings = holdings
        self._loading = loading
        self._publish = publish
        self._load = load

    async def evict(self, name: str, down_to: Tier = Tier.DISK) -> ResidencyResult:
        """Drop `name` from every tier above `down_to`. Pinned adapters are refused.
        Raises only when the engine fails the unload (ConnectorError)."""
        spec = self.catalog.get(name)
        if spec is None:
            return rejected("unknown_adapter")
        state = self._states[name]
        if state.pinned:
            return rejected("pinned")
        if name in self._loading:
            return rejected("loading")
        holdings = self.holdings
        evicted = False
        async with holdings.lock:
            if name in holdings.device:
                if name in await self.connector.busy():
                    return rejected("busy")
                await holdings.unload(name, EvictReason.OPERATOR, publish=False)
                evicted = True
        if down_to in (Tier.DISK, Tier.REMOTE) and holdings.host.pop(name, None) is not None:
            holdings.evicted(name, Tier.HOST, EvictReason.OPERATOR, publish=False)
            evicted = True
        if down_to is Tier.REMOTE and self.store.forget_local(spec):
            holdings.evicted(name, Tier.DISK, EvictReason.OPERATOR, publish=False)
            evicted = True
        self._publish(name)
        return DONE if evicted else rejected("not_resident")

    def pin(self, name: str) -> ResidencyResult:
        """Never evict `name`; it is also loaded (at top priority) if it is not resident."""
        if self.catalog.get(name) is None:
            return rejected("unknown_adapter")
        self._states[name].pinned = True
        device = self.holdings.device
        if name in device:
            try:  # an engine that evicts by itself must know too (builtin pool)
                self.connector.set_pinned(name, True)
            except AgentError:  # it left the engine meanwhile: load (and pin) it again
                device.pop(name, None)
        if name not in device:
            result = self._load(name, priority=1 << 30, reason="pin")
            if not result.ok:
                self._states[name].pinned = False
                return result
        self._publish(name)
        return DONE

    def unpin(self, name: str) -> ResidencyResult:
        if self.catalog.get(name) is None:
            return rejected("unknown_adapter")
        self._states[name].pinned = False
        if name in self.holdings.device:
            try:
                self.connector.set_pinned(name, False)
            except AgentError:
                pass  # not resident any more: nothing to unpin
        self._publish(name)
        return DONE
