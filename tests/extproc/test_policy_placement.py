"""Placement by demand (routing.place_by_demand), the owners' precedence in
choose_endpoint, and the board keeping the published placement."""
import pytest

from extproc.policy.routing import choose_endpoint, place_by_demand, replicas_of
from extproc.residency_view import ResidencyBoard, ResidencySnapshot, TierReport

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
    "demand, total, hosts, slots, expected",
    [
        (0.0, 0.0, 4, 16, 1),      # nothing counted yet
        (10.0, 1000.0, 4, 16, 1),  # 1%: under two slots' share (2/64)
        (40.0, 1000.0, 4, 16, 2),  # 4%: hot, a second owner
        (300.0, 1000.0, 4, 16, 3),  # 30%: more than half a host's share on each of two
        (900.0, 1000.0, 4, 16, 4),  # capped at the hosts
        (900.0, 1000.0, 1, 16, 1),  # one host: nowhere else to go
    ],
)
def test_replicas_of(demand, total, hosts, slots, expected):
    assert replicas_of(demand, total, hosts, slots) == expected


def test_demand_is_balanced_across_hosts_and_the_hot_adapters_have_several_owners():
    demand = zipf_demand(200)
    placement = place_by_demand(demand, HOSTS, slots=16, adapters=demand)
    load = host_demand(placement, demand)
    mean = sum(load.values()) / len(HOSTS)
    assert max(load.values()) <= 1.15 * mean, load
    assert len(placement["ad-000"]) >= 2 and len(set(placement["ad-000"])) == len(placement["ad-000"])
    assert all(len(placement[f"ad-{i:03d}"]) == 1 for i in range(100, 200))  # the cold tail: one owner
    assert set(placement) == set(demand)


def test_placement_is_sticky_an_adapter_keeps_its_owners():
    demand = zipf_demand(60)
    first = place_by_demand(demand, HOSTS, slots=16, adapters=demand)
    shifted = {a: d * (1.5 if i % 7 == 0 else 1.0) for i, (a, d) in enumerate(demand.items())}
    again = place_by_demand(shifted, HOSTS, slots=16, adapters=demand, previous=first)
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
