"""The adapter cache model: which adapters a pool holds, since when, and why.

One implementation for two users: the gateway keeps one per engine host to decide what
to prefetch, and ``bench.sim`` replays traces through the very same class. Keys are any
hashable (adapter name, digest, or the simulator's integer ids).

Semantics, per entry: ``ready_at`` is when its load completes (a load in flight is an
entry whose ``ready_at`` lies in the future); ``prefetched`` marks an entry brought in by a
prefetch that no request has used yet; ``score`` / ``scored_at`` are the latest prediction
that it will be needed soon (the one that brought it in, or a later one).
Eviction is least-recently-used, skipping pinned entries. Capacity is in the caller's
unit: slots (vLLM's ``--max-loras``: every adapter takes one slot whatever its rank) or
bytes (a paged pool), through each entry's ``size``.

Access outcomes (``access``):

- ``HIT``: resident and loaded by ``now``.
- ``LATE``: resident but its load is still in flight; the request waits ``ready_at - now``.
- ``MISS``: absent; the caller decides when the load starts and calls ``admit``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable, Iterator, Mapping

HIT = "hit"
LATE = "late"
MISS = "miss"

__all__ = ["AdapterCache", "CacheStats", "Entry", "HIT", "LATE", "MISS"]


class Entry:
    """One cached adapter (mutable, owned by its cache)."""

    __slots__ = ("size", "ready_at", "prefetched", "score", "scored_at", "pinned")

    def __init__(self, size: int, ready_at: float, prefetched: bool, score: float, scored_at: float) -> None:
        self.size = size
        self.ready_at = ready_at
        self.prefetched = prefetched
        self.score = score
        self.scored_at = scored_at
        self.pinned = False

    def __repr__(self) -> str:
        return (
            f"Entry(size={self.size}, ready_at={self.ready_at}, "
            f"prefetched={self.prefetched}, score={self.score}, scored_at={self.scored_at}, "
            f"pinned={self.pinned})"
        )


@dataclass
class CacheStats:
    """Counters; every number is counted, none estimated."""

    hits: int = 0
    late: int = 0
    misses: int = 0
    loads: int = 0
    prefetches: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    prefetch_refused: int = 0  # prefetches withdrawn: the agent refused the load (``withdraw``)
    evictions: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class AdapterCache:
    """LRU cache of adapters with in-flight loads and prefetch accounting."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.used = 0
        self.stats = CacheStats()
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Hashable]:
        """Keys from least to most recently used."""
        return iter(self._entries)

    @property
    def entries(self) -> Mapping[Hashable, Entry]:
        """The entries, LRU first: a read-only view for callers that test membership in
        many pools per request (the fleet simulator's router)."""
        return self._entries

    def get(self, key: Hashable) -> Entry | None:
        """The entry, without counting an access or changing the order."""
        return self._entries.get(key)

    def access(self, key: Hashable, now: float) -> str:
        """A request needs ``key`` at ``now``: count HIT, LATE or MISS; a present key becomes MRU."""
        entry = self._entries.get(key)
        if entry is None:
            self.stats.misses += 1
            return MISS
        self._entries.move_to_end(key)
        if entry.prefetched:
            entry.prefetched = False
            self.stats.prefetch_used += 1
        if entry.ready_at <= now:
            self.stats.hits += 1
            return HIT
        self.stats.late += 1
        return LATE

    def victims(self, size: int = 1) -> list[Hashable]:
        """Keys ``admit`` would evict to make room for ``size``, LRU first; nothing changes."""
        need = self.used + size - self.capacity
        out: list[Hashable] = []
        if need <= 0:
            return out
        for key, entry in self._entries.items():
            if entry.pinned:
                continue
            out.append(key)
            need -= entry.size
            if need <= 0:
                return out
        return out if need <= 0 else []

    def admit(
        self,
        key: Hashable,
        ready_at: float,
        *,
        size: int = 1,
        prefetched: bool = False,
        score: float = 0.0,
        scored_at: float | None = None,
    ) -> list[Hashable] | None:
        """Insert ``key`` as MRU, its load completing at ``ready_at``; evict LRU entries as needed.

        Returns the evicted keys, or None when it cannot fit (larger than the capacity,
        or everything else is pinned). Re-admitting a present key only refreshes it.
        """
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            entry.ready_at = min(entry.ready_at, ready_at)
            return []
        if size > self.capacity:
            return None
        evict = self.victims(size)
        if self.used + size > self.capacity and not evict:
            return None
        for victim in evict:
            self.evict(victim)
        self._entries[key] = Entry(size, ready_at, prefetched, score, ready_at if scored_at is None else scored_at)
        self.used += size
        self.stats.loads += 1
        if prefetched:
            self.stats.prefetches += 1
        return evict

    def predict(self, key: Hashable, score: float, now: float) -> bool:
        """A prediction says ``key`` is needed soon with probability ``score``: remember it
        on the entry (``coldest``'s score functions read it). False when absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.score = score
        entry.scored_at = now
        return True

    def evict(self, key: Hashable) -> bool:
        """Remove ``key``; an unused prefetch counts as wasted. False when absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry.size
        self.stats.evictions += 1
        if entry.prefetched:
            self.stats.prefetch_wasted += 1
        return True

    def withdraw(self, key: Hashable, now: float) -> bool:
        """A prefetch of ``key`` that will not happen (its agent refused the load): drop the
        entry if it is still an unused prefetch in flight at ``now``, counted as refused,
        neither an eviction nor a waste. False (nothing changes) otherwise."""
        entry = self._entries.get(key)
        if entry is None or not entry.prefetched or entry.ready_at <= now:
            return False
        del self._entries[key]
        self.used -= entry.size
        self.stats.prefetch_refused += 1
        return True

    def pin(self, key: Hashable, pinned: bool = True) -> None:
        """Pinned entries are never chosen as victims."""
        self._entries[key].pinned = pinned

    def coldest(self, score: Callable[[Hashable, Entry], float], window: int = 8) -> Hashable | None:
        """Among the ``window`` least recently used unpinned entries, the one ``score`` rates lowest.

        LRU with a look at the scores: recency still decides which entries are eligible,
        and a fresh prefetch or a hot adapter that happens to sit at the LRU end is spared
        for a colder neighbour. Ties go to the least recently used. ``window=1`` is LRU;
        ``window=0`` looks at every entry (the scores alone decide).
        """
        best = None
        best_score = 0.0
        seen = 0
        for key, entry in self._entries.items():
            if entry.pinned:
                continue
            sc = score(key, entry)
            if best is None or sc < best_score:
                best, best_score = key, sc
            seen += 1
            if seen == window:
                break
        return best

    def lru_key(self) -> Hashable | None:
        """The next victim for a unit-size admission, or None."""
        for key, entry in self._entries.items():
            if not entry.pinned:
                return key
        return None
