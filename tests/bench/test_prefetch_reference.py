"""``bench.prefetch_reference``: one run's requests replayed with predictors of increasing
knowledge through the same caches and rule (pure)."""
from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings, strategies as st

from bench.bounds import belady_hits
from bench.prefetch_reference import PREDICTORS, learnability, prefetch_reference, workflow_next


def rows_of(steps, flow=None):
    """``steps``: (session, adapter, host) in send order, one second apart."""
    out, labels = [], {}
    for i, (s, a, h) in enumerate(steps):
        out.append({"id": f"r{i}", "session": s, "adapter": a, "host": h, "sent_s": i, "at_s": float(i)})
        if flow:
            labels[f"r{i}"] = flow[s]
    return out, labels


def lru_hits(seq, slots):
    cache, hits = OrderedDict(), 0
    for a in seq:
        if a in cache:
            hits += 1
            cache.move_to_end(a)
            continue
        if len(cache) >= slots:
            cache.popitem(last=False)
        cache[a] = None
    return hits


def test_workflow_next_follows_the_chain_through_repeats_and_strays():
    chain = ["a", "b", "a", "c"]
    assert workflow_next([], chain) == "a"
    assert workflow_next(["a"], chain) == "b"
    assert workflow_next(["a", "a"], chain) == "b"        # a repeat stays in place
    assert workflow_next(["a", "z", "b"], chain) == "a"   # a stray is skipped
    assert workflow_next(["a", "c"], chain) is None       # a jump to the chain's last step: its end
    assert workflow_next(["a", "b", "a", "c"], chain) is None


def test_knowing_the_next_step_turns_a_thrashing_host_into_hits():
    # two interleaved sessions alternating over three adapters on one host of 2 slots
    steps = [("s1", "a", "h"), ("s2", "c", "h"), ("s1", "b", "h"), ("s2", "c", "h"), ("s1", "a", "h"),
             ("s2", "c", "h"), ("s1", "b", "h")]
    rows, labels = rows_of(steps, flow={"s1": "a->b->a->b", "s2": "c->c->c"})
    got = prefetch_reference(rows, 2, labels=labels)
    p = got["predictors"]
    assert p["none"]["hits"] == lru_hits([a for _, a, _ in steps], 2) == 2
    assert p["next_step"]["hits"] > p["none"]["hits"]
    assert p["next_step"]["predictions_right"] == p["next_step"]["predictions"] == 5
    assert p["workflow"]["hits"] == p["next_step"]["hits"]   # the sessions follow their plans exactly
    assert got["belady_hits"] == belady_hits([a for _, a, _ in steps], 2)


def test_the_learned_model_only_knows_what_was_sent_before():
    # the first session teaches a -> b; the second, on a cold host, is predicted from it
    steps = [("s1", "a", "h1"), ("s1", "b", "h1"), ("s2", "a", "h2"), ("s2", "b", "h2")]
    rows, _ = rows_of(steps)
    p = prefetch_reference(rows, 1, labels={})["predictors"]
    assert p["learned"]["predictions"] == 1 and p["learned"]["predictions_right"] == 1
    # b was last sent to h1, so the prediction targets h1 (where routing keeps b): no hit on h2
    assert p["learned"]["hits"] == p["none"]["hits"] == 0
    assert p["workflow"]["predictions"] == 0   # no labels: no plan known


def test_seen_workflows_knows_a_plan_only_after_a_session_followed_it():
    # s1 opens workflow a->b->c (never seen: the learned model, empty, guesses nothing);
    # s2 follows it again later: its plan is known, so both its next steps are predicted
    steps = [("s1", "a", "h"), ("s1", "b", "h"), ("s1", "c", "h"), ("s2", "a", "h"), ("s2", "b", "h"),
             ("s2", "c", "h")]
    rows, labels = rows_of(steps, flow={"s1": "a->b->c", "s2": "a->b->c"})
    p = prefetch_reference(rows, 1, labels=labels)["predictors"]
    assert p["workflow"]["predictions"] == 4
    assert p["seen_workflows"]["predictions"] == 2 and p["seen_workflows"]["predictions_right"] == 2
    assert p["learned"]["predictions"] == 2   # a -> b and b -> c, learned from s1
    assert p["none"]["hits"] == 0 and p["workflow"]["hits"] == 4 and p["seen_workflows"]["hits"] == 2


def test_a_prediction_protects_its_adapter_only_while_live():
    # s1 predicts b at t=1 (prefetched); s2 then needs d and c on the same 2-slot host; s1's b
    # comes back at t=60: kept while s1's prediction is live, the LRU victim once it lapsed
    steps = [("s0", "x", 0), ("s1", "a", 1), ("s2", "d", 2), ("s2", "c", 3), ("s1", "b", 60)]
    rows = [{"id": f"r{i}", "session": s, "adapter": a, "host": "h", "sent_s": i, "at_s": float(t)}
            for i, (s, a, t) in enumerate(steps)]
    live = prefetch_reference(rows, 2, live_s=100.0)["predictors"]["next_step"]
    lapsed = prefetch_reference(rows, 2, live_s=0.5)["predictors"]["next_step"]
    assert live["prefetches"] == lapsed["prefetches"] == 2
    assert live["hits"] == lapsed["hits"] + 1


def test_slots_must_be_positive():
    with pytest.raises(ValueError):
        prefetch_reference([], 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["s1", "s2", "s3"]), st.sampled_from("abcdef"),
                          st.sampled_from(["h1", "h2"])), max_size=40),
       st.integers(min_value=1, max_value=4))
def test_every_predictor_counts_within_the_requests_and_none_is_lru(steps, slots):
    rows, labels = rows_of(steps, flow={"s1": "a->b->c", "s2": "d->e", "s3": "f->a"})
    got = prefetch_reference(rows, slots, labels=labels)
    assert set(got["predictors"]) == set(PREDICTORS)
    for e in got["predictors"].values():
        assert 0 <= e["hits"] <= len(steps)
        assert 0 <= e["predictions_right"] <= e["predictions"] <= len(steps)
    by_host = {}
    for _, a, h in steps:
        by_host.setdefault(h, []).append(a)
    assert got["predictors"]["none"]["hits"] == sum(lru_hits(v, slots) for v in by_host.values())
    assert got["predictors"]["none"]["hits"] <= got["belady_hits"]


def test_learnability_splits_first_sessions_of_a_workflow_from_later_ones():
    def req(t, s, a, flow):
        return {"t": t, "tenant": "t1", "session": s, "adapter": a, "workflow": flow}
    flow = "a->b->c"
    trace = [req(0, "s1", "a", flow), req(1, "s1", "b", flow), req(2, "s1", "c", flow),
             req(10, "s2", "a", flow), req(11, "s2", "b", flow), req(12, "s2", "c", flow),
             req(20, "s3", "z", "one-off")]
    got = learnability(list(reversed(trace)))   # time order is the trace's, not the list's
    assert got["first"] == {"steps": 2, "learned": 0, "gateway": 0, "workflow": 2}
    # s2 follows the plan s1 taught: both models name both its steps (the gateway's from its
    # all-tenant rows, the tenant's own having fewer than min_support observations)
    assert got["later"] == {"steps": 2, "learned": 2, "gateway": 2, "workflow": 2}


def test_the_builtin_benchs_rows_are_replayed_on_the_traces_clock_in_the_order_sent():
    """``bench.multi_lora_eval.stack_prefetch_reference``: an arm's rows (sent out of the
    trace's order) and the trace (its ``t`` and ``workflow`` labels) give the same reference
    as the rows ``prefetch_reference`` takes directly."""
    from bench.multi_lora_eval import stack_prefetch_reference

    trace = [{"id": f"r{i}", "t": 10.0 * i, "workflow": "a->b->c"} for i in range(6)]
    sent = [("r1", 2.0), ("r0", 1.0), ("r2", 3.0), ("r4", 5.0), ("r3", 4.0), ("r5", 6.0)]
    steps = {"r0": ("s0", "a"), "r1": ("s0", "b"), "r2": ("s0", "c"), "r3": ("s1", "a"), "r4": ("s1", "b"),
             "r5": ("s1", "c")}
    ok = [{"id": i, "session": steps[i][0], "adapter": steps[i][1], "host": "h0", "sent_s": at, "wait_ms": 0.0}
          for i, at in sent]
    got = stack_prefetch_reference(ok, trace, 2)
    direct = prefetch_reference([{"id": r["id"], "session": r["session"], "adapter": r["adapter"], "host": "h0",
                                  "sent_s": r["sent_s"], "at_s": 10.0 * int(r["id"][1:])} for r in ok], 2,
                                labels={f"r{i}": "a->b->c" for i in range(6)})
    assert got == direct
    assert got["requests"] == 6 and got["slots"] == 2
    # with the plan known, the second session's b and c are prefetched behind its a
    assert got["predictors"]["workflow"]["hits"] > got["predictors"]["none"]["hits"]
