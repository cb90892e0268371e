import pytest

from extproc.state.catalog import Upstream
from extproc.policy.routing import choose_endpoint, ring_walk
from extproc.policy.warmset import warm_set
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport, host_load


def Res(tier: str) -> TierReport:
    return TierReport(tier, None)


def snap(**hosts) -> ResidencySnapshot:
    """snap(h1={"a": "device"}) -> the snapshot where h1 reports adapter a on its device"""
    return ResidencySnapshot.build({h: {a: Res(t) for a, t in adapters.items()}
                                    for h, adapters in hosts.items()})


HOSTS3 = dict(h1={}, h2={}, h3={})


@pytest.mark.parametrize(
    "snapshot, loads, expected",
    [
        (snap(h1={}, h2={"a": "device"}, h3={}), {}, ("h2", "resident")),
        # resident on two hosts: the less loaded one
        (snap(h1={"a": "device"}, h2={"a": "device"}, h3={}), {"h1": 3, "h2": 1}, ("h2", "resident")),
        # host memory beats a cold host
        (snap(h1={"a": "host"}, h2={}, h3={}), {}, ("h1", "staged")),
        # device beats host memory
        (snap(h1={"a": "host"}, h2={"a": "device"}), {}, ("h2", "resident")),
        # disk/remote tiers are not affinity: consistent hashing decides
        (snap(h1={"a": "disk"}, h2={"a": "remote"}), {}, (None, "hashed")),
        (snap(), {}, (None, "none")),
    ],
)
def test_tiers(snapshot, loads, expected):
    d = choose_endpoint(snapshot, "a", "digest-a", loads=loads)
    if expected[0] is None and expected[1] == "hashed":
        assert d.reason == "hashed" and d.endpoint in snapshot.by_upstream
    else:
        assert (d.endpoint, d.reason) == expected


def test_overloaded_resident_host_spills_to_another_host():
    s = snap(h1={"a": "device"}, h2={}, h3={})
    d = choose_endpoint(s, "a", "digest-a", loads={"h1": 10, "h2": 0, "h3": 0})
    assert d.reason == "hashed" and d.endpoint in ("h2", "h3")


def test_consistent_hashing_is_stable_and_spreads():
    s = snap(**HOSTS3)
    picks = {choose_endpoint(s, f"a{i}", f"d{i}").endpoint for i in range(60)}
    assert picks == {"h1", "h2", "h3"}
    # the same digest always lands on the same host
    assert len({choose_endpoint(s, "x", "dx").endpoint for _ in range(5)}) == 1


def test_removed_host_only_moves_its_own_adapters():
    full = snap(**HOSTS3)
    part = snap(h1={}, h2={})
    for i in range(40):
        before = choose_endpoint(full, "a", f"d{i}").endpoint
        after = choose_endpoint(part, "a", f"d{i}").endpoint
        assert after in ("h1", "h2")
        if before != "h3":
            assert after == before


def test_absent_host_is_never_chosen_even_if_resident_in_old_view():
    s = snap(h1={}, h2={})
    assert choose_endpoint(s, "a", "da").endpoint in ("h1", "h2")


def test_hot_adapter_replicas_pick_least_loaded_owner():
    s = snap(**HOSTS3)
    walk = ring_walk(("h1", "h2", "h3"), "dhot")
    loads = {walk[0]: 1, walk[1]: 0, walk[2]: 0}
    pick = lambda r: choose_endpoint(s, "hot", "dhot", loads=loads, replicas=r, load_factor=2).endpoint
    assert pick(1) == walk[0]  # under the bound: the ring owner
    assert pick(2) == walk[1]  # two owners: the less loaded


def test_hosts_narrow_the_choice_and_an_unknown_host_holds_nothing():
    s = snap(h1={"a": "device"}, h2={})
    assert choose_endpoint(s, "a", "da").endpoint == "h1"
    d = choose_endpoint(s, "a", "da", hosts=("h2", "h3"))
    assert d.reason == "hashed" and d.endpoint in ("h2", "h3")


def test_warm_set_follows_routing_and_fills_hosts():
    pop = {f"a{i}": 100 - i for i in range(20)}
    digests = {a: f"d-{a}" for a in pop}
    ws = warm_set(pop, digests, ["h1", "h2"], per_host=3)
    assert sum(len(v) for v in ws.values()) == 6
    placed = [a for v in ws.values() for a in v]
    assert set(placed) == {f"a{i}" for i in range(6)}  # the 6 hottest
    s = snap(h1={}, h2={})
    for h, adapters in ws.items():
        for a in adapters[:1]:  # the hottest on each host is where routing sends it
            assert choose_endpoint(s, a, digests[a]).endpoint == h


def test_warm_set_replicates_the_hottest():
    pop = {"hot": 10, "b": 5, "c": 1}
    ws = warm_set(pop, {}, ["h1", "h2"], per_host=2, replicas_for_top=1)
    assert "hot" in ws["h1"] and "hot" in ws["h2"]


def test_route_plugs_into_the_gateway_seam():
    from extproc.state.catalog import Adapter, Upstream
    from extproc.policy.routing import load_policy, route

    assert load_policy("extproc.policy.routing:route") is route
    ups = [Upstream(f"e{i}", f"127.0.0.1:{9000 + i}", "builtin", "tiny") for i in range(3)]
    other = Upstream("x", "127.0.0.1:9100", "builtin", "other-base")
    ad = Adapter("code-sql", "tiny", 32, ("q_proj",), 100, "public", "adapters/code-sql", "ab" * 32)
    sent = SentCounts()
    # resident on e2
    snap = ResidencySnapshot.build({"e0": {}, "e1": {}, "e2": {"code-sql": Res("device")}})
    assert route(ups + [other], ad, snap, sent).name == "e2"
    # e2's agent is gone: only e0/e1 are known, never e2
    snap = ResidencySnapshot.build({"e0": {}, "e1": {}})
    assert route(ups, ad, snap, sent).name in ("e0", "e1")
    # no residency at all: fail open to hashing over the base model's upstreams
    assert route(ups + [other], ad, ResidencySnapshot(), sent).name in ("e0", "e1", "e2")
    assert route(ups, None, ResidencySnapshot(), sent).name == "e0"


def test_load_policy_owns_the_default():
    from extproc.errors import ConfigError
    from extproc.policy.routing import choose_upstream, load_policy, round_robin, route

    assert load_policy(None) is choose_upstream
    assert load_policy(None, 1) is choose_upstream
    assert load_policy(None, 3) is route             # several upstreams: adapter affinity
    assert load_policy("extproc.policy.routing:round_robin", 3) is round_robin
    assert load_policy("extproc.policy.routing:choose_upstream", 3) is choose_upstream
    for bad in ("extproc.policy.routing", "extproc.policy.routing:nope", "no.such.module:f"):
        with pytest.raises(ConfigError):
            load_policy(bad)


# ---- loads: the engines' own, published by the agents (ResidencySnapshot.loads) ----------

def test_an_overloaded_resident_host_loses_to_one_that_is_not():
    s = snap(h1={"a": "device"}, h2={"a": "device"}, h3={})
    # h1 is over the bound (ceil(1.25 * 41 / 3) = 18), h2 under it although busy
    d = choose_endpoint(s, "a", "da", loads={"h1": 30, "h2": 10, "h3": 0})
    assert (d.endpoint, d.reason) == ("h2", "resident")
    # the only resident host overloaded: a staged host that is not wins
    s = snap(h1={"a": "device"}, h2={"a": "host"}, h3={})
    d = choose_endpoint(s, "a", "da", loads={"h1": 30, "h2": 10, "h3": 0})
    assert (d.endpoint, d.reason) == ("h2", "staged")


def test_hashed_tier_skips_an_overloaded_host():
    s = snap(**HOSTS3)
    walk = ring_walk(("h1", "h2", "h3"), "dcold")
    assert choose_endpoint(s, "cold", "dcold").endpoint == walk[0]
    d = choose_endpoint(s, "cold", "dcold", loads={walk[0]: 20, walk[1]: 1, walk[2]: 1})
    assert (d.endpoint, d.reason) == (walk[1], "hashed")


def test_min_bound_keeps_a_lightly_loaded_resident_host():
    s = snap(h1={"a": "device"}, h2={}, h3={})
    loads = {"h1": 3, "h2": 0, "h3": 0}
    # pure bounded loads spill at tiny totals (bound ceil(1.25 * 4 / 3) = 2) ...
    assert choose_endpoint(s, "a", "da", loads=loads).reason == "hashed"
    # ... the floor keeps the adapter where it is resident until the host carries LOAD_FLOOR
    from extproc.policy.routing import LOAD_FLOOR
    assert choose_endpoint(s, "a", "da", loads=loads, min_bound=LOAD_FLOOR).endpoint == "h1"
    heavy = {"h1": 40, "h2": 0, "h3": 0}
    assert choose_endpoint(s, "a", "da", loads=heavy, min_bound=LOAD_FLOOR).reason == "hashed"


def _route_fixture():
    from extproc.state.catalog import Adapter, Upstream

    ups = [Upstream(f"e{i}", f"127.0.0.1:{9000 + i}", "builtin", "tiny") for i in range(3)]
    ad = Adapter("code-sql", "tiny", 32, ("q_proj",), 100, "public", "adapters/code-sql", "ab" * 32)
    return ups, ad, Res


def test_route_reads_the_snapshots_loads():
    from extproc.policy.routing import route

    ups, ad, res = _route_fixture()
    table = {"e0": {"code-sql": res("device")}, "e1": {"code-sql": res("device")}, "e2": {}}
    at = lambda loads: route(ups, ad, ResidencySnapshot.build(table, loads=loads), SentCounts()).name
    # both resident: the less loaded one, from the agents' measurements
    assert at({"e0": 9, "e1": 2, "e2": 0}) == "e1"
    assert at({"e0": 2, "e1": 9, "e2": 0}) == "e0"
    # both resident hosts overloaded: the adapter spreads to the third host
    assert at({"e0": 40, "e1": 40, "e2": 0}) == "e2"
    # light load never moves it off its resident hosts
    assert at({"e0": 5, "e1": 5, "e2": 0}) in ("e0", "e1")


def test_route_with_unknown_loads_decides_as_before():
    from extproc.policy.routing import route

    ups, ad, res = _route_fixture()
    table = {"e0": {}, "e1": {}, "e2": {"code-sql": res("device")}}
    assert route(ups, ad, ResidencySnapshot.build(table), SentCounts()).name == "e2"
    # a load for one host only: the others count as 0 and e2 is under the bound
    assert route(ups, ad, ResidencySnapshot.build(table, loads={"e2": 6}), SentCounts()).name == "e2"
    cold = ResidencySnapshot.build({"e0": {}, "e1": {}, "e2": {}})
    for i in range(20):
        other = _with_digest(ad, f"d{i}")
        assert (route(ups, other, cold, SentCounts()).name
                == choose_endpoint(cold, other.name, other.sha256, adapters=()).endpoint)


def _with_digest(ad, digest):
    from dataclasses import replace
    return replace(ad, name=f"x-{digest}", sha256=digest)


# ---- the gateway's own sends since a host's last measurement (SentCounts beside the snapshot)

def test_a_burst_spreads_once_the_sends_since_the_measurement_reach_the_floor():
    from extproc.policy.routing import LOAD_FLOOR, route

    ups, ad, res = _route_fixture()
    table = {"e0": {"code-sql": res("device")}, "e1": {}}
    measured = {"e0": 0, "e1": 0}  # both idle when their agents last measured
    at = lambda sent: route(ups[:2], ad, ResidencySnapshot.build(table, measured), SentCounts(sent)).name
    # the resident host keeps the burst until it carries LOAD_FLOOR requests ...
    assert [at({"e0": n, "e1": 0}) for n in range(LOAD_FLOOR)] == ["e0"] * LOAD_FLOOR
    # ... then the next one goes to the other host, not to the same host again
    assert at({"e0": LOAD_FLOOR, "e1": 0}) == "e1"
    # resident on both: the sends alone break the tie, the burst alternates
    both = ResidencySnapshot.build({"e0": {"code-sql": res("device")}, "e1": {"code-sql": res("device")}},
                                   measured)
    assert route(ups[:2], ad, both, SentCounts({"e0": 1, "e1": 0})).name == "e1"
    assert route(ups[:2], ad, both, SentCounts({"e0": 1, "e1": 1})).name == "e0"
    # the sends add to the measurement
    assert at({"e0": 3, "e1": 0}) == "e0"
    assert route(ups[:2], ad, ResidencySnapshot.build(table, {"e0": LOAD_FLOOR - 3, "e1": 0}),
                 SentCounts({"e0": 3, "e1": 0})).name == "e1"


def test_sends_to_a_host_without_a_measured_load_are_not_counted():
    from extproc.policy.routing import route

    ups, ad, res = _route_fixture()
    table = {"e0": {"code-sql": res("device")}, "e1": {}}
    # no agent measurement for e0: its load is unknown (0) whatever the gateway sent there
    assert route(ups[:2], ad, ResidencySnapshot.build(table, {"e1": 0}), SentCounts({"e0": 50})).name == "e0"
    assert route(ups[:2], ad, ResidencySnapshot.build(table, {}), SentCounts({"e0": 50, "e1": 0})).name == "e0"


def test_a_new_measurement_resets_the_sends_since():
    from extproc.policy.routing import LOAD_FLOOR, route

    ups, ad, res = _route_fixture()
    table = {"e0": {"code-sql": res("device")}, "e1": {}}
    sent = SentCounts({"e0": 7})       # sends before the measurement do not count
    measured_at = lambda: {u: sent.value(u) for u in ("e0", "e1")}
    snap = ResidencySnapshot.build(table, {"e0": 0, "e1": 0}, measured_at())
    loads = lambda s: [host_load(s, sent, u) for u in ("e0", "e1")]
    assert loads(snap) == [0, 0]
    for _ in range(LOAD_FLOOR):
        assert route(ups[:2], ad, snap, sent).name == "e0"
        sent.record("e0")
    assert loads(snap) == [LOAD_FLOOR, 0]   # the count moves, the snapshot stays as it was built
    assert route(ups[:2], ad, snap, sent).name == "e1"
    # e0's agent measures again (its load, say, still 0): counting starts over
    fresh = ResidencySnapshot.build(table, {"e0": 0, "e1": 0}, measured_at())
    assert loads(fresh) == [0, 0]
    assert route(ups[:2], ad, fresh, sent).name == "e0"


def test_sent_counts_lose_no_count_across_threads():
    import sys
    import threading

    sent, n, threads = SentCounts(), 20_000, 8
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        workers = [threading.Thread(target=lambda: [sent.record("h") for _ in range(n)])
                   for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        sys.setswitchinterval(before)
    assert sent.value("h") == n * threads and sent.value("other") == 0


# ---- placement: distinct adapters per host, bounded by the pools

TEN = [f"adapter-{i}" for i in range(10)]
FOUR = ["engine-1", "engine-2", "engine-3", "engine-4"]


def test_place_spreads_ten_adapters_evenly_over_four_five_slot_hosts():
    from collections import Counter

    from extproc.policy.routing import place
    owners = place(TEN, FOUR, {h: 5 for h in FOUR})
    assert set(owners) == set(TEN)
    counts = Counter(owners.values())
    assert set(counts) == set(FOUR)
    assert max(counts.values()) - min(counts.values()) <= 1
    assert sorted(counts.values()) == [2, 2, 3, 3]
    assert place(TEN, FOUR) == owners  # equal pools: the same as unknown pools


def test_place_never_gives_a_host_more_than_its_slots_while_others_have_room():
    from collections import Counter

    from extproc.policy.routing import place
    slots = {"engine-1": 1, "engine-2": 2, "engine-3": 3, "engine-4": 6}
    counts = Counter(place(TEN, FOUR, slots).values())
    assert all(counts[h] <= slots[h] for h in FOUR)
    assert counts["engine-4"] >= counts["engine-3"] >= counts["engine-2"] >= counts["engine-1"]


def test_place_moves_little_when_a_host_leaves_or_joins():
    from extproc.policy.routing import place
    before = place(TEN, FOUR)
    after = place(TEN, FOUR[:3])
    stayed = [a for a in TEN if before[a] != "engine-4" and after[a] == before[a]]
    kept = [a for a in TEN if before[a] != "engine-4"]
    assert len(stayed) >= len(kept) - 2  # the quotas grow, few adapters change host
    assert place(TEN, FOUR[:3] + ["engine-4"]) == before  # back: the same placement


def test_hashed_tier_follows_the_placement_not_the_plain_hash():
    from collections import Counter
    s = snap(**{h: {} for h in FOUR})
    plain = Counter(choose_endpoint(s, a, a).endpoint for a in TEN)
    placed = Counter(choose_endpoint(s, a, a, adapters=TEN).endpoint for a in TEN)
    assert max(placed.values()) - min(placed.values()) <= 1 and len(placed) == 4
    assert plain != placed  # these 10 names hash unevenly; the placement does not


def test_route_places_over_the_adapters_the_agents_report():
    from collections import Counter

    from extproc.policy.routing import route
    ups = [Upstream(h, "127.0.0.1:1", "builtin", "m") for h in FOUR]
    view = snap(**{h: {a: "remote" for a in TEN} for h in FOUR})
    picks = Counter(route(ups, lora(a), view, SentCounts()).name for a in TEN)
    assert sorted(picks.values()) == [2, 2, 3, 3]


def test_round_robin_cycles_hosts_whatever_the_adapter():
    from extproc.policy.routing import RoundRobin
    ups = [Upstream(h, "127.0.0.1:1", "builtin", "m") for h in FOUR]
    rr = RoundRobin()
    assert [rr(ups, lora(f"a{i}"), ResidencySnapshot(), SentCounts()).name for i in range(6)] == FOUR + FOUR[:2]


def lora(name: str):
    from extproc.state.catalog import Adapter
    return Adapter(name, "m", 8, ("q_proj",), 1, "public", f"adapters/{name}", name)


def test_warm_set_over_the_fleet_agrees_with_the_placement():
    from extproc.policy.routing import place
    popularity = {a: 10.0 - i for i, a in enumerate(TEN)}
    plan = warm_set(popularity, {a: a for a in TEN}, FOUR, 5, adapters=TEN)
    owners = place(TEN, FOUR)
    assert {a: h for h, adapters in plan.items() for a in adapters} == owners


def test_fill_set_puts_each_adapter_on_its_placement_owner_public_first_bounded():
    from extproc.policy.routing import place
    from extproc.policy.warmset import fill_set
    public = {f"pub-{i}": True for i in range(6)} | {f"own-{i}": False for i in range(6)}
    hosts = ["h0", "h1", "h2"]
    full = fill_set(public, hosts)
    owners = place(sorted(public), tuple(hosts))
    assert {a: h for h, names in full.items() for a in names} == owners
    for names in full.values():
        flags = [public[a] for a in names]
        assert flags == sorted(flags, reverse=True)       # public ones first
    assert fill_set({}, hosts) == {h: [] for h in hosts}


class _CountingTable(dict):
    """An agent's table that counts how often its adapters were listed."""

    listed = 0

    def __iter__(self):
        _CountingTable.listed += 1
        return super().__iter__()


def test_route_lists_the_fleets_adapters_only_for_an_adapter_it_must_place():
    """Listing every adapter of every host was the costliest step of ``route`` (4 x 226 at
    hundreds, per request and per speculation offer); only the ring's placement of an
    adapter that is neither placed, resident nor staged reads that list."""
    from extproc.policy.routing import route
    ups = [Upstream(h, "127.0.0.1:1", "builtin", "m") for h in FOUR]
    tables = {h: _CountingTable({a: Res("device" if (h, a) == ("engine-1", "adapter-0") else "remote") for a in TEN})
              for h in FOUR}
    view = ResidencySnapshot(tables)
    _CountingTable.listed = 0
    assert route(ups, lora("adapter-0"), view, SentCounts()).name == "engine-1"   # resident: nothing listed
    assert _CountingTable.listed == 0
    placed = route(ups, lora("adapter-1"), view, SentCounts()).name       # cold: placed over the fleet
    assert _CountingTable.listed == len(FOUR)
    plain = snap(**{h: {a: ("device" if (h, a) == ("engine-1", "adapter-0") else "remote") for a in TEN} for h in FOUR})
    assert route(ups, lora("adapter-1"), plain, SentCounts()).name == placed   # the same choice as before
