"""Placement and prefetch policies: pure decisions over snapshots, shared with the simulator.

- ``routing.choose_endpoint``: which engine host serves a request for an adapter.
- ``prediction.TransitionModel`` / ``should_speculate``: which adapter a session needs next,
  and whether bringing it in is worth what it evicts.
- ``warmset.warm_set``: the most popular adapters per host at start-up.
- ``cache.AdapterCache``: the demand/prefetch cache model (LRU) used by both the gateway's
  bookkeeping and ``bench.sim`` so there is one implementation.

Plain Python only: the gateway does not install numpy or torch.
"""

from extproc.policy.cache import AdapterCache, CacheStats, Entry
from extproc.policy.prediction import (
    DecayedPopularity,
    PredictionLedger,
    TransitionModel,
    should_speculate,
)
from extproc.policy.routing import RoutingDecision, choose_endpoint
from extproc.policy.warmset import warm_set

__all__ = [
    "AdapterCache",
    "CacheStats",
    "DecayedPopularity",
    "Entry",
    "PredictionLedger",
    "RoutingDecision",
    "TransitionModel",
    "choose_endpoint",
    "should_speculate",
    "warm_set",
]
