import json
from pathlib import Path

import numpy as np
import pytest

from bench import sim
from bench.workload import Workload, WorkloadSpec, encode_trace, synthetic

EVAL_TRACE = Path(__file__).resolve().parents[2] / "data/multi_lora_eval/multi_lora_eval_800.json"


def workload(adapters, t=None, sessions=None, ranks=None):
    n = len(adapters)
    return Workload(
        t=np.asarray(t if t is not None else [float(i) for i in range(n)]),
        tenant=np.zeros(n, dtype=np.int32),
        session=np.asarray(sessions if sessions is not None else list(range(n)), dtype=np.int64),
        adapter=np.asarray(adapters, dtype=np.int32),
        rank_of=np.asarray(ranks or [8] * (max(adapters) + 1), dtype=np.int32),
        names=[str(i) for i in range(max(adapters) + 1)],
    )


def args(**over):
    a = sim.parse_args(["--lead-ms", "0.001"])
    for k, v in over.items():
        setattr(a, k, v)
    return a


def test_next_use():
    assert sim.next_use(np.asarray([1, 2, 1, 1, 2])) == [2, 4, 3, 5, 5]


def test_load_channel_serialises():
    ch = sim.LoadChannel(1)
    assert ch.load(0.0, 1.0) == 1.0
    assert ch.load(0.5, 1.0) == 2.0  # waits for the link
    assert ch.backlog(0.5) == 1.5
    assert ch.load(5.0, 1.0) == 6.0


def test_belady_beats_lru_on_a_classic_sequence():
    # cyclic access over 3 adapters with 2 slots: LRU misses everything, Belady does not
    w = workload([0, 1, 2] * 20)
    res = sim.simulate(w, [2], args(policies=["lru", "belady", "oracle"]))
    assert res["lru"]["2"]["hit_ratio"] == 0.0
    assert res["belady"]["2"]["hit_ratio"] > 0.4
    assert res["oracle"]["2"]["hit_ratio"] >= res["belady"]["2"]["hit_ratio"]


def chains(n: int = 60):
    """Every session is 0 -> 1 -> 2; a one-off adapter (3..) between sessions churns the
    single free slot."""
    adapters, sessions, t = [], [], []
    clock = 0.0
    for s in range(n):
        for a in (0, 1, 2):
            adapters.append(a)
            sessions.append(s)
            t.append(clock)
            clock += 2.0
        adapters.append(3 + s)
        sessions.append(1000 + s)
        t.append(clock)
        clock += 2.0
    return workload(adapters, t, sessions)


def test_speculation_learns_a_chain_and_counts_predictions():
    w = chains()
    res = sim.simulate(w, [2], args(policies=["lru", "speculative"]))
    spec = res["speculative"]["2"]
    assert spec["hit_ratio"] > res["lru"]["2"]["hit_ratio"] + 0.3
    assert spec["predictions_used"] > 100
    assert spec["prefetch_used"] + spec["prefetch_wasted"] <= spec["prefetches"]


def test_targets_arithmetic():
    r = {p: {"32": {"hit_ratio": h}} for p, h in
         {"lru": 0.5, "speculative": 0.8, "oracle": 1.0, "belady": 0.7, "ingress": 0.6}.items()}
    t = sim.targets(r, [8, 32, 128])
    assert t["gap_closed"] == pytest.approx(0.6) and t["gap_closed_met"] and t["beats_belady"]
    assert t["gap_closed_vs_ingress"] == pytest.approx(0.5)


def test_synthetic_workload_shape():
    w = synthetic(WorkloadSpec(requests=5000, adapters=300, tenants=40, seed=3))
    assert len(w) == 5000 and np.all(np.diff(w.t) >= 0)
    counts = np.sort(np.bincount(w.adapter))[::-1]
    assert counts[0] > 5 * counts[20]  # skewed (Zipf)
    w2 = synthetic(WorkloadSpec(requests=5000, adapters=300, tenants=40, seed=3))
    assert np.array_equal(w.adapter, w2.adapter)


def test_cli_on_the_eval_trace(tmp_path):
    out = tmp_path / "sim.json"
    assert sim.main(["--trace", str(EVAL_TRACE), "--out", str(out), "--hosts", "0", "--one-host-trace", ""]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 800 and report["budgets"] == [1, 2, 3, 5, 7]
    assert set(report["results"]) == set(sim.POLICIES)
    for by_budget in report["results"].values():
        for r in by_budget.values():
            assert 0.0 <= r["hit_ratio"] <= 1.0
    assert out.with_suffix(".png").stat().st_size > 1000


def test_cli_reports_bad_trace(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"t": 1}]')
    assert sim.main(["--trace", str(bad), "--out", str(tmp_path / "x.json"), "--hosts", "0"]) == 2
    assert "missing field" in capsys.readouterr().err


def test_cli_synthetic_small(tmp_path):
    out = tmp_path / "sim.json"
    assert sim.main(["--requests", "3000", "--adapters", "200", "--tenants", "30", "--budget", "4,8,16",
                     "--out", str(out), "--hosts", "4", "--fleet-requests", "3000", "--fleet-adapters", "300",
                     "--fleet-tenants", "40", "--fleet-rate", "40", "--fleet-budget", "4,8",
                     "--one-host-trace", ""]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 3000 and report["targets"]["budget"] == 8
    assert report["workload"]["synthetic"]["adapters"] == 200
    for p in sim.POLICIES:
        assert set(report["results"][p]) == {"4", "8", "16"}
    # the oracle is an upper bound on every online policy
    for b in ("4", "8", "16"):
        assert report["results"]["oracle"][b]["hit_ratio"] >= report["results"]["speculative"][b]["hit_ratio"]
    assert report["bounds_ok"] is True and report["bounds_broken"] == []
    assert out.with_name("sim_fleet.png").stat().st_size > 1000
    fleet = report["fleet"]
    assert fleet["hosts"] == 4 and set(fleet["results"]) == {"4", "8"}
    for arms in fleet["results"].values():
        assert set(arms) == {"round_robin", "affinity", "ace"}
        for r in arms.values():
            assert r["hit_ratio"] <= r["bounds"]["oracle"]["hit_ratio"] + 1e-3
            assert r["first_steps"] > 0


def adversarial(requests=6000, adapters=400, seed=5):
    """The shape of the trace the oracle once failed on, scaled down: Zipf entry
    adapters, ~80% of sessions on per-tenant chains, sessions opening faster than the
    load link can serve the misses at small budgets (~50 sessions/s)."""
    return synthetic(WorkloadSpec(requests=requests, adapters=adapters, tenants=60, rate_per_s=130.0,
                                  p_single=0.2, seed=seed))


@pytest.mark.parametrize("seed", [5, 11])
def test_oracle_is_an_upper_bound_on_the_adversarial_shape(seed):
    w = adversarial(seed=seed)
    n_ad = len(np.unique(w.adapter))
    budgets = sorted({max(1, round(n_ad * f)) for f in (0.1, 0.2, 0.3, 0.5)})
    res = sim.simulate(w, budgets, args(policies=list(sim.POLICIES), lead_ms=50.0))
    for b in map(str, budgets):
        assert res["oracle"][b]["hit_ratio"] >= res["belady_ingress"][b]["hit_ratio"] - 1e-3
    low = str(budgets[0])  # the link is saturated here: the old oracle scored LRU's ratio exactly
    assert res["oracle"][low]["hit_ratio"] > res["lru"][low]["hit_ratio"] + 0.05
    # every bound holds at every budget, the saturated ones included
    assert sim.check_bounds(res) == []


def test_check_bounds_names_every_broken_bound():
    r = {"lru": {"8": {"hit_ratio": 0.6}}, "belady": {"8": {"hit_ratio": 0.5}},
         "speculative": {"8": {"hit_ratio": 0.9}}, "oracle": {"8": {"hit_ratio": 0.8}}}
    broken = sim.check_bounds(r)
    assert any("speculative" in m and "oracle" in m for m in broken)
    assert any("lru" in m and "Belady" in m for m in broken)
    r["oracle"]["8"]["hit_ratio"] = 0.9005  # within the tolerance
    r["belady"]["8"]["hit_ratio"] = 0.6
    assert sim.check_bounds(r) == []


def test_main_fails_loudly_when_a_bound_breaks(tmp_path, monkeypatch, capsys):
    real = sim.run_ceiling

    def weak_oracle(cols, possible=None):
        return dict(real(cols, possible), hit_ratio=0.0)
    monkeypatch.setattr(sim, "run_ceiling", weak_oracle)
    rc = sim.main(["--requests", "2000", "--adapters", "100", "--tenants", "20", "--budget", "4,8",
                   "--out", str(tmp_path / "s.json"), "--hosts", "0", "--one-host-trace", ""])
    assert rc == 3
    assert "bounds do not hold" in capsys.readouterr().err
    assert json.loads((tmp_path / "s.json").read_text())["bounds_ok"] is False


def test_gap_closed_is_not_computed_over_a_vanishing_gap():
    r = {p: {"32": {"hit_ratio": h}} for p, h in
         {"lru": 0.5, "speculative": 0.52, "oracle": 0.5005, "belady": 0.5}.items()}
    t = sim.targets(r, [8, 32, 128])
    assert t["gap_closed"] is None and t["gap_closed_met"] is False


def test_first_steps_come_from_session_order_on_a_trace_without_step_fields(tmp_path):
    rows = [{"t": i * 1.0, "tenant": "a" if i % 2 else "b", "adapter": f"x{i % 3}", "rank": 8, "domain": "d",
             "session": i // 4, "messages": [{"role": "user", "content": "hi"}]} for i in range(12)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    from bench.trace import load_trace

    w = encode_trace(load_trace(path))
    first = sim.first_steps(w.session)
    # (tenant, session) pairs: b/0 a/0 b/1 a/1 b/2 a/2, each opened once
    assert sum(first) == 6 and first[:2] == [True, True] and first[2:4] == [False, False]
    res = sim.simulate(w, [2], args(policies=["lru", "speculative"]))
    assert res["lru"]["2"]["first_steps"] == 6 and res["speculative"]["2"]["first_steps"] == 6


def test_one_host_check_on_the_eval_trace_starts_cold():
    a = args(one_host_trace=str(EVAL_TRACE), one_host_budget=5)
    r = sim.one_host_check(a)
    assert r["budget"] == 5 and r["requests"] == 800 and r["broken"] == []
    h = r["hit_ratio"]
    assert h["oracle"] >= max(h["speculative"], h["belady"], h["lru"]) - 1e-3
    assert 0 < r["first_steps"] < 800


def test_oracle_is_an_upper_bound_on_a_dense_trace_of_the_hundreds_shape(tmp_path):
    """The unseen-trace failure, scaled down: the hundreds scenario's shape (Zipf tenants,
    workflows, strays, one-offs) opening 50 sessions/s, so the load link saturates at small
    budgets. The former oracle (now ``lookahead``: Belady eviction + aggressive prefetch)
    scores 0.12 at 29 slots there, beaten by ``scored``'s 0.36; the oracle is a true bound."""
    import subprocess
    import sys

    from bench.trace import load_trace
    trace = tmp_path / "dense.jsonl"
    subprocess.run([sys.executable, str(EVAL_TRACE.parent / "generate.py"), "--scenario", "hundreds",
                    "--n", "6000", "--tenants", "60", "--public", "150", "--session-rate", "50", "--seed", "3",
                    "--out", str(trace)], check=True, capture_output=True)
    w = encode_trace(load_trace(trace))
    res = sim.simulate(w, [29, 147], args(policies=["ingress", "scored", "belady_ingress", "lookahead", "oracle"],
                                          lead_ms=50.0))
    assert res["scored"]["29"]["hit_ratio"] > res["lookahead"]["29"]["hit_ratio"] + 0.1
    assert sim.check_bounds(res) == []
    for b in ("29", "147"):
        assert all(res["oracle"][b]["hit_ratio"] >= by[b]["hit_ratio"] for p, by in res.items() if p != "lookahead")
