from extproc.policy.speculator import SpeculationSettings, Speculator


def run_sessions(spec, n, chain=("code", "review", "sql"), start=0.0, tenant="acme"):
    now = start
    out = []
    for s in range(n):
        for a in chain:
            out.append(spec.on_request(tenant, f"s{s}", a, now))
            now += 1.0
    return out, now


def test_learns_the_chain_and_prefetches_the_next_step():
    spec = Speculator(capacity=8)
    out, _ = run_sessions(spec, 5)
    # after learning: code -> prefetch review? review is resident (8 slots) -> only noted
    assert spec.model.predict_next("acme", "code", 1)[0][0] == "review"
    c = spec.counters()
    assert c["predictions_used"] >= 8 and c["predictions_wasted"] == 0


def test_prefetch_goes_out_when_the_next_adapter_is_not_resident():
    spec = Speculator(capacity=2, settings=SpeculationSettings(window=2))
    _, now = run_sessions(spec, 4)
    # fill the pool with two one-off adapters nobody will ask again soon
    spec.on_request("other", "x1", "junk1", now + 100)
    spec.on_request("other", "x2", "junk2", now + 101)
    assert "review" not in spec.cache
    got = spec.on_request("acme", "new", "code", now + 102)
    assert [p.adapter for p in got] == ["review"] and got[0].probability == 1.0
    assert "review" in spec.cache and spec.cache.get("review").prefetched
    used = spec.cache.stats.prefetch_used
    spec.on_request("acme", "new", "review", now + 103)
    assert spec.cache.stats.prefetch_used == used + 1


def test_never_evicts_the_adapter_in_use():
    spec = Speculator(capacity=1)
    for s in range(5):
        spec.on_request("t", s, "a", 2.0 * s)
        spec.on_request("t", s, "b", 2.0 * s + 1)
    assert spec.on_request("t", "last", "a", 20.0) == []  # the only slot serves this request
    assert "a" in spec.cache


def test_never_evicts_something_hotter():
    spec = Speculator(capacity=2, settings=SpeculationSettings(window=2, horizon_s=10, half_life_s=60))
    now = 0.0
    for i in range(600):  # "hot" is asked every second by everyone: use probability ~1
        spec.on_request("t", f"h{i}", "hot", now)
        now += 1.0
    for s in range(10):  # a strong but not certain habit: a -> b 9 times in 10
        spec.on_request("t", f"s{s}", "a", now)
        spec.on_request("t", f"s{s}", "b" if s else "c", now + 0.5)
        spec.on_request("t", f"k{s}", "hot", now + 0.7)
        now += 1.0
    spec.cache.evict("b")
    spec.cache.evict("c")
    spec.on_request("t", f"k{s}", "hot", now)
    got = spec.on_request("t", "last", "a", now + 0.1)
    assert got == [] and "hot" in spec.cache  # b (p=0.9) is not worth hot (p~1)
    spec2 = Speculator(capacity=3, settings=SpeculationSettings(window=3))
    for s in range(10):
        spec2.on_request("t", s, "a", float(s))
        spec2.on_request("t", s, "b", s + 0.5)
    spec2.cache.evict("b")
    assert [p.adapter for p in spec2.on_request("t", "new", "a", 20.0)] == ["b"]  # free slot


def test_busy_load_path_learns_but_does_not_load():
    spec = Speculator(capacity=4)
    for s in range(3):
        spec.demand("x", float(s))
        spec.speculate("t", s, "x", float(s), may_load=False)
        spec.demand("y", s + 0.5)
        spec.speculate("t", s, "y", s + 0.5, may_load=False)
    spec.cache.evict("y")
    assert spec.speculate("t", 9, "x", 10.0, may_load=False) == []
    assert spec.speculate("t", 10, "x", 11.0) != []


def test_load_callback_sets_ready_time():
    spec = Speculator(capacity=4)
    ready = spec.demand("a", 5.0, load=lambda a, now: now + 0.25)
    assert ready == 5.25 and spec.cache.stats.late == 1


def test_sync_follows_the_agents_view():
    spec = Speculator(capacity=3)
    spec.demand("a", 0.0)
    spec.demand("b", 0.0)
    spec.demand("loading", 0.0, load=lambda a, now: now + 5.0)
    spec.sync({"a", "c"}, now=1.0)  # the engine evicted b and loaded c on its own
    assert set(spec.cache) == {"a", "c", "loading"}  # b's slot went to c; the load in flight stays
    spec.sync({"a", "c"}, now=6.0)  # loading is done but not in the pool: dropped
    assert set(spec.cache) == {"a", "c"}


def test_a_shorter_horizon_tells_hot_from_lukewarm():
    import pytest
    spec = Speculator(capacity=4)
    for i in range(20):                     # "warm" asked every 2 s for 40 s
        spec.demand("warm", 2.0 * i)
    entry = spec.cache.get("warm")
    long = spec.score("warm", entry)
    spec.set_horizon(0.5)
    assert spec.score("warm", entry) < long  # within half a second it is far less certain
    with pytest.raises(ValueError):
        spec.set_horizon(0)


def test_eviction_spares_the_adapter_another_session_comes_back_for():
    """LRU would evict "review" (least recent); a session in progress expects it next,
    while nobody expects "junk" (more recent), so the score evicts "junk"."""
    spec = Speculator(capacity=3, settings=SpeculationSettings(min_p=0.99, k=1))
    _, now = run_sessions(spec, 6, chain=("code", "review"))
    spec.on_request("acme", "live", "code", now)          # the live session expects "review" next
    spec.on_request("other", "x", "junk", now + 0.1)
    assert set(spec.cache) == {"code", "review", "junk"}
    spec.demand("solo", now + 0.2)                         # a one-off request needs a slot
    assert "review" in spec.cache and "junk" not in spec.cache


def test_a_session_still_coming_back_keeps_its_adapter_hot_after_another_used_it():
    """Session "live" expects x next; session "other" then uses x. The old rule cleared the
    score left on x's entry (its prediction "came true"), so x looked as cold as its
    popularity; SessionDemand still counts "live" coming back for it."""
    def scenario(session_demand: bool) -> float:
        spec = Speculator(capacity=4, settings=SpeculationSettings(min_p=0.5, k=1, session_demand=session_demand))
        _, now = run_sessions(spec, 6, chain=("code", "x"))
        spec.on_request("acme", "live", "code", now)
        spec.on_request("acme", "other", "x", now + 0.1)
        return spec.score("x", spec.cache.get("x"))

    assert scenario(True) > 0.9
    assert scenario(False) < 0.5


# -- the first-step model inside the loop

def open_sessions(spec, n, opener="code", start=0.0, gap=1.0, tenant="acme"):
    now = start
    for s in range(n):
        spec.step(tenant, f"open{s}", opener, now)
        now += gap
    return now


def test_a_tenants_session_opener_is_kept_resident_where_the_pool_has_room():
    spec = Speculator(capacity=4, settings=SpeculationSettings(min_p=0.35, k=1))
    now = open_sessions(spec, 20)                           # acme's sessions open with "code", 1/s
    spec.cache.evict("code")                                # the engine dropped it
    got = spec.step("acme", "busy", "other", now)           # any request of the tenant
    assert [(p.adapter, p.reason) for p in got.prefetches] == [("code", "first_step")]
    assert got.first_step
    nxt = spec.step("acme", "fresh", "code", now + 0.5)
    assert nxt.first_step and nxt.ready_at <= now + 0.5      # the first step finds it loaded


def test_a_session_opener_never_evicts_what_a_session_in_flight_needs():
    spec = Speculator(capacity=2, settings=SpeculationSettings(min_p=0.35, k=1))
    now = open_sessions(spec, 20)
    for s in range(8):                                      # teach x -> needed (many sessions)
        spec.step("acme", f"w{s}", "x", now)
        spec.step("acme", f"w{s}", "needed", now + 0.1)
        now += 0.2
    spec.cache.evict("code")
    spec.step("acme", "live", "x", now)                     # live expects "needed" next
    assert set(spec.cache) == {"x", "needed"}
    assert spec.expected.need("needed", now) > 0.9
    got = spec.offer("code", 0.5, now, in_use="x", reason="first_step")  # less likely than "needed"
    assert got is None and set(spec.cache) == {"x", "needed"}


def test_first_steps_off_offers_no_openers():
    spec = Speculator(capacity=4, settings=SpeculationSettings(min_p=0.35, k=1, first_steps=0))
    now = open_sessions(spec, 20)
    spec.cache.evict("code")
    got = spec.step("acme", "busy", "other", now)
    assert got.prefetches == [] and not got.first_step


def test_step_offers_each_prediction_to_the_host_place_names():
    shared = Speculator(capacity=4)
    other = Speculator(capacity=4, model=shared.model, ledger=shared.ledger, pace=shared.pace,
                       expected=shared.expected, first_steps=shared.first_steps, name="other")
    sent = []
    for s in range(5):
        sent += shared.step("acme", f"s{s}", "code", float(s), place=lambda b: other).prefetches
        sent += shared.step("acme", f"s{s}", "review", s + 0.5, place=lambda b: other).prefetches
    assert sent and {p.host for p in sent} == {"other"} and "review" in other.cache
    assert shared.step("acme", "n2", "code", 11.0, place=lambda b: None).prefetches == []


def test_at_most_max_inflight_prefetches_load_on_a_host():
    spec = Speculator(capacity=8, settings=SpeculationSettings(max_inflight=1, first_steps=0))
    slow = lambda a, now: now + 5.0  # noqa: E731 - every load takes 5 s
    assert spec.offer("a", 0.9, 0.0, load=slow) is not None
    assert spec.offer("b", 0.9, 1.0, load=slow) is None  # "a" still loading
    assert spec.inflight(1.0) == ["a"]
    assert spec.offer("b", 0.9, 6.0, load=slow) is not None  # "a" is loaded by now


def test_a_prefetch_that_would_evict_a_costlier_reload_is_not_sent():
    spec = Speculator(capacity=1, settings=SpeculationSettings(max_inflight=0, first_steps=0, min_p=0.0))
    spec.demand("big", 0.0)
    spec.expected.expect("t", "s", [("big", 0.8)], 0.5)  # a session in flight comes back for it
    cost = {"big": 0.2, "small": 0.02}.get
    assert spec.offer("small", 0.9, 0.5, load_s=cost) is None
    assert "big" in spec.cache
    # the same case unpriced (should_speculate: 0.9 > 0.8) would have evicted it
    unpriced = Speculator(capacity=1, settings=SpeculationSettings(max_inflight=0, first_steps=0, min_p=0.0,
                                                                   priced=False))
    unpriced.demand("big", 0.0)
    unpriced.expected.expect("t", "s", [("big", 0.8)], 0.5)
    assert unpriced.offer("small", 0.9, 0.5, load_s=cost) is not None


def test_victims_are_the_coldest_first_never_a_load_in_flight():
    spec = Speculator(capacity=4, settings=SpeculationSettings(first_steps=0))
    for a, t in (("hot", 0.0), ("hot", 1.0), ("hot", 2.0), ("warm", 2.5), ("warm", 3.0), ("cold", 3.5)):
        spec.demand(a, t)
    spec.offer("loading", 0.9, 4.0, load=lambda a, now: now + 10.0)
    assert spec.victims(4.0, n=3) == ["cold", "warm", "hot"]


def test_lookahead_offers_the_step_after_the_next():
    settings = SpeculationSettings(lookahead=2, first_steps=0, max_inflight=0)
    spec = Speculator(capacity=8, settings=settings)
    run_sessions(spec, 5, chain=("plan", "code", "test"))
    spec.cache.evict("test")  # the engine let it go
    got = spec.on_request("acme", "new", "plan", 100.0)
    assert [p.adapter for p in got] == ["test"]  # code is resident; test is two steps ahead
    spec_one = Speculator(capacity=8, settings=SpeculationSettings(first_steps=0, max_inflight=0))
    run_sessions(spec_one, 5, chain=("plan", "code", "test"))
    assert spec_one._two_ahead("acme", "plan", set()) == [("test", 1.0)]


def test_min_support_setting_reaches_the_shared_model():
    from extproc.fleet.speculation import SpeculationPlanner
    from extproc.policy.speculator import SpeculationSettings, Speculator

    assert Speculator(4, SpeculationSettings(min_support=1.0)).model.min_support == 1.0
    assert SpeculationPlanner(SpeculationSettings(min_support=5.0)).model.min_support == 5.0


def test_opener_floor_lets_a_cheap_opener_in():
    from extproc.policy.speculator import SpeculationSettings, Speculator

    def opener(settings):
        spec = Speculator(4, settings)
        # the tenant opened many sessions with "o"; the next request (another session) offers it
        for i in range(20):
            spec.step("t", f"s{i}", "o", float(i))
        spec.cache.evict("o")
        got = spec.step("t", "new", "x", 20.0).prefetches
        return [p.adapter for p in got if p.reason == "first_step"]

    assert opener(SpeculationSettings(opener_min_p=0.0, min_p=0.99)) == ["o"]
    assert opener(SpeculationSettings(min_p=0.99)) == []
