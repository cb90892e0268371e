"""The garbage collector's pauses in a long-running server, and the start-up heap kept out
of them.

CPython's cyclic collector stops the whole process (it holds the GIL) while it walks the
objects of the generations it collects; a full collection (generation 2) walks every
tracked object. A process that imports torch tracks about 183,000 objects after start-up,
and a full collection of them took 57 ms on the 2-core test machine (the gateway's 35,000:
10 ms), longer than a request's whole TTFT: every request that process is serving then
waits for it.

- ``GcPauses``: every collection's duration by generation (``gc.callbacks``), for the
  process's metrics (``snapshot``) and its shutdown log; a pause of ``slow_s`` or more is
  logged at INFO as it happens.
- ``freeze_startup_heap``: after start-up (modules, settings, the model's weights, the
  first state), ``gc.freeze()`` moves every tracked object to the permanent generation,
  which no collection walks, so a full collection walks only what was allocated since.
  The cost: a reference cycle among the frozen objects is never reclaimed (acyclic ones
  are freed by reference counting as usual); start-up objects live as long as the
  process anyway.
"""
from __future__ import annotations

import bisect
import gc
import json
import logging
import os
import time
from typing import Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

__all__ = ["GC_PAUSE_BUCKETS_S", "GcPauseCollector", "GcPauses", "freeze_enabled", "freeze_startup_heap"]

log = logging.getLogger(__name__)

#: a young collection takes tens of µs; a full one of an unfrozen heap tens of ms
GC_PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)


class GcPauses:
    """Durations of this process's garbage collections, by generation (0, 1, 2).

    ``install`` adds a ``gc.callbacks`` hook (once per object); the hook runs in whichever
    thread triggered the collection and only does arithmetic on plain lists. Collections
    never overlap (CPython runs one at a time, under the GIL), so one start time is kept.
    ``snapshot`` is for a metrics scrape; ``close`` uninstalls and logs the totals."""

    def __init__(self, slow_s: float = 0.02, buckets: tuple[float, ...] = GC_PAUSE_BUCKETS_S) -> None:
        self.slow_s = slow_s
        self.buckets = buckets
        self._counts = [[0] * (len(buckets) + 1) for _ in range(3)]   # per generation, +Inf last
        self._sums = [0.0, 0.0, 0.0]
        self._max = [0.0, 0.0, 0.0]
        self._began: float | None = None   # perf_counter at the running collection's "start"
        self._installed = False

    def install(self) -> "GcPauses":
        if not self._installed:
            gc.callbacks.append(self._hook)
            self._installed = True
        return self

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._hook)
            self._installed = False

    def close(self, logger: logging.Logger) -> None:
        """Uninstall, and log the totals as ``gc pauses: {json}`` (a process's shutdown)."""
        self.uninstall()
        logger.info("gc pauses: %s", json.dumps(self.summary(), sort_keys=True))

    def _hook(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        began, self._began = self._began, None
        if began is not None:   # None: installed mid-collection
            self.record(info.get("generation", 2), time.perf_counter() - began)

    def record(self, generation: int, seconds: float) -> None:
        g = min(max(generation, 0), 2)
        self._counts[g][bisect.bisect_left(self.buckets, seconds)] += 1
        self._sums[g] += seconds
        if seconds > self._max[g]:
            self._max[g] = seconds
        if seconds >= self.slow_s:
            log.info("garbage collection of generation %d paused the process %.1f ms", g, seconds * 1e3)

    def snapshot(self) -> dict[int, dict]:
        """Per generation: ``count``, ``sum_s``, ``max_s`` and cumulative ``buckets``
        (``(upper bound s, collections at most that long)``, +Inf last)."""
        out = {}
        for g in range(3):
            counts = self._counts[g]
            cumulative, acc = [], 0
            for bound, n in zip((*self.buckets, float("inf")), counts):
                acc += n
                cumulative.append((bound, acc))
            out[g] = {"count": acc, "sum_s": self._sums[g], "max_s": self._max[g], "buckets": cumulative}
        return out

    def summary(self) -> dict[str, dict]:
        """For a log line: per generation, collections, total and longest pause in ms."""
        return {f"gen{g}": {"n": s["count"], "sum_ms": round(s["sum_s"] * 1e3, 1), "max_ms": round(s["max_s"] * 1e3, 1)}
                for g, s in self.snapshot().items()}


def freeze_startup_heap(logger: logging.Logger | None = None) -> int | None:
    """Unless ``ACE_GC_FREEZE=off``: collect once, then move every tracked object to the
    permanent generation; returns how many objects were frozen (None: off) and logs it to
    ``logger``. Call it once start-up is done."""
    if not freeze_enabled():
        return None
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    if logger is not None:
        logger.info("froze %d start-up objects out of the garbage collector's walks", frozen)
    return frozen


def freeze_enabled() -> bool:
    """``ACE_GC_FREEZE=off`` leaves the start-up heap to the collector (to compare, or if a
    deployment's start-up makes reference cycles it later drops); on by default."""
    return os.environ.get("ACE_GC_FREEZE", "on").strip().lower() not in ("off", "0", "false", "no")


class GcPauseCollector(Collector):
    """``<name>{generation}``: a Prometheus histogram of ``GcPauses``, read at scrape time."""

    def __init__(self, pauses: GcPauses, name: str) -> None:
        self.pauses, self.name = pauses, name

    def collect(self) -> Iterator[HistogramMetricFamily]:
        fam = HistogramMetricFamily(self.name, "Garbage collections of this process by generation, "
                                    "and how long each paused it (seconds).", labels=["generation"])
        for g, s in self.pauses.snapshot().items():
            buckets = [("+Inf" if bound == float("inf") else repr(bound), n) for bound, n in s["buckets"]]
            fam.add_metric([str(g)], buckets, s["sum_s"])
        yield fam
