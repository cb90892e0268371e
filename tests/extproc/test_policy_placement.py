"""Placement by demand (routing.place_by_demand), the owners' precedence in
choose_endpoint, and the board keeping the published placement."""
import pytest

from extproc.policy.routing import choose_endpoint, place_by_demand, replicas_of
from extproc.state.residency import ResidencyBoard, ResidencySnapshot, TierReport

HOSTS = ("h0", "h1", "h2", "h3")


def zipf_demand(n: int, s: float = 1.1) -> dict[str, float]:
    return {f"ad-{i:03d}": 1000.0 / (i + 1) ** s for i in range(n)}


def host_demand(placement, demand):
    load = dict.fromkeys(HOSTS, 0.0)
    for a, owners in placement.items():
        for h in owners:
            load[h] += demand.get(a, 0.0) / len(owners)
    return load


@pytest.mark.parametrize(
    "demand, total, hosts, slots, owners",
    [
        (0.0, 0.0, 4, 16, 1),       # nothing counted yet
        (40.0, 1000.0, 4, 16, 1),   # 4%: one owner is enough
        (8.0, 20.0, 4, 16, 1),      # 40%, but 8 requests say nothing yet
        (300.0, 1000.0, 4, 16, 3),  # 30%: more than half a host's share on each of two
        (900.0, 1000.0, 4, 16, 4),  # capped at the hosts
        (900.0, 1000.0, 1, 16, 1),  # one host: nowhere else to go
    ],
)
def test_replicas_of(demand, total, hosts, slots, owners):
    assert replicas_of(demand, total, hosts, slots) == owners


def test_demand_is_evened_out_by_moving_single_owner_adapters():
    demand = zipf_demand(200)
    ring = place_by_demand({}, HOSTS, adapters=demand)  # the count quota's owners
    placement = place_by_demand(demand, HOSTS, slots=16, adapters=demand)
    mean = sum(demand.values()) / len(HOSTS)
    assert max(host_demand(ring, demand).values()) > 1.2 * mean  # the ring alone leaves one heavy
    assert max(host_demand(placement, demand).values()) <= 1.2 * mean
    assert len(placement["ad-000"]) == 2  # a fifth of all demand: over half a host's share
    assert all(len(o) == 1 for a, o in placement.items() if a != "ad-000")  # the rest by moves, not copies
    assert set(placement) == set(demand)


def test_a_very_hot_adapter_gets_several_owners():
    demand = {"hot": 1000.0, **{f"ad-{i}": 50.0 for i in range(40)}}  # a third of all
    placement = place_by_demand(demand, HOSTS, slots=8, adapters=demand)  # 41 adapters, 32 slots
    assert len(placement["hot"]) == 3 and len(set(placement["hot"])) == 3


def test_no_move_while_the_hosts_are_even():
    demand = {f"ad-{i}": 100.0 for i in range(8)}  # 8 equal adapters, 4 hosts: 2 each
    ring = place_by_demand({}, HOSTS, adapters=demand)
    assert place_by_demand(demand, HOSTS, slots=1, adapters=demand) == ring  # crowded, but even


def test_unknown_pool_size_neither_copies_nor_moves():
    demand = zipf_demand(200)
    ring = place_by_demand({}, HOSTS, adapters=demand)
    assert place_by_demand(demand, HOSTS, slots=None, adapters=demand) == ring
    assert place_by_demand(demand, HOSTS, slots=16, adapters=demand) != ring  # known to be crowded: it does


def test_placement_is_sticky_an_adapter_keeps_its_owners():
    demand = zipf_demand(60)
    first = place_by_demand(demand, HOSTS, slots=8, adapters=demand)  # 60 adapters, 32 slots
    shifted = {a: d * (1.5 if i % 7 == 0 else 1.0) for i, (a, d) in enumerate(demand.items())}
    again = place_by_demand(shifted, HOSTS, slots=8, adapters=demand, previous=first)
    moved = [a for a in demand if not set(first[a]) & set(again[a])]
    assert moved == []


def test_adapters_without_demand_keep_the_ring_placement():
    placement = place_by_demand({}, HOSTS, adapters=[f"ad-{i}" for i in range(8)])
    counts = [sum(1 for o in placement.values() if o == (h,)) for h in HOSTS]
    assert sorted(counts) == [2, 2, 2, 2]


def snap(**hosts) -> ResidencySnapshot:
    return ResidencySnapshot.build({h: {a: TierReport(t, None) for a, t in ads.items()} for h, ads in hosts.items()})


@pytest.mark.parametrize(
    "residency, loads, routed, owners, expected",
    [
        # an owner with fewer requests routed so far wins over the resident non-owner
        (snap(h0={"a": "device"}, h1={}, h2={}), {}, {"h1": 5, "h2": 3}, ("h1", "h2"), ("h2", "placed")),
        # fewer requests in flight first, then fewer routed
        (snap(h0={}, h1={}, h2={}), {"h1": 0, "h2": 2}, {"h1": 9, "h2": 0}, ("h1", "h2"), ("h1", "placed")),
        # every owner over the bound: the tiers decide (resident elsewhere)
        (snap(h0={"a": "device"}, h1={}, h2={}), {"h0": 0, "h1": 40, "h2": 0}, {}, ("h1",), ("h0", "resident")),
        # no owners: the tiers, as before
        (snap(h0={}, h1={"a": "device"}), {}, {}, (), ("h1", "resident")),
    ],
)
def test_owners_come_first(residency, loads, routed, owners, expected):
    d = choose_endpoint(residency, "a", "a", loads=loads, min_bound=16, owners=owners, routed=routed)
    assert (d.endpoint, d.reason) == expected


def test_the_board_keeps_the_placement_when_the_agents_publish():
    board = ResidencyBoard()
    board.place({"a": ("h1",)})
    board.publish(snap(h1={"a": "device"}))
    assert dict(board.current.placement) == {"a": ("h1",)}
    assert board.current.of("h1", "a").tier == "device"
    board.place({"a": ("h0", "h1")})
    assert board.current.of("h1", "a").tier == "device"  # the agents' view is kept


def test_no_move_while_the_pools_hold_the_whole_catalog():
    demand = zipf_demand(10)  # 10 adapters, 4 pools of 5: every adapter fits somewhere
    ring = place_by_demand({}, HOSTS, adapters=demand)

    def moved(placement):  # single-owner adapters off their ring owner (the hottest has copies)
        return [a for a, o in placement.items() if len(o) == 1 and o != ring[a]]

    assert place_by_demand(demand, HOSTS, slots=5, adapters=demand) == ring  # no copy, no move
    assert moved(place_by_demand(demand, HOSTS, slots=2, adapters=demand)) != []  # 10 > 8: it balances
