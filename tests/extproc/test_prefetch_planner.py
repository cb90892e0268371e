"""Gateway-side speculation: the planner over snapshots, the hand-off, the warm set."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from extproc.domain.auth import Principal
from extproc.state.catalog import Upstream
from extproc.domain.decision import InferenceRequest, decide
from extproc.domain.headers import session_of
from extproc.app.outcomes import RequestHead
from extproc.app.context import Gateway
from extproc.state.residency import ResidencyBoard, ResidencySnapshot, SentCounts, TierReport
from extproc.fleet.speculation import (GatewaySpeculation, PopularityFile, Saved, SpeculationPlanner, ObservedRequest,
                                      route_by_policy, warm_signals)
from tests.extproc.builders import KEYS
from tests.support.wait import wait_until

PROD = {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
SHADOW = {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}
OFF = {"multi_lora": "prod", "dynamic_lora_prefetch": "off"}


class Sink:
    def __init__(self, accept=True):
        self.signals, self.accept = [], accept

    def submit(self, signal):
        self.signals.append(signal)
        return self.accept


class FakeStore:
    def __init__(self, snapshot):
        self.snapshot = snapshot


def pool(upstream, *names, prefetched=False):
    return ResidencySnapshot.build({upstream: {n: TierReport("device", 10.0, 1, prefetched) for n in names}})


def decision(snapshot, adapter="code-python", skills=PROD, residency=ResidencySnapshot()):
    key = next(k for k in snapshot.keys.values() if k.name == "alice")
    p = Principal(key=key, tenant=snapshot.tenants["acme"])
    return decide(snapshot, residency, SentCounts(), InferenceRequest(p, {"model": adapter}, skills))


def teach(planner, snapshot, steps, *, upstream="local-vllm", residency=ResidencySnapshot(), start=0.0):
    """Run (session, adapter) steps through the planner; returns all signals and the clock."""
    out, now = [], start
    for session, adapter in steps:
        out += planner.step(ObservedRequest(upstream, "acme", session, adapter, "prod"), snapshot, residency, SentCounts(), now)
        now += 1.0
    return out, now


# -- session id

def test_session_from_header_then_user_then_none():
    assert session_of("s-1", {"user": "u"}) == "s-1"
    assert session_of(None, {"user": "agent-7"}) == "agent-7"
    assert session_of("", {"user": ""}) is None
    assert session_of(None, {"user": 42}) is None
    assert len(session_of("x" * 1000, {})) == 256


# -- planner (pure: snapshot in, signals out)

def test_planner_learns_the_workflow_and_prefetches_the_next_step(snapshot):
    planner = SpeculationPlanner(initial_slots=2)
    _, now = teach(planner, snapshot, [(f"s{i}", a) for i in range(4) for a in ("code-python", "acme-legal")])
    planner.sync(pool("local-vllm", "code-python"), now + 10)   # the engine evicted acme-legal
    got, _ = teach(planner, snapshot, [("new", "code-python")], start=now + 10)
    assert [(s.adapter, s.upstream, s.priority, s.reason) for s in got] == [
        ("acme-legal", "local-vllm", 0, "predicted")]
    assert got[0].digest == "b" * 64
    c = planner.counters()
    assert c["predictions"] >= 4 and c["predictions_used"] >= 3


def test_a_prefetch_names_the_victim_its_pool_model_evicted_for_the_agent(snapshot):
    planner = SpeculationPlanner(initial_slots=2)
    _, now = teach(planner, snapshot, [(f"s{i}", a) for i in range(4) for a in ("code-python", "acme-legal")])
    full = pool("local-vllm", "code-python", "old-one")            # two slots, both taken
    planner.sync(full, now + 10)
    got, now = teach(planner, snapshot, [("new", "code-python")], start=now + 10, residency=full)
    assert [(s.adapter, s.evict) for s in got] == [("acme-legal", ("old-one",))]
    roomy = pool("local-vllm", "code-python")                     # a free slot: no victim
    planner.sync(roomy, now + 10)
    got, _ = teach(planner, snapshot, [("newer", "code-python")], start=now + 10, residency=roomy)
    assert [(s.adapter, s.evict) for s in got] == [("acme-legal", ())]


def test_a_bet_planned_on_a_request_whose_adapter_is_loading_yields_to_that_load(snapshot):
    """The engine loads the request's own adapter now (not on its host's device tier): the
    bets this step plans carry ``yields_to`` (the sender holds them until that load lands,
    at most ``hold_s``); a resident adapter, ``hold_s`` 0 or a host with no residency
    view (nothing would say when the load landed) plan bets that go at once."""
    def bets(residency, hold_s=0.5):
        planner = SpeculationPlanner(initial_slots=2, hold_s=hold_s)
        _, now = teach(planner, snapshot, [(f"s{i}", a) for i in range(4) for a in ("code-python", "acme-legal")])
        planner.sync(residency, now + 10)
        got, _ = teach(planner, snapshot, [("new", "code-python")], start=now + 10, residency=residency)
        assert [s.adapter for s in got] == ["acme-legal"]
        return got[0], planner.counters()["prefetch_held"]

    loading = ResidencySnapshot.build({"local-vllm": {"code-python": TierReport("disk", 10.0, 1)}})
    bet, held = bets(loading)
    assert bet.yields_to == ("local-vllm", "code-python") and bet.hold_until == pytest.approx(18.5) and held == 1
    bet, held = bets(pool("local-vllm", "other"))                  # not listed at all: loading too
    assert bet.yields_to == ("local-vllm", "code-python")
    for residency, hold_s in ((pool("local-vllm", "code-python"), 0.5), (loading, 0.0)):
        bet, held = bets(residency, hold_s)
        assert bet.yields_to is None and bet.hold_until == 0.0 and held == 0
    step = ObservedRequest("local-vllm", "acme", "s", "code-python", "prod")
    assert SpeculationPlanner().demand_load(step, pool("another-host", "code-python")) is None


def test_planner_without_session_counts_demand_but_learns_nothing(snapshot):
    planner = SpeculationPlanner()
    for _ in range(5):
        for a in ("code-python", "acme-legal"):
            assert planner.step(ObservedRequest("local-vllm", "acme", None, a, "prod"), snapshot, ResidencySnapshot(), SentCounts(), 0.0) == []
    assert planner.model.predict_next("acme", "code-python") == []
    assert "code-python" in planner.speculator("local-vllm").cache


def test_planner_never_predicts_an_adapter_the_tenant_cannot_see(snapshot):
    planner = SpeculationPlanner(initial_slots=1)
    # another tenant's habit code-python -> globex-secret, learned from globex's traffic
    for i in range(5):
        for a in ("code-python", "globex-secret"):
            planner.step(ObservedRequest("local-vllm", "globex", f"g{i}", a, "prod"), snapshot, ResidencySnapshot(), SentCounts(), i)
    got = planner.step(ObservedRequest("local-vllm", "acme", "a1", "code-python", "prod"), snapshot, ResidencySnapshot(), SentCounts(), 9.0)
    assert got == []


def test_planner_offers_the_prediction_to_the_host_routing_picks(snapshot):
    other = Upstream("other", "127.0.0.1:2", "vllm", "ace-tiny-llama")
    snap = replace(snapshot, upstreams=snapshot.upstreams + (other,))
    planner = SpeculationPlanner(initial_slots=1, route=lambda s, name, r, sent: "other" if name == "acme-legal" else "local-vllm")
    got, _ = teach(planner, snap, [(f"s{i}", a) for i in range(4) for a in ("code-python", "acme-legal")])
    assert got and {s.upstream for s in got} == {"other"}


def test_route_by_policy_adapts_the_gateway_seam(snapshot):
    seen = []

    def policy(upstreams, adapter, residency, sent):
        seen.append((adapter.name, sent))
        return upstreams[0]
    sent = SentCounts()
    assert route_by_policy(policy)(snapshot, "acme-legal", ResidencySnapshot(), sent) == "local-vllm"
    assert route_by_policy(policy)(snapshot, "nope", ResidencySnapshot(), sent) is None
    assert seen == [("acme-legal", sent)]


def test_horizon_follows_the_sessions_pace(snapshot):
    planner = SpeculationPlanner()
    assert planner.speculator("local-vllm").horizon_s == 10.0
    now = 0.0
    for i in range(40):          # 40 sessions, 2 steps 0.5 s apart
        planner.step(ObservedRequest("local-vllm", "acme", f"s{i}", "code-python", "prod"), snapshot, ResidencySnapshot(), SentCounts(), now)
        planner.step(ObservedRequest("local-vllm", "acme", f"s{i}", "acme-legal", "prod"), snapshot, ResidencySnapshot(), SentCounts(), now + 0.5)
        now += 3.0
    assert planner.pace.horizon_s == 1.0 and planner.speculator("local-vllm").horizon_s == 1.0
    assert planner.speculator("other").horizon_s == 1.0
    assert planner.counters()["horizon_ms"] == 1000


def test_sync_learns_the_pool_size_and_drops_what_the_engine_evicted():
    planner = SpeculationPlanner(initial_slots=2)
    planner.sync(pool("u", "a", "b", "c"), 0.0)
    spec = planner.speculator("u")
    assert spec.cache.capacity == 3 and set(spec.cache) == {"a", "b", "c"}
    planner.sync(pool("u", "a"), 1.0)
    assert set(spec.cache) == {"a"} and spec.cache.capacity == 3
    assert planner.slots() == {"u": 3}


def test_placement_plans_with_a_pool_size_only_once_that_pool_was_seen_evicting():
    # the learned capacity is the most a pool held: a lower bound until the pool lets one go
    planner = SpeculationPlanner(initial_slots=2)
    planner.sync(pool("u", "a", "b"), 0.0)
    planner.sync(pool("u", "a", "b", "c"), 1.0)        # grew: more room than learned
    planner.sync(pool("v", "x"), 1.0)
    assert planner.placement_slots() is None
    planner.sync(pool("u", "a", "c", "d"), 2.0)        # at its most, b went for d: full
    planner.sync(pool("v", "y"), 2.0)                  # x went, but v held 1 of the 2 it may hold
    assert planner.full == {"u"} and planner.placement_slots() == 3


def test_gateway_placement_keeps_the_ring_while_no_pool_is_known_full(snapshot):
    upstreams = tuple(Upstream(name=f"h{i}", address=f"127.0.0.1:{9000 + i}", flavour="builtin", base_model="base")
                      for i in range(4))
    names = [f"ad-{i}" for i in range(16)]
    board = ResidencyBoard()
    spec = gateway_speculation(replace(snapshot, upstreams=upstreams), Sink(), board)
    spec.counts.update({a: (400.0 if a == "ad-0" else 10.0) for a in names})  # one adapter carries most
    views = {f"h{i}": {a: TierReport("device" if i == 0 and a in names[:2] else "remote", None) for a in names}
             for i in range(4)}
    board.publish(ResidencySnapshot.build(views))
    spec.planner.sync(board.current, 0.0)               # h0 holds 2: learned capacity 2, 4 x 2 < 16
    spec.place()
    ring = dict(board.current.placement)
    assert all(len(o) == 1 for o in ring.values())      # no copy, no move: the pools may hold all 16
    views["h0"] = {a: TierReport("device" if a in ("ad-0", "ad-2") else "remote", None) for a in names}
    board.publish(ResidencySnapshot.build(views, placement=ring))
    spec.planner.sync(board.current, 1.0)               # h0 let ad-1 go at its most: full at 2
    spec.place()
    assert len(board.current.placement["ad-0"]) > 1     # crowded now: the hot adapter gets owners


def test_an_unmeasured_load_is_priced_at_the_typical_measured_one(snapshot):
    planner = SpeculationPlanner()
    views = ResidencySnapshot.build({"u": {"a": TierReport("device", None), "b": TierReport("remote", 4.0),
                                           "c": TierReport("remote", 6.0), "d": TierReport("disk", 8.0)}})
    assert planner.typical_load_s(views) == pytest.approx(0.006)
    assert planner.typical_load_s(ResidencySnapshot.build({"u": {"a": TierReport("device", None)}})) == 0.1


def learned_then_offered(snapshot) -> tuple[SpeculationPlanner, float]:
    """A planner taught code-python -> acme-legal; the engine evicts acme-legal, and the next
    code-python request offers it again as a bet (at the returned time)."""
    planner = SpeculationPlanner(initial_slots=2, load_grace_s=2.0)
    _, now = teach(planner, snapshot, [(f"s{i}", a) for i in range(4) for a in ("code-python", "acme-legal")])
    planner.sync(pool("local-vllm", "code-python"), now + 10)   # acme-legal evicted by the engine
    now += 10
    got, _ = teach(planner, snapshot, [("n", "code-python")], start=now,
                   residency=pool("local-vllm", "code-python"))
    assert [s.adapter for s in got] == ["acme-legal"]
    return planner, now


def test_prefetch_in_flight_survives_a_sync_for_the_grace_period(snapshot):
    planner, now = learned_then_offered(snapshot)                 # signalled at `now`
    planner.sync(pool("local-vllm", "code-python"), now + 1.0)      # not yet there: in flight
    assert "acme-legal" in planner.speculator("local-vllm").cache
    planner.sync(pool("local-vllm", "code-python"), now + 5.0)      # never arrived: dropped
    assert "acme-legal" not in planner.speculator("local-vllm").cache


def test_a_refused_bet_leaves_the_model_at_once_and_is_offered_again(snapshot):
    """Before, a bet the agent refused stayed in the pool model as in flight for the grace
    period: it held a slot, and no later prediction offered the adapter meanwhile."""
    planner, now = learned_then_offered(snapshot)
    again, _ = teach(planner, snapshot, [("m", "code-python")], start=now + 0.1,
                     residency=pool("local-vllm", "code-python"))
    assert again == []                                             # in flight, as far as the model knows
    assert planner.refused("local-vllm", "acme-legal", now + 0.2)  # the agent said no
    assert "acme-legal" not in planner.speculator("local-vllm").cache
    assert planner.counters()["prefetch_refused"] == 1
    again, _ = teach(planner, snapshot, [("k", "code-python")], start=now + 0.3,
                     residency=pool("local-vllm", "code-python"))
    assert [s.adapter for s in again] == ["acme-legal"]          # offered anew
    assert not planner.refused("local-vllm", "code-python", now + 0.4)   # resident, not a bet: kept
    assert not planner.refused("elsewhere", "acme-legal", now + 0.4)


# -- the hand-off and the background side (drained by hand: no thread)

def gateway_speculation(snapshot, sink, board=None, **kw):
    return GatewaySpeculation(FakeStore(snapshot), board or ResidencyBoard(), sink,
                              SpeculationPlanner(initial_slots=2), clock=lambda: 0.0, **kw)


def feed(gs, snapshot, skills, sessions=4):
    """Teach code-python -> acme-legal, then the engine evicts acme-legal."""
    for i in range(sessions):
        for a in ("code-python", "acme-legal"):
            gs.observe(decision(snapshot, a, skills), "acme", f"s{i}")
        gs.drain()
    gs.board.publish(pool("local-vllm", "code-python"))


def test_prod_submits_predicted_prefetches_to_the_sink(snapshot):
    sink = Sink()
    gs = gateway_speculation(snapshot, sink)
    feed(gs, snapshot, PROD)
    assert gs.observe(decision(snapshot, "code-python", PROD), "acme", "new")
    gs.drain()
    assert [s.adapter for s in sink.signals][-1] == "acme-legal"
    c = gs.counters()
    assert c["signals_sent"] == len(sink.signals) and c["observed"] == 9 and c["shadow_prefetches"] == 0


def fed_then_asked(snapshot, skills):
    """``feed``, then one more code-python request drained: (the speculation, its sink)."""
    sink = Sink()
    gs = gateway_speculation(snapshot, sink)
    feed(gs, snapshot, skills)
    gs.observe(decision(snapshot, "code-python", skills), "acme", "new")
    gs.drain()
    return gs, sink


def test_a_refusal_from_the_agent_link_reaches_the_model_at_the_next_drain(snapshot):
    gs, sink = fed_then_asked(snapshot, PROD)
    assert sink.signals[-1].adapter == "acme-legal"
    assert "acme-legal" in gs.planner.speculator("local-vllm").cache
    gs.refused("local-vllm", "acme-legal")      # what AgentLink.on_refused calls
    gs.drain()
    assert "acme-legal" not in gs.planner.speculator("local-vllm").cache
    assert gs.counters()["prefetch_refused"] == 1


def test_shadow_decides_and_counts_but_signals_nothing(snapshot):
    gs, sink = fed_then_asked(snapshot, SHADOW)
    assert sink.signals == [] and gs.counters()["shadow_prefetches"] >= 1


def test_off_requests_are_counted_never_planned_and_unapplied_ones_ignored(snapshot):
    sink = Sink()
    gs = gateway_speculation(snapshot, sink)
    feed(gs, snapshot, OFF)
    assert gs.observe(decision(snapshot, "code-python", OFF), "acme", "new")
    assert not gs.observe(decision(snapshot, "code-python", {"multi_lora": "shadow",
                                                             "dynamic_lora_prefetch": "prod"}), "acme", "s")
    assert gs.drain() == 1
    assert sink.signals == [] and gs.counts == {"code-python": 5.0, "acme-legal": 4.0}
    c = gs.counters()
    assert c["predictions"] == 0 and c["shadow_prefetches"] == 0 and c["observed"] == 9
    # the workflow is still learned, for the next start (the benchmark's baseline gateway)
    assert gs.planner.model.predict_next("acme", "code-python", 1) == [("acme-legal", 1.0)]


def test_the_hand_off_is_bounded(snapshot):
    gs = gateway_speculation(snapshot, Sink(), max_pending=3)
    d = decision(snapshot, "code-python", PROD)
    assert [gs.observe(d, "acme", "s") for _ in range(5)] == [True, True, True, False, False]
    assert gs.counters()["dropped"] == 2 and gs.drain() == 3


def test_a_full_sink_is_counted_not_retried(snapshot):
    sink = Sink(accept=False)
    gs = gateway_speculation(snapshot, sink)
    feed(gs, snapshot, PROD)
    gs.observe(decision(snapshot, "code-python", PROD), "acme", "new")
    gs.drain()
    assert gs.counters()["signals_dropped"] == len(sink.signals) > 0


def test_the_thread_runs_and_stops(snapshot):
    sink = Sink()
    board = ResidencyBoard()
    now = [0.0]   # the speculation's clock, moved by the test
    gs = GatewaySpeculation(FakeStore(snapshot), board, sink, SpeculationPlanner(initial_slots=2, load_grace_s=0.05),
                            poll_s=0.001, clock=lambda: now[0]).start()
    try:
        for i in range(4):
            for a in ("code-python", "acme-legal"):
                gs.observe(decision(snapshot, a, PROD), "acme", f"s{i}")
        wait_until(lambda: gs.counters()["observed"] >= 8, what="the thread handled 8 steps")
        now[0] += 1.0  # past the in-flight grace, then the engine evicts acme-legal
        board.publish(pool("local-vllm", "code-python"))
        gs.observe(decision(snapshot, "code-python", PROD), "acme", "new")
        wait_until(lambda: gs.counters()["observed"] >= 9, what="the thread handled the 9th step")
    finally:
        gs.close()
    assert not gs._thread.is_alive()
    assert any(s.adapter == "acme-legal" for s in sink.signals)


def test_an_idle_thread_sleeps_until_a_request_wakes_it(snapshot):
    """No polling while idle: with hour-long poll and idle waits, a request is still
    handled at once (observe wakes the thread), and close() does not wait out the hour
    (the thread then batches for poll_s: close interrupts that too)."""
    gs = GatewaySpeculation(FakeStore(snapshot), ResidencyBoard(), Sink(),
                            SpeculationPlanner(initial_slots=2), poll_s=3600.0, idle_wait_s=3600.0).start()
    try:
        wait_until(lambda: gs._idle, what="the thread waiting for work")
        gs.observe(decision(snapshot, "code-python", PROD), "acme", "s1")
        wait_until(lambda: gs.counters()["observed"] == 1, what="the request handled")
    finally:
        gs.close(timeout=30.0)
    assert not gs._thread.is_alive()


# -- processor wiring: the session reaches the observer

class Recorder:
    def __init__(self):
        self.seen = []

    def observe(self, d, tenant, session):
        self.seen.append((d.adapter.name if d.adapter else None, tenant, session))
        return True


def _head(path, **headers):
    h = {":path": path, ":method": "POST", "authorization": f"Bearer {KEYS['alice']}", **headers}
    return RequestHead("POST", path, h, False)


def test_gateway_hands_every_decided_request_to_the_observer(store):
    rec = Recorder()
    gw = Gateway(store, speculation=rec)
    ex = gw.exchange()
    ex.on_request_headers(_head("/v1/chat/completions", **{"x-ace-session-id": "wf-1"}))
    ex.on_request_body(json.dumps({"model": "code-python", "messages": [], "user": "ignored"}).encode())
    ex = gw.exchange()
    ex.on_request_headers(_head("/v1/chat/completions"))
    ex.on_request_body(json.dumps({"model": "code-python", "messages": [], "user": "agent-3"}).encode())
    assert rec.seen == [("code-python", "acme", "wf-1"), ("code-python", "acme", "agent-3")]


# -- warm set and the popularity file

def test_warm_signals_follow_counts_and_learned_slots(snapshot):
    got = warm_signals({"code-python": 10, "acme-legal": 5, "globex-secret": 1, "gone": 99},
                       snapshot, {"local-vllm": 2}, ["local-vllm"])
    assert [(s.adapter, s.reason, s.priority) for s in got] == [
        ("code-python", "warm_set", 0), ("acme-legal", "warm_set", 0)]
    assert warm_signals({"code-python": 10}, snapshot, {}, ["local-vllm"]) == []


def test_popularity_file_round_trip_and_bad_file(tmp_path):
    f = PopularityFile(tmp_path / "gw.popularity.json")
    assert f.load() == ({}, {})
    f.save({"a": 3.0}, {"u": 4})
    assert f.load() == ({"a": 3.0}, {"u": 4})
    f.path.write_text("{not json")
    assert f.load() == ({}, {})


def test_warm_set_is_sent_once_when_the_agent_appears_and_counts_are_saved(tmp_path, snapshot):
    f = PopularityFile(tmp_path / "gw.popularity.json")
    f.save({"code-python": 7.0, "acme-legal": 3.0}, {"local-vllm": 1})
    snap = replace(snapshot, default_skills={**snapshot.default_skills, "dynamic_lora_prefetch": "prod"})
    board, sink = ResidencyBoard(), Sink()
    gs = GatewaySpeculation(FakeStore(snap), board, sink, popularity=f, clock=lambda: 0.0)
    gs._warm()
    assert sink.signals == []                       # no agent yet
    board.publish(pool("local-vllm"))
    gs._warm()
    gs._warm()
    assert [(s.adapter, s.reason) for s in sink.signals] == [("code-python", "warm_set")]
    gs.observe(decision(snap, "acme-legal", PROD), "acme", "s")
    gs.drain()
    gs.close()
    counts, slots = f.load()
    assert counts == {"code-python": 7.0, "acme-legal": 4.0} and slots["local-vllm"] >= 1


def test_popularity_file_keeps_the_transition_model(tmp_path):
    from extproc.policy.prediction import TransitionModel
    model = TransitionModel()
    for s in range(3):
        for a in ("code", "review", "sql"):
            model.observe("acme", f"s{s}", a)
    f = PopularityFile(tmp_path / "gw.popularity.json")
    f.save({"code": 3.0}, {"u": 2}, model)
    saved = f.read()
    assert (saved.counts, saved.slots) == ({"code": 3.0}, {"u": 2}) and f.load() == ({"code": 3.0}, {"u": 2})
    back = TransitionModel.from_state(saved.transitions)
    assert back.predict_next("acme", "review", 1, before="code") == [("sql", 1.0)]


def test_an_old_file_without_transitions_still_loads(tmp_path, snapshot):
    f = PopularityFile(tmp_path / "gw.popularity.json")
    f.path.write_text(json.dumps({"counts": {"code-python": 2.0}, "slots": {"local-vllm": 3}}))
    assert f.read().transitions is None
    gs = gateway_speculation(snapshot, Sink(), popularity=f)
    assert gs.counts == {"code-python": 2.0} and gs.planner.model.to_state()["tenants"] == []
    gs.close()
    assert f.read().transitions["version"] == 1


@pytest.mark.parametrize("transitions", [
    [1, 2], "x", {"version": 9}, {"version": 1, "global": "rows", "tenants": []},
])
def test_a_bad_transition_model_is_ignored_and_the_counts_kept(tmp_path, snapshot, transitions):
    f = PopularityFile(tmp_path / "gw.popularity.json")
    f.path.write_text(json.dumps({"counts": {"code-python": 2.0}, "slots": {}, "transitions": transitions}))
    gs = gateway_speculation(snapshot, Sink(), popularity=f)
    assert gs.counts == {"code-python": 2.0} and gs.planner.model.to_state()["global"] == []


def test_an_unparseable_or_oversized_file_is_ignored(tmp_path):
    f = PopularityFile(tmp_path / "gw.popularity.json", max_bytes=10_000)
    f.path.write_text('{"transitions": ' + "[" * 100_000 + "]" * 100_000 + "}")  # over the bound
    assert f.read() == Saved({}, {})
    f.path.write_text("[" * 5_000 + "]" * 5_000)  # under it, nested past the parser's recursion
    assert f.read() == Saved({}, {})


def test_the_file_stays_under_its_byte_bound(tmp_path):
    from extproc.policy.prediction import TransitionModel
    model = TransitionModel(order=1, min_support=1)
    for t in range(200):
        for a in range(20):
            model.observe(f"tenant-{t}", "s", f"adapter-{a:02d}")
    f = PopularityFile(tmp_path / "gw.popularity.json", max_bytes=20_000)
    f.save({"adapter-00": 1.0}, {}, model)
    assert f.path.stat().st_size <= 20_000
    saved = f.read()
    back = TransitionModel.from_state(saved.transitions, min_support=1)
    assert back.predict_next("tenant-199", "adapter-03", 1) == [("adapter-04", 1.0)]  # the latest kept
    assert back.predict_next("new", "adapter-03", 1) == [("adapter-04", 1.0)]         # and the global rows
    big = PopularityFile(tmp_path / "gw.popularity.json", max_bytes=10)
    big.save({"adapter-00": 1.0}, {}, model)                                           # cannot fit: not written
    assert f.read() == saved


@pytest.mark.parametrize("first_mode", [PROD, OFF])
def test_a_restarted_gateway_predicts_the_learned_chain_at_a_new_sessions_first_step(tmp_path, snapshot,
                                                                                    first_mode):
    f = PopularityFile(tmp_path / "gw.popularity.json")
    first = gateway_speculation(snapshot, Sink(), popularity=f)
    feed(first, snapshot, first_mode)  # OFF: the benchmark's baseline gateway
    first.close()
    for restored, expected in ((True, ["acme-legal"]), (False, [])):
        if not restored:
            f.path.unlink()
        sink = Sink()
        gs = gateway_speculation(snapshot, sink, board=ResidencyBoard(pool("local-vllm", "code-python")),
                                 popularity=f)
        gs.observe(decision(snapshot, "code-python", PROD), "acme", "new")
        gs.drain()
        assert [(s.adapter, s.reason) for s in sink.signals] == [(a, "predicted") for a in expected]
        assert gs.planner.model.last_adapter("acme", "s0") is None  # sessions were not kept


def test_no_warm_set_where_prefetch_is_off_everywhere(tmp_path, snapshot):
    f = PopularityFile(tmp_path / "p.json")
    f.save({"code-python": 7.0}, {"local-vllm": 2})
    board, sink = ResidencyBoard(pool("local-vllm")), Sink()
    gs = GatewaySpeculation(FakeStore(snapshot), board, sink, popularity=f)
    gs._warm()
    assert sink.signals == []


# -- start-up wiring

def test_routing_policy_defaults_to_affinity_with_several_upstreams():
    from extproc.__main__ import popularity_path
    from extproc.policy.routing import choose_upstream, load_policy, route
    assert load_policy(None, 1) is choose_upstream
    assert load_policy(None, 3) is route
    assert load_policy("extproc.policy.routing:choose_upstream", 3) is choose_upstream
    assert popularity_path("x/gw.sqlite3").name == "gw.popularity.json"


def test_warm_set_waits_for_every_agent_host_and_follows_the_routing_placement(tmp_path, snapshot):
    from extproc.state.catalog import Upstream
    from extproc.policy.routing import place
    hosts = ["engine-1", "engine-2"]
    names = sorted(snapshot.adapters)
    f = PopularityFile(tmp_path / "gw.popularity.json")
    f.save({a: 10.0 - i for i, a in enumerate(names)}, {h: len(names) for h in hosts})
    ups = tuple(Upstream(h, f"127.0.0.1:{i}", "builtin", snapshot.upstreams[0].base_model, agent=f"127.0.0.1:9{i}")
                for i, h in enumerate(hosts))
    snap = replace(snapshot, upstreams=ups,
                   default_skills={**snapshot.default_skills, "dynamic_lora_prefetch": "prod"})
    now = [0.0]
    board, sink = ResidencyBoard(), Sink()
    gs = GatewaySpeculation(FakeStore(snap), board, sink, popularity=f, clock=lambda: now[0])
    remote = {a: TierReport("remote", None) for a in names}
    board.publish(ResidencySnapshot.build({"engine-1": remote}))
    gs._warm()
    assert sink.signals == []                       # engine-2's agent has not reported yet
    board.publish(ResidencySnapshot.build({h: remote for h in hosts}))
    gs._warm()
    assert {s.adapter: s.upstream for s in sink.signals} == place(names, hosts)
    # an agent that never reports: after warm_wait_s the hosts known are warmed
    sink2 = Sink()
    gs2 = GatewaySpeculation(FakeStore(snap), ResidencyBoard(), sink2, popularity=f, clock=lambda: now[0])
    gs2.board.publish(ResidencySnapshot.build({"engine-1": remote}))
    gs2._warm()
    assert sink2.signals == []
    now[0] = gs2.warm_wait_s + 1
    gs2._warm()
    assert {s.upstream for s in sink2.signals} == {"engine-1"} and len(sink2.signals) == len(names)


def test_with_nothing_learned_each_empty_pool_is_filled_with_what_routing_places_there(tmp_path, snapshot):
    from extproc.state.catalog import PUBLIC, Upstream
    from extproc.policy.routing import place
    hosts = ["engine-1", "engine-2"]
    names = sorted(snapshot.adapters)
    ups = tuple(Upstream(h, f"127.0.0.1:{i}", "builtin", snapshot.upstreams[0].base_model, agent=f"127.0.0.1:9{i}")
                for i, h in enumerate(hosts))
    snap = replace(snapshot, upstreams=ups,
                   default_skills={**snapshot.default_skills, "dynamic_lora_prefetch": "prod"})
    board, sink = ResidencyBoard(), Sink()
    gs = GatewaySpeculation(FakeStore(snap), board, sink, popularity=PopularityFile(tmp_path / "none.json"),
                            clock=lambda: 0.0)
    remote = {a: TierReport("remote", None) for a in names}
    board.publish(ResidencySnapshot.build({h: remote for h in hosts}))
    gs._warm()
    gs._warm()                                               # once per host
    owners = place(names, tuple(hosts))
    assert sorted((s.adapter, s.upstream) for s in sink.signals) == sorted(owners.items())
    assert all(s.room_only and s.reason == "fill" and s.probability is None and s.evict == () for s in sink.signals)
    for h in hosts:                                          # public adapters first
        publics = [snap.adapters[s.adapter].owner == PUBLIC for s in sink.signals if s.upstream == h]
        assert publics == sorted(publics, reverse=True)
    assert gs.counters()["fill_sent"] == len(names)
    # prefetch off everywhere: no fill
    board2, sink2 = ResidencyBoard(ResidencySnapshot.build({h: remote for h in hosts})), Sink()
    GatewaySpeculation(FakeStore(replace(snapshot, upstreams=ups)), board2, sink2, clock=lambda: 0.0)._warm()
    assert sink2.signals == []


def test_fill_signals_are_bounded_per_host_and_skip_other_base_models(snapshot):
    from extproc.fleet.speculation import fill_signals
    from extproc.state.catalog import Upstream
    names = sorted(snapshot.adapters)
    one = (Upstream("h", "127.0.0.1:1", "builtin", snapshot.upstreams[0].base_model),)
    assert len(fill_signals(replace(snapshot, upstreams=one), ["h"], adapters=names, per_host=1)) == 1
    other = (Upstream("h", "127.0.0.1:1", "builtin", "some-other-base"),)
    assert fill_signals(replace(snapshot, upstreams=other), ["h"], adapters=names) == []
    assert fill_signals(snapshot, ["h"], adapters=["not-in-the-catalog"]) == []


def test_drain_publishes_each_pools_first_victims(snapshot):
    sink = Sink()
    gs = gateway_speculation(snapshot, sink)
    gs.board.publish(pool("local-vllm", "code-python", "acme-legal"))
    for i in range(3):
        gs.observe(decision(snapshot, "code-python", PROD), "acme", f"s{i}")
    gs.drain()
    # acme-legal: resident, never asked for; code-python: asked three times
    assert gs.board.current.victims["local-vllm"][0] == "acme-legal"
    gs.board.publish(pool("local-vllm", "code-python"))  # the agents' next view keeps them
    assert gs.board.current.victims["local-vllm"][0] == "acme-legal"


def test_place_publishes_the_placement_by_demand_over_the_agents_hosts(snapshot):
    gs = gateway_speculation(snapshot, Sink())
    cold = TierReport("remote", None)
    gs.board.publish(ResidencySnapshot.build({h: {a: cold for a in "abcde"} for h in ("h1", "h2")}))
    assert gs.place() is True  # no counts yet: the ring's owners, one each
    assert all(len(o) == 1 for o in gs.board.current.placement.values())
    gs.counts.update({"a": 500.0, "b": 40.0, "c": 30.0, "d": 20.0, "e": 10.0})
    # 5 adapters over 2 hosts whose pools were seen full at 2: more than the pools hold
    for held in ("ab", "ac"):
        gs.planner.sync(ResidencySnapshot.build({"h1": {a: TierReport("device" if a in held else "remote", None)
                                                        for a in "abcde"}}), 0.0)
    gs.place()
    placement = gs.board.current.placement
    assert set(placement) == set("abcde")
    assert len(placement["a"]) == 2  # most of all demand: more than half a host's share
    assert gs.place() is False  # unchanged: nothing published again
    assert gs.board.current.of("h1", "a").tier == "remote"  # the agents' view is kept


def test_a_pool_whose_agent_announces_its_slots_is_modelled_at_that_size():
    """vLLM's resolver loads a request's adapter before the agent shrinks the cache back to
    S: the pool shows S + 1 for a moment, which a learned capacity would keep for good."""
    planner = SpeculationPlanner(initial_slots=2)
    five = pool("u", "a", "b", "c", "d", "e")
    planner.sync(replace(five, slots={"u": 4}), 0.0)
    spec = planner.speculator("u")
    assert spec.cache.capacity == 4 and len(spec.cache) == 4
    planner.sync(replace(pool("u", "a", "b", "c", "e"), slots={"u": 4}), 1.0)
    assert spec.cache.capacity == 4 and planner.full == {"u"}   # held its 4+ and let d go
    planner.sync(five, 2.0)                                      # not announced (builtin): learned
    assert spec.cache.capacity == 5


def test_sync_reads_an_agents_table_once_and_a_new_one_again():
    """The agents' tables are frozen and most syncs find most of them unchanged (a load
    measured, another host's change): each is read once (226 adapters x 4 hosts at
    hundreds, per sync, was the speculation thread's costliest step)."""
    from types import MappingProxyType

    class Table(dict):
        read = 0

        def items(self):
            Table.read += 1
            return super().items()

    first = Table({n: TierReport("device", 10.0, 1, False) for n in "ab"})
    planner = SpeculationPlanner(initial_slots=4)
    planner.sync(ResidencySnapshot(MappingProxyType({"u": first})), 0.0)
    planner.sync(ResidencySnapshot(MappingProxyType({"u": first}), loads={"u": 3}), 1.0)  # a load measured
    assert Table.read == 1 and set(planner.speculator("u").cache) == {"a", "b"}
    planner.sync(ResidencySnapshot(MappingProxyType({"u": Table({"c": TierReport("device", 10.0, 1, False)})})), 2.0)
    assert Table.read == 2 and set(planner.speculator("u").cache) == {"c"}
