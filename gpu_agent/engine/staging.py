"""Adapter staging: disk -> host memory -> device (the paged pool), with the measured time of every step.

``AdapterTiers.ensure(name, path, sha256)`` makes an adapter resident in the pool and
says where it came from (``device``, ``host`` or ``disk``: ``ace_common.tiers.Tier`` values) and how long each tier took
(:class:`LoadTimings`). The host tier is an LRU of parsed adapters with a byte budget;
its buffers stay pageable (a CUDA pool carries them to the device through its pinned
staging buffers, ``gpu_agent.engine.pool_copy.PinnedStaging``). Remote fetching is the agent service's job: it puts the
files in a local directory and calls ``ensure`` with the catalog's digest once.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpu_agent.errors import AdapterNotFound, AdapterNotResident, LoadYielded
from gpu_agent.eviction import Shortfall, ordered, plan_evictions
from gpu_agent.engine.peft import LoraAdapter, load_peft_dir
from gpu_agent.engine.pool import AdapterPool, PoolEntry
from ace_common.tiers import Tier

__all__ = ["LoadTimings", "HostCache", "AdapterTiers", "TIERS"]

TIERS = (Tier.DEVICE.value, Tier.HOST.value, Tier.DISK.value)


@dataclass
class LoadTimings:
    """Where an adapter was when asked for, and the measured milliseconds per tier."""

    name: str
    tier: str                  # device | host | disk (the agent service adds remote)
    read_ms: float = 0.0       # open + map the file (CPU: pages come in during the pool
                               # copy) or the copy into pinned memory (CUDA)
    verify_ms: float = 0.0     # SHA-256, only when a digest was given
    parse_ms: float = 0.0      # config + header validation
    pool_ms: float = 0.0       # host -> pool pages (one memcpy; H2D on the side stream on CUDA)
    total_ms: float = 0.0
    nbytes: int = 0
    extra: dict[str, float] = field(default_factory=dict)


class HostCache:
    """LRU of host-resident adapters bounded by bytes (what goes: ``gpu_agent.eviction``)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.used_bytes = 0
        self._items: OrderedDict[str, LoraAdapter] = OrderedDict()
        self.evictions = 0

    def get(self, name: str) -> LoraAdapter | None:
        ad = self._items.get(name)
        if ad is not None:
            self._items.move_to_end(name)
        return ad

    def put(self, adapter: LoraAdapter) -> bool:
        """Keep ``adapter``; False when it alone exceeds the budget (not kept)."""
        size = adapter.nbytes
        if size > self.budget_bytes:
            return False
        old = self._items.pop(adapter.name, None)
        if old is not None:
            self.used_bytes -= old.nbytes
        short = Shortfall(size=self.used_bytes + size - self.budget_bytes)
        for name in plan_evictions(ordered(self._items, lambda n: self._items[n].nbytes), short):
            self.used_bytes -= self._items.pop(name).nbytes
            self.evictions += 1   # reason: budget (the only one that evicts here)
        self._items[adapter.name] = adapter
        self.used_bytes += size
        return True

    def drop(self, name: str) -> None:
        old = self._items.pop(name, None)
        if old is not None:
            self.used_bytes -= old.nbytes

    def __contains__(self, name: str) -> bool:
        return name in self._items

    def names(self) -> list[str]:
        return list(self._items)


class AdapterTiers:
    """disk -> host -> pool for one pool."""

    def __init__(self, pool: AdapterPool, host_budget_bytes: int, *, pin_host: bool = False) -> None:
        self.pool = pool
        self.host = HostCache(host_budget_bytes)
        # Host copies stay pageable by default, on CUDA too: the pool's pinned staging
        # buffers carry them to the device, and pinning each new host copy (cudaHostAlloc)
        # stalled the forward's kernel launches (docs/pool.md).
        self.pin_host = pin_host
        self._lock = threading.RLock()
        self.last: dict[str, LoadTimings] = {}

    @property
    def lock(self) -> threading.RLock:
        """Held for a whole load below the pool (a caller may try it to avoid waiting)."""
        return self._lock

    def where(self, name: str) -> str | None:
        """The fastest tier holding ``name`` (``device``/``host``), None if neither."""
        if self.pool.contains(name):
            return Tier.DEVICE.value
        if name in self.host:
            return Tier.HOST.value
        return None

    def ensure(self, name: str, path: str | Path | None = None, sha256: str | None = None,
               *, pin: bool = False, should_yield: Callable[[str], bool] | None = None
               ) -> tuple[PoolEntry, LoadTimings]:
        """Make ``name`` resident in the pool; return its entry and the timings.

        ``path`` is the adapter directory, needed only when it is in neither pool nor
        host memory. Give ``sha256`` when the files just entered from outside.
        ``should_yield(stage)`` (a prefetch's load): asked before the read (``read``),
        before the pool copy and between chunks of it (``copy``); True stops the load
        there (``LoadYielded``).
        """
        t0 = time.perf_counter()
        pool = self.pool
        if pool.touch(name):                      # resident lookup: the hot path
            try:
                entry = pool.entry(name)
                if pin:
                    pool.pin(name)
            except AdapterNotResident:            # another thread's load evicted it just now
                pass                              # load it again below
            else:
                return entry, LoadTimings(name, Tier.DEVICE.value, total_ms=(time.perf_counter() - t0) * 1e3,
                                          nbytes=entry.nbytes)
        with self._lock:
            adapter = self.host.get(name)
            t = LoadTimings(name, "host" if adapter is not None else "disk")
            if adapter is None:
                if should_yield is not None and should_yield("read"):
                    raise LoadYielded(name, "read")
                if path is None:
                    raise AdapterNotFound(f"adapter {name!r} is not in memory and no path was given")
                parts: dict[str, float] = {}
                t1 = time.perf_counter()
                adapter = load_peft_dir(path, pool.spec, sha256, name=name,
                                        pin_memory=self.pin_host, timings=parts)
                t.read_ms = parts.get("read_ms", 0.0)
                t.verify_ms = parts.get("verify_ms", 0.0)
                t.parse_ms = (time.perf_counter() - t1) * 1e3 - t.read_ms - t.verify_ms
                self.host.put(adapter)
            t2 = time.perf_counter()
            entry = pool.load(adapter, pin=pin, should_yield=should_yield)
            t.pool_ms = (time.perf_counter() - t2) * 1e3
            t.nbytes = adapter.nbytes
            t.total_ms = (time.perf_counter() - t0) * 1e3
            self.last[name] = t
            return entry, t
