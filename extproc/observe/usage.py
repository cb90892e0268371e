"""The last hour of each (tenant, adapter), per minute, as the gateway saw it: what the
settings page charts (``GET /api/v1/usage``).

What the gateway can know at decision time, and nothing else (it never sees the engine's
own wait):

- ``requests``: inference requests that selected the adapter (any multi_lora mode);
- ``hits``: of those, the adapter was on the upstream's device (residency tier ``device``)
  when the gateway decided: an *effective hit*, no load before the request runs;
- ``unknown``: the residency was unknown (no agent data): neither hit nor miss;
- expected stall: ``0`` on a hit, else the agent's measured ``cold_load_ms`` of the tier the
  adapter was in at decision time (host, disk, remote); kept as a histogram per minute
  (``STALL_BOUNDS_MS``), so percentiles are bucket upper bounds;
- ``prefetch_signalled``: the request made the gateway signal the agent to prefetch it;
- ``prefetch_used``: the request found it on the device because a prefetch put it there
  (``is_prefetch_hit`` in the trace header).

Writes are per thread (like ``extproc.observe.metrics``): a thread records into its own shard,
found through a ``threading.local``, so the request path takes no lock after a thread's
first request. A shard's series is a ring of 60 minute buckets; a bucket from another
minute is replaced by a fresh list (one reference swap), so a reader sees either bucket
whole. ``series`` (the API, off the request path) sums the shards. Bounded: keys are
tenants x adapters of the state file, 60 buckets each.
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING, Callable

from ace_common.tiers import Tier

if TYPE_CHECKING:
    from extproc.domain.decision import Decision

__all__ = ["STALL_BOUNDS_MS", "WINDOW_MINUTES", "UsageRing", "stall_percentile"]

WINDOW_MINUTES = 60
#: expected-stall histogram: upper bounds in ms (the last bucket is "above 5 s")
STALL_BOUNDS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0, 5000.0)
# bucket layout: [minute, requests, hits, unknown, prefetch_signalled, prefetch_used, *stall histogram]
_MINUTE, _REQUESTS, _HITS, _UNKNOWN, _SIGNALLED, _USED, _STALL = range(7)
_WIDTH = _STALL + len(STALL_BOUNDS_MS) + 1
_EMPTY_SERIES: tuple = ()


def _new_series() -> list:
    return [[-1] + [0] * (_WIDTH - 1) for _ in range(WINDOW_MINUTES)]


def stall_percentile(histogram: list[int], q: float) -> float | None:
    """The upper bound of the bucket holding the ``q`` quantile (None: no samples; inf:
    above the last bound)."""
    total = sum(histogram)
    if not total:
        return None
    rank, acc = q * total, 0
    for i, n in enumerate(histogram):
        acc += n
        if acc >= rank and n:
            return STALL_BOUNDS_MS[i] if i < len(STALL_BOUNDS_MS) else float("inf")
    return float("inf")


class UsageRing:
    """Per (tenant, adapter): 60 one-minute buckets. ``record`` on the request path."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._local = threading.local()
        self._shards: list[dict[tuple[str, str], list]] = []
        self._register = threading.Lock()    # a thread's first record only

    def _shard(self) -> dict:
        try:
            return self._local.shard
        except AttributeError:
            shard = self._local.shard = {}
            with self._register:
                self._shards.append(shard)
            return shard

    def record(self, tenant: str, d: "Decision", prefetch_queued: bool | None) -> None:
        """One decided inference request (nothing when it selected no adapter)."""
        if d.adapter is None:
            return
        minute = int(self.clock() // 60)
        shard = self._shard()
        key = (tenant, d.adapter.name)
        series = shard.get(key)
        if series is None:
            series = shard[key] = _new_series()
        slot = minute % WINDOW_MINUTES
        bucket = series[slot]
        if bucket[_MINUTE] != minute:          # an hour-old bucket: start this minute's
            bucket = [minute] + [0] * (_WIDTH - 1)
            series[slot] = bucket
        bucket[_REQUESTS] += 1
        res = d.residency
        if not res.known:
            bucket[_UNKNOWN] += 1
        else:
            stall = 0.0 if res.tier == Tier.DEVICE else res.cold_load_ms
            if res.tier == Tier.DEVICE:
                bucket[_HITS] += 1
            if stall is not None:
                bucket[_STALL + bisect.bisect_left(STALL_BOUNDS_MS, stall)] += 1
            if d.prefetch_used:
                bucket[_USED] += 1
        if d.prefetch_signal is not None and prefetch_queued:
            bucket[_SIGNALLED] += 1

    def series(self, tenant: str, adapters: list[str], window_s: int = 3600) -> dict:
        """``{"minutes": [epoch minute, ...], "adapters": {name: {...}}}`` for the last
        ``window_s`` seconds (whole minutes, at most 60, the current one last)."""
        minutes = max(1, min(WINDOW_MINUTES, -(-int(window_s) // 60)))
        now = int(self.clock() // 60)
        wanted = list(range(now - minutes + 1, now + 1))
        with self._register:
            shards = list(self._shards)
        out: dict = {}
        for name in adapters:
            rows = {m: [0] * (_WIDTH - 1) for m in wanted}
            for shard in shards:
                series = shard.get((tenant, name), _EMPTY_SERIES)
                for bucket in list(series):
                    row = rows.get(bucket[_MINUTE])
                    if row is not None:
                        for i, n in enumerate(bucket[1:]):
                            row[i] += n
            out[name] = _summary([rows[m] for m in wanted])
        return {"window_s": minutes * 60, "minute_s": 60, "start_minute": wanted[0] * 60,
                "stall_bounds_ms": list(STALL_BOUNDS_MS), "adapters": out}


def _summary(rows: list[list[int]]) -> dict:
    col = {name: i - 1 for name, i in (("requests", _REQUESTS), ("hits", _HITS), ("unknown", _UNKNOWN),
                                       ("prefetch_signalled", _SIGNALLED), ("prefetch_used", _USED))}
    per_minute = {name: [r[i] for r in rows] for name, i in col.items()}
    stall = [sum(r[_STALL - 1 + i] for r in rows) for i in range(len(STALL_BOUNDS_MS) + 1)]
    per_minute["stall_p99_ms"] = [_json_ms(stall_percentile(r[_STALL - 1:], 0.99)) for r in rows]
    totals = {name: sum(v) for name, v in per_minute.items() if name != "stall_p99_ms"}
    known = totals["requests"] - totals["unknown"]
    return {
        "per_minute": per_minute,
        "totals": totals,
        "effective_hit_ratio": totals["hits"] / known if known else None,
        "expected_stall_ms": {f"p{int(q * 100)}": _json_ms(stall_percentile(stall, q)) for q in (0.5, 0.9, 0.99)},
        "stall_histogram": stall,
        # the gateway cannot see a prefetched adapter leave the device unused, per tenant: this
        # is the upper bound of wasted prefetches in the window
        "prefetch_unused": max(0, totals["prefetch_signalled"] - totals["prefetch_used"]),
    }


def _json_ms(value: float | None) -> float | str | None:
    return "inf" if value == float("inf") else value
