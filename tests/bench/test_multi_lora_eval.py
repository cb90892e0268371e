import hashlib

import yaml

from bench.multi_lora_eval import remote_catalog, state_yaml


def test_remote_catalog_points_every_adapter_at_the_store(tmp_path):
    src = tmp_path / "fx"
    src.mkdir()
    (src / "catalog.yaml").write_text(yaml.safe_dump({
        "base_model": {"name": "ace-tiny-llama", "path": "model"},
        "adapters": [
            {"name": "a", "rank": 8, "uri": "adapters/a", "owner": "acme", "sha256": "x", "size_bytes": 1},
            {"name": "b", "rank": 16, "uri": "adapters/b/", "owner": "public", "sha256": "y", "size_bytes": 2},
        ],
    }))
    out = tmp_path / "remote.yaml"
    data = remote_catalog(src / "catalog.yaml", "http://127.0.0.1:9", out, {"a"})
    assert [a["uri"] for a in data["adapters"]] == ["http://127.0.0.1:9/adapters/a"]
    assert data["adapters"][0]["owner"] == "public"
    assert data["base_model"]["path"] == str((src / "model").resolve())
    assert yaml.safe_load(out.read_text()) == data


def test_state_yaml_keys_and_skills(tmp_path):
    keys = state_yaml(tmp_path / "s.yaml", tmp_path / "c.yaml", ["acme", "medco"], "127.0.0.1:1", "127.0.0.1:2",
                      prefetch=False)
    state = yaml.safe_load((tmp_path / "s.yaml").read_text())
    assert state["skills"]["dynamic_lora_prefetch"] == "off"
    assert {k["tenant"] for k in state["keys"]} == {"acme", "medco"}
    for k in state["keys"]:
        assert k["sha256"] == hashlib.sha256(keys[k["tenant"]].encode()).hexdigest()
    assert state["upstreams"][0]["agent"] == "127.0.0.1:2"
