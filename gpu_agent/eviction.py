"""Pluggable eviction policies for :class:`gpu_agent.pool.AdapterPool`, and the
caller's eviction hints for the agent's device tier.

A policy only orders candidates; the pool decides who may go (never an adapter that is
pinned or in use by a running batch) and stops as soon as enough pages are free. That
split keeps policies pure and testable with plain access sequences. ``hinted_victims``
is the same split for a Prefetch's ``evict`` list: it only says which named adapters
may go, in the caller's order; the residency manager evicts them while room is needed.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Container, Iterable, Iterator, Protocol

__all__ = ["EvictionPolicy", "LRUPolicy", "FIFOPolicy", "make_policy", "hinted_victims"]


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
