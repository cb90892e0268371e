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
  elsewhere (another host's requests, a warm set) or loaded unasked (ace's start-up fill).
- ``fleet_compulsory_hits`` (``fleet_bounds``): every request but the first of each
  adapter in the whole trace: the ceiling of every policy that starts cold and loads
  only adapters some request has named (affinity; not ace, whose gateway fills each empty
  pool at start-up with the adapters routing places there: ``fill_signals``).

A hit here is by count: timing (a load still in flight) is not modelled, so these are
ceilings, not predictions.

``miss_causes`` explains an arm's misses one by one (``MISS_CAUSES``, first match wins),
from the trace's own labels (``workflow``: the generator's ground truth of which
requests are one-offs and which steps stray from their session's habitual workflow),
the arm's realized per-host sequences and Belady's choices on them.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Hashable, Iterable, Mapping, Sequence

__all__ = ["MISS_CAUSES", "belady_flags", "belady_hits", "compulsory_hits", "fleet_bounds", "host_sequences",
           "miss_causes"]


def belady_hits(seq: Sequence[Hashable], slots: int) -> int:
    """Hits of Belady's furthest-next-use eviction over ``seq`` with ``slots`` slots."""
    return sum(belady_flags(seq, slots))


def belady_flags(seq: Sequence[Hashable], slots: int) -> list[bool]:
    """Per request of ``seq``: does Belady's furthest-next-use eviction hit it?"""
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
    hits = [False] * n
    for i, a in enumerate(seq):
        if a in cached:
            hits[i] = True
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


#: why a request missed, in the order ``miss_causes`` tries them (first match wins)
MISS_CAUSES = {
    "compulsory": "the first request for its adapter in the whole fleet: only a load before any request "
                  "named it (ace's start-up fill of free room) can hit it",
    "unpredictable": "a one-off request, a step that strays from its session's workflow (trace labels), or "
                     "the tenant's first request for this adapter: nothing learned online names it",
    "late": "its adapter was being loaded (a prefetch or an ingress load in flight) when the engine reached it",
    "opener": "the first step of a habitual workflow: only the tenant's openers (popularity) predict it",
    "placement": "the first request for its adapter on this host (routing moved or replicated it)",
    "evicted": "on this host before and evicted since, though Belady on the same host sequence keeps it: "
               "the eviction (or prefetch victim) choice lost it",
    "capacity": "on this host before and evicted since, and Belady on the same host sequence misses it too: "
                "the host's working set exceeds its slots",
}


def miss_causes(rows: Sequence[Mapping], slots: int, *, labels: Mapping[str, str] | None = None) -> dict:
    """Each miss of an arm counted under one ``MISS_CAUSES`` cause.

    ``rows``: the arm's requests with ``host``, ``adapter``, ``tenant``, ``session``, ``step``,
    ``sent_s`` (send order), ``hit`` (bool) and optionally ``late`` (bool: the miss waited
    for a load already in flight), ``wait_ms`` (its adapter stall) and ``id``; ``labels``: request id -> the trace's
    ``workflow`` (``"one-off"`` or the session's chain ``"a->b->c"``; without it no step
    counts as a stray). Returns the counts per cause, the requests, hits and misses, how
    many unpredictable requests there were (and how many hit anyway: an adapter someone
    else kept resident), ``ceiling``: the hit ratio if every miss but the compulsory
    and unpredictable ones were a hit, and (with ``wait_ms``) ``compulsory_stall_p99_ms``:
    the stall p99 if only the compulsory misses had stalled, each as long as it did: the
    floor of every cold-start policy's stall p99 whenever they are more than 1% of the
    requests. Against Belady on the same host sequences (the demand-caching optimum at
    ``slots``): ``belady_kept``, the misses per cause that Belady hits (it knows which stray
    comes), and ``belady_missed_hits``, the hits Belady misses (a prefetch, or the start-up
    fill, loaded the adapter before its request): the arm's hits minus Belady's are
    ``belady_missed_hits - sum(belady_kept)``."""
    labels = labels or {}
    ordered = sorted(rows, key=lambda r: r["sent_s"])
    flags: dict[int, bool] = {}
    by_host: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(ordered):
        by_host[r["host"] or "unknown"].append(i)
    for idx in by_host.values():
        for i, f in zip(idx, belady_flags([ordered[i]["adapter"] for i in idx], slots)):
            flags[i] = f
    fleet_seen: set = set()
    tenant_seen: set = set()
    host_seen: set = set()
    counts = dict.fromkeys(MISS_CAUSES, 0)
    kept = dict.fromkeys(MISS_CAUSES, 0)
    unpredictable = unpredictable_hits = missed_hits = 0
    floor: list[float] = []
    for i, r in enumerate(ordered):
        a, host = r["adapter"], r["host"] or "unknown"
        flow = labels.get(r.get("id"), "")
        stray = flow == "one-off" or (bool(flow) and a not in flow.split("->"))
        new_for_tenant = (r["tenant"], a) not in tenant_seen
        compulsory = a not in fleet_seen
        if not compulsory and (stray or new_for_tenant):
            unpredictable += 1
            unpredictable_hits += bool(r["hit"])
        if not r["hit"]:
            if compulsory:
                cause = "compulsory"
                floor.append(float(r.get("wait_ms") or 0.0))
            elif stray or new_for_tenant:
                cause = "unpredictable"
            elif r.get("late"):
                cause = "late"
            elif r.get("step") == 0:
                cause = "opener"
            elif (host, a) not in host_seen:
                cause = "placement"
            else:
                cause = "evicted" if flags[i] else "capacity"
            counts[cause] += 1
            kept[cause] += flags[i]
        elif not flags[i]:
            missed_hits += 1
        fleet_seen.add(a)
        tenant_seen.add((r["tenant"], a))
        host_seen.add((host, a))
    n = len(ordered)
    hits = sum(1 for r in ordered if r["hit"])
    bound = n - counts["compulsory"] - counts["unpredictable"]
    out = {"requests": n, "hits": hits, "misses": n - hits, "causes": counts,
           "unpredictable_requests": unpredictable, "unpredictable_hits": unpredictable_hits,
           "ceiling": bound / n if n else None,
           "belady_kept": {c: k for c, k in kept.items() if k}, "belady_missed_hits": missed_hits}
    if n and any("wait_ms" in r for r in ordered):
        stalls = sorted(floor + [0.0] * (n - len(floor)))
        out["compulsory_stall_p99_ms"] = round(stalls[min(n - 1, int(0.99 * n))], 2)
    out["definitions"] = MISS_CAUSES
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.bounds REPORT``: (re)derive every fleet entry's ``miss_causes`` and
    ``prefetch_reference`` of a ``bench.multi_lora_eval`` or ``bench.vllm_eval`` report from the rows it wrote beside it
    (``<report>_rows.jsonl``; each arm's first run) and its trace; rewrites the report."""
    import argparse
    import json
    from pathlib import Path

    from bench.multi_lora_eval import ok_rows, stack_miss_causes, stack_prefetch_reference
    from bench.report import first_replay_rows
    from bench.trace import load_trace

    ap = argparse.ArgumentParser(prog="python -m bench.bounds", description=main.__doc__.split(";")[0])
    ap.add_argument("report")
    path = Path(ap.parse_args(argv).report)
    report = json.loads(path.read_text())
    requests = load_trace(report["trace"])
    if report.get("engine") == "vllm":
        from bench.vllm_eval import first_requests, vllm_miss_causes, vllm_prefetch_reference

        requests = first_requests(requests, report["requests"])
        flags = report["vllm_flags"]
        capacity = int(flags[flags.index("--max-cpu-loras") + 1])
        by_arm: dict[str, list] = defaultdict(list)
        for r in first_replay_rows(path):
            by_arm[r["arm"]].append(r)
        for arms in report["fleets"].values():
            for arm, entry in arms.items():
                entry["miss_causes"] = vllm_miss_causes(by_arm[arm], requests, capacity)
                entry["prefetch_reference"] = vllm_prefetch_reference(by_arm[arm], requests, capacity)
        path.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    rows: dict[tuple[str, str], list] = defaultdict(list)
    for r in first_replay_rows(path):
        rows[(str(r.pop("hosts")), r.pop("arm"))].append(r)
    for n, arms in report["fleets"].items():
        for arm, entry in arms.items():
            ok = ok_rows(rows[(n, arm)])
            entry["miss_causes"] = stack_miss_causes(ok, requests, report["pool_adapters"])
            entry["prefetch_reference"] = stack_prefetch_reference(ok, requests, report["pool_adapters"])
    path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
