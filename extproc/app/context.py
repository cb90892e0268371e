"""What every exchange shares: the ``Gateway`` context (state, residency, the prefetch
sink, the routing policy, the counts). ``Gateway.exchange()`` opens one request's
``extproc.app.exchange.Exchange``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from extproc.app.exchange import Exchange
from extproc.domain.prefetch import NullPrefetchSink, PrefetchSink
from extproc.observe.metrics import GatewayMetrics
from extproc.observe.usage import UsageRing
from extproc.policy.routing import RoutePolicy, choose_upstream
from extproc.state.residency import ResidencyBoard
from extproc.state.store import Store

if TYPE_CHECKING:
    from extproc.fleet.speculation import RequestObserver

__all__ = ["Gateway"]


class Gateway:
    """What every exchange shares: state, residency, the prefetch sink, the routing policy,
    the request counts (``metrics``, read by /metrics)."""

    def __init__(self, store: Store, residency: ResidencyBoard | None = None,
                 prefetch: PrefetchSink | None = None, route: RoutePolicy = choose_upstream,
                 speculation: "RequestObserver | None" = None,
                 metrics: GatewayMetrics | None = None, shed_load: int = 0,
                 epp_fallbacks: int = 0) -> None:
        self.store = store
        self.residency = residency or ResidencyBoard()
        self.prefetch = prefetch or NullPrefetchSink()
        self.route = route
        self.speculation = speculation  # extproc.fleet.speculation.GatewaySpeculation: one append per request
        self.metrics = metrics or GatewayMetrics()
        self.shed_load = shed_load      # endpoint picker protocol: 429 when every host carries this many (0: never)
        self.epp_fallbacks = epp_fallbacks   # endpoint picker protocol: fallback hosts after the pick
        self.usage = UsageRing()        # the settings page's last hour per (tenant, adapter)

    def exchange(self, route: RoutePolicy | None = None) -> Exchange:
        """``route``: this request's routing policy when not the gateway's (the endpoint
        picker protocol narrows the hosts to the gateway's subset hint, extproc.protocols.epp)."""
        return Exchange(self, route)
