"""A Prometheus-style histogram kept in plain lists: counts per bucket, their sum and how
many, rendered as cumulative ``(le, count)`` pairs at scrape time. Not thread-safe: its
owner updates it from one thread (an event loop). The agent's load and stage times
(``gpu_agent.metrics``) and an event loop's lag (``ace_common.loop_lag``) keep theirs here."""
from __future__ import annotations

import bisect

__all__ = ["Histogram"]


class Histogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)   # +Inf last
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, count of observations <= le) per bucket, +Inf last."""
        out, acc = [], 0
        for bound, count in zip((*map(repr, self.buckets), "+Inf"), self.counts):
            acc += count
            out.append((bound, acc))
        return out
