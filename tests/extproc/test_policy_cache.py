import pytest

from extproc.policy.cache import HIT, LATE, MISS, AdapterCache


@pytest.mark.parametrize(
    "capacity, accesses, expected",
    [
        # plain LRU on a 2-slot cache: a b a c b -> b was LRU when c came in
        (2, "abacb", [MISS, MISS, HIT, MISS, MISS]),
        (3, "abacb", [MISS, MISS, HIT, MISS, HIT]),
        (1, "aab", [MISS, HIT, MISS]),
    ],
)
def test_lru_access_sequences(capacity, accesses, expected):
    cache = AdapterCache(capacity)
    got = []
    for i, key in enumerate(accesses):
        outcome = cache.access(key, now=float(i))
        if outcome == MISS:
            cache.admit(key, ready_at=float(i))
        got.append(outcome)
    assert got == expected


def test_in_flight_load_is_late_then_hit():
    cache = AdapterCache(2)
    cache.admit("a", ready_at=10.0, prefetched=True, score=0.8)
    assert cache.access("a", now=5.0) == LATE
    assert cache.access("a", now=10.0) == HIT
    assert cache.stats.prefetch_used == 1 and cache.stats.late == 1


def test_unused_prefetch_counts_as_wasted_on_eviction():
    cache = AdapterCache(1)
    cache.admit("a", 0.0, prefetched=True)
    assert cache.admit("b", 0.0) == ["a"]
    assert cache.stats.prefetch_wasted == 1 and cache.stats.prefetches == 1


def test_a_refused_prefetch_is_withdrawn_not_evicted_or_wasted():
    cache = AdapterCache(2)
    cache.admit("a", 0.0)
    cache.admit("b", ready_at=5.0, prefetched=True)
    assert cache.withdraw("b", now=1.0)                      # still in flight: dropped
    assert "b" not in cache and cache.used == 1
    assert (cache.stats.prefetch_refused, cache.stats.prefetch_wasted, cache.stats.evictions) == (1, 0, 0)
    assert not cache.withdraw("a", now=1.0)                  # not a prefetch
    cache.admit("c", ready_at=2.0, prefetched=True)
    assert not cache.withdraw("c", now=3.0)                  # its load is done by now: kept
    assert not cache.withdraw("zz", now=3.0) and "c" in cache


def test_victims_do_not_mutate_and_skip_pinned():
    cache = AdapterCache(2)
    cache.admit("a", 0.0)
    cache.admit("b", 0.0)
    cache.pin("a")
    assert cache.victims() == ["b"]
    assert list(cache) == ["a", "b"]
    assert cache.admit("c", 0.0) == ["b"]
    cache.pin("c")
    assert cache.admit("d", 0.0) is None  # everything pinned


def test_sizes_in_bytes():
    cache = AdapterCache(100)
    cache.admit("small", 0.0, size=30)
    cache.admit("mid", 0.0, size=50)
    assert cache.victims(40) == ["small"]
    assert cache.victims(60) == ["small", "mid"]
    assert cache.admit("huge", 0.0, size=101) is None
    assert cache.admit("big", 0.0, size=60) == ["small", "mid"]
    assert cache.used == 60


def test_coldest_spares_a_hot_lru_entry():
    cache = AdapterCache(3)
    for k in "abc":
        cache.admit(k, 0.0)
    scores = {"a": 0.9, "b": 0.1, "c": 0.0}
    assert cache.coldest(lambda k, e: scores[k], window=2) == "b"  # c is outside the window
    assert cache.coldest(lambda k, e: scores[k], window=1) == "a"  # plain LRU
    assert cache.coldest(lambda k, e: 0.0, window=3) == "a"  # ties: least recent


def test_coldest_window_zero_looks_at_every_entry():
    c = AdapterCache(4)
    for k in "abcd":
        c.admit(k, 0.0)
    scores = {"a": 0.9, "b": 0.8, "c": 0.7, "d": 0.1}
    assert c.coldest(lambda k, e: scores[k], window=2) == "b"
    assert c.coldest(lambda k, e: scores[k], window=0) == "d"
    c.pin("d")
    assert c.coldest(lambda k, e: scores[k], window=0) == "c"
