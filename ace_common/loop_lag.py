"""How late an asyncio event loop runs what is due: the lag every request on it waits.

An agent serves gRPC, its metrics and the builtin engine's HTTP on one event loop. When
that loop is late, every request on it is late by as much, whatever the adapter: a
callback that blocks, a thread that holds the GIL, or a machine whose cores are all busy
(the benchmarks run several engine hosts on two cores: the four agents' loops were late
by 15-48 ms at the same instants, each loop idle in ``select`` meanwhile, so no code of
theirs held it). A TTFT tail that a lag explains is the machine's, not the adapters'.

``LoopLag`` is one task that sleeps ``interval_s`` and records how much later than due it
woke (``asyncio.sleep``'s timer fires on the loop's next turn, so the lateness is the time
the loop took to come back to it). A stall of ``d`` seconds is seen when a wake-up falls in
it, with a chance of about ``d / interval_s`` for ``d`` below the interval. Prometheus:
``<name>`` histogram (``LoopLagCollector``), plus the longest lag seen (``<name>_max``
gauge). Cost: one timer a ``interval_s`` (50 wake-ups a second at 20 ms).

``LoopLag.running()`` is the monitor started on the running loop (None: none), so code on
that loop can read ``sum_s`` at two moments: the lag measured between them (the builtin
engine puts a request's in its ``ace_timing.loop_lag_ms``).
"""
from __future__ import annotations

import asyncio
import time
import weakref
from typing import Iterator

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ace_common.histogram import Histogram

__all__ = ["LOOP_LAG_BUCKETS_S", "LoopLag", "LoopLagCollector"]

#: a turn of an idle loop takes tens of µs; a starved or blocked one tens of ms
LOOP_LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

_ON_LOOP: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopLag]" = weakref.WeakKeyDictionary()


class LoopLag:
    """Lateness of a periodic wake-up on the running loop. ``start`` inside the loop,
    ``close`` (awaitable) to stop; ``record`` is the arithmetic, for tests."""

    def __init__(self, interval_s: float = 0.02, buckets: tuple[float, ...] = LOOP_LAG_BUCKETS_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.histogram = Histogram(buckets)
        self.max_s = 0.0
        self._task: asyncio.Task | None = None

    @staticmethod
    def running() -> "LoopLag | None":
        """The monitor started on the running loop, if any (call from that loop)."""
        try:
            return _ON_LOOP.get(asyncio.get_running_loop())
        except RuntimeError:
            return None

    def start(self) -> "LoopLag":
        """Start measuring on the running loop (once; a loop has one monitor)."""
        if self._task is None:
            loop = asyncio.get_running_loop()
            if _ON_LOOP.get(loop) not in (None, self):
                raise RuntimeError("this event loop already has a LoopLag running")
            self._task = loop.create_task(self._run(), name="loop-lag")
            _ON_LOOP[loop] = self
        return self

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            loop = task.get_loop()
            if _ON_LOOP.get(loop) is self:
                del _ON_LOOP[loop]
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _run(self) -> None:
        interval = self.interval_s
        while True:
            due = time.perf_counter() + interval
            await asyncio.sleep(interval)
            self.record(max(0.0, time.perf_counter() - due))

    def record(self, lag_s: float) -> None:
        self.histogram.observe(lag_s)
        if lag_s > self.max_s:
            self.max_s = lag_s

    @property
    def sum_s(self) -> float:
        """Every wake-up's lateness added up (seconds): read it at two moments for the lag between."""
        return self.histogram.total

    @property
    def samples(self) -> int:
        return self.histogram.n


class LoopLagCollector(Collector):
    """``LoopLag`` for a ``prometheus_client`` registry."""

    def __init__(self, lag: LoopLag, name: str) -> None:
        self.lag, self.name = lag, name

    def collect(self) -> Iterator:
        lag = self.lag
        h = HistogramMetricFamily(self.name, "How much later than due the event loop ran a periodic "
                                  "wake-up (seconds): what every request on the loop waited then.")
        h.add_metric([], lag.histogram.cumulative(), lag.sum_s)
        yield h
        yield GaugeMetricFamily(f"{self.name}_max", "The longest event-loop lag seen since start (seconds).",
                                value=lag.max_s)
