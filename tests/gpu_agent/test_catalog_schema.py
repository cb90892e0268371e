"""catalog.yaml (docs/contracts.md) against its one typed schema, through every reader:
the agent (``Catalog.from_yaml``), the builtin engine (``read_catalog``) and, in
tests/extproc/test_state_schema.py, the gateway. Each required field missing and a wrong
type for each field is refused with the file and the field's path."""
from __future__ import annotations

import copy
import re

import pytest
import yaml

from gpu_agent.artifacts import Catalog, CatalogError
from ace_common.catalog_schema import SchemaError, read_catalog_file
from gpu_agent.engine.adapters import read_catalog

CATALOG = {
    "base_model": {"name": "ace-tiny-llama", "path": "model"},
    "adapters": [{"name": "code-python", "base_model": "ace-tiny-llama", "rank": 8, "alpha": 16,
                  "target_modules": ["q_proj", "v_proj"], "size_bytes": 4096, "owner": "public",
                  "domain": "coding", "uri": "adapters/code-python", "sha256": "a" * 64}],
}

REQUIRED = ["base_model", "base_model.name", "adapters[0].name", "adapters[0].uri", "adapters[0].rank"]

# (field path, a value of the wrong type, what the error says)
WRONG_TYPES = [
    ("base_model", 5, "expected a mapping or a string, got 5"),
    ("base_model.name", ["m"], "expected a string, got a list"),
    ("base_model.path", 5, "expected a string, got 5"),
    ("adapters", {"name": "x"}, "expected a list, got a mapping"),
    ("adapters[0]", "code-python", "expected a mapping, got 'code-python'"),
    ("adapters[0].name", 7, "expected a string, got 7"),
    ("adapters[0].uri", 7, "expected a string, got 7"),
    ("adapters[0].rank", "x", "expected an integer, got 'x'"),
    ("adapters[0].rank", 8.5, "expected an integer, got 8.5"),
    ("adapters[0].base_model", 1, "expected a string, got 1"),
    ("adapters[0].sha256", 12, "expected a string, got 12"),
    ("adapters[0].alpha", "x", "expected a number, got 'x'"),
    ("adapters[0].alpha", True, "expected a number, got True (YAML reads a bare"),
    ("adapters[0].target_modules", "q_proj", "expected a list, got 'q_proj'"),
    ("adapters[0].target_modules[1]", 3, "expected a string, got 3"),
    ("adapters[0].size_bytes", "4k", "expected an integer, got '4k'"),
    ("adapters[0].owner", ["acme"], "expected a string, got a list"),
    ("adapters[0].domain", 1, "expected a string, got 1"),
    ("adapters[0].colour", "blue", "unknown field (known: name, uri, rank,"),
]


def _steps(path: str) -> list[str | int]:
    return [int(tok[1:-1]) if tok.startswith("[") else tok for tok in re.findall(r"\[\d+\]|[^.\[\]]+", path)]


def mutated(doc: dict, path: str, value=None, *, delete: bool = False) -> dict:
    """A copy of ``doc`` with the value at ``path`` (``a.b[0].c``) replaced or deleted."""
    out = copy.deepcopy(doc)
    *parents, last = _steps(path)
    node = out
    for step in parents:
        node = node[step]
    if delete:
        del node[last]
    else:
        node[last] = value
    return out


def _readers(tmp_path, doc):
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path, [(read_catalog_file, SchemaError), (Catalog.from_yaml, CatalogError), (read_catalog, ValueError)]


def test_the_valid_catalog_reads_alike_everywhere(tmp_path):
    path, _ = _readers(tmp_path, CATALOG)
    assert Catalog.from_yaml(path).get("code-python").alpha == 16.0
    name, _, entries = read_catalog(path)
    assert (name, entries["code-python"].rank, entries["code-python"].sha256) == ("ace-tiny-llama", 8, "a" * 64)
    short = mutated(mutated(CATALOG, "base_model", "ace-tiny-llama"), "adapters[0].base_model", delete=True)
    path, _ = _readers(tmp_path, short)      # base_model as a plain name; the entry's defaults to it
    assert Catalog.from_yaml(path).get("code-python").base_model == "ace-tiny-llama"


@pytest.mark.parametrize("field", REQUIRED)
def test_each_required_field_missing_is_named(tmp_path, field):
    path, readers = _readers(tmp_path, mutated(CATALOG, field, delete=True))
    for read, error in readers:
        with pytest.raises(error) as caught:
            read(path)
        assert str(caught.value) == f"{path}: {field}: required field missing"


@pytest.mark.parametrize("field, value, says", WRONG_TYPES)
def test_a_wrong_type_for_each_field_is_named(tmp_path, field, value, says):
    path, readers = _readers(tmp_path, mutated(CATALOG, field, value))
    for read, error in readers:
        with pytest.raises(error) as caught:
            read(path)
        assert str(caught.value).startswith(f"{path}: {field}: {says}")


def test_python_m_gpu_agent_exits_2_with_one_line_on_a_bad_catalog(tmp_path):
    import subprocess
    import sys

    from tests.support.procs import REPO

    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(mutated(CATALOG, "adapters[0].rank", delete=True), sort_keys=False))
    run = subprocess.run([sys.executable, "-m", "gpu_agent", "serve", "--catalog", str(path), "--engine", "builtin", "--auth", "none"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2, run.stderr
    assert len(run.stderr.splitlines()) == 1, run.stderr
    assert "adapters[0].rank: required field missing" in run.stderr
