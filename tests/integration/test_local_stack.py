"""`make demo` and `make bench` end to end on a small scale: the same local stack
(tools.localstack.gateway_stack: agent + builtin engine, ext_proc, real Envoy)."""
from __future__ import annotations

import json

import pytest

from tests.support.vllm import fixtures_dir

pytest.importorskip("torch")


def test_demo_shows_prefetched_and_cold_side_by_side(tmp_path_factory, capsys):
    from tools import demo

    fixtures = fixtures_dir(tmp_path_factory)
    assert demo.main(["--fixtures", str(fixtures), "--work", str(tmp_path_factory.mktemp("demo"))]) == 0
    out = capsys.readouterr().out
    assert "adapter_prefetched_applied" in out and "adapter_cold_loaded" in out
    assert "401" in out and "404" in out and "400" in out
    assert "dedicated instances" in out


def test_bench_replays_a_small_trace_and_writes_the_report(tmp_path_factory, tmp_path):
    from bench import multi_lora_eval
    from tests.support.procs import REPO

    trace = json.loads((REPO / "data" / "multi_lora_eval" / "multi_lora_eval_800.json").read_text())
    rows = trace["requests"] if isinstance(trace, dict) else trace
    first_sessions = {(r["tenant"], r["session"]) for r in rows[:3]}
    small = [r for r in rows if (r["tenant"], r["session"]) in first_sessions]
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in small))
    out = tmp_path / "report.json"
    rc = multi_lora_eval.main(["--trace", str(path), "--out", str(out), "--speed", "50",
                               "--fixtures", str(fixtures_dir(tmp_path_factory))])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["total"] == len(small)
    assert report["errors"] == {"baseline": 0, "prefetch": 0}
    for run in ("baseline", "prefetch"):
        assert set(report["ttft_ms"][run]) == {"p50", "p90", "p95", "p99"}
    assert (tmp_path / "report.png").exists()
