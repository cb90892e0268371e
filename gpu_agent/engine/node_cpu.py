"""Whether the cores this engine runs on are taken by other tasks: the part of a prefetch's
wait that no one engine sees (:mod:`gpu_agent.engine.load_order`).

An engine's own compute is in its batcher; the engines beside it on the same node (one
per GPU on a GPU node, several builtin engines on one CPU machine), the gateway or a
tokenizer are not. A prefetch's fetch, parse and copy take a core: when every core is
running something else, it takes one from a forward pass somewhere on the node, and the
request that pass serves waits. :meth:`NodeCpu.busy` says busy when two readings agree:

- **now**, the kernel's count of runnable tasks (``/proc/loadavg``'s fourth field, one
  short read): the others (the caller itself is one of them) fill as many cores as this
  process may use. The count is the whole machine's, so alone it also counts tasks that
  run on cores this process never touches;
- **lately, on this process's own cores** (``/proc/stat``'s per-core lines): over the last
  ``window_s`` or more (since the newest earlier look at least that old), the time those
  cores ran anything, less this process's own CPU time, is at least ``share`` of them.

A process pinned to some of the machine's cores (the fleet benchmark's CPU split,
``bench/cores.py``: the request path on core 0, the engine hosts on the rest) therefore no
longer waits while only the request path's cores are busy: the loadavg count alone held a
1-host fleet's bets whenever Envoy or the gateway ran, and cost 4-8 points of hits on the
800 trace (docs/bench-history.md, "The node wait, measured off"). Where ``/proc/stat``
lacks this process's cores, or no earlier look is at most ``max_age_s`` old, the count
alone decides (as before: waits more than it needs to, never less). Where
``/proc/loadavg`` cannot be read (not Linux), the node is never busy: prefetches wait for
their own engine only.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Collection

__all__ = ["NodeCpu"]

_LOADAVG = "/proc/loadavg"
_STAT = "/proc/stat"
#: Enough of /proc/stat for the per-core lines of ~1,000 cores (they come first; the long
#: interrupt counts after them are never read).
_STAT_READ = 1 << 16


def _cores() -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def _ticks_per_s() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK")) or 100
    except (AttributeError, ValueError, OSError):
        return 100


class NodeCpu:
    """``busy()``: the other tasks fill ``cores`` cores now, and lately used at least
    ``share`` of this process's own cores (``cpus``)."""

    def __init__(self, cores: int | None = None, path: str = _LOADAVG, *,
                 cpus: Collection[int] | None = None, stat_path: str = _STAT,
                 window_s: float = 0.1, share: float = 0.5, max_age_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 own_cpu_s: Callable[[], float] = time.process_time,
                 ticks_per_s: int | None = None) -> None:
        mine = frozenset(cpus) if cpus is not None else _cores()
        if cores is None:
            cores = len(mine) if mine else max(1, os.cpu_count() or 1)
        if cores < 1:
            raise ValueError("cores must be >= 1")
        if mine is not None and not mine:
            raise ValueError("cpus must name at least one core")
        if not 0.0 < share <= 1.0:
            raise ValueError("share must be in (0, 1]")
        if not 0.0 < window_s <= max_age_s:
            raise ValueError("need 0 < window_s <= max_age_s")
        self.cores = cores
        self.path = path
        self.cpus = mine
        self.stat_path = stat_path
        self.window_s, self.share, self.max_age_s = window_s, share, max_age_s
        self._clock, self._own_cpu_s = clock, own_cpu_s
        self._tick_s = 1.0 / (ticks_per_s or _ticks_per_s())
        self._readable = True
        self._stat_readable = mine is not None
        #: earlier looks, oldest first: (monotonic s, ticks the cores ran, own CPU s)
        self._looks: collections.deque[tuple[float, int, float]] = collections.deque()
        #: the last answer: asked again within a tick, nothing new can be read
        self._last: tuple[float, float | None] | None = None
        #: the looks are shared by the event loop and the load threads (a copy's checkpoint)
        self._lock = threading.Lock()

    def runnable(self) -> int | None:
        """Runnable tasks on the node now, the caller included; None when unreadable."""
        if not self._readable:
            return None
        try:
            with open(self.path, "rb") as f:
                text = f.read(128)
            return int(text.split()[3].split(b"/")[0])
        except (OSError, IndexError, ValueError):
            self._readable = False  # not Linux, or no /proc: never busy from here on
            return None

    def _ran_ticks(self) -> int | None:
        """Clock ticks this process's cores ran anything (every state but idle and
        iowait), summed; None when ``/proc/stat`` lacks one of them."""
        if not self._stat_readable:
            return None
        try:
            with open(self.stat_path, "rb") as f:
                text = f.read(_STAT_READ)
            total, seen = 0, 0
            for line in text.splitlines():
                if not line.startswith(b"cpu") or line[3:4] in (b" ", b""):
                    continue
                name, *fields = line.split()
                if int(name[3:]) not in self.cpus:
                    continue
                ticks = [int(x) for x in fields[:8]]
                total += sum(ticks) - ticks[3] - ticks[4]   # less idle and iowait
                seen += 1
            if seen != len(self.cpus):
                raise ValueError("a core of this process is not in /proc/stat")
            return total
        except (OSError, IndexError, ValueError):
            self._stat_readable = False  # the count alone decides from here on
            return None

    def others_share(self) -> float | None:
        """The share of this process's cores that other tasks used since the newest earlier
        look at least ``window_s`` old (this look is kept for the next); None without one
        (or no per-core counts). Thread-safe."""
        with self._lock:
            return self._others_share()

    def _others_share(self) -> float | None:
        now = self._clock()
        if self._last is not None and 0.0 <= now - self._last[0] < 0.99 * self._tick_s:
            return self._last[1]           # the counts move in ticks: a look now adds nothing
        ticks = self._ran_ticks()
        if ticks is None:
            return None
        own = self._own_cpu_s()
        looks = self._looks
        while looks and now - looks[0][0] > self.max_age_s:
            looks.popleft()
        while len(looks) >= 2 and now - looks[1][0] >= self.window_s:
            looks.popleft()                # looks[0]: the newest at least window_s old
        base = looks[0] if looks and now - looks[0][0] >= self.window_s else None
        looks.append((now, ticks, own))
        share = None
        if base is not None:
            span = (now - base[0]) * len(self.cpus)
            others = (ticks - base[1]) * self._tick_s - (own - base[2])
            share = max(0.0, min(1.0, others / span))
        self._last = (now, share)
        return share

    def busy(self) -> bool:
        n = self.runnable()
        if n is None or n - 1 < self.cores:
            if n is not None:
                self.others_share()        # keep the per-core look fresh for the next call
            return False
        lately = self.others_share()
        return lately is None or lately >= self.share
