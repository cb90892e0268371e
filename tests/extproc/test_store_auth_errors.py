from __future__ import annotations

import json

import pytest
import yaml

from extproc.domain.auth import authenticate
from extproc.errors import (BadRequest, ConfigError, Forbidden, GatewayError, InvalidField,
                            MethodNotAllowed, NotFound, PayloadTooLarge, StoreUnavailable,
                            Unauthorized)
from extproc.state.store import Store
from tests.extproc.builders import KEYS, sha, upstream, write_state


def test_runtime_skills_survive_restart(tmp_path, state_file):
    db = tmp_path / "gw.sqlite3"
    s = Store(state_file, db)
    s.set_key_skills(sha(KEYS["bob"]), {"dynamic_lora_prefetch": "prod"})
    s.close()
    s2 = Store(state_file, db)
    assert dict(s2.snapshot.keys[sha(KEYS["bob"])].skills) == {
        "multi_lora": "prod", "dynamic_lora_prefetch": "prod"}
    s2.close()


def test_keys_are_never_stored_in_plaintext(tmp_path, store, state_file):
    store.set_key_skills(sha(KEYS["alice"]), {"multi_lora": "off"})
    for path in (state_file, tmp_path / "gw.sqlite3"):
        assert KEYS["alice"].encode() not in path.read_bytes()


def test_snapshot_is_swapped_not_mutated(store):
    before = store.snapshot
    store.set_key_skills(sha(KEYS["alice"]), {"multi_lora": "off"})
    assert store.snapshot is not before
    assert dict(before.keys[sha(KEYS["alice"])].skills) == {}
    with pytest.raises(TypeError):
        before.keys["x"] = None


def test_separate_catalog_file(tmp_path):
    state = write_state(tmp_path, [upstream()], include_catalog=False)
    s = Store(state, tmp_path / "db", catalog=tmp_path / "catalog.yaml")
    assert set(s.snapshot.adapters) == {"code-python", "acme-legal", "globex-secret"}
    assert "ace-tiny-llama" in s.snapshot.base_models
    s.close()


@pytest.mark.parametrize("mutate,match", [
    (lambda st: st["keys"][0].update(sha256="plaintext"), "sha256"),
    (lambda st: st["upstreams"][0].update(flavour="tgi"), "flavour"),
    (lambda st: st["upstreams"][0].update(address="nohost"), "IP:port"),
    (lambda st: st["upstreams"][0].update(address="localhost:8000"), "IP:port"),
    (lambda st: st.update(upstreams=[]), "upstream"),
    (lambda st: st["tenants"][0].update(default_adapter="nope"), "default_adapter"),
    (lambda st: st.update(skills={"multi_lora": "max"}), "skills"),
])
def test_invalid_state_is_a_config_error(tmp_path, state_file, mutate, match):
    st = yaml.safe_load(state_file.read_text())
    mutate(st)
    state_file.write_text(yaml.safe_dump(st))
    with pytest.raises(ConfigError, match=match):
        Store(state_file, tmp_path / "db")


def test_auth(snapshot):
    p = authenticate(snapshot, f"Bearer {KEYS['alice']}", None)
    assert (p.key.name, p.tenant.id) == ("alice", "acme")
    assert authenticate(snapshot, f"bearer {KEYS['alice']}", "acme").tenant.id == "acme"
    for header in (None, "", "Bearer", "Basic x", "Bearer wrong"):
        with pytest.raises(Unauthorized):
            authenticate(snapshot, header, None)
    with pytest.raises(Forbidden):
        authenticate(snapshot, f"Bearer {KEYS['alice']}", "globex")


@pytest.mark.parametrize("cls,status", [
    (BadRequest, 400), (Unauthorized, 401), (Forbidden, 403), (NotFound, 404),
    (MethodNotAllowed, 405), (PayloadTooLarge, 413), (InvalidField, 422), (StoreUnavailable, 503),
    (GatewayError, 500)])
def test_errors_are_openai_shaped(cls, status):
    err = cls("boom", param="p")
    assert err.status == status
    body = json.loads(err.to_json())
    assert body == {"error": {"message": "boom", "type": err.type, "param": "p", "code": err.code}}


def test_fixtures_catalog_loads_unchanged(tmp_path):
    """The agent's generated catalog (docs/contracts.md format) is read as is via --catalog."""
    from tests.support.procs import REPO
    catalog = REPO / ".fixtures" / "catalog.yaml"
    if not catalog.exists():
        pytest.skip("fixtures not generated (make fixtures)")
    state = tmp_path / "state.yaml"
    state.write_text(yaml.safe_dump({
        "tenants": [{"id": "acme"}], "keys": [{"sha256": sha("k"), "tenant": "acme"}],
        "upstreams": [upstream()]}))
    s = Store(state, tmp_path / "db", catalog=catalog)
    raw = yaml.safe_load(catalog.read_text())
    assert set(s.snapshot.adapters) == {a["name"] for a in raw["adapters"]}
    first = raw["adapters"][0]
    a = s.snapshot.adapters[first["name"]]
    assert (a.rank, a.sha256, a.owner, a.size_bytes) == (first["rank"], first["sha256"], first["owner"],
                                                         first["size_bytes"])
    assert raw["base_model"]["name"] in s.snapshot.base_models
    s.close()


def test_key_hash_is_sha256_hex():
    import hashlib

    from extproc.domain.auth import hash_key
    for key in ("sk-alice-0001", "", "ключ-é-🔑", "x" * 1000):
        assert hash_key(key) == hashlib.sha256(key.encode()).hexdigest()
