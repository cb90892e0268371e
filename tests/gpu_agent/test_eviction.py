import pytest
import torch

from gpu_agent.eviction import FIFOPolicy, LRUPolicy, make_policy
from gpu_agent.engine.pool import AdapterPool

from .lora_testing import SPEC, make_adapter

PAGES_R8 = 8 * 14


def _run(policy, budget_adapters, sequence, pinned=()):
    """Replay an access sequence: 'x' loads/uses x. Returns residents in policy order."""
    pool = AdapterPool(SPEC, budget_adapters * PAGES_R8 * 32 * 4, eviction=policy)
    evicted = []
    for name in sequence:
        before = set(pool.resident())
        if pool.contains(name):
            pool.touch(name)
        else:
            pool.load(make_adapter(name, 8), pin=name in pinned)
        evicted += sorted(before - set(pool.resident()))
    return evicted, sorted(pool.resident())


@pytest.mark.parametrize("policy, sequence, pinned, evicted, resident", [
    # budget = 3 adapters
    ("lru", "abcd", (), ["a"], ["b", "c", "d"]),
    ("lru", "abcad", (), ["b"], ["a", "c", "d"]),
    ("lru", "abcaeda", (), ["b", "c"], ["a", "d", "e"]),
    ("fifo", "abcad", (), ["a"], ["b", "c", "d"]),
    ("fifo", "abcaeda", (), ["a", "b", "c"], ["a", "d", "e"]),
    ("lru", "abcd", ("a",), ["b"], ["a", "c", "d"]),
    ("lru", "abcdef", ("a", "b"), ["c", "d", "e"], ["a", "b", "f"]),
    ("fifo", "abcde", ("a",), ["b", "c"], ["a", "d", "e"]),
])
def test_access_sequences(policy, sequence, pinned, evicted, resident):
    assert _run(make_policy(policy), 3, sequence, pinned) == (evicted, resident)


def test_policy_orders_directly():
    p = LRUPolicy()
    for n in "abc":
        p.on_load(n)
    p.on_access("a")
    p.on_remove("b")
    assert list(p.candidates()) == ["c", "a"]
    f = FIFOPolicy()
    for n in "abc":
        f.on_load(n)
    f.on_access("a")
    assert list(f.candidates()) == ["a", "b", "c"]


def test_unknown_policy():
    with pytest.raises(ValueError):
        make_policy("random")


def test_in_use_skipped_by_policy():
    pool = AdapterPool(SPEC, 2 * PAGES_R8 * 32 * 4)
    pool.load(make_adapter("a", 8))
    pool.load(make_adapter("b", 8))
    with pool.batch(["a"]):
        pool.load(make_adapter("c", 8))   # a is LRU but in use: b goes
    assert sorted(pool.resident()) == ["a", "c"]
    assert torch.is_tensor(pool.pages)


@pytest.mark.parametrize("hints, resident, protected, victims", [
    (["b"], "abc", "", ["b"]),
    (["c", "a"], "abc", "", ["c", "a"]),             # the caller's order, not residency order
    (["b", "b"], "abc", "", ["b"]),                  # each once
    (["x"], "x", "", []),                            # never the adapter being loaded
    (["d"], "abc", "", []),                          # not resident
    (["b", "c"], "abc", "b", ["c"]),                 # pinned / in use / loading
    ([], "abc", "", []),
])
def test_hinted_victims(hints, resident, protected, victims):
    from gpu_agent.eviction import hinted_victims
    assert hinted_victims(hints, "x", resident=set(resident), protected=set(protected)) == victims


@pytest.mark.parametrize("order, short, victims", [
    ([("a", 1), ("b", 1), ("c", 1)], dict(count=1), ["a"]),
    ([("a", 1), ("b", 1), ("c", 1)], dict(count=0), []),                 # nothing short: nothing goes
    ([("a", 2), ("b", 5), ("c", 1)], dict(size=6), ["a", "b"]),           # sizes add up in order
    ([("a", 2, False), ("b", 5), ("c", 1)], dict(size=6), ["b", "c"]),     # not evictable: skipped
    ([("a", 1), ("b", 1)], dict(size=5), ["a", "b"]),                     # never met: every evictable one
    ([("a", 9), ("b", 1), ("c", 1)], dict(count=2, size=1), ["a", "b"]),   # both budgets
])
def test_plan_evictions(order, short, victims):
    from gpu_agent.eviction import Candidate, Shortfall, plan_evictions

    assert plan_evictions([Candidate(*c) for c in order], Shortfall(**short)) == victims


def test_pool_frees_what_its_owner_chooses_never_an_adapter_in_use():
    pool = AdapterPool(SPEC, 2 * PAGES_R8 * 32 * 4)
    pool.load(make_adapter("a", 8))
    pool.load(make_adapter("b", 8))
    asked = []

    def owner(loading, short, order):
        asked.append((loading, short.size > 0, [(c.name, c.evictable) for c in order]))
        return ["a", "b"]            # "a" is in use: the pool frees only "b"

    pool.choose_victims = owner
    with pool.batch(["a"]):
        pool.load(make_adapter("c", 8))
    assert asked == [("c", True, [("b", True), ("a", False)])]   # the batch used "a" last
    assert sorted(pool.resident()) == ["a", "c"]
    pool.check_invariants()


@pytest.mark.parametrize("order, hints, names", [
    ("abc", "c", "cab"),
    ("abc", "cb", "cba"),                  # the hint's order, then the policy's
    ("abc", "xb", "bac"),                  # names that match no candidate are dropped
    ("abc", "", "abc"),
    ("abc", "bb", "bac"),
])
def test_hinted_first(order, hints, names):
    from gpu_agent.eviction import Candidate, Shortfall, hinted_first, plan_evictions

    assert "".join(c.name for c in hinted_first([Candidate(n, 1) for n in order], list(hints))) == names
    # a hinted candidate that may not go stays where plan_evictions skips it
    cands = hinted_first([Candidate("a", 1), Candidate("b", 1, False)], ["b"])
    assert plan_evictions(cands, Shortfall(count=1)) == ["a"]
