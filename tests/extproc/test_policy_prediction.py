import math

import pytest

from extproc.policy.prediction import (
    DecayedPopularity,
    PredictionLedger,
    TransitionModel,
    candidate_score,
    should_speculate,
    use_probability,
    victim_score,
)


@pytest.mark.parametrize(
    "cand, victim, min_score, expected",
    [
        (0.6, 0.0, 0.0, True),  # free slot
        (0.6, 0.5, 0.0, True),
        (0.5, 0.5, 0.0, False),  # a tie keeps what is resident
        (0.4, 0.9, 0.0, False),  # never evict something hotter
        (0.1, 0.0, 0.2, False),  # below the floor even into a free slot
    ],
)
def test_should_speculate_tiers(cand, victim, min_score, expected):
    assert should_speculate(cand, victim, min_score=min_score) is expected


def test_scores():
    assert use_probability(0.0, 10) == 0.0
    assert use_probability(0.1, 10) == pytest.approx(1 - math.exp(-1))
    assert candidate_score(0.5, 0.0, 10) == pytest.approx(0.5)
    assert candidate_score(0.5, 0.1, 10) > 0.5
    assert victim_score(0.0, 10, pending=0.7) == 0.7


def test_workflow_chain_is_learned_per_tenant():
    model = TransitionModel(min_support=2)
    for s in range(5):
        for adapter in ("code", "review", "sql"):
            model.observe("t1", s, adapter)
    assert model.predict_next("t1", "code", 1) == [("review", 1.0)]
    assert model.predict_next("t1", "review", 2) == [("sql", 1.0)]
    assert model.predict_next("t1", "sql", 2) == []  # chain ends, nothing learned after sql


def test_new_tenant_falls_back_to_global_model():
    model = TransitionModel(min_support=2)
    for s in range(3):
        model.observe("old", s, "a")
        model.observe("old", s, "b")
    assert model.predict_next("new", "a", 1) == [("b", 1.0)]


def test_probabilities_and_aging():
    model = TransitionModel(min_support=1, halve_at=8)
    for s in range(6):
        model.observe("t", s, "a")
        model.observe("t", s, "b" if s < 4 else "c")
    top = model.predict_next("t", "a", 2)
    assert [a for a, _ in top] == ["b", "c"]
    assert sum(p for _, p in top) == pytest.approx(1.0)
    for s in range(6, 30):  # the workflow changes: a -> c now
        model.observe("t", s, "a")
        model.observe("t", s, "c")
    assert model.predict_next("t", "a", 1)[0][0] == "c"


def test_sessions_are_bounded():
    model = TransitionModel(max_sessions=2)
    for s in range(5):
        model.observe("t", s, "a")
    assert model.last_adapter("t", 0) is None
    assert model.last_adapter("t", 4) == "a"


def test_ledger_counts_used_and_wasted():
    ledger = PredictionLedger()
    ledger.record("t", 1, ("b", "c"))
    assert ledger.resolve("t", 1, "b") is True
    ledger.record("t", 1, ("d",))
    assert ledger.resolve("t", 1, "e") is False
    ledger.record("t", 2, ("x",))
    ledger.flush()
    assert (ledger.stats.predictions, ledger.stats.used, ledger.stats.wasted) == (4, 1, 3)


def test_decayed_popularity():
    pop = DecayedPopularity(half_life_s=10)
    for i in range(10):
        pop.hit("hot", float(i))
    pop.hit("cold", 0.0)
    assert pop.top(1, 10.0) == ["hot"]
    assert pop.rate("hot", 20.0) == pytest.approx(pop.rate("hot", 10.0) / 2)
    assert pop.rate("never", 0.0) == 0.0


def test_step_pace_sets_the_horizon_from_the_median_gap():
    from extproc.policy.prediction import StepPace
    pace = StepPace(10.0, every=4, window=8)
    assert not pace.observe("t", "s1", 0.0)          # a first step has no gap
    changed = [pace.observe("t", "s1", 0.5 * (i + 1)) for i in range(4)]
    assert changed == [False, False, False, True] and pace.horizon_s == 1.0
    for i in range(5):
        pace.observe("t", "s2", 1000.0 * i)          # very slow sessions: clamped
    assert pace.horizon_s == 60.0


# ---------------------------------------------------------------- SessionDemand

def test_session_demand_is_what_sessions_in_progress_expect():
    from extproc.policy.prediction import SessionDemand

    d = SessionDemand(horizon_s=10.0)
    d.expect("acme", "s1", [("review", 0.8), ("sql", 0.2)], now=0.0)
    assert d.need("review", 0.0) == pytest.approx(0.8)
    assert d.need("sql", 0.0) == pytest.approx(0.2)
    assert d.need("code", 0.0) == 0.0
    d.expect("bank", "s2", [("review", 0.5)], now=0.0)
    assert d.need("review", 0.0) == pytest.approx(1 - 0.2 * 0.5)
    # the session took its step: its old expectation is gone, the new one replaces it
    d.expect("acme", "s1", [("sql", 0.9)], now=1.0)
    assert d.need("review", 1.0) == pytest.approx(0.5 * math.exp(-0.1))
    assert d.need("sql", 1.0) == pytest.approx(0.9)
    d.expect("acme", "s1", [], now=2.0)
    assert d.need("sql", 2.0) == 0.0 and len(d) == 1


def test_session_demand_fades_and_expires_sessions_that_do_not_come_back():
    from extproc.policy.prediction import SessionDemand

    d = SessionDemand(horizon_s=2.0, expire_horizons=4.0)
    d.expect("acme", "s1", [("review", 1.0)], now=0.0)
    assert d.need("review", 2.0) == pytest.approx(math.exp(-1.0))
    assert d.need("review", 8.5) == 0.0  # older than 4 horizons: dropped
    assert len(d) == 0


def test_session_demand_is_bounded():
    from extproc.policy.prediction import SessionDemand

    d = SessionDemand(max_sessions=3)
    for i in range(10):
        d.expect("t", f"s{i}", [(f"a{i}", 1.0)], now=0.0)
    assert len(d) == 3
    assert d.need("a0", 0.0) == 0.0 and d.need("a9", 0.0) == 1.0


# ---------------------------------------------------------------- order 2

def test_order_two_tells_a_revisit_apart_by_where_it_came_from():
    # notes -> triage -> notes -> translate: after "notes" comes triage or translate,
    # after (triage, notes) always translate
    m = TransitionModel(order=2)
    for s in range(6):
        for a in ("notes", "triage", "notes", "translate"):
            m.observe("medco", f"s{s}", a)
    first = dict(m.predict_next("medco", "notes", 2))
    assert first["triage"] == pytest.approx(0.5) and first["translate"] == pytest.approx(0.5)
    assert m.predict_next("medco", "notes", 1, before="triage") == [("translate", 1.0)]
    m.observe("medco", "live", "triage")
    m.observe("medco", "live", "notes")
    assert m.previous("medco", "live") == "triage"
    # too little support for the pair: back off to the first-order row
    assert dict(m.predict_next("medco", "notes", 2, before="unseen")) == first


def test_order_one_keeps_no_pairs():
    m = TransitionModel(order=1, min_support=1)
    for a in ("a", "b", "a", "c"):
        m.observe("t", "s", a)
    assert m.previous("t", "s") is None
    assert dict(m.predict_next("t", "a", 2, before="b")) == {"b": 0.5, "c": 0.5}
    with pytest.raises(ValueError):
        TransitionModel(order=3)
