"""bench.gateway_replay: Belady's count, and the replay through the gateway's own routing."""
import pytest

from bench.gateway_replay import belady_hits, replay
from bench.trace import load_trace

TRACE = "data/multi_lora_eval/multi_lora_eval_800.json"


@pytest.mark.parametrize(
    "seq, slots, hits",
    [
        ("abcabc", 3, 3),
        ("abcabc", 2, 2),   # evict the one used furthest: a b c(evict b) a(hit) b(evict c or a) c
        ("aaaa", 1, 3),
        ("abcdabcd", 1, 0),
        ("abacabad", 2, 3),  # a stays: a b a(hit) c(evict b) a(hit) b(evict c) a(hit) d
    ],
)
def test_belady_hits(seq, slots, hits):
    assert belady_hits(list(seq), slots) == hits


def test_placement_by_demand_evens_the_hosts_out():
    trace = load_trace(TRACE)
    # 10 adapters over 4 pools of 2: more than the pools hold, so placement balances
    ring = replay(trace, "affinity", hosts=4, slots=2, speed=8, place_every_s=0)
    by_demand = replay(trace, "affinity", hosts=4, slots=2, speed=8)
    assert sum(by_demand["requests_per_host"]) == len(trace)
    assert max(by_demand["requests_per_host"]) < max(ring["requests_per_host"])
    for r in (ring, by_demand):  # Belady by count bounds what a demand pool makes
        assert r["effective_hits"] <= r["belady_hit_ratio"] * len(trace) + 1e-9


def test_the_ace_arm_sends_prefetches_through_the_gateways_planner():
    trace = load_trace(TRACE)
    r = replay(trace, "ace", hosts=1, slots=5, speed=2)
    assert r["prefetch"]["sent"] > 0 and r["planner"]["predictions"] > 0
    assert r["prefetch"]["used"] + r["prefetch"]["wasted"] <= r["prefetch"]["sent"]
