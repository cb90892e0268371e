"""Where each adapter lives on each upstream, as last reported by the agents.

Immutable: a background task builds a new ``ResidencySnapshot`` and swaps the reference
(``ResidencyBoard.publish``); a request reads ``ResidencyBoard.current`` once. Unknown is
a value (``UNKNOWN``), so the trace can say ``unknown`` instead of inventing a number.

``loads``: each upstream's engine load (running + waiting requests) as its agent last
measured it, only while fresh; an upstream missing there has an unknown load.
``sent_since``: for those same upstreams, the requests this gateway routed there since
that measurement arrived. The one live part of a snapshot: a view over the board's
``SentCounter`` (which the request path bumps) minus the counter's value when the
measurement arrived, so it moves between snapshots without a new one being built.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Iterator, Mapping

__all__ = ["TierReport", "ResidencySnapshot", "ResidencyBoard", "SentCounter", "SentSince",
           "UNKNOWN", "TIERS"]

TIERS = ("pool", "host", "disk", "remote", "none")


@dataclass(frozen=True, slots=True)
class TierReport:
    tier: str                      # pool | host | disk | remote | none | unknown
    cold_load_ms: float | None     # measured time to load from where it is; None = unknown
    bytes: int | None = None
    prefetched: bool = False       # in the pool because a prefetch put it there (agent's loaded_by)
    base_model_bytes: int | None = None  # the upstream's base weights: what a dedicated instance repeats

    @property
    def known(self) -> bool:
        return self.tier != "unknown"


UNKNOWN = TierReport(tier="unknown", cold_load_ms=None, bytes=None)


class SentCounter:
    """Requests this gateway routed to each upstream since it started.

    ``record`` is one ``next()`` on the upstream's ``itertools.count``: a single C call,
    atomic under the GIL, so concurrent request threads (``--server threads``) lose no
    count and take no lock. ``value`` reads the count back exactly from the counter's repr
    (``count(n)``: n calls so far) instead of keeping a second, racy "last value" field.
    """

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[str, Iterator[int]] = {}

    def record(self, upstream: str) -> None:
        count = self._counts.get(upstream)
        if count is None:  # first request there; setdefault keeps one counter if two race
            count = self._counts.setdefault(upstream, itertools.count())
        next(count)

    def value(self, upstream: str) -> int:
        count = self._counts.get(upstream)
        return 0 if count is None else int(repr(count)[6:-1])


class SentSince(Mapping[str, int]):
    """upstream -> requests routed there since ``base[upstream]`` (the counter's value when
    the upstream's load measurement arrived); only the upstreams in ``base``."""

    __slots__ = ("counter", "base")

    def __init__(self, counter: SentCounter, base: Mapping[str, int]) -> None:
        self.counter, self.base = counter, base

    def __getitem__(self, upstream: str) -> int:
        return self.counter.value(upstream) - self.base[upstream]

    def get(self, upstream: str, default: int = 0) -> int:  # type: ignore[override]
        base = self.base.get(upstream)  # (the Mapping mixin's try/except costs more here)
        return default if base is None else self.counter.value(upstream) - base

    def __iter__(self) -> Iterator[str]:
        return iter(self.base)

    def __len__(self) -> int:
        return len(self.base)


@dataclass(frozen=True, slots=True)
class ResidencySnapshot:
    by_upstream: Mapping[str, Mapping[str, TierReport]] = field(
        default_factory=lambda: MappingProxyType({}))
    loads: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    sent_since: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))

    def of(self, upstream: str, adapter: str) -> TierReport:
        return self.by_upstream.get(upstream, {}).get(adapter, UNKNOWN)

    @classmethod
    def build(cls, table: Mapping[str, Mapping[str, TierReport]],
              loads: Mapping[str, int] | None = None,
              sent_since: Mapping[str, int] | None = None) -> "ResidencySnapshot":
        return cls(MappingProxyType({u: MappingProxyType(dict(a)) for u, a in table.items()}),
                   MappingProxyType(dict(loads or {})), MappingProxyType(dict(sent_since or {})))


EMPTY = ResidencySnapshot()


class ResidencyBoard:
    """Holds the current snapshot; one reference swap per update, no locks on read.

    ``sent``: the requests the gateway routed to each upstream (``record`` on the request
    path); the publisher bases each snapshot's ``sent_since`` on it. ``published_at``: when
    ``current`` was published (``time.monotonic``), for its age on /metrics."""

    def __init__(self, initial: ResidencySnapshot = EMPTY) -> None:
        self.current = initial
        self.sent = SentCounter()
        self.published_at = time.monotonic()

    def publish(self, snapshot: ResidencySnapshot) -> None:
        self.current = snapshot
        self.published_at = time.monotonic()
