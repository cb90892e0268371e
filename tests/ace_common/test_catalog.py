"""The catalog entry has one model, ``ace_common.catalog.Adapter``: the gateway, the agent
and the builtin engine read the same file into it, field for field (each reader adds
only its own checks: the agent lower-cases the digest)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from ace_common.catalog import PUBLIC, Adapter
from extproc.state.store import load_state_file
from gpu_agent.artifacts import Catalog
from gpu_agent.engine.adapters import entry_dir, read_catalog

DIGEST = "AB" * 32
CATALOG = {
    "base_model": {"name": "ace-tiny-llama", "path": "model"},
    "adapters": [
        {"name": "code-python", "rank": 8, "alpha": 16, "target_modules": ["q_proj", "v_proj"],
         "size_bytes": 4096, "owner": "t1", "domain": "coding", "uri": "adapters/code-python",
         "sha256": DIGEST},
        {"name": "remote", "base_model": "other", "rank": 4, "uri": "https://example.invalid/remote",
         "sha256": DIGEST.lower()},
    ],
}


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(CATALOG, sort_keys=False))
    (tmp_path / "state.yaml").write_text("{}\n")
    return path


def test_every_reader_holds_the_one_entry_model(tmp_path):
    path = _write(tmp_path)
    gateway = load_state_file(tmp_path / "state.yaml", path, upstreams_required=False)["adapters"]
    agent = {a.name: a for a in Catalog.from_yaml(path)}
    _, _, engine = read_catalog(path)
    for side in (gateway, agent, engine):
        assert set(side) == {"code-python", "remote"}
        assert all(type(a) is Adapter for a in side.values())
    want = Adapter(name="code-python", base_model="ace-tiny-llama", rank=8, target_modules=("q_proj", "v_proj"),
                   size_bytes=4096, owner="t1", uri="adapters/code-python", sha256=DIGEST, alpha=16.0,
                   domain="coding")
    assert gateway["code-python"] == want
    assert agent["code-python"] == dataclasses.replace(want, sha256=DIGEST.lower())
    assert engine["code-python"] == want
    assert entry_dir(engine["code-python"], tmp_path) == (tmp_path / "adapters" / "code-python").resolve()
    assert gateway["remote"] == agent["remote"] == engine["remote"]
    assert gateway["remote"].base_model == "other" and gateway["remote"].is_remote


def test_visibility_and_local_directories(tmp_path):
    ad = Adapter("a", "m", 8, (), 1, PUBLIC, "adapters/a", "")
    assert ad.visible_to("anyone") and not dataclasses.replace(ad, owner="t1").visible_to("t2")
    assert ad.local_dir(tmp_path) == (tmp_path / "adapters" / "a").resolve()
    assert ad.local_dir() is None                                   # relative, and no root given
    assert dataclasses.replace(ad, uri="file:///x/a%20b").local_dir() == Path("/x/a b")
    assert dataclasses.replace(ad, uri="https://h/a").local_dir(tmp_path) is None
    assert dataclasses.replace(ad, uri="s3://b/a").local_dir(tmp_path) is None
