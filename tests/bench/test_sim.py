import json
from pathlib import Path

import numpy as np
import pytest

from bench import sim
from bench.workload import Workload, WorkloadSpec, synthetic


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


def test_speculation_learns_a_chain_and_counts_predictions():
    # every session is 0 -> 1 -> 2 (adapters 3.. are one-offs that churn the single free slot)
    adapters, sessions, t = [], [], []
    clock = 0.0
    for s in range(60):
        for a in (0, 1, 2):
            adapters.append(a)
            sessions.append(s)
            t.append(clock)
            clock += 2.0
        adapters.append(3 + s)
        sessions.append(1000 + s)
        t.append(clock)
        clock += 2.0
    w = workload(adapters, t, sessions)
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
    assert sim.main(["--trace", str(Path(__file__).resolve().parents[2] / "data/multi_lora_eval/multi_lora_eval_800.json"), "--out", str(out)]) == 0
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
    assert sim.main(["--trace", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    assert "missing field" in capsys.readouterr().err


def test_cli_synthetic_small(tmp_path):
    out = tmp_path / "sim.json"
    assert sim.main(["--requests", "3000", "--adapters", "200", "--tenants", "30", "--budget", "4,8,16",
                     "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 3000 and report["targets"]["budget"] == 8
    assert report["workload"]["synthetic"]["adapters"] == 200
    for p in sim.POLICIES:
        assert set(report["results"][p]) == {"4", "8", "16"}
    # the oracle is an upper bound on every online policy in practice
    for b in ("4", "8", "16"):
        assert report["results"]["oracle"][b]["hit_ratio"] >= report["results"]["speculative"][b]["hit_ratio"]
