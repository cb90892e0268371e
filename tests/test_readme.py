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
