import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.policy.prediction import (
    FirstSteps,
    DecayedPopularity,
    PredictionLedger,
    TransitionModel,
    candidate_score,
    PrefetchCase,
    prefetch_pays,
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


def _habits(model: TransitionModel) -> None:
    """Five sessions of other tenants go a -> c, and t1's one session a -> b."""
    for s in range(5):
        model.observe(f"other{s}", s, "a")
        model.observe(f"other{s}", s, "c")
    model.observe("t1", "s", "a")
    model.observe("t1", "s", "b")


def test_a_tenants_habit_seen_once_is_weighed_against_all_tenants_not_ignored():
    smoothed = TransitionModel(min_support=2)  # smoothing 1 by default
    _habits(smoothed)
    # all tenants: a -> c 5 of 6, a -> b 1 of 6; t1's row (1 observation): a -> b.
    # b: (1 + 1/6) / 2, c: (0 + 5/6) / 2
    (first, p_first), (second, p_second) = smoothed.predict_next("t1", "a", 2)
    assert (first, second) == ("b", "c")
    assert p_first == pytest.approx(7 / 12) and p_second == pytest.approx(5 / 12)
    hard = TransitionModel(min_support=2, smoothing=0)  # the rule before: t1's row is ignored
    _habits(hard)
    assert hard.predict_next("t1", "a", 1) == [("c", pytest.approx(5 / 6))]
    # a tenant with no row of its own gets all tenants' in both
    assert smoothed.predict_next("new", "a", 1) == hard.predict_next("new", "a", 1)


def test_a_row_with_min_support_observations_speaks_alone_with_smoothing():
    model = TransitionModel(min_support=2)
    _habits(model)
    model.observe("t1", "s2", "a")
    model.observe("t1", "s2", "b")
    assert model.predict_next("t1", "a", 2) == [("b", 1.0)]


def test_a_sessions_own_sparse_pair_row_is_weighed_against_its_tenants_row():
    model = TransitionModel(min_support=2, context_steps=0)
    for s in range(3):  # t: x -> a -> c, three times
        for step in ("x", "a", "c"):
            model.observe("t", s, step)
    for step in ("y", "a", "d"):  # and once y -> a -> d
        model.observe("t", "once", step)
    model.observe("t", "now", "y")
    model.observe("t", "now", "a")
    # the (y, a) pair row (1 observation) says d; t's a row (4) says c 3, d 1:
    # d: (1 + 1/4) / 2, c: (3/4) / 2
    assert model.predict_session("t", "now", 2) == [("d", pytest.approx(5 / 8)), ("c", pytest.approx(3 / 8))]
    hard = TransitionModel(min_support=2, context_steps=0, smoothing=0)
    for s, steps in [(0, "xac"), (1, "xac"), (2, "xac"), ("once", "yad"), ("now", "ya")]:
        for step in steps:
            hard.observe("t", s, step)
    assert hard.predict_session("t", "now", 1) == [("c", 0.75)]  # the rule before: the pair row is ignored


@pytest.mark.parametrize("bad", [-0.5, math.nan, math.inf])
def test_smoothing_must_be_a_finite_number_at_least_0(bad):
    with pytest.raises(ValueError, match="smoothing"):
        TransitionModel(smoothing=bad)


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


# ---------------------------------------------------------------- the session's steps so far

def _two_workflows(m, sessions=3):
    """W1 = a b a c and W2 = b a b d: after (b, a) W1 goes on to c and W2 to b, after (a, b)
    W1 to a and W2 to d, so the last two steps cannot tell them apart; their openers can."""
    for i in range(sessions):
        for a in "abac":
            m.observe("t", f"w1-{i}", a)
        for a in "babd":
            m.observe("t", f"w2-{i}", a)


def test_the_sessions_steps_so_far_tell_apart_workflows_that_the_last_two_steps_cannot():
    m = TransitionModel(order=2, min_support=2)
    _two_workflows(m)
    assert dict(m.predict_next("t", "a", 2, before="b")) == {"c": 0.5, "b": 0.5}   # order 2: a coin
    for a in "aba":
        m.observe("t", "new1", a)
    for a in "bab":
        m.observe("t", "new2", a)
    assert m.predict_session("t", "new1", 2) == [("c", 1.0)]
    assert m.predict_session("t", "new2", 2) == [("d", 1.0)]
    # a session's first step: the row of sessions that opened with it
    m.observe("t", "new3", "b")
    assert m.predict_session("t", "new3", 1) == [("a", 1.0)]
    assert m.predict_session("t", "never-seen", 2) == []


def test_a_context_is_trusted_after_min_support_sessions_and_otherwise_the_order_two_row_speaks():
    m = TransitionModel(order=2, min_support=2)
    _two_workflows(m, sessions=1)      # each context seen once
    for a in "aba":
        m.observe("t", "new", a)
    assert m.predict_session("t", "new", 2) == m.predict_next("t", "a", 2, before="b")
    off = TransitionModel(order=2, min_support=2, context_steps=0)
    _two_workflows(off)
    for a in "aba":
        off.observe("t", "new", a)
    assert off.predict_session("t", "new", 2) == off.predict_next("t", "a", 2, before="b")
    assert off._contexts == {} and off._steps == {}


def test_a_repeated_step_is_written_once_and_long_sessions_fall_back():
    m = TransitionModel(order=2, min_support=1, context_steps=3)
    for a in "aabac":
        m.observe("t", "s1", a)
    # (a,) saw a (the repeat) and b; (a, b) saw a; (a, b, a) saw c
    rows = m._contexts["t"]
    assert {k: dict(r.counts) for k, r in rows.items()} == {
        ("a",): {"a": 1.0, "b": 1.0}, ("a", "b"): {"a": 1.0}, ("a", "b", "a"): {"c": 1.0}}
    assert m._steps[("t", "s1")] is None          # a fourth distinct step: past context_steps
    m.observe("t", "s1", "d")
    assert len(rows) == 3                          # nothing more counted for it
    assert m.predict_session("t", "s1", 2) == m.predict_next("t", "d", 2, before="c")
    with pytest.raises(ValueError):
        TransitionModel(context_steps=-1)


def test_contexts_and_the_sessions_steps_are_bounded():
    m = TransitionModel(order=2, min_support=1, max_rows=4, max_sessions=10)
    for i in range(50):
        m.observe("t", f"s{i}", f"x{i}")
        m.observe("t", f"s{i}", "y")
    assert len(m._contexts["t"]) == 4
    assert list(m._contexts["t"]) == [(f"x{i}",) for i in range(46, 50)]   # the latest counted
    assert len(m._steps) <= 10 and len(m._last) <= 10


# ---------------------------------------------------------------- persistence

def _trained(order):
    m = TransitionModel(order=order)
    for s in range(6):
        for a in ("notes", "triage", "notes", "translate"):
            m.observe("medco", f"m{s}", a)
        for a in ("code", "review", "sql", "review", "code"):
            m.observe("acme", f"a{s}", a)
    for a in ("code", "sql", "code", "review"):  # one tie-prone row
        m.observe("globex", "g", a)
    return m


def _predictions(m):
    names = ("notes", "triage", "translate", "code", "review", "sql", "unknown")
    return {(t, a, b): m.predict_next(t, a, 3, before=b)
            for t in ("medco", "acme", "globex", "new-tenant") for a in names for b in (None, *names)}


@pytest.mark.parametrize("order", [1, 2])
def test_state_round_trips_through_json_with_the_same_predictions(order):
    m = _trained(order)
    state = json.loads(json.dumps(m.to_state(), sort_keys=True))
    back = TransitionModel.from_state(state)
    assert back.order == order
    assert _predictions(back) == _predictions(m)
    assert back.to_state() == m.to_state()
    # sessions do not survive a restart: a new step is a session's first
    assert back.last_adapter("medco", "m0") is None and back.previous("medco", "m0") is None
    assert back.observe("medco", "m0", "notes") is None


def test_contexts_survive_a_restart_and_hostile_ones_are_skipped():
    m = TransitionModel(order=2, min_support=2)
    _two_workflows(m)
    state = json.loads(json.dumps(m.to_state()))
    assert {tuple(r["after"]) for r in state["tenants"][0]["contexts"]} >= {("a", "b", "a"), ("b", "a", "b")}
    back = TransitionModel.from_state(state, min_support=2)
    assert back.to_state() == m.to_state()
    for model in (m, back):
        for a in "bab":
            model.observe("t", "after-restart", a)
    assert back.predict_session("t", "after-restart", 2) == m.predict_session("t", "after-restart", 2) \
        == [("d", 1.0)]
    hostile = {"version": 1, "global": [], "tenants": [{"tenant": "t", "rows": [_row("a", ("b", 3))], "contexts": [
        _row(["a"] * 13, ("b", 3)),                 # longer than context_steps
        _row([], ("b", 3)), _row("a", ("b", 3)), _row(["a", 1], ("b", 3)), _row(["x" * 257], ("b", 3)),
        _row(["a", "b"], ("c", -1)), {"after": ["a"]}, "row", None,
        _row(["a", "b"], ("c", 2), ("d", 1)),       # the one valid row
    ]}, {"tenant": "u", "rows": [], "contexts": [_row(["a"], ("b", 3))]}]}   # no rows: dropped
    m2 = TransitionModel(min_support=1)
    assert m2.load_state(hostile) == 2
    assert {k: dict(r.counts) for k, r in m2._contexts["t"].items()} == {("a", "b"): {"c": 2.0, "d": 1.0}}
    assert "u" not in m2._contexts
    assert TransitionModel(context_steps=0).load_state(hostile) == 1   # contexts off: none kept


def test_pair_keys_stay_apart_whatever_the_names_contain():
    m = TransitionModel(order=2, min_support=1)
    for before, after, nxt in (("a|b", "c", "x"), ("a", "b|c", "y"), ("a,b", "c", "z"), ('["a"', '"b"]', "w")):
        m.observe("t", before + after, before)
        m.observe("t", before + after, after)
        m.observe("t", before + after, nxt)
    back = TransitionModel.from_state(json.loads(json.dumps(m.to_state())), min_support=1)
    assert back.predict_next("t", "c", 1, before="a|b") == [("x", 1.0)]
    assert back.predict_next("t", "b|c", 1, before="a") == [("y", 1.0)]
    assert back.predict_next("t", "c", 1, before="a,b") == [("z", 1.0)]
    assert back.predict_next("t", '"b"]', 1, before='["a"') == [("w", 1.0)]


def test_an_order_one_model_skips_pair_rows_and_load_state_replaces_the_counts():
    state = _trained(2).to_state()
    m = TransitionModel(order=1)
    m.observe("old", "s", "x")
    m.observe("old", "s", "y")
    n = m.load_state(state)
    assert n == sum(1 for r in state["global"] if isinstance(r["after"], str)) + sum(
        1 for t in state["tenants"] for r in t["rows"] if isinstance(r["after"], str)) + sum(
        len(t.get("contexts", ())) for t in state["tenants"])
    assert "old" not in m._tenants and m.last_adapter("old", "s") == "y"  # sessions untouched
    assert m.predict_next("acme", "code", 1) == _trained(1).predict_next("acme", "code", 1)


@pytest.mark.parametrize("state", [
    None, [], "x", 1, {}, {"version": 2, "global": [], "tenants": []},
    {"version": 1, "global": {}, "tenants": []}, {"version": 1, "global": [], "tenants": {"acme": []}},
])
def test_a_state_of_the_wrong_shape_is_rejected_and_the_model_kept(state):
    m = _trained(2)
    before = m.to_state()
    with pytest.raises(ValueError):
        m.load_state(state)
    assert m.to_state() == before


def _row(after, *nxt):
    return {"after": after, "next": [list(p) for p in nxt]}


def test_hostile_entries_are_skipped_and_the_rest_clipped_to_the_bounds():
    m = TransitionModel(order=2, max_tenants=2, max_rows=3, max_successors=2, halve_at=512.0)
    state = {"version": 1, "order": 2, "global": [
        _row("a", ("b", -3), ("c", float("nan")), ("d", True), ("e", "7"), ("f", None), ("g", 5)),
        _row("h", ("i", 10 ** 400), ("j", 1e308), ("k", 1.0)),      # huge: clipped, then scaled
        _row("inf", ("x", float("inf"))),
        _row(["p", "q", "r"], ("s", 3)), _row(["p", 1], ("s", 3)), _row(7, ("s", 3)),
        _row("x" * 257, ("s", 3)), _row("", ("s", 3)), _row("n", ("y" * 257, 3), ("", 3)),
        {"after": "z"}, {"after": "z", "next": {"a": 3}}, "row", None, [1, 2],
    ], "tenants": [
        {"tenant": "t0", "rows": [_row("a", ("b", 3))]},             # the oldest: dropped
        {"tenant": 5, "rows": [_row("a", ("b", 3))]}, {"rows": []}, "t", {"tenant": "t1", "rows": "x"},
        {"tenant": "t1", "rows": [_row("a", ("b", 3))]},
        {"tenant": "t2", "rows": [_row(c, ("b", n)) for n, c in enumerate("abcdef", 1)]
         + [_row("m", *((s, 1) for s in "uvwxyz"))]},
    ]}
    m.load_state(state)
    assert {k: dict(r.counts) for k, r in m._global.items()} == {
        "a": {"g": 5.0}, "h": {"i": 256.0, "j": 256.0}, "inf": {"x": 512.0}}
    assert list(m._tenants) == ["t1", "t2"]
    assert set(m._tenants["t2"]) == {"d", "e", "f"}                # the three strongest rows
    assert m.predict_next("t2", "f", 1) == [("b", 1.0)]
    assert m.predict_next("zz", "h", 2) == [("i", 0.5), ("j", 0.5)]
    # a clipped row still learns: the next step passes halve_at and ages it
    for _ in range(2):
        m.observe("t9", "s", "inf")
        m.observe("t9", "s", "y")
        m._last.clear()
    assert m._global["inf"].total <= 512.0 and "y" in m._global["inf"].counts


def test_too_many_successors_keep_the_strongest_and_unknown_names_are_just_names():
    m = TransitionModel(order=1, max_successors=2)
    m.load_state({"version": 1, "global": [_row("a", ("../../etc/passwd", 1), ("b", 9), ("c", 4))],
                  "tenants": []})
    assert m.predict_next("t", "a", 3) == [("b", 9 / 13), ("c", 4 / 13)]


def test_random_garbage_loads_or_is_rejected_and_stays_bounded():
    import random
    rng = random.Random(7)
    atoms = [None, True, 0, -1, 3, 2.5, 1e308, float("nan"), "a", "b", "", "x" * 300, [], {}]

    def junk(depth):
        r = rng.random()
        if depth > 4 or r < 0.3:
            return rng.choice(atoms)
        if r < 0.5:
            return [junk(depth + 1) for _ in range(rng.randint(0, 4))]
        if r < 0.7:
            return [rng.choice(["a", "b", "c", ["a", "b"]]), rng.choice([3, -1, "q", 1e9])]
        if r < 0.85:
            return {"after": rng.choice(["a", ["a", "b"], 1, None]), "next": junk(depth + 1)}
        return {"tenant": rng.choice(["t", "u", 1]), "rows": junk(depth + 1), "contexts": junk(depth + 1)}

    for _ in range(500):
        state = {"version": 1, "global": junk(0), "tenants": junk(0)}
        m = TransitionModel(max_tenants=3, max_rows=4, max_successors=2)
        try:
            m.load_state(state)
        except ValueError:
            continue
        assert len(m._tenants) <= 3 and set(m._contexts) <= set(m._tenants)
        for rows in (m._global, *m._tenants.values(), *m._contexts.values()):
            assert len(rows) <= 4
            for row in rows.values():
                assert 0 < row.total <= m.halve_at and len(row.counts) <= 2
                assert all(math.isfinite(c) and c > 0 for c in row.counts.values())
        m.predict_next("t", "a", 2, before="b")


def test_to_state_row_budget_keeps_the_global_rows_then_the_latest_tenants():
    m = _trained(1)
    n_global = len(m._global)
    state = m.to_state(row_budget=n_global + 1)
    assert len(state["global"]) == n_global
    assert [t["tenant"] for t in state["tenants"]] == ["globex"] and len(state["tenants"][0]["rows"]) == 1
    assert m.to_state(row_budget=0)["global"] == []
    with pytest.raises(TypeError):
        bad = TransitionModel(min_support=1)
        bad.observe("t", "s", 1)
        bad.observe("t", "s", 2)
        bad.to_state()


# -- FirstSteps: which adapters open a tenant's sessions

def test_first_steps_detects_openers_by_new_id_and_by_idle_timeout():
    fs = FirstSteps(half_life_s=600.0, idle_timeout_s=100.0)
    table = [  # (tenant, session, adapter, now, opens a session?)
        ("acme", "s1", "code", 0.0, True),
        ("acme", "s1", "review", 5.0, False),
        ("acme", "s2", "code", 6.0, True),
        ("acme", "s1", "sql", 104.0, False),      # 99 s idle: still the same session
        ("acme", "s1", "code", 300.0, True),      # idle past the timeout: opens anew
        ("other", "s1", "chat", 301.0, True),     # session ids are per tenant
    ]
    for tenant, session, adapter, now, opens in table:
        assert fs.observe(tenant, session, adapter, now) is opens, (tenant, session, now)
    assert fs.first_steps == 4
    assert fs.openers("acme") == pytest.approx({"code": 1.0})
    assert fs.is_open("acme", "s1", 350.0) and not fs.is_open("acme", "nope", 350.0)


def test_first_steps_ranks_openers_and_gives_use_probabilities_within_the_horizon():
    fs = FirstSteps(half_life_s=1e9)              # no decay: plain counts
    for i in range(30):
        fs.observe("acme", f"a{i}", "code" if i % 3 else "chat", float(i))
    likely = fs.likely("acme", 30.0, horizon_s=10.0, k=2)
    assert [a for a, _ in likely] == ["code", "chat"]
    assert 0.0 < likely[1][1] < likely[0][1] < 1.0
    # a longer horizon: likelier to be asked for within it
    assert fs.likely("acme", 30.0, horizon_s=100.0, k=1)[0][1] > likely[0][1]
    assert fs.likely("nobody", 30.0, horizon_s=10.0) == []


def test_first_steps_forget_old_habits_and_stay_bounded():
    fs = FirstSteps(half_life_s=10.0, per_tenant=2, max_sessions=3)
    for i in range(20):
        fs.observe("acme", f"old{i}", "legacy", float(i))
    for i in range(20):
        fs.observe("acme", f"new{i}", "fresh", 100.0 + i)
    assert [a for a, _ in fs.likely("acme", 120.0, 10.0, k=1)] == ["fresh"]
    fs.observe("acme", "x", "third", 121.0)
    assert len(fs.openers("acme")) <= 2 and len(fs._seen) <= 3


@pytest.mark.parametrize(
    "case, min_p, expected",
    [
        # a free slot, an idle link: pays when likely enough
        (PrefetchCase(0.6, 0.1), 0.35, True),
        (PrefetchCase(0.3, 0.1), 0.35, False),  # under min_p
        # never evicts something at least as likely to be used
        (PrefetchCase(0.6, 0.1, victim_p=0.6, victim_load_s=0.01), 0.0, False),
        # a cheap candidate does not pay for evicting a costly one: 0.7*0.03 < 0.4*0.2
        (PrefetchCase(0.7, 0.03, victim_p=0.4, victim_load_s=0.2), 0.0, False),
        # a costly candidate evicting a cheap one: 0.7*0.2 > 0.4*0.03
        (PrefetchCase(0.7, 0.2, victim_p=0.4, victim_load_s=0.03), 0.0, True),
        # the link already busy most of the horizon: the saving does not cover it
        (PrefetchCase(0.6, 0.1, link_busy=0.7), 0.0, False),
        (PrefetchCase(0.9, 0.1, link_busy=0.5), 0.0, True),
        (PrefetchCase(0.9, 0.1, link_busy=5.0), 0.0, False),  # over 1: capped, still no
        # a wasted load charged its whole engine time (the agents' waste share on the CPU):
        # a coin flip does not pay (0.5*0.1 = 0.5*0.1), a likelier bet does; charged nothing
        # (CUDA), the coin flip pays
        (PrefetchCase(0.5, 0.1, waste_share=1.0), 0.0, False),
        (PrefetchCase(0.6, 0.1, waste_share=1.0), 0.0, True),
        (PrefetchCase(0.5, 0.1, waste_share=0.0), 0.0, True),
        (PrefetchCase(0.6, 0.1, victim_p=0.1, victim_load_s=0.1, waste_share=1.0), 0.0, True),  # .06 > .01+.04
        (PrefetchCase(0.54, 0.1, victim_p=0.1, victim_load_s=0.1, waste_share=1.0), 0.0, False),  # .054 < .01+.046
    ],
)
def test_prefetch_pays(case, min_p, expected):
    assert prefetch_pays(case, min_p=min_p) is expected


def test_session_demand_expects_the_sessions_working_set_back_at_the_measured_revisit_rate():
    from extproc.policy.prediction import SessionDemand

    demand = SessionDemand(horizon_s=10.0, working_set=2)
    # one session alternates plan -> code -> plan -> code: every step after the second revisits
    for i, a in enumerate(("plan", "code", "plan", "code", "plan")):
        demand.step("t", "s", a)
        demand.expect("t", "s", [], float(i))
    assert (demand.steps, demand.revisits) == (4, 3)
    # after "plan", the model predicts nothing, yet "code" (used before) is expected back
    assert demand.need("code", 4.0) == pytest.approx(3 / 4)
    assert demand.need("plan", 4.0) == 0.0  # the current step is not its own next
    off = SessionDemand(horizon_s=10.0)
    for i, a in enumerate(("plan", "code", "plan")):
        off.step("t", "s", a)
        off.expect("t", "s", [], float(i))
    assert off.need("plan", 2.0) == 0.0 and off.need("code", 2.0) == 0.0


@given(st.lists(st.tuples(st.sampled_from("tuv"), st.integers(0, 5), st.sampled_from("abcde")), max_size=60),
       st.sampled_from([0.0, 0.5, 1.0, 4.0]), st.sampled_from([1.0, 2.0, 3.0]))
@settings(max_examples=200, deadline=None)
def test_predictions_are_a_ranked_distribution_whatever_was_observed(steps, smoothing, min_support):
    model = TransitionModel(min_support=min_support, smoothing=smoothing)
    for tenant, session, adapter in steps:
        model.observe(tenant, session, adapter)
    for tenant, session, _ in steps:
        ranked = model.predict_session(tenant, session, 5)
        probabilities = [p for _, p in ranked]
        assert all(0.0 < p <= 1.0 for p in probabilities)
        assert probabilities == sorted(probabilities, reverse=True)
        assert sum(probabilities) <= 1.0 + 1e-9
        assert len({a for a, _ in ranked}) == len(ranked)
