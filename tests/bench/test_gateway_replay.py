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


def test_bets_priced_with_the_agents_waste_share_are_fewer():
    """What the hosts' agents announce as a wasted bet's cost reaches the planner's price:
    charged in full (the builtin engine on the CPU), fewer bets pay than when free."""
    trace = load_trace(TRACE)
    free = replay(trace, "ace", hosts=1, slots=5, speed=2)
    charged = replay(trace, "ace", hosts=1, slots=5, speed=2, waste_share=1.0)
    assert 0 < charged["prefetch"]["sent"] < free["prefetch"]["sent"]
    with pytest.raises(ValueError, match="waste_share"):
        replay(trace, "ace", hosts=1, slots=5, waste_share=1.5)


def test_an_engine_that_keeps_its_own_lru_ignores_the_named_victims():
    """``engine_lru`` (vLLM's cache without ace's evicting unload): the named victims do not
    decide what leaves, so the same bets find a different pool."""
    trace = load_trace(TRACE)
    named = replay(trace, "ace", hosts=1, slots=3, speed=2, keep_rows=True)
    lru = replay(trace, "ace", hosts=1, slots=3, speed=2, keep_rows=True, engine_lru=True)
    assert [r["hit"] for r in named["rows"]] != [r["hit"] for r in lru["rows"]]
