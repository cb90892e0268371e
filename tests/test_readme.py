"""The README starts with the two set-up commands and shows what the reports say."""
import json
import shutil
import subprocess

import pytest

from tools.report_tables import REPO, stale_section

README = (REPO / "README.md").read_text()


def test_two_commands_at_the_top():
    top = README[:600]
    assert "make demo" in top and "make test" in top


def test_numbers_section_is_rendered_from_the_committed_reports():
    assert stale_section(REPO) is None


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_a_bench_run_that_rewrote_a_report_leaves_the_check_passing_until_update(tmp_path):
    """``make bench && make test``: a report rewritten in the working tree (not committed)
    leaves the committed README true; ``--update`` makes it match the new report; a README
    that matches neither still fails."""
    (tmp_path / "reports").mkdir()
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    for path in (REPO / "reports").glob("*.json"):
        shutil.copy(path, tmp_path / "reports" / path.name)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "reports")
    assert stale_section(tmp_path) is None
    report = tmp_path / "reports" / "gateway_overhead.json"
    rerun = json.loads(report.read_text())
    rerun["added_p50_ms"] += 1.25                        # what a new run changes: its numbers
    report.write_text(json.dumps(rerun))
    assert stale_section(tmp_path) is None               # the bench ran, nothing committed
    from tools import report_tables
    readme = (tmp_path / "README.md").read_text()
    section = report_tables.readme_section(readme)
    updated = readme.replace(section, "\n" + report_tables.render(report_tables.working_tree_reports(tmp_path)))
    (tmp_path / "README.md").write_text(updated)
    assert stale_section(tmp_path) is None               # --update after the run
    (tmp_path / "README.md").write_text(updated.replace("### Gateway overhead", "### Gateway overhead (by hand)"))
    assert "--update" in stale_section(tmp_path)


def test_every_linked_doc_and_image_exists():
    import re
    for target in re.findall(r"\]\(([^)#]+)\)", README):
        if "://" not in target:
            assert (REPO / target).exists(), target


def test_sim_section_renders_the_fleet_the_bounds_and_the_one_host_check():
    from tools.report_tables import sim

    arm = {"hit_ratio": 0.5, "resident_hit_ratio": 0.4, "first_step_hit_ratio": 0.3,
           "bounds": {"belady": {"hit_ratio": 0.6}, "oracle": {"hit_ratio": 0.9}}}
    r = {"budgets": [8], "results": {"lru": {"8": {"hit_ratio": 0.2}}}, "requests": 10, "adapters_seen": 3,
         "tenants_seen": 1, "sessions": 2, "elapsed_s": 1.0, "metric": "hit_ratio = x",
         "targets": {"budget": 8, "gap_closed": None, "gap_closed_met": False, "beats_belady": False,
                     "hit_ratio": {"speculative": 0.1, "belady": 0.2}},
         "bounds_ok": False, "bounds_broken": ["budget 8: lru beats Belady"],
         "one_host": {"trace": "t.json", "budget": 5, "first_steps": 12, "ace_above_belady": True,
                      "hit_ratio": {"speculative": 0.81, "belady": 0.795},
                      "first_step_hits": {"speculative": 7, "lru": 6}},
         "fleet": {"hosts": 64, "budgets": [8], "workload": {"requests": 100, "adapters": 10, "tenants": 2,
                                                             "rate_per_s": 640.0},
                   "results": {"8": {"round_robin": arm, "affinity": arm, "ace": arm}},
                   "targets": {"budget": 8, "ace_minus_affinity": 0.0, "ace_minus_affinity_met": False,
                               "gap_closed": 0.0, "gap_closed_met": False}}}
    text = "\n".join(sim(r))
    assert "n/a of the LRU → oracle gap" in text and "BROKEN: budget 8: lru beats Belady" in text
    assert "| 8 | 0.500 (0.400) | 0.500 (0.400) | 0.500 (0.400) | 0.300 / 0.300 / 0.300 | 0.600 | 0.900 |" in text
    assert "ace (speculative) 0.810 vs Belady's demand optimum 0.795 (met)" in text
    assert "reports/sim_fleet.png" in text


def _arm(hits, stall99, ttft):
    return {"total": 100, "errors": 0, "resident_hits": hits, "effective_hits": hits,
            "effective_hit_ratio": hits / 100, "stall_ms": {"p50": 0.0, "p99": stall99},
            "ttft_ms": {"p50": ttft, "p90": ttft, "p95": ttft, "p99": ttft},
            "first_step": {"total": 10, "effective_hits": 5}, "requests_per_host": {"engine-1": 60, "engine-2": 40},
            "loads_by_tier": {"remote": 30}, "prefetch": {"sent": 0, "used": 0, "wasted": 0, "preempted": None},
            "engine_busy": {"engine-1": 0.42, "engine-2": 0.3},
            "bounds": {"belady_hit_ratio": 0.8, "compulsory_hit_ratio": 0.9},
            "ttft_breakdown": {"rows": 100, **{k: {"p50": 1.0, "p99": 9.0} for k in
                                               ("queue_ms", "stall_ms", "compute_ms", "loads_ms", "outside_engine_ms")},
                               "worst_1pct": {"rows": 1, "ttft_ms_p50": 50.0, "queue_ms_p50": 40.0, "stall_ms_p50": 0.0,
                                              "compute_ms_p50": 5.0, "loads_ms_p50": 30.0,
                                              "outside_engine_ms_p50": 5.0}}}


def test_hundreds_section_renders_targets_breakdown_bounds_and_plot():
    from bench.report import fleet_checks
    from tools.report_tables import hundreds

    fleets = {"4": {"affinity": _arm(70, 60.0, 10.0), "ace": _arm(91, 10.0, 10.0)}}
    r = {"trace": "data/multi_lora_eval/hundreds.json", "sessions": 40, "adapters": 226, "pool_adapters": 16,
         "pool_mb": 15, "fleet_hosts": 4, "warm_from": None, "wall_s": 600.0, "speed": "auto",
         "speed_by_hosts": {"4": 2.5}, "scenario": "hundreds", "fleets": fleets,
         "checks": fleet_checks(fleets, "hundreds")}
    text = "\n".join(hundreds(r))
    assert "226 adapters" in text and "replay ×2.5 at 4 hosts" in text
    assert "ace effective hits ≥ 90% — met (91.00%)" in text and "≥ affinity + 12 points — met (+21.00)" in text
    assert "own per-host sequences — met (+11.00 points)" in text and "stall P99 ≥ 3× lower than affinity — met (6.0×)" in text
    assert "| 4 | ace | 42% | 91.00% | 80.00% | 90.00% | 1.0 / 9.0 |" in text
    assert "50.0: 40.0 / 0.0 / 5.0 / 30.0 / 5.0 |" in text
    assert "(reports/hundreds_eval.png)" in text
    assert "Replayed" not in text  # one replay each: no pooled table
    assert "loop lag" not in text   # no engine reported its loop's lag: no column
    fleets["4"]["ace"]["ttft_breakdown"]["loop_lag_ms"] = {"p50": 0.0, "p99": 12.0, "rows": 100}
    fleets["4"]["ace"]["ttft_breakdown"]["worst_1pct"]["loop_lag_ms_p50"] = 20.0
    fleets["4"]["ace"]["loop_lag"] = {"wakeups": 9000, "over_25ms": 7}
    fleets["4"]["ace"]["gateway_loop_lag"] = {"wakeups": 2250, "over_25ms": 3}
    text = "\n".join(hundreds(r))
    fleets["4"]["ace"]["client_loop_lag"] = {"wakeups": 9000, "over_25ms": 0}
    text = "\n".join(hundreds(r))
    assert "loop lag: p99 / worst 1% / wake-ups > 25 ms: agents / gateway / load generator |" in text
    assert "5.0 | 12.0 / 20.0 / 7 / 3 / 0 |" in text and "| 4 | affinity |" in text and "/ 5.0 | – |" in text
    del fleets["4"]["ace"]["gateway_loop_lag"], fleets["4"]["ace"]["client_loop_lag"]   # older reports
    assert "5.0 | 12.0 / 20.0 / 7 / – / – |" in "\n".join(hundreds(r))
    # which cores ran what (bench.cores): said in the section's first paragraph
    assert "Every process ran on every core of the machine." in text
    r["cpus"] = {"request_path": [0], "hosts": [1, 2, 3]}
    assert "ext_proc ran on core(s) 0 and the engine hosts on 1, 2, 3" in "\n".join(hundreds(r))
    del r["cpus"]
    # replayed twice: each replay's TTFT and the pooled percentiles the checks compare
    pooled = {"replays": 2, "requests": 200, "errors": 0, "effective_hit_ratio": 0.9,
              "stall_ms": {"p50": 0.0, "p99": 9.0}, "ttft_ms": {"p50": 10.0, "p90": 11.0, "p95": 12.0, "p99": 13.0}}
    for arm, order in (("affinity", (1, 4)), ("ace", (2, 3))):
        fleets["4"][arm].update(pooled=pooled, replays=[{"order": k, "ttft_ms": {"p50": 10.0, "p99": 12.5 + k}}
                                                        for k in order])
    r.update(replays=2, replay_order=["4:affinity#1", "4:ace#1", "4:ace#2", "4:affinity#2"],
             checks=fleet_checks(fleets, "hundreds"))
    text = "\n".join(hundreds(r))
    assert "in the order `4:affinity#1 4:ace#1 4:ace#2 4:affinity#2`" in text
    assert "| 4 | ace | 2 / 3 | 0 | 0.0 | 9.0 | 10.0 | 11.0 | 12.0 | 13.0 | 10.0, 14.5 / 10.0, 15.5 |" in text


def test_sim_vs_stack_section_names_the_terms_that_differ():
    from tools.report_tables import sim_vs_stack

    r = {"hundreds@4x16": {"agreement": {"arms": {"affinity": {"stack": 0.7, "sim": 0.72, "diff": 0.02,
                                                               "within": True}}},
                           "calibration": [{"term": "replay loop", "differs": True},
                                           {"term": "replay speed", "differs": False}]}}
    text = "\n".join(sim_vs_stack(r))
    assert "| hundreds@4x16 | affinity | 0.700 | 0.720 | +0.020 | met |" in text
    assert "terms that differ — replay loop." in text


def test_miss_table_and_sixteen_targets_render():
    from tools.report_tables import miss_table, sixteen_targets

    causes = {"compulsory": 16, "unpredictable": 0, "late": 1, "opener": 0, "placement": 0, "evicted": 0,
              "capacity": 0}
    m = {"misses": 17, "causes": causes, "unpredictable_hits": 3, "unpredictable_requests": 4, "ceiling": 0.9867,
         "definitions": {c: f"what {c} is" for c in causes}}
    text = "\n".join(miss_table({"fleets": {"4": {"ace": {"miss_causes": m, "stall_ms": {"p99": 9.0}}}}}))
    assert "| 4 | ace | 17 | 16 | 0 | 1 |" in text and "**late**: what late is" in text and "98.67%" in text
    assert "against Belady" not in text  # an older report: no column
    m.update(belady_kept={"late": 1}, belady_missed_hits=5)
    text = "\n".join(miss_table({"fleets": {"4": {"ace": {"miss_causes": m, "stall_ms": {"p99": 9.0}}}}}))
    assert "| 9.0 | 1 (late 1) / 5 |" in text.replace("– / ", "") and "its hits Belady misses |" in text
    pct = {"p50": True, "p99": False}
    t = {"effective_hit_ratio": {"met": True, "got": 0.99, "ceiling": 0.9867},
         "stall_ms_no_worse": {"met": True, "got": {"p50": True}}, "ttft_ms_no_worse": {"met": False, "got": pct},
         "no_errors": {"met": True, "got": 0}}
    line = sixteen_targets(t)
    assert "99.00%" in line and "worse at ttft p99" in line and "**missed**" in line


def test_gpu_sections_render_from_their_reports_and_are_left_out_without_them():
    """``make gpu-check`` writes reports only a session lent a GPU can make: the README
    shows them when committed (device, staging path, every phase), and nothing when absent."""
    from tools.report_tables import render, working_tree_reports

    load = working_tree_reports(REPO)
    full = render(load)
    for line in ("### Agent runtime on a GPU", "pinned staging buffers", "two GEMMs per adapter segment",
                 "### Forward steps while loads stream in, on the GPU",
                 "| disk reads pinned per load (the old default) |"):
        assert line in full
    without = render(lambda name: None if "cuda" in name else load(name))
    assert "on a GPU" not in without and "### Agent runtime —" in without


def test_vllm_section_says_when_the_arms_were_compared_pooled():
    import copy

    from bench.vllm_eval import pooled_entry, targets
    from tools.report_tables import vllm_eval

    r = json.loads((REPO / "reports" / "vllm_eval.json").read_text())
    (hosts, arms), = r["fleets"].items()
    for e in arms.values():   # one run each: no line says how they were compared
        e.pop("pooled", None), e.pop("replays", None)
        e["pace_probe_ms"] = {"samples": 9, "cpu_ms_p50": 2.0}
    r["targets"] = targets(arms)
    assert "compare affinity and ace" not in "\n".join(vllm_eval(r))
    for arm in ("affinity", "ace"):
        e = arms[arm]
        runs = []
        for k, pace in enumerate((2.0, 2.2)):
            run = copy.deepcopy(e)
            run["pace_probe_ms"] = {"samples": 9, "cpu_ms_p50": pace if arm == "ace" else 2.0}
            runs.append((run, [{"status": 200, "ttft_ms": float(10 + k)}]))
        arms[arm] = {**runs[0][0], **pooled_entry(runs)}
    r["targets"] = targets(arms)
    text = "\n".join(vllm_eval(r))
    assert "compare affinity and ace pooled over 2 runs each, palindromic order" in text
    assert "the machine's pace in their runs" in text and "ace 1.00, 1.10" in text


def test_the_hundreds_section_says_what_prediction_is_worth_against_each_target():
    from tools.report_tables import hundreds_reference

    report = json.loads((REPO / "reports" / "hundreds_eval.json").read_text())
    ace = report["fleets"][str(report["fleet_hosts"])]["ace"]
    line = "\n".join(hundreds_reference(report))
    assert f"ace's own first run: {ace['effective_hits']} effective hits" in line
    assert f">= its own per-host Belady {ace['bounds']['belady_hits']}" in line
    for name in ("none", "learned", "workflow", "next_step"):
        assert str(ace["prefetch_reference"]["predictors"][name]["hits"]) in line
    del ace["prefetch_reference"]
    assert hundreds_reference(report) == []  # a report from before the reference: no line
