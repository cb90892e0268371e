"""Bounds on a host's hit count from its realized request sequence (pure, by count).

For one host's sequence of adapters (in the order its engine received them) and a pool
of ``slots`` adapters:

- ``belady_hits``: Belady's demand-caching optimum: a missing adapter is loaded when
  its request arrives, evicting the adapter whose next use is furthest away (optimal
  for unit-size slots). No on-demand policy (LRU, affinity's engines) gets more hits on
  the same sequence; a prefetching one can (it loads before the request).
- ``compulsory_hits``: every request but the first of each adapter on that host: the
  ceiling of any policy that loads an adapter onto a host only after a request for it
  reached that host. A policy that prefetches can beat it only with adapters it learned
  elsewhere (another host's requests, a warm set).
- ``fleet_compulsory_hits`` (``fleet_bounds``): every request but the first of each
  adapter in the whole trace: the ceiling of every policy that starts cold and loads
  only adapters some request has named (ace's cold-start arm included).

A hit here is by count: timing (a load still in flight) is not modelled, so these are
ceilings, not predictions.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = ["belady_hits", "compulsory_hits", "fleet_bounds", "host_sequences"]


def belady_hits(seq: Sequence[Hashable], slots: int) -> int:
    """Hits of Belady's furthest-next-use eviction over ``seq`` with ``slots`` slots."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    n = len(seq)
    nxt = [n] * n
    last: dict = {}
    for i in range(n - 1, -1, -1):
        nxt[i] = last.get(seq[i], n)
        last[seq[i]] = i
    cached: dict = {}  # adapter -> its next use
    heap: list[tuple[int, int, Hashable]] = []  # (-next use, tiebreak, adapter); stale entries skipped
    hits = 0
    for i, a in enumerate(seq):
        if a in cached:
            hits += 1
        elif len(cached) >= slots:
            while True:
                neg, _, victim = heapq.heappop(heap)
                if cached.get(victim) == -neg:
                    del cached[victim]
                    break
        cached[a] = nxt[i]
        heapq.heappush(heap, (-nxt[i], i, a))
    return hits


def compulsory_hits(seq: Sequence[Hashable]) -> int:
    return len(seq) - len(set(seq))


def host_sequences(rows: Iterable[Mapping]) -> dict[str, list]:
    """Per host, its requests' adapters in the order they were sent (``sent_s``)."""
    by: dict[str, list] = defaultdict(list)
    for r in sorted(rows, key=lambda r: r["sent_s"]):
        by[r["host"] or "unknown"].append(r["adapter"])
    return dict(sorted(by.items()))


def fleet_bounds(rows: Sequence[Mapping], slots: int) -> dict:
    """Per host and summed: requests, distinct adapters, Belady's demand optimum and the
    compulsory-miss ceiling (counts and ratios), and the fleet's cold-start ceiling."""
    per_host = {}
    for host, seq in host_sequences(rows).items():
        per_host[host] = {"requests": len(seq), "adapters": len(set(seq)),
                          "belady_hits": belady_hits(seq, slots), "compulsory_hits": compulsory_hits(seq)}
    n = sum(h["requests"] for h in per_host.values())
    bel = sum(h["belady_hits"] for h in per_host.values())
    comp = sum(h["compulsory_hits"] for h in per_host.values())
    fleet_comp = compulsory_hits([r["adapter"] for r in rows])
    return {"slots": slots, "per_host": per_host, "belady_hits": bel, "compulsory_hits": comp,
            "fleet_compulsory_hits": fleet_comp,
            "belady_hit_ratio": bel / n if n else None, "compulsory_hit_ratio": comp / n if n else None,
            "fleet_compulsory_hit_ratio": fleet_comp / n if n else None}
