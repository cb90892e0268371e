"""What leaves a tier, and why: the eviction policy of every tier, as pure functions.

One place decides; the owners of the tiers ask it and carry the plan out:

- the agent's device and host tiers: :class:`gpu_agent.residency.holdings.TierHoldings`;
- the builtin engine's pool and host copies: :class:`gpu_agent.engine.adapters.EngineAdapters`
  (it installs :func:`plan_evictions` as its pool's ``choose_victims``; the pool itself is
  mechanism: it frees the pages of the names it is given, never picks them);
- the host copies of :class:`gpu_agent.engine.staging.HostCache` and the agent's disk cache
  (:class:`gpu_agent.artifacts.DiskCache`).

A policy object (:class:`LRUPolicy`, :class:`FIFOPolicy`) is the record of use that orders
candidates, first to go first; :func:`plan_evictions` takes that order, skips what may not
go (pinned, in use, claimed, being loaded) and stops as soon as the shortfall is met; that
split keeps the decision testable with plain access sequences. :func:`hinted_victims` is
the same split for a Prefetch's ``evict`` list: it only says which named adapters may go,
in the caller's order; the agent's holdings evict them while room is needed.
:func:`hinted_first` puts a request's hinted victims (the gateway's model of the pool:
lowest predicted use first) ahead of the policy order for the load the engine makes
itself when that request arrives (builtin: ``EngineAdapters.prefer_victims``).

Every eviction has a :class:`EvictReason`; the agent counts them in
``ace_agent_evictions_total{tier, reason}``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Container, Iterable, Iterator, Protocol

__all__ = ["EvictReason", "Shortfall", "Candidate", "plan_evictions", "ordered", "EvictionPolicy", "LRUPolicy",
           "FIFOPolicy", "make_policy", "hinted_victims", "hinted_first"]


class EvictReason(str, Enum):
    """Why an adapter left a tier (the ``reason`` label of ``ace_agent_evictions_total``)."""

    BUDGET = "budget"              # the tier's budget needed room for another adapter (policy order)
    HINT = "hint"                  # named by a Prefetch's ``evict`` list (the gateway's choice)
    OPERATOR = "operator"          # an explicit Evict (gRPC) / unload (engine HTTP) call
    ENGINE_GONE = "engine_gone"    # the engine no longer holds it: its own pool (or cache) evicted it
    ENGINE_DROPPED = "engine_dropped"  # registered, but the engine's cache had dropped its weights
    LEFT_DEVICE = "left_device"    # a resident-only disk tier drops what left the device


@dataclass(frozen=True)
class Shortfall:
    """How far a tier is over its budget with the incoming adapter: ``count`` adapters and
    ``size`` units (bytes, or pool pages) too many. Nothing is short at <= 0."""

    count: int = 0
    size: int = 0

    @property
    def met(self) -> bool:
        return self.count <= 0 and self.size <= 0


@dataclass(frozen=True)
class Candidate:
    """A resident adapter as the policy sees it: its size in the shortfall's unit, and
    whether it may go at all (not pinned, in use, claimed by a request, being loaded)."""

    name: str
    size: int = 0
    evictable: bool = True


def plan_evictions(order: Iterable[Candidate], short: Shortfall) -> list[str]:
    """The adapters to evict, first to go first: the evictable candidates in ``order``
    until ``short`` is met. When it never is, every evictable candidate (the caller then
    fails its load, as it would have after evicting them one by one)."""
    count, size = short.count, short.size
    out: list[str] = []
    for cand in order:
        if count <= 0 and size <= 0:
            break
        if not cand.evictable:
            continue
        out.append(cand.name)
        count -= 1
        size -= cand.size
    return out


def ordered(names: Iterable[str], size: Callable[[str], int],
            evictable: Callable[[str], bool] = lambda name: True) -> Iterator[Candidate]:
    """Candidates for :func:`plan_evictions` from names already in policy order."""
    for name in names:
        yield Candidate(name, size(name), evictable(name))


class EvictionPolicy(Protocol):
    """Orders resident adapters for eviction."""

    def on_load(self, name: str) -> None:
        """``name`` became resident."""

    def on_access(self, name: str) -> None:
        """``name`` was used (a batch or a lookup)."""

    def on_remove(self, name: str) -> None:
        """``name`` left the pool."""

    def candidates(self) -> Iterator[str]:
        """Resident adapters, first to evict first."""


class LRUPolicy:
    """Least recently used first (the default, as in SGLang's ``--lora-eviction-policy lru``)."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def on_load(self, name: str) -> None:
        self._order[name] = None
        self._order.move_to_end(name)

    def on_access(self, name: str) -> None:
        if name in self._order:
            self._order.move_to_end(name)

    def on_remove(self, name: str) -> None:
        self._order.pop(name, None)

    def candidates(self) -> Iterator[str]:
        return iter(list(self._order))


class FIFOPolicy(LRUPolicy):
    """First loaded first out; accesses do not refresh."""

    def on_access(self, name: str) -> None:
        pass


_POLICIES = {"lru": LRUPolicy, "fifo": FIFOPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return _POLICIES[name.lower()]()
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(_POLICIES)}") from None


def hinted_victims(hints: Iterable[str], loading: str, *, resident: Container[str],
                   protected: Container[str]) -> list[str]:
    """The hinted adapters that may be evicted to make room for ``loading``, in hint order:
    resident, not ``protected`` (pinned, in use, being loaded), not ``loading`` itself,
    each once. Names that match nothing are dropped (a hint is never an error)."""
    out: list[str] = []
    for name in hints:
        if name == loading or name in out or name not in resident or name in protected:
            continue
        out.append(name)
    return out


def hinted_first(order: Iterable[Candidate], hints: Iterable[str]) -> list[Candidate]:
    """``order`` with the candidates named in ``hints`` moved to the front, in hint order;
    the rest keep the policy order. Names that match no candidate are dropped; a hinted
    candidate that may not go stays not evictable (plan_evictions skips it)."""
    cands = list(order)
    by_name = {c.name: c for c in cands}
    front = [by_name[n] for n in dict.fromkeys(hints) if n in by_name]
    if not front:
        return cands
    chosen = {c.name for c in front}
    return front + [c for c in cands if c.name not in chosen]
