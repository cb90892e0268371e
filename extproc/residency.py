"""Where each adapter lives on each upstream, as last reported by the agents.

Immutable: a background task builds a new ``ResidencySnapshot`` and swaps the reference
(``ResidencyBoard.publish``); a request reads ``ResidencyBoard.current`` once. Unknown is
a value (``UNKNOWN``), so the trace can say ``unknown`` instead of inventing a number.

``loads``: each upstream's engine load (running + waiting requests) as its agent last
measured it, only while fresh; an upstream missing there has an unknown load.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["AdapterResidency", "ResidencySnapshot", "ResidencyBoard", "UNKNOWN", "TIERS"]

TIERS = ("pool", "host", "disk", "remote", "none")


@dataclass(frozen=True, slots=True)
class AdapterResidency:
    tier: str                      # pool | host | disk | remote | none | unknown
    cold_load_ms: float | None     # measured time to load from where it is; None = unknown
    bytes: int | None = None
    prefetched: bool = False       # in the pool because a prefetch put it there (agent's loaded_by)
    base_model_bytes: int | None = None  # the upstream's base weights: what a dedicated instance repeats

    @property
    def known(self) -> bool:
        return self.tier != "unknown"


UNKNOWN = AdapterResidency(tier="unknown", cold_load_ms=None, bytes=None)


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    by_upstream: Mapping[str, Mapping[str, AdapterResidency]] = field(
        default_factory=lambda: MappingProxyType({}))
    loads: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, upstream: str, adapter: str) -> AdapterResidency:
        return self.by_upstream.get(upstream, {}).get(adapter, UNKNOWN)

    @classmethod
    def build(cls, table: Mapping[str, Mapping[str, AdapterResidency]],
              loads: Mapping[str, int] | None = None) -> "ResidencySnapshot":
        return cls(MappingProxyType({u: MappingProxyType(dict(a)) for u, a in table.items()}),
                   MappingProxyType(dict(loads or {})))


EMPTY = ResidencySnapshot()


class ResidencyBoard:
    """Holds the current snapshot; one reference swap per update, no locks on read."""

    def __init__(self, initial: ResidencySnapshot = EMPTY) -> None:
        self.current = initial

    def publish(self, snapshot: ResidencySnapshot) -> None:
        self.current = snapshot
