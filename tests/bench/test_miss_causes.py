"""bench.bounds.miss_causes: every miss counted under one cause, from labels and host sequences."""
from __future__ import annotations

from bench.bounds import MISS_CAUSES, belady_flags, belady_hits, miss_causes


def row(i, host, adapter, *, hit, tenant="t", session="s1", step=1, late=False):
    return {"id": f"r{i}", "host": host, "adapter": adapter, "tenant": tenant, "session": session,
            "step": step, "sent_s": float(i), "hit": hit, "late": late}


def test_belady_flags_sum_to_belady_hits():
    seq = list("abcabdabcdeab")
    flags = belady_flags(seq, 2)
    assert sum(flags) == belady_hits(seq, 2)
    assert flags[:3] == [False, False, False]


def test_each_cause():
    rows = [
        row(0, "h1", "a", hit=False, step=0),                       # compulsory
        row(1, "h1", "b", hit=False),                               # compulsory
        row(2, "h2", "a", hit=False, tenant="u", session="x"),      # unpredictable: new for tenant u
        row(3, "h1", "a", hit=False, step=0, session="s2"),         # opener (a habitual first step)
        row(4, "h2", "b", hit=False, late=True),                    # late
        row(5, "h3", "a", hit=False, session="s3"),                 # placement: the first a on h3
        row(6, "h1", "b", hit=False),                               # h1 saw b before: evicted or capacity
        row(7, "h1", "c", hit=True, session="s9"),                  # a stray that hit
    ]
    labels = {f"r{i}": "a->b" for i in range(8)}
    labels["r7"] = "a->b"  # c is not in its workflow: a stray
    out = miss_causes(rows, 1, labels=labels)
    c = out["causes"]
    assert set(c) == set(MISS_CAUSES)
    assert c["compulsory"] == 2  # a and b (c is the fleet's first c too, but it hit)
    assert c["unpredictable"] == 1 and c["late"] == 1 and c["opener"] == 1 and c["placement"] == 1
    assert c["evicted"] + c["capacity"] == 1
    assert out["misses"] == sum(c.values()) == 7 and out["hits"] == 1
    assert out["unpredictable_requests"] == 1  # row 2 (row 7's c is compulsory)


def test_one_off_and_stray_are_unpredictable():
    rows = [row(0, "h", "a", hit=True), row(1, "h", "b", hit=True), row(2, "h", "a", hit=False, session="s2"),
            row(3, "h", "b", hit=False, session="s3", step=0)]
    labels = {"r0": "a->b", "r1": "a->b", "r2": "b->c", "r3": "one-off"}
    out = miss_causes(rows, 4, labels=labels)
    assert out["causes"]["unpredictable"] == 2
    assert out["ceiling"] == 2 / 4


def test_capacity_when_belady_misses_too():
    # 1 slot, a b a b: Belady misses every request, so the repeats are capacity, not eviction choices
    rows = [row(i, "h", x, hit=False) for i, x in enumerate("abab")]
    out = miss_causes(rows, 1, labels={f"r{i}": "a->b" for i in range(4)})
    assert out["causes"]["capacity"] == 2 and out["causes"]["evicted"] == 0
    # 2 slots: Belady keeps both, so the same misses are the policy's eviction choices
    out = miss_causes(rows, 2, labels={f"r{i}": "a->b" for i in range(4)})
    assert out["causes"]["evicted"] == 2 and out["causes"]["capacity"] == 0


def test_compulsory_stall_floor():
    rows = [{**row(i, "h", f"a{i % 50}", hit=i >= 50), "wait_ms": 100.0 if i < 50 else 0.0} for i in range(100)]
    out = miss_causes(rows, 64)
    assert out["causes"]["compulsory"] == 50
    assert out["compulsory_stall_p99_ms"] == 100.0  # half the requests stalled on a first load
    assert "compulsory_stall_p99_ms" not in miss_causes([row(0, "h", "a", hit=False)], 1)


def test_against_belady_the_misses_it_keeps_and_the_hits_it_misses():
    # 1 slot on one host: a b a. Belady misses all three (the second a's slot went to b);
    # a prefetch that brought a back in time made the third a hit: a hit Belady misses
    rows = [row(0, "h", "a", hit=False), row(1, "h", "b", hit=False), row(2, "h", "a", hit=True)]
    out = miss_causes(rows, 1, labels={f"r{i}": "a->b" for i in range(3)})
    assert out["belady_kept"] == {} and out["belady_missed_hits"] == 1
    # 2 slots: Belady keeps a, so the policy's miss on it (a stray here) is one Belady hits
    rows = [row(0, "h", "a", hit=False), row(1, "h", "b", hit=False), row(2, "h", "a", hit=False, session="s2")]
    out = miss_causes(rows, 2, labels={"r0": "a->b", "r1": "a->b", "r2": "one-off"})
    assert out["causes"]["unpredictable"] == 1
    assert out["belady_kept"] == {"unpredictable": 1} and out["belady_missed_hits"] == 0
    # the arm's hits minus Belady's = hits Belady misses - misses Belady keeps
    assert out["hits"] - belady_hits([r["adapter"] for r in rows], 2) == \
        out["belady_missed_hits"] - sum(out["belady_kept"].values())
