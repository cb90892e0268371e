import random

from bench import fleet, sim
from bench.workload import WorkloadSpec, synthetic
from extproc.policy.routing import LOAD_FLOOR, choose_endpoint
from extproc.state.residency import ResidencySnapshot, TierReport
from ace_common.tiers import Tier


def test_fleet_router_agrees_with_choose_endpoint():
    rng = random.Random(3)
    hosts = [f"host-{h:03d}" for h in range(8)]
    for _ in range(300):
        pools = [set(rng.sample(range(30), 4)) for _ in hosts]
        router = fleet.FleetRouter(hosts, pools)
        router.load = [rng.randrange(0, 14) for _ in hosts]
        router.total = sum(router.load)
        a = rng.randrange(30)
        device = TierReport(Tier.DEVICE.value, None)
        snapshot = ResidencySnapshot.build({h: {str(b): device for b in pools[i]} for i, h in enumerate(hosts)})
        want = choose_endpoint(snapshot, str(a), f"adapter-{a}", loads=dict(zip(hosts, router.load)),
                               min_bound=LOAD_FLOOR)
        assert hosts[router.choose(a)] == want.endpoint, (a, pools, router.load, want)


def small_fleet(**over):
    a = sim.parse_args(["--hosts", "4", "--service-s", "1.0"])
    for k, v in over.items():
        setattr(a, k, v)
    w = synthetic(WorkloadSpec(requests=4000, adapters=300, tenants=40, rate_per_s=40.0, seed=9))
    return fleet.run_fleet(w, [4, 8], 4, sim.settings_of(a), a)


def test_fleet_arms_side_by_side_with_bounds_that_hold():
    res = small_fleet()
    assert fleet.check_bounds(res) == []
    for arms in res.values():
        assert set(arms) == set(fleet.ARMS)
        for name, r in arms.items():
            assert 0.0 <= r["hit_ratio"] <= r["bounds"]["oracle"]["hit_ratio"] + fleet.TOLERANCE
            assert r["first_steps"] == arms["round_robin"]["first_steps"] > 0
        # residency-aware routing keeps an adapter on few hosts: fewer loads than round robin
        assert arms["affinity"]["loads"] < arms["round_robin"]["loads"]
        assert arms["ace"]["predictions"] > 0


def test_fleet_check_bounds_fails_on_a_policy_above_its_oracle():
    res = {"8": {"ace": {"hit_ratio": 0.9, "bounds": {"oracle": {"hit_ratio": 0.8}, "belady": {"hit_ratio": 0.5}}},
                 "affinity": {"hit_ratio": 0.6, "bounds": {"oracle": {"hit_ratio": 0.9}, "belady": {"hit_ratio": 0.5}}}}}
    broken = fleet.check_bounds(res)
    assert len(broken) == 2 and "ace" in broken[0] and "Belady" in broken[1]


def test_fleet_targets_need_a_meaningful_gap():
    res = {"8": {"affinity": {"hit_ratio": 0.5}, "ace": {"hit_ratio": 0.62, "bounds": {"oracle": {"hit_ratio": 0.7}}}}}
    t = fleet.fleet_targets(res, [8])
    assert t["ace_minus_affinity_met"] and abs(t["gap_closed"] - 0.6) < 1e-9 and t["gap_closed_met"]
    res["8"]["ace"]["bounds"]["oracle"]["hit_ratio"] = 0.505
    assert fleet.fleet_targets(res, [8])["gap_closed"] is None


def test_ace_loads_a_requests_own_adapter_at_ingress_or_at_its_engine():
    from bench.fleet import run_arm
    from extproc.policy.speculator import SpeculationSettings
    cols = ([0.0], [0.05], [0], [0], [0], [0.01], [True])  # reaches the engine 50 ms after the gateway
    run = lambda **kw: run_arm("ace", cols, 1, 2, 1, SpeculationSettings(), service_s=0.1, max_backlog_s=0.25, **kw)[0]
    assert run()["hit_ratio"] == 1.0  # the 10 ms load started at ingress is done when it arrives
    assert run(ingress=False)["hit_ratio"] == 0.0  # started by the engine: it waits for it


def test_the_gateway_prices_its_bets_as_the_agents_do_and_the_agents_rule_refuses_the_rest():
    """A tenant's sessions go A -> B or A -> C in turn, so after A each is a coin flip: with
    a wasted load charged its whole time such a bet does not pay; the hosts' speculation
    prices it with the share the agents announce and does not send it (before, it sent it
    and the agents refused it ``not_worth``); with nothing charged it is sent and taken."""
    from bench.fleet import run_arm
    from extproc.policy.speculator import SpeculationSettings
    t, ad, ss = [], [], []
    for k in range(40):
        t += [10.0 * k, 10.0 * k + 1.0]
        ad += [0, 1 + k % 2]
        ss += [k, k]
    n = len(t)
    cols = (t, [x + 0.005 for x in t], ad, [0] * n, ss, [0.01, 0.01, 0.01], [j % 2 == 0 for j in range(n)])
    run = lambda share: run_arm("ace", cols, 1, 2, 1, SpeculationSettings(), service_s=0.1, max_backlog_s=0.25,
                                ingress=False, agent_waste_share=share)[0]
    charged, free = run(1.0), run(0.0)
    assert charged["prefetches"] < free["prefetches"]
    assert "not_worth" not in charged["refused"] and "not_worth" not in free["refused"]
    # the request's own load is in flight when its bets arrive: refused as the agents do
    assert free["refused"]["demand_queued"] > 0
    assert "refused" not in run_arm("ace", cols, 1, 2, 1, SpeculationSettings(), service_s=0.1,
                                    max_backlog_s=0.25)[0]  # every bet taken: nothing counted
