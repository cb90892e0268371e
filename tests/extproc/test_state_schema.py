"""The gateway's state file and the catalogs it includes against their typed schema:
each required field missing and a wrong type for each field is a ``ConfigError`` naming
the file and the field's path, and ``python -m extproc`` answers it with exit code 2 and
one line on stderr (no traceback)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from extproc.errors import ConfigError
from extproc.state.store import Store
from tests.extproc.builders import upstream, write_state
from tests.gpu_agent.test_catalog_schema import REQUIRED as CATALOG_REQUIRED
from tests.gpu_agent.test_catalog_schema import WRONG_TYPES as CATALOG_WRONG_TYPES
from tests.gpu_agent.test_catalog_schema import mutated
from tests.support.procs import REPO

REQUIRED = ["tenants[1].id", "keys[0].sha256", "keys[0].tenant", "upstreams[0].name",
            "upstreams[0].address", "upstreams[0].flavour", "upstreams[0].base_model"]

ADAPTER = {"name": "extra", "base_model": "ace-tiny-llama", "rank": 4, "uri": "adapters/extra"}

# (field path, a value of the wrong type, what the error says)
WRONG_TYPES = [
    ("include", 5, "expected a string or a list, got 5"),
    ("include[0]", ["catalog.yaml"], "expected a string, got a list"),
    ("base_model", 5, "expected a mapping or a string, got 5"),
    ("adapters", "extra", "expected a list, got 'extra'"),
    ("adapters[0].rank", "x", "expected an integer, got 'x'"),
    ("tenants", {"id": "acme"}, "expected a list, got a mapping"),
    ("tenants[0]", "acme", "expected a mapping, got 'acme'"),
    ("tenants[1].id", 42, "expected a string, got 42"),
    ("tenants[0].default_adapter", ["acme-legal"], "expected a string, got a list"),
    ("tenants[0].skills", "prod", "expected a mapping, got 'prod'"),
    ("tenants[0].skills.multi_lora", False, "expected a string, got False (YAML reads a bare"),
    ("keys", "alice", "expected a list, got 'alice'"),
    ("keys[0].sha256", 7, "expected a string, got 7"),
    ("keys[0].tenant", ["acme"], "expected a string, got a list"),
    ("keys[0].name", 7, "expected a string, got 7"),
    ("keys[0].skills", ["prod"], "expected a mapping, got a list"),
    ("keys[0].role", "root", "expected one of developer, admin, got 'root'"),
    ("upstreams", {"name": "local"}, "expected a list, got a mapping"),
    ("upstreams[0].name", 1, "expected a string, got 1"),
    ("upstreams[0].address", 8000, "expected a string, got 8000"),
    ("upstreams[0].flavour", "tgi", "expected one of builtin, vllm, sglang, got 'tgi'"),
    ("upstreams[0].base_model", 1, "expected a string, got 1"),
    ("upstreams[0].hints", True, "expected one of body, headers, off, got True"),
    ("upstreams[0].agent", 50061, "expected a string, got 50061"),
    ("skills", ["multi_lora"], "expected a mapping, got a list"),
    ("limits", 5, "expected a mapping, got 5"),
    ("limits.max_body_bytes", "1MB", "expected an integer, got '1MB'"),
    ("tenants[0].colour", "blue", "unknown field (known: id, default_adapter, skills)"),
    ("upstream", [], "unknown field (known: upstreams,"),
]


@pytest.fixture
def state(tmp_path):
    path = write_state(tmp_path, [upstream()])
    doc = yaml.safe_load(path.read_text())
    doc["include"] = ["catalog.yaml"]
    doc["adapters"] = [dict(ADAPTER)]
    doc["upstreams"][0]["agent"] = "127.0.0.1:50061"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _refused(tmp_path, path) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        Store(path, tmp_path / "db").close()
    return caught.value


def _rewrite(path, doc):
    path.write_text(yaml.safe_dump(doc, sort_keys=False))


def test_the_valid_state_loads(tmp_path, state):
    s = Store(state, tmp_path / "db")
    assert {"code-python", "extra"} <= set(s.snapshot.adapters)
    assert s.snapshot.upstreams[0].agent == "127.0.0.1:50061"
    s.close()


@pytest.mark.parametrize("field", REQUIRED)
def test_each_required_state_field_missing_is_named(tmp_path, state, field):
    _rewrite(state, mutated(yaml.safe_load(state.read_text()), field, delete=True))
    err = _refused(tmp_path, state)
    assert (str(err), err.field) == (f"{state}: {field}: required field missing", field)


@pytest.mark.parametrize("field, value, says", WRONG_TYPES)
def test_a_wrong_type_for_each_state_field_is_named(tmp_path, state, field, value, says):
    _rewrite(state, mutated(yaml.safe_load(state.read_text()), field, value))
    err = _refused(tmp_path, state)
    assert str(err).startswith(f"{state}: {field}: {says}") and err.field == field


@pytest.mark.parametrize("field", CATALOG_REQUIRED)
def test_each_required_catalog_field_missing_is_named_by_the_gateway(tmp_path, state, field):
    catalog = state.parent / "catalog.yaml"
    _rewrite(catalog, mutated(yaml.safe_load(catalog.read_text()), field, delete=True))
    err = _refused(tmp_path, state)
    assert (str(err), err.field) == (f"{catalog}: {field}: required field missing", field)


@pytest.mark.parametrize("field, value, says", CATALOG_WRONG_TYPES)
def test_a_wrong_type_for_each_catalog_field_is_named_by_the_gateway(tmp_path, state, field, value, says):
    catalog = state.parent / "catalog.yaml"
    _rewrite(catalog, mutated(yaml.safe_load(catalog.read_text()), field, value))
    err = _refused(tmp_path, state)
    assert str(err).startswith(f"{catalog}: {field}: {says}") and err.field == field


@pytest.mark.parametrize("field, value, says", [
    ("keys[1].tenant", "initech", "unknown tenant initech"),
    ("keys[0].sha256", "plaintext", "must be the hex SHA-256"),
    ("tenants[0].default_adapter", "nope", "nope not in catalog"),
    ("tenants[0].skills.multi_lora", "max", "must be one of off|shadow|prod, got 'max'"),
    ("skills.colour", "prod", "unknown skill 'colour'"),
    ("upstreams[0].address", "localhost:8000", "upstream local: address must be IP:port"),
    ("upstreams", [], "at least one upstream is required"),
    ("limits.max_body_bytes", 0, "must be positive"),
])
def test_what_the_schema_cannot_say_is_named_alike(tmp_path, state, field, value, says):
    _rewrite(state, mutated(yaml.safe_load(state.read_text()), field, value))
    err = _refused(tmp_path, state)
    assert str(err).startswith(f"{state}: {field}: {says}") and err.field == field


def test_upstreams_may_be_left_out_only_when_discovery_gives_them(tmp_path, state):
    _rewrite(state, mutated(yaml.safe_load(state.read_text()), "upstreams", delete=True))
    err = _refused(tmp_path, state)
    assert str(err).startswith(f"{state}: upstreams: at least one upstream is required")
    s = Store(state, tmp_path / "db", upstreams_required=False)
    assert s.snapshot.upstreams == ()
    s.close()


def test_python_m_extproc_exits_2_with_one_line_and_no_traceback(tmp_path, state):
    _rewrite(state, mutated(yaml.safe_load(state.read_text()), "tenants[1].id", delete=True))
    run = subprocess.run([sys.executable, "-m", "extproc", "--config", str(state), "--db", str(tmp_path / "db")],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [f"extproc: configuration error: {state}: tenants[1].id: required field missing"]
