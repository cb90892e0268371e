"""The real-vLLM benches' pure parts: what bounds an arm (``bench.vllm_eval.bounds``), how
replayed arms are pooled for the targets (``pooled_entry``, ``targets``) and the summary read
from inference-perf's own report files (``bench.inference_perf.summarize``)."""
from __future__ import annotations

import pytest

from bench.inference_perf import adapters, summarize
from bench.report import percentiles
from bench.vllm_eval import belady_misses, bounds, compared, pooled_entry, targets


def test_belady_counts_the_fewest_loads_of_any_eviction():
    assert belady_misses(list("aaaa"), 1) == 1
    assert belady_misses(list("abab"), 1) == 4
    assert belady_misses(list("abab"), 2) == 2
    # c evicts b (next used after a), d evicts the one needed last
    assert belady_misses(list("abcabdab"), 2) == 6


def test_bounds_take_the_arms_routing_and_the_order_sent():
    rows = [{"seq": i, "status": 200, "adapter": a, "host": h}
            for i, (a, h) in enumerate([("a", "h1"), ("b", "h2"), ("a", "h1"), ("c", "h1"), ("b", "h2")])]
    rows.append({"seq": 9, "adapter": "z", "error": "boom"})          # a failed request counts for nothing
    got = bounds(list(reversed(rows)), capacity=1, hosts=2)
    assert got == {"requests": 5, "compulsory_fleet": 3, "belady_fleet_cache": 3,
                   "compulsory_this_routing": 3, "belady_this_routing": 3}
    # no host per request (vllm-router's arms): only the fleet's bounds
    assert set(bounds([dict(r, host=None) for r in rows[:5]], 1, 2)) == {"requests", "compulsory_fleet",
                                                                          "belady_fleet_cache"}


def test_inference_perf_summary_reads_the_tools_files():
    def report(n, ttft):
        return {"successes": {"count": n, "latency": {"time_to_first_token": {"median": ttft, "p90": 2 * ttft,
                                                                                 "p99": 3 * ttft}}},
                "failures": {"count": 0}}
    files = {"summary_lifecycle_metrics.json": report(3, 0.02),
             "adapter_ip-adapter-01_lifecycle_metrics.json": report(2, 0.01)}
    got = summarize(files)
    assert got["overall"] == {"successes": 3, "failures": 0, "ttft_ms": {"p50": 20.0, "p90": 40.0, "p99": 60.0}}
    assert got["per_adapter"]["ip-adapter-01"]["ttft_ms"] == {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    assert got["per_adapter"]["ip-adapter-15"] == {"successes": 0, "failures": 0, "ttft_ms": None}
    assert len(adapters()) == 15 and abs(sum(s for _, s in adapters()) - 1) < 1e-6


def test_error_statuses_name_what_failed_each_request():
    from bench.vllm_eval import error_statuses
    rows = [{"status": 200}, {"status": 404}, {"status": 404}, {"status": 503}, {"error": "ReadTimeout"}]
    assert error_statuses(rows) == {"404": 2, "503": 1, "transport": 1}
    assert error_statuses([{"status": 200}]) == {}


def _run(hits, served, on_demand, ttfts, pace):
    rows = [{"status": 200, "ttft_ms": t} for t in ttfts] + [{"status": 503, "ttft_ms": None, "error": "x"}]
    entry = {"hits": hits, "served": served, "hit_ratio": hits / served, "on_demand_loads": on_demand,
             "errors": 1, "ttft_ms": percentiles(ttfts), "pace_probe_ms": {"samples": 3, "cpu_ms_p50": pace}}
    return entry, rows


def test_replayed_arms_are_compared_pooled_beside_the_machines_pace():
    aff = [_run(6, 10, 4, [10.0] * 10, 2.0), _run(6, 10, 4, [10.0] * 10, 2.0)]
    # ace's first run sat on a machine 1.5x slower: its TTFT alone is over affinity's line,
    # pooled with its second run it is not
    ace = [_run(8, 10, 2, [12.0] * 10, 3.0), _run(8, 10, 2, [8.0] * 10, 2.0)]
    entries = {"affinity": {**aff[0][0], **pooled_entry(aff)}, "ace": {**ace[0][0], **pooled_entry(ace)}}
    assert entries["ace"]["pooled"]["hit_ratio"] == 0.8 and entries["ace"]["pooled"]["errors"] == 2
    assert entries["ace"]["pooled"]["pace_probe_ms"] == [3.0, 2.0]
    assert [r["ttft_ms"]["p50"] for r in entries["ace"]["replays"]] == [12.0, 8.0]
    assert compared(entries["ace"])["on_demand_loads"] == 2
    t = targets(entries)
    assert t["compared"] == "pooled over 2 runs each, palindromic order"
    assert t["machine_pace"]["runs"] == {"affinity": [1.0, 1.0], "ace": [1.5, 1.0]}
    assert t["hits_over_affinity"]["got"] == pytest.approx(0.2)
    assert t["on_demand_loads_half_of_affinity"] == {"want": 2.0, "got": 2.0, "met": True}
    assert t["ttft_no_worse_than_affinity"]["p50"] is True
    # one run each: the first runs are what is compared
    single = targets({"affinity": aff[0][0], "ace": ace[0][0]})
    assert single["compared"] == "one run each"
    assert single["ttft_no_worse_than_affinity"]["p50"] is False


def test_ttft_is_compared_request_by_request_beside_each_arms_drift():
    """ace's rows are affinity's + 2 ms on resident requests and - 6 ms on the others; the
    second runs of both arms sat on a machine 1 ms slower. Percentiles of two samples
    cannot say which; the paired measure can."""
    def rows(arm, replay, resident_ms, cold_ms, shift):
        out = []
        for i in range(40):
            resident = i % 4 != 0
            base = 20.0 + i  # the trace's own variety: each request its own TTFT
            out.append({"arm": arm, "id": f"req-{i:04d}", "replay": replay, "status": 200, "registered": resident,
                        "ttft_ms": base + (resident_ms if resident else cold_ms) + shift})
        return out

    got = {"affinity": rows("affinity", 1, 0, 0, 0) + rows("affinity", 2, 0, 0, 1.0),
           "ace": rows("ace", 1, 2.0, -6.0, 0) + rows("ace", 2, 2.0, -6.0, 1.0)}
    aff = [_run(6, 10, 4, [10.0] * 10, 2.0)] * 2
    ace = [_run(8, 10, 2, [10.0] * 10, 2.0)] * 2
    entries = {"affinity": {**aff[0][0], **pooled_entry(aff)}, "ace": {**ace[0][0], **pooled_entry(ace)}}
    p = targets(entries, got)["ttft_paired"]
    assert p["all"]["requests"] == 40 and p["all"]["median_ms"] == 2.0
    assert p["resident_both"] == {"requests": 30, "median_ms": 2.0, "ci95_ms": [2.0, 2.0]}
    assert p["drift_ms"] == {"ace": 1.0, "affinity": 1.0}
    # a request registered in one run and not in another is not resident in every run
    got["ace"][0 + 40 + 1]["registered"] = False
    assert targets(entries, got)["ttft_paired"]["resident_both"]["requests"] == 29
    # without rows (or without a request of both arms) there is nothing to pair
    assert "ttft_paired" not in targets(entries)
    from bench.report import paired_ttft
    assert paired_ttft(got["ace"], "ace", "round_robin") is None


def test_vllm_miss_causes_read_registration_and_the_send_order():
    from bench.vllm_eval import vllm_miss_causes
    trace = [{"id": f"r{i}", "tenant": "t1", "workflow": "a->b", "adapter": a}
             for i, a in enumerate(["a", "b", "c", "a", "b"])]
    trace[2]["workflow"] = "one-off"
    # sent out of id order: r1 went before r0; one cache slot on the host
    rows = [{"id": r["id"], "adapter": r["adapter"], "seq": seq, "session": "t1/s", "step": step, "status": 200,
             "host": "engine-1", "registered": False}
            for step, (r, seq) in enumerate(zip(trace, [2, 1, 3, 4, 5]), 1)]
    rows.append({"id": "r9", "adapter": "a", "seq": 6, "status": 503, "error": "x"})
    m = vllm_miss_causes(rows, trace, 1)
    assert m["requests"] == 5 and m["misses"] == 5
    assert m["causes"]["compulsory"] == 3 and m["causes"]["unpredictable"] == 0
    assert m["causes"]["evicted"] + m["causes"]["capacity"] == 2
    # the vllm-router arms' rows say nothing of registration
    assert vllm_miss_causes([{k: v for k, v in r.items() if k != "registered"} for r in rows], trace, 1) is None


def test_bounds_cli_rederives_a_vllm_reports_miss_causes(tmp_path):
    import json

    from bench import bounds
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([{"id": f"r{i}", "t": float(i), "tenant": "t1", "session": "s", "step": i,
                                  "workflow": "a->b", "adapter": a, "rank": 8, "domain": "d",
                                  "messages": [{"role": "user", "content": "x"}]}
                                 for i, a in enumerate(["a", "b", "a", "b"])]))
    report = tmp_path / "v.json"
    report.write_text(json.dumps({"engine": "vllm", "trace": str(trace), "requests": 4,
                                  "vllm_flags": ["--max-loras", "1", "--max-cpu-loras", "2"],
                                  "fleets": {"1": {"ace": {"hits": 2}}}}))
    rows = [{"arm": "ace", "replay": k, "id": f"r{i}", "adapter": a, "seq": i + 1, "session": "t1/s", "step": i,
             "status": 200, "host": "engine-1", "registered": i >= 2 and k == 1}
            for k in (1, 2) for i, a in enumerate(["a", "b", "a", "b"])]
    (tmp_path / "v_rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bounds.main([str(report)]) == 0
    m = json.loads(report.read_text())["fleets"]["1"]["ace"]["miss_causes"]
    assert (m["hits"], m["misses"], m["causes"]["compulsory"]) == (2, 2, 2)  # the first run's rows only


@pytest.mark.parametrize("arms", ["vllm_router+keep", "nope", "ace+nope"])
def test_keep_variants_exist_only_for_the_gateways_arms(arms, capsys):
    """``ace+keep`` / ``affinity+keep`` run agents that keep names registered; a vllm-router
    arm has no agent that evicts, so ``+keep`` there (or any other suffix) is refused
    before anything starts."""
    from bench.vllm_eval import main
    with pytest.raises(SystemExit) as exc:
        main(["--arms", f"ace,{arms}"])
    assert exc.value.code == 2 and arms in capsys.readouterr().err
