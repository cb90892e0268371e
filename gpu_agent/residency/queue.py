"""The order loads go in: a bounded priority queue of prefetches, and the requests'
loads in flight, which go before every queued prefetch.

Prefetches wait in a priority queue (highest first, then in arrival order); the bound is
the admission's (``gpu_agent.residency.admission``). A request's load (an awaited
``ensure_resident``) is counted in ``DemandLoads`` while it runs: the workers take no new
prefetch while one is in flight, and a running prefetch waits for it before its device
stage (``gpu_agent.residency.pipeline``).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["DemandLoads", "PrefetchQueue"]


class PrefetchQueue:
    """The queued prefetches. A name leaves ``queued`` when its load starts (or it turned
    resident meanwhile); its heap entry stays until a worker pops it (its load is then
    joined or found done)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, str]] = []
        self.queued: set[str] = set()
        self._seq = itertools.count()
        self._wakeup = asyncio.Event()

    def __len__(self) -> int:
        return len(self.queued)

    def __contains__(self, name: str) -> bool:
        return name in self.queued

    def push(self, name: str, priority: int) -> None:
        heapq.heappush(self._heap, (-priority, next(self._seq), name))
        self.queued.add(name)
        self._wakeup.set()

    def discard(self, name: str) -> None:
        self.queued.discard(name)

    def has_work(self) -> bool:
        return bool(self._heap)

    async def wait_for_work(self) -> None:
        while not self._heap:
            self._wakeup.clear()
            await self._wakeup.wait()

    def pop(self) -> str:
        return heapq.heappop(self._heap)[2]


class DemandLoads:
    """Requests' loads (``ensure_resident``) in flight, by adapter name."""

    def __init__(self) -> None:
        self._loads: dict[str, int] = {}
        self._changed = asyncio.Event()  # replaced on every change

    def __len__(self) -> int:
        return len(self._loads)

    def __contains__(self, name: str) -> bool:
        return name in self._loads

    def step(self, name: str, delta: int) -> None:
        n = self._loads.get(name, 0) + delta
        if n > 0:
            self._loads[name] = n
        else:
            self._loads.pop(name, None)
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_clear(self, name: str = "") -> bool:
        """Wait until no request's load (of another adapter than `name`: a request that
        joined this load promotes it) is in flight; True when it had to wait."""
        waited = False
        while any(n != name for n in self._loads):
            waited = True
            changed = self._changed
            await changed.wait()
        return waited
