"""The layers are import-linter contracts (pyproject.toml, [tool.importlinter]), run here
so that ``make test`` checks them: each package's layers point down, the shared vocabulary
(ace_common) imports neither deployable, the gateway never imports the agent."""
from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_the_contracts_cover_both_packages_and_the_shared_one():
    kinds = {(c["type"], tuple(c.get("containers", c.get("source_modules", ())))) for c in _contracts()}
    assert ("layers", ("extproc",)) in kinds and ("layers", ("gpu_agent",)) in kinds
    assert ("forbidden", ("extproc",)) in kinds and ("forbidden", ("ace_common",)) in kinds


def test_lint_imports_keeps_every_contract():
    out = subprocess.run([str(LINT), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert f"Contracts: {len(_contracts())} kept, 0 broken." in out.stdout
