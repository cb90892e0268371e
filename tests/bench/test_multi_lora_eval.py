import hashlib
import os
import time

import pytest
import yaml

from bench.multi_lora_eval import remote_catalog, state_yaml
from bench.report import percentiles
from tests.support.scrape import scrape_text


def test_remote_catalog_points_every_adapter_at_the_store(tmp_path):
    src = tmp_path / "fx"
    src.mkdir()
    (src / "catalog.yaml").write_text(yaml.safe_dump({
        "base_model": {"name": "ace-tiny-llama", "path": "model"},
        "adapters": [
            {"name": "a", "rank": 8, "uri": "adapters/a", "owner": "acme", "sha256": "x", "size_bytes": 1},
            {"name": "b", "rank": 16, "uri": "adapters/b/", "owner": "public", "sha256": "y", "size_bytes": 2},
        ],
    }))
    out = tmp_path / "remote.yaml"
    data = remote_catalog(src / "catalog.yaml", "http://127.0.0.1:9", out, {"a"})
    assert [a["uri"] for a in data["adapters"]] == ["http://127.0.0.1:9/adapters/a"]
    assert data["adapters"][0]["owner"] == "public"
    assert data["base_model"]["path"] == str((src / "model").resolve())
    assert yaml.safe_load(out.read_text()) == data


def test_state_yaml_keys_and_skills(tmp_path):
    hosts = [{"name": "engine-1", "engine": "127.0.0.1:1", "agent": "127.0.0.1:2"},
             {"name": "engine-2", "engine": "127.0.0.1:3", "agent": "127.0.0.1:4"}]
    keys = state_yaml(tmp_path / "s.yaml", tmp_path / "c.yaml", ["acme", "medco"], hosts, prefetch=False)
    state = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert state["skills"]["dynamic_lora_prefetch"] == "off"
    assert {k["tenant"] for k in state["keys"]} == {"acme", "medco"}
    for k in state["keys"]:
        assert k["sha256"] == hashlib.sha256(keys[k["tenant"]].encode()).hexdigest()
    assert [(u["name"], u["address"], u["agent"]) for u in state["upstreams"]] == [
        ("engine-1", "127.0.0.1:1", "127.0.0.1:2"), ("engine-2", "127.0.0.1:3", "127.0.0.1:4")]


def test_sessions_group_steps_in_order_and_think_time():
    from bench.multi_lora_eval import sessions, think_s
    reqs = [{"tenant": "a", "session": "s1", "step": 1, "t": 5.0, "think_s": 0.5},
            {"tenant": "b", "session": "s1", "step": 0, "t": 1.0},
            {"tenant": "a", "session": "s1", "step": 0, "t": 2.0},
            {"tenant": "a", "session": "s1", "step": 2, "t": 9.0}]
    got = sessions(reqs)
    assert [[(r["tenant"], r["step"]) for r in s] for s in got] == [[("b", 0)], [("a", 0), ("a", 1), ("a", 2)]]
    a = got[1]
    assert think_s(a[0], a[1]) == 0.5          # the trace's think time
    assert think_s(a[1], a[2]) == 4.0          # none given: the gap between the steps' t


def test_speculation_counters_read_the_last_log_line(tmp_path):
    from bench.multi_lora_eval import speculation_counters
    log = tmp_path / "extproc.log"
    log.write_text('x INFO extproc.fleet.speculation: speculation counters: {"observed": 1}\n'
                   'noise\nx INFO extproc.fleet.speculation: speculation counters: {"observed": 7}\n')
    assert speculation_counters(log) == {"observed": 7}
    assert speculation_counters(tmp_path / "missing.log") is None


def test_committed_trace_has_think_times_after_first_steps():
    import json
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    reqs = json.loads((root / "data/multi_lora_eval/multi_lora_eval_800.json").read_text())
    assert all(("think_s" in r) == (r["step"] > 0) for r in reqs)
    assert all(0.2 <= r["think_s"] <= 8.0 for r in reqs if "think_s" in r)


def test_think_s_is_validated(tmp_path):
    import json

    import pytest
    from bench.trace import TraceError, load_trace
    bad = {"t": 0, "tenant": "a", "adapter": "x", "rank": 8, "domain": "d", "session": 1,
           "messages": [{"role": "user", "content": "hi"}], "think_s": -1}
    (tmp_path / "t.json").write_text(json.dumps([bad]))
    with pytest.raises(TraceError, match="think_s"):
        load_trace(tmp_path / "t.json")


def test_pool_has_max_loras_semantics():
    """Half of the adapters as slots, bytes for the largest that many at once (whole MiB)."""
    from bench.multi_lora_eval import pool_size
    sizes = {"a": 919616, "b": 919616, "c": 460848, "d": 460848, "e": 231464, "f": 231464,
             "g": 116760, "h": 116760, "i": 59392, "j": 59392}
    slots, needed, mb = pool_size(set(sizes), sizes)
    assert (slots, needed, mb) == (5, 2 * 919616 + 2 * 460848 + 231464, 3)
    assert pool_size({"i"}, sizes) == (1, 59392, 1)


def test_bench_runs_the_agent_cold(tmp_path):
    from bench.multi_lora_eval import COLD_AGENT_ARGS
    from gpu_agent.settings import parse_args
    assert dict(zip(COLD_AGENT_ARGS[::2], COLD_AGENT_ARGS[1::2])) == {"--engine-host-mb": "0", "--disk-budget-mb": "0"}
    cat = tmp_path / "c.yaml"
    cat.write_text("base_model: {name: m}\nadapters: []\n")
    s = parse_args(["--catalog", str(cat), "--auth", "none", *COLD_AGENT_ARGS])
    assert s.engine_host_mb == 0 and s.disk_budget_mb == 0


def test_store_fetches_counts_weight_gets_after_an_offset(tmp_path):
    from bench.multi_lora_eval import store_fetches
    log = tmp_path / "store.log"
    first = '127.0.0.1 - - [x] "GET /adapters/a/adapter_model.safetensors HTTP/1.1" 200 -\n'
    log.write_text(first + '127.0.0.1 - - [x] "GET /adapters/a/adapter_config.json HTTP/1.1" 200 -\n')
    n, at = store_fetches(log)
    assert n == 1 and at == log.stat().st_size
    with log.open("a") as f:
        f.write(first + first.replace('" 200 ', '" 404 '))
    assert store_fetches(log, at)[0] == 1
    assert store_fetches(tmp_path / "missing.log") == (0, 0)


def test_arms_are_round_robin_affinity_ace():
    from bench.multi_lora_eval import ARMS
    assert ARMS == {"round_robin": ("extproc.policy.routing:round_robin", False),
                    "affinity": ("extproc.policy.routing:route", False),
                    "ace": ("extproc.policy.routing:route", True)}


def test_preemptions_sum_counters_named_preempt_or_none():
    from bench.multi_lora_eval import preemptions
    a = ('# HELP ace_agent_prefetch_preempted_total x\n# TYPE ace_agent_prefetch_preempted_total counter\n'
         'ace_agent_prefetch_preempted_total{reason="request"} 2.0\nace_agent_prefetch_total{outcome="ok"} 9\n')
    b = 'ace_agent_prefetch_preempted_total{reason="request"} 3\n'
    assert preemptions([a, b]) == 5
    assert preemptions(['ace_agent_prefetch_total{outcome="ok"} 9\n']) is None
    assert preemptions(['ace_agent_prefetch_preempted_total 0\n']) == 0


def test_prefetch_outcomes_sum_the_agents_answers_by_outcome():
    from bench.multi_lora_eval import prefetch_outcomes

    a = ('# TYPE ace_agent_prefetch_total counter\n'
         'ace_agent_prefetch_total{outcome="accepted"} 3\n'
         'ace_agent_prefetch_total{outcome="rejected_not_worth"} 2.0\n')
    b = 'ace_agent_prefetch_total{outcome="accepted"} 4\nace_agent_prefetch_preempted_total 1\n'
    assert prefetch_outcomes([a, b]) == {"accepted": 7, "rejected_not_worth": 2}
    c = 'ace_agent_prefetch_cancelled_total{reason="victim_in_use"} 5\n'
    assert prefetch_outcomes([a, c]) == {"accepted": 3, "cancelled_victim_in_use": 5, "rejected_not_worth": 2}
    assert prefetch_outcomes(["ace_agent_loads_total 5\n"]) == {}


def test_engine_counters_read_cold_loads_by_tier_and_pool_evictions_by_reason():
    from bench.multi_lora_eval import engine_counters

    text = ('# TYPE ace_engine_adapter_cold_loads_total counter\n'
            'ace_engine_adapter_cold_loads_total{tier="remote"} 7\n'
            'ace_engine_adapter_cold_loads_total{tier="disk"} 2.0\n'
            'ace_engine_adapter_evictions_total{tier="device",reason="hint"} 3\n'
            'ace_engine_adapter_evictions_total{tier="device",reason="budget"} 4\n'
            'ace_engine_adapter_evictions_total{tier="host",reason="budget"} 9\n')
    assert engine_counters(text) == ({"remote": 7, "disk": 2}, {"hint": 3, "budget": 4})
    assert engine_counters("ace_engine_loads_total 5\n") == ({}, {})


def test_learned_state_is_the_gateways_own_file_from_another_trace(tmp_path):
    from bench.multi_lora_eval import learned_state
    from extproc.policy.prediction import TransitionModel
    from extproc.fleet.speculation import PopularityFile
    reqs = [{"t": 0.0, "tenant": "acme", "session": "s1", "step": 0, "adapter": "a"},
            {"t": 3.0, "tenant": "acme", "session": "s1", "step": 1, "adapter": "b"},
            {"t": 1.0, "tenant": "acme", "session": "s2", "step": 0, "adapter": "a"},
            {"t": 4.0, "tenant": "acme", "session": "s2", "step": 1, "adapter": "b"}]
    saved = PopularityFile(learned_state(reqs, ["engine-1", "engine-2"], 5, tmp_path / "gw.popularity.json")).read()
    assert saved.counts == {"a": 2.0, "b": 2.0}
    assert saved.slots == {"engine-1": 5, "engine-2": 5}
    model = TransitionModel()
    assert model.load_state(saved.transitions) > 0


def test_committed_previous_day_trace_is_the_generator_with_the_day_before_seed(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "prev.json"
    subprocess.run([sys.executable, str(root / "data/multi_lora_eval/generate.py"), "--seed", "20261129",
                    "--out", str(out)], check=True, capture_output=True)
    prev = root / "data/multi_lora_eval/multi_lora_eval_800_prev.json"
    assert out.read_bytes() == prev.read_bytes()
    assert prev.read_bytes() != (root / "data/multi_lora_eval/multi_lora_eval_800.json").read_bytes()


def test_hosts_and_arms_are_validated():
    from bench.multi_lora_eval import main
    assert main(["--hosts", "0", "--out", "/nonexistent/r.json"]) == 2
    assert main(["--arms", "ace,nope", "--out", "/nonexistent/r.json"]) == 2


@pytest.mark.slow
def test_small_fleet_run_writes_the_report(tmp_path):
    """2 engine hosts behind Envoy + ext_proc, 40 requests, all three arms, ace cold;
    affinity and ace replayed twice (``--replays 2``), their checks on the pooled rows."""
    import json
    from pathlib import Path

    from bench.multi_lora_eval import main
    root = Path(__file__).resolve().parents[2]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps(json.loads((root / "data/multi_lora_eval/multi_lora_eval_800.json").read_text())[:40]))
    out = tmp_path / "r.json"
    assert main(["--trace", str(trace), "--hosts", "2", "--speed", "20", "--out", str(out), "--replays", "2",
                 "--fixtures", str(root / ".fixtures")]) == 0
    report = json.loads(out.read_text())
    assert report["warm_from"] is None and set(report["fleets"]) == {"2"}
    arms = report["fleets"]["2"]
    assert list(arms) == ["round_robin", "affinity", "ace"]
    for name, e in arms.items():
        assert e["errors"] == 0 and e["total"] == 40, name
        assert sum(e["requests_per_host"].values()) == 40
        assert 0 <= e["resident_hits"] <= e["total"] and 0 <= e["effective_hits"] <= e["total"]
        assert e["resident_hit_ratio"] == pytest.approx(e["resident_hits"] / 40)
        assert set(e["stall_ms"]) == set(e["ttft_ms"]) == {"p50", "p90", "p95", "p99"}
        assert e["first_step"]["total"] == sum(1 for r in json.loads(trace.read_text()) if r["step"] == 0)
        assert set(e["prefetch"]) == {"sent", "used", "wasted", "preempted", "agent_outcomes"}
        if name == "ace":  # every signal the agents answered: the ingress ones at least
            assert sum(e["prefetch"]["agent_outcomes"].values()) >= 1
        assert sum(e["loads_by_tier"].values()) >= 1  # every adapter starts cold
        assert e["speed"] == 20.0 and set(e["engine_busy"]) == {"engine-1", "engine-2"}
        assert all(0 < v < 1 for v in e["engine_busy"].values())
        split = e["ttft_breakdown"]
        assert split["rows"] == 40 and split["compute_ms"]["p50"] > 0 and split["worst_1pct"]["rows"] == 1
        # the load generator's own loop, over the replay and per request
        assert e["client_loop_lag"]["wakeups"] > 0 and split["client_lag_ms"]["rows"] == 40
        assert sum(h["requests"] for h in e["bounds"]["per_host"].values()) == 40
        assert e["bounds"]["belady_hits"] <= e["bounds"]["compulsory_hits"] <= e["bounds"]["fleet_compulsory_hits"]
    assert arms["round_robin"]["requests_per_host"] == {"engine-1": 20, "engine-2": 20}
    assert arms["affinity"]["prefetch"]["sent"] == 0 and arms["ace"]["prefetch"]["sent"] >= 0
    # top level: the largest fleet's affinity (baseline) and ace (prefetch)
    assert report["total"] == arms["ace"]["total"] and report["baseline_hits"]["total"] == 40
    assert report["stall_ms"]["prefetch"] == arms["ace"]["stall_ms"]
    assert report["checks"]["2"]["no_errors"] is True
    assert report["speed_by_hosts"] == {"2": 20.0} and "below_saturation" in report["checks"]["2"]
    assert out.with_suffix(".png").exists()
    # the pair replayed twice, palindromic; round robin once
    assert report["replays"] == 2 and report["replay_order"] == [
        "2:round_robin#1", "2:affinity#1", "2:ace#1", "2:ace#2", "2:affinity#2"]
    assert "pooled" not in arms["round_robin"]
    rows = [json.loads(line) for line in out.with_name("r_rows.jsonl").read_text().splitlines()]
    for name in ("affinity", "ace"):
        pooled, replays = arms[name]["pooled"], arms[name]["replays"]
        assert [r["order"] for r in replays] == ([2, 5] if name == "affinity" else [3, 4])
        assert pooled["replays"] == 2 and pooled["requests"] == 80 and pooled["errors"] == 0
        mine = [r for r in rows if r["arm"] == name]
        assert sorted(r["replay"] for r in mine) == [1] * 40 + [2] * 40
        assert pooled["ttft_ms"]["p99"] == pytest.approx(percentiles([r["ttft_ms"] for r in mine])["p99"])
        assert replays[0]["ttft_ms"] == arms[name]["ttft_ms"]  # the entry's own fields: replay 1
    assert report["checks"]["2"]["compared"] == "pooled over 2 replays each, palindromic order"


def test_bad_speed_slots_and_replays_are_refused():
    from bench.multi_lora_eval import main
    assert main(["--speed", "fast", "--out", "/nonexistent/r.json"]) == 2
    assert main(["--speed", "-1", "--out", "/nonexistent/r.json"]) == 2
    assert main(["--slots", "0", "--out", "/nonexistent/r.json"]) == 2
    assert main(["--replays", "0", "--out", "/nonexistent/r.json"]) == 2


def test_replay_order_repeats_the_compared_pair_palindromically():
    from bench.multi_lora_eval import replay_order
    assert replay_order([4], ["round_robin", "affinity", "ace"]) == [
        (4, "round_robin", 1), (4, "affinity", 1), (4, "ace", 1)]
    order = replay_order([1, 4], ["affinity", "vllm_router", "ace"], 3)
    assert order[:6] == [(1, "affinity", 1), (1, "vllm_router", 1), (1, "ace", 1),
                         (1, "ace", 2), (1, "affinity", 2), (1, "affinity", 3)]
    four = [(arm, k) for n, arm, k in order if n == 4]
    assert four == [("affinity", 1), ("vllm_router", 1), ("ace", 1), ("ace", 2), ("affinity", 2),
                    ("affinity", 3), ("ace", 3)]
    # two replays: each of the pair at the same mean position, so a linear drift weighs on both alike
    two = [arm for _, arm, _ in replay_order([4], ["round_robin", "vllm_router", "affinity", "ace"], 2)]
    mean = {a: sum(i for i, x in enumerate(two) if x == a) / two.count(a) for a in ("affinity", "ace")}
    assert mean["affinity"] == mean["ace"]
    assert replay_order([2], ["round_robin"], 3) == [(2, "round_robin", 1)]


def test_pooled_entry_percentiles_over_every_replay():
    from bench.multi_lora_eval import pooled_entry

    def rows(ttfts, wait=0.0):
        return [{"status": 200, "wait_ms": wait, "ttft_ms": t} for t in ttfts]
    done = [{"order": 2, "rows": rows([10.0] * 9 + [100.0]) + [{"id": "x", "error": "boom"}],
             "entry": {"total": 11, "effective_hits": 10, "effective_hit_ratio": 10 / 11, "errors": 1,
                       "stall_ms": {"p50": 0.0}, "ttft_ms": {"p50": 10.0}}},
            {"order": 5, "rows": rows([20.0] * 10, wait=5.0),
             "entry": {"total": 10, "effective_hits": 0, "effective_hit_ratio": 0.0, "errors": 0,
                       "stall_ms": {"p50": 5.0}, "ttft_ms": {"p50": 20.0},
                       "process_cpu_s": {"client": 7.5}, "pace_probe_ms": {"samples": 9, "cpu_ms_p50": 2.5}}}]
    out = pooled_entry(done)
    assert out["pooled"]["client_cpu_s"] == [None, 7.5] and out["pooled"]["pace_probe_ms"] == [None, 2.5]
    assert [r["order"] for r in out["replays"]] == [2, 5] and out["replays"][1]["ttft_ms"] == {"p50": 20.0}
    pooled = out["pooled"]
    assert (pooled["replays"], pooled["requests"], pooled["errors"]) == (2, 20, 1)
    assert pooled["effective_hit_ratio"] == pytest.approx(10 / 21)
    assert pooled["ttft_ms"]["p50"] == pytest.approx(20.0) and pooled["ttft_ms"]["p99"] > 20 and pooled["stall_ms"]["p50"] == pytest.approx(2.5)


def test_pool_size_takes_the_slots_knob():
    from bench.multi_lora_eval import pool_size
    sizes = {"a": 3 << 20, "b": 2 << 20, "c": 1 << 20, "d": 1 << 20}
    assert pool_size(set(sizes), sizes) == (2, 5 << 20, 5)
    assert pool_size(set(sizes), sizes, 3) == (3, 6 << 20, 6)
    assert pool_size(set(sizes), sizes, 9)[0] == 4  # never more slots than adapters


def test_metric_reads_one_series_or_zero():
    from bench.multi_lora_eval import metric
    text = ('# TYPE ace_agent_prefetch_total counter\nace_agent_prefetch_total{outcome="accepted"} 3.0\n'
            'ace_agent_prefetch_total{outcome="coalesced"} 1.0\nace_agent_prefetch_queue_depth 0\n')
    assert metric(text, 'ace_agent_prefetch_total{outcome="accepted"}') == 3.0
    assert metric(text, "ace_agent_prefetch_queue_depth") == 0.0
    assert metric(text, 'ace_agent_tier_adapters{tier="device"}') == 0.0


def test_a_replays_gc_pauses_are_read_from_the_scrapes_and_subtracted():
    from ace_common.gc_pauses import GcPauseCollector, GcPauses
    from bench.multi_lora_eval import gc_pause_delta, gc_pauses

    def scrape(*pauses):
        return [scrape_text(GcPauseCollector(p, "ace_agent_gc_pause_seconds")) for p in pauses]

    host1, host2 = GcPauses(), GcPauses()
    host1.record(2, 0.057)
    before = gc_pauses(scrape(host1, host2))
    host1.record(2, 0.004)
    host2.record(2, 0.030)
    host2.record(0, 0.0001)
    after = gc_pauses(scrape(host1, host2))
    assert after["gen2"] == {"n": 3, "sum_ms": pytest.approx(91.0), "slow": 2}   # summed over hosts
    delta = gc_pause_delta(before, after)
    assert delta["gen2"] == {"n": 2, "sum_ms": 34.0, "slow": 1}
    assert delta["gen0"] == {"n": 1, "sum_ms": 0.1, "slow": 0}
    assert gc_pauses(scrape(host1), "ace_gateway_gc_pause_seconds") == {}   # another process's name


def test_the_agents_loop_lag_is_read_from_the_scrapes_and_subtracted():
    from ace_common.loop_lag import LoopLag, LoopLagCollector
    from bench.multi_lora_eval import GATEWAY_LOOP_LAG_METRIC, LOOP_LAG_METRIC, loop_lag_delta, loop_lags

    def scrape(*lags):
        return [scrape_text(LoopLagCollector(lag, LOOP_LAG_METRIC)) for lag in lags]

    host1, host2 = LoopLag(), LoopLag()
    host1.record(0.0002)
    before = loop_lags(scrape(host1, host2))
    assert before == {"wakeups": 1, "sum_ms": pytest.approx(0.2), "over_10ms": 0, "over_25ms": 0, "over_50ms": 0}
    host1.record(0.030)
    host2.record(0.012)
    host2.record(0.070)
    after = loop_lags(scrape(host1, host2))
    assert after["wakeups"] == 4 and (after["over_10ms"], after["over_25ms"], after["over_50ms"]) == (3, 2, 1)
    assert loop_lag_delta(before, after) == {"wakeups": 3, "sum_ms": 112.0, "over_10ms": 3, "over_25ms": 2,
                                             "over_50ms": 1}
    assert loop_lags(scrape(host1), GATEWAY_LOOP_LAG_METRIC)["wakeups"] == 0   # another process's name
    gateway = LoopLag()
    gateway.record(0.040)
    text = scrape_text(LoopLagCollector(gateway, GATEWAY_LOOP_LAG_METRIC))
    assert loop_lags([text], GATEWAY_LOOP_LAG_METRIC) == {"wakeups": 1, "sum_ms": pytest.approx(40.0),
                                                          "over_10ms": 1, "over_25ms": 1, "over_50ms": 0}


def test_the_load_generators_lag_summary_counts_wakeups_over_each_bound():
    from ace_common.loop_lag import LoopLag
    from bench.multi_lora_eval import lag_summary
    lag = LoopLag(interval_s=0.005)
    for s in (0.0001, 0.012, 0.030, 0.060, 0.010):
        lag.record(s)
    assert lag_summary(lag) == {"wakeups": 5, "sum_ms": 112.1, "over_10ms": 3, "over_25ms": 2, "over_50ms": 1}


def test_a_replay_runs_with_the_garbage_collector_off_and_leaves_it_as_it_was():
    import gc

    from bench.multi_lora_eval import no_gc_pauses
    assert gc.isenabled()
    with no_gc_pauses():
        assert not gc.isenabled() and gc.get_freeze_count() > 0
    assert gc.isenabled() and gc.get_freeze_count() == 0
    with pytest.raises(RuntimeError), no_gc_pauses():
        raise RuntimeError("a replay that fails")
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_hosts_torch_threads_split_the_hosts_cores():
    from bench.multi_lora_eval import agent_env
    assert agent_env(4, host_cores=1) == {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    assert agent_env(2, host_cores=6)["OMP_NUM_THREADS"] == "3"
    assert agent_env(1)["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)


def test_a_replay_whose_request_goes_unanswered_stops_with_an_error_instead_of_waiting_forever():
    """``guarded``: while the oldest request in flight has waited less than the limit the
    work goes on; past it the work is cancelled and ``StackStalled`` names the run. (A
    stuck agent once held a fleet run for minutes with no end.)"""
    import asyncio

    from bench.multi_lora_eval import StackStalled, guarded

    async def main():
        inflight: dict = {}
        stuck = asyncio.Event()
        cancelled = asyncio.Event()

        async def hangs():
            inflight["r"] = time.perf_counter()
            try:
                await stuck.wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise

        with pytest.raises(StackStalled, match="2 hosts ace: a request went unanswered"):
            await guarded(asyncio.ensure_future(hangs()), inflight, stall_s=0.05, what="2 hosts ace", poll_s=0.01)
        assert cancelled.is_set()

        async def answers():
            inflight["q"] = time.perf_counter()
            del inflight["q"]
            return "ok"

        inflight.clear()
        work = asyncio.ensure_future(answers())
        await guarded(work, inflight, stall_s=0.05, what="x", poll_s=0.01)
        assert work.result() == "ok"
    asyncio.run(main())


def test_replay_order_repeats_the_arms_named_compared():
    from bench.multi_lora_eval import replay_order
    got = replay_order([2], ["round_robin", "vllm_router", "affinity", "ace"], 2,
                       compared=("vllm_router", "affinity", "ace"))
    assert [(arm, k) for _, arm, k in got] == [
        ("round_robin", 1), ("vllm_router", 1), ("affinity", 1), ("ace", 1),
        ("ace", 2), ("affinity", 2), ("vllm_router", 2)]
