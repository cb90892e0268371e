"""Per-host bounds by count, the TTFT split and the replay pacing (pure)."""
from __future__ import annotations

import itertools

import pytest

from bench.bounds import belady_hits, compulsory_hits, fleet_bounds
from bench.pacing import replay_speed
from bench.report import fleet_checks, ttft_breakdown


def lru_hits(seq, slots):
    cache: list = []
    hits = 0
    for a in seq:
        if a in cache:
            hits += 1
            cache.remove(a)
        elif len(cache) >= slots:
            cache.pop(0)
        cache.append(a)
    return hits


def brute_force_best(seq, slots):
    """The most hits of any demand policy (every eviction choice tried)."""
    best = 0

    def go(i, cache, hits):
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        a = seq[i]
        if a in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < slots:
            go(i + 1, cache | {a}, hits)
        else:
            for v in cache:
                go(i + 1, (cache - {v}) | {a}, hits)
    go(0, frozenset(), 0)
    return best


def test_belady_is_the_demand_optimum_and_beats_lru():
    assert belady_hits(list("abcabcabc"), 2) == 3  # LRU gets none on the cycle
    assert lru_hits(list("abcabcabc"), 2) == 0
    for seq in ("abcdabcdaeb", "aabbcadbeca", "abacadaeafag"):
        for slots in (1, 2, 3):
            assert belady_hits(seq, slots) == brute_force_best(seq, slots)
            assert belady_hits(seq, slots) >= lru_hits(seq, slots)
    with pytest.raises(ValueError):
        belady_hits("ab", 0)


def test_fleet_bounds_per_host_in_send_order():
    rows = [{"host": h, "adapter": a, "sent_s": t} for t, (h, a) in
            enumerate([("e1", "a"), ("e2", "b"), ("e1", "c"), ("e1", "a"), ("e2", "a"), ("e1", "c")])]
    b = fleet_bounds(list(reversed(rows)), slots=1)
    assert b["per_host"]["e1"] == {"requests": 4, "adapters": 2, "belady_hits": 0, "compulsory_hits": 2}
    assert b["per_host"]["e2"] == {"requests": 2, "adapters": 2, "belady_hits": 0, "compulsory_hits": 0}
    assert b["compulsory_hits"] == 2 and b["fleet_compulsory_hits"] == 3 and b["belady_hit_ratio"] == 0
    assert compulsory_hits("aab") == 1


def test_ttft_breakdown_names_what_the_tail_is_made_of():
    rows = [{"ttft_ms": 10.0 + i, "wait_ms": 0.0, "queue_ms": 2.0, "compute_ms": 5.0, "loads_ms": 0.0,
             "outside_engine_ms": 3.0 + i} for i in range(99)]
    rows.append({"ttft_ms": 500.0, "wait_ms": 1.0, "queue_ms": 400.0, "compute_ms": 5.0, "loads_ms": 390.0,
                 "outside_engine_ms": 94.0})
    rows[0].update(wait_ms=9.0, load_fetch_ms=6.0, load_tiers_ms=2.5, load_paused_ms=0.0)  # a cold load
    rows.append({"ttft_ms": 9.0, "wait_ms": 0.0, "queue_ms": None, "compute_ms": None, "loads_ms": None,
                 "outside_engine_ms": None})  # no engine timing: left out
    b = ttft_breakdown(rows)
    assert b["rows"] == 100
    assert b["worst_1pct"] == {"rows": 1, "ttft_ms_p50": 500.0, "queue_ms_p50": 400.0, "stall_ms_p50": 1.0,
                               "compute_ms_p50": 5.0, "loads_ms_p50": 390.0, "outside_engine_ms_p50": 94.0}
    assert b["queue_ms"]["p50"] == 2.0 and b["compute_ms"]["mean"] == 5.0
    loads = b["source_loads"]
    assert loads["rows"] == 1 and loads["stall"]["p50"] == 9.0
    assert (loads["fetch"]["p99"], loads["tiers"]["p50"], loads["paused"]["p50"]) == (6.0, 2.5, 0.0)
    assert "source_loads" not in ttft_breakdown(rows[1:])
    assert "outside_engine_split" not in b   # no engine arrival marks: no split
    assert ttft_breakdown([]) == {"rows": 0}


def test_ttft_breakdown_splits_the_time_outside_the_engine_at_its_arrival_mark():
    rows = [{"ttft_ms": 10.0 + i, "wait_ms": 0.0, "queue_ms": 2.0, "compute_ms": 5.0, "loads_ms": 0.0,
             "outside_engine_ms": 3.0, "to_engine_ms": 2.0} for i in range(99)]
    rows.append({"ttft_ms": 160.0, "wait_ms": 0.0, "queue_ms": 2.0, "compute_ms": 5.0, "loads_ms": 0.0,
                 "outside_engine_ms": 53.0, "to_engine_ms": 3.0})   # the first token's way back stalled
    b = ttft_breakdown(rows)
    split = b["outside_engine_split"]
    assert split["rows"] == 100 and split["to_engine_ms"]["p50"] == 2.0 and split["from_engine_ms"]["p50"] == 1.0
    assert b["worst_1pct"]["to_engine_ms_p50"] == 3.0 and b["worst_1pct"]["from_engine_ms_p50"] == 50.0
    rows[-1]["to_engine_ms"] = None   # the worst request has no mark: no worst-row split
    assert "to_engine_ms_p50" not in ttft_breakdown(rows)["worst_1pct"]
    assert "loop_lag_ms" not in b


def test_ttft_breakdown_shows_the_engines_loop_lag_in_the_tail():
    rows = [{"ttft_ms": 10.0, "wait_ms": 0.0, "queue_ms": 2.0, "compute_ms": 5.0, "loads_ms": 0.0,
             "outside_engine_ms": 3.0, "loop_lag_ms": 0.0} for _ in range(99)]
    rows.append({"ttft_ms": 90.0, "wait_ms": 0.0, "queue_ms": 2.0, "compute_ms": 5.0, "loads_ms": 0.0,
                 "outside_engine_ms": 3.0, "loop_lag_ms": 80.0})
    b = ttft_breakdown(rows)
    assert b["loop_lag_ms"]["rows"] == 100 and b["loop_lag_ms"]["p50"] == 0.0 and b["loop_lag_ms"]["mean"] == 0.8
    assert b["worst_1pct"]["loop_lag_ms_p50"] == 80.0


def test_replay_speed_puts_the_busiest_host_at_the_target():
    reqs = [{"t": float(t)} for t in range(0, 1001)]  # 1001 requests over 1000 s
    speed, cal = replay_speed(reqs, hosts=4, compute_s=0.05, max_speed=100.0)
    # busiest host: 1.5/4 of 1001 requests x 50 ms = 18.8 s of compute; half busy -> 37.5 s
    assert speed == pytest.approx(1000 / 37.54, rel=0.01)
    assert cal["predicted_busiest_busy"] == pytest.approx(0.5, abs=0.01)
    assert replay_speed(reqs, hosts=4, compute_s=0.0001)[0] == 8.0  # capped
    slower = [replay_speed(reqs, hosts=n, compute_s=0.05, max_speed=100.0)[0] for n in (1, 2, 4)]
    assert slower == sorted(slower) and len(set(slower)) == 3


def test_fleet_checks_say_whether_affinity_stayed_below_saturation():
    entry = {"errors": 0, "stall_ms": {"p99": 1.0}, "ttft_ms": {"p99": 1.0}, "engine_busy": {"e1": 0.4, "e2": 0.69}}
    c = fleet_checks({"2": {"affinity": entry}})["2"]
    assert c["affinity_busiest_engine_busy"] == 0.69 and c["below_saturation"] is True
    c = fleet_checks({"2": {"affinity": dict(entry, engine_busy={"e1": 0.75})}})["2"]
    assert c["below_saturation"] is False


def test_every_permutation_of_a_small_sequence_keeps_belady_above_lru():
    for seq in itertools.permutations("aabbcd"):
        assert belady_hits(seq, 2) >= lru_hits(seq, 2)
