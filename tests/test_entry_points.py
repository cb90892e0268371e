"""Every entry point a user or a Makefile target runs answers ``--help`` (exit 0, a usage
line) under its documented name, whatever the package layout beneath it (issue 19)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

#: ``python -m NAME`` as README, docs/, the Makefile and deploy/ invoke them
MODULES = [
    "extproc", "extproc.admin", "extproc.envoy_config",
    "gpu_agent", "gpu_agent.fixtures", "gpu_agent.engine",
    "bench.agent", "bench.gateway_overhead", "bench.gateway_profile", "bench.multi_lora_eval",
    "bench.replica_learning", "bench.sim", "bench.speculation_cost", "bench.scenario_fixtures",
    "bench.load_interference", "bench.gateway_replay", "bench.sim_stack", "bench.inference_perf",
    "bench.vllm_eval", "bench.vllm_fit", "bench.vllm_paths", "bench.bounds", "bench.fetch_cost", "bench.pace",
    "bench.prefetch_reference",
    "tools.demo", "tools.istio_envoyfilter", "tools.report_tables",
]


def test_the_list_names_every_module_with_a_main():
    """A new entry point joins the list (or this test fails)."""
    found = set()
    for path in REPO.glob("*/**/*.py"):
        rel = path.relative_to(REPO)
        if rel.parts[0] not in ("extproc", "gpu_agent", "bench", "tools", "ace_common"):
            continue
        text = path.read_text()
        if path.name == "__main__.py":
            found.add(".".join(rel.parts[:-1]))
        elif 'if __name__ == "__main__"' in text:
            found.add(".".join(rel.with_suffix("").parts))
    assert found == set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_help_works(module):
    out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in out.stdout.lower(), out.stdout[:500]
