"""The simulator <-> stack agreement check (pure, over bench report rows) and its CLI."""
from __future__ import annotations

import json
from pathlib import Path

from bench import sim_stack

TRACE = Path(__file__).resolve().parents[2] / "data/multi_lora_eval/multi_lora_eval_800.json"


def test_agreement_is_within_three_points_per_arm():
    stack = {"round_robin": {"effective_hit_ratio": 0.55}, "affinity": {"effective_hit_ratio": 0.70},
             "ace": {"effective_hit_ratio": 0.80}}
    sim = {"round_robin": {"hit_ratio": 0.57}, "affinity": {"hit_ratio": 0.7299}, "ace": {"hit_ratio": 0.90}}
    a = sim_stack.agreement(stack, sim)
    assert a["arms"]["round_robin"] == {"stack": 0.55, "sim": 0.57, "diff": 0.02, "within": True}
    assert a["arms"]["affinity"]["within"] is True
    assert a["arms"]["ace"]["within"] is False and a["arms"]["ace"]["diff"] == 0.1
    assert a["all_within"] is False
    del sim["ace"]
    assert sim_stack.agreement(stack, sim)["all_within"] is True
    assert sim_stack.agreement(stack, {})["all_within"] is False  # nothing compared: no agreement


def rows_and_report(hosts=1):
    rows = [
        {"hosts": hosts, "arm": "affinity", "adapter": "code-python", "tier": "remote", "wait_ms": 10.0,
         "total_ms": 100.0, "outside_engine_ms": 4.0},
        {"hosts": hosts, "arm": "affinity", "adapter": "code-python", "tier": "device", "wait_ms": 0.0,
         "total_ms": 80.0, "outside_engine_ms": 6.0},
        {"hosts": hosts, "arm": "round_robin", "adapter": "tr-fr-en", "tier": "disk", "wait_ms": 50.0,
         "total_ms": 120.0},
        {"hosts": hosts, "arm": "ace", "adapter": "tr-fr-en", "tier": "remote", "wait_ms": 999.0, "total_ms": 90.0},
        {"hosts": hosts + 1, "arm": "affinity", "adapter": "tr-fr-en", "tier": "remote", "wait_ms": 7.0,
         "total_ms": 1.0},
    ]
    fleet = {arm: {"effective_hit_ratio": 0.5, "requests_per_host": {"engine-1": 800},
                   "prefetch": {"sent": 3, "used": 2}} for arm in sim_stack.ARMS}
    report = {"fleets": {str(hosts): fleet}, "pool_adapters": 5, "speed": 8.0, "speed_by_hosts": {str(hosts): 4.0},
              "warm_from": "prev.json", "replay": "closed-loop sessions (think_s)"}
    return rows, report


def test_measured_model_takes_the_fleet_sizes_demand_loads():
    from bench.trace import load_trace
    rows, report = rows_and_report()
    m = sim_stack.measured_model(report, rows, load_trace(TRACE), 1, None)
    assert m["speed"] == 4.0 and m["slots"] == 5
    # rank 8 (code-python): its one demand load; rank 128 (tr-fr-en): round robin's disk load,
    # not ace's (a prefetch arm) nor another fleet size's; other ranks: the median of both
    assert m["load_ms_by_rank"][8] == 10.0 and m["load_ms_by_rank"][128] == 50.0 and m["load_ms_by_rank"][32] == 30.0
    assert m["lead_ms"] == m["lead_measured_ms"] == 5.0 and m["service_s"] == 0.095  # median request duration
    cal = {c["term"]: c for c in sim_stack.calibration(report, 1, dict(m, slots=6), {})}
    assert cal["pool slots per host"]["differs"] is True and cal["ace arm's start"]["differs"] is True
    assert cal["replay speed"]["differs"] is False
    refused = "ace: bets the agents refused"
    assert refused not in cal  # no simulated ace arm: nothing to set beside it
    sim = {"ace": {"prefetches": 9, "prefetch_used": 5, "requests_per_host": {"host-0": 800}}}
    cal = {c["term"]: c for c in sim_stack.calibration(report, 1, dict(m, slots=6), sim)}
    assert cal[refused] == {"term": refused, "stack": {}, "sim": {}, "differs": False}  # none either side
    assert cal["ace: a wasted bet's load time charged (the agents' budget)"]["sim"] == 1.0  # the CPU's share
    assert "ace: what chose the pool's evictions" not in cal  # the report did not count them
    report["fleets"]["1"]["ace"]["prefetch"]["agent_outcomes"] = {
        "accepted": 9, "rejected_not_worth": 4, "rejected_demand_queued": 2, "rejected_queue_full": 1,
        "rejected_invalid_probability": 5}
    report["fleets"]["1"]["ace"]["pool_evictions"] = {"budget": 3, "hint": 7}
    report["fleets"]["1"]["ace"]["speculation"] = {"fill_sent": 4}
    sim["ace"]["refused"] = {"not_worth": 1}
    cal = {c["term"]: c for c in sim_stack.calibration(report, 1, dict(m, slots=6), sim)}
    # the budget's refusals, not a full queue nor a malformed hint
    assert cal[refused]["stack"] == {"demand_queued": 2, "not_worth": 4} and cal[refused]["differs"] is True
    assert cal[refused]["sim"] == {"not_worth": 1}
    assert cal["ace: what chose the pool's evictions"]["differs"] is True  # the engine's LRU chose 3
    assert cal["ace: start-up fill of empty pools (signals; among the prefetches sent)"]["stack"] == 4
    assert cal["replay loop"]["differs"] is True  # the simulator ran on the nominal clock
    sim["ace"]["clock"] = "realized"
    cal = {c["term"]: c for c in sim_stack.calibration(report, 1, dict(m, slots=6), sim)}
    assert cal["replay loop"]["differs"] is False


def test_the_agents_waste_share_is_the_benchs_own_setting_else_the_cpus():
    assert sim_stack.agent_waste_share({}) == 1.0
    assert sim_stack.agent_waste_share({"agent_extra_args": ["--prefetch-waste-share", "0.5"]}) == 0.5
    assert sim_stack.agent_waste_share({"agent_cold_args": ["--x", "1"],
                                        "agent_extra_args": ["--prefetch-waste-share=0.25"]}) == 0.25


def test_each_arm_replays_in_the_order_the_stack_sent_it():
    rows = [{"hosts": 1, "arm": "ace", "id": i, "sent_s": t} for i, t in (("a", 10.5), ("b", 10.0), ("c", 12.0))]
    rows.append({"hosts": 2, "arm": "ace", "id": "a", "sent_s": 0.0})  # another fleet size
    assert sim_stack.realized_order(rows, 1, "ace", ["a", "b", "c"]) == ([1, 0, 2], [0.0, 0.5, 2.0])
    assert sim_stack.realized_order(rows, 1, "ace", ["a", "b", "c", "d"]) is None  # "d" never sent
    assert sim_stack.realized_order(rows, 1, "affinity", ["a"]) is None


def test_cli_merges_each_configuration_into_the_report(tmp_path):
    rows, report = rows_and_report()
    rep = tmp_path / "r.json"
    rep.write_text(json.dumps(report))
    (tmp_path / "r_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "svs.json"
    out.write_text(json.dumps({"other@4x16": {"kept": True}}))
    assert sim_stack.main(["--trace", str(TRACE), "--hosts", "1", "--stack-report", str(rep), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["other@4x16"] == {"kept": True}
    r = got["multi_lora_eval_800@1x5"]
    assert set(r["agreement"]["arms"]) == set(sim_stack.ARMS)
    for arm in sim_stack.ARMS:
        assert 0.0 <= r["sim"][arm]["hit_ratio"] <= 1.0
        assert sum(r["sim"][arm]["requests_per_host"].values()) == 800
    assert sim_stack.main(["--trace", str(TRACE), "--hosts", "3", "--stack-report", str(rep), "--out", str(out)]) == 2
