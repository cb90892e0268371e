"""The real-vLLM benches' pure parts: what bounds an arm (``bench.vllm_eval.bounds``) and the
summary read from inference-perf's own report files (``bench.inference_perf.summarize``)."""
from __future__ import annotations

from bench.inference_perf import adapters, summarize
from bench.vllm_eval import belady_misses, bounds


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
