"""bench.replica_learning: R gateway replicas, each with its own learned state, one pool."""
from bench import replica_learning, sim
from tests.bench.test_sim import args, chains


def _chains():
    return chains()


def test_one_replica_is_bench_sims_speculative_policy():
    w, a = _chains(), args(policies=["speculative"])
    one = replica_learning.run_replicas(replica_learning.columns(w, a), 2, a, 1, affinity=False)
    assert one["hit_ratio"] == sim.simulate(w, [2], a)["speculative"]["2"]["hit_ratio"]


def test_round_robin_breaks_the_session_chains_session_affinity_keeps_them():
    w, a = _chains(), args()
    cols = replica_learning.columns(w, a)
    one = replica_learning.run_replicas(cols, 2, a, 1, affinity=False)["hit_ratio"]
    rr = replica_learning.run_replicas(cols, 2, a, 2, affinity=False)["hit_ratio"]
    sticky = replica_learning.run_replicas(cols, 2, a, 2, affinity=True)["hit_ratio"]
    assert rr < sticky <= one
