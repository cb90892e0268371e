import hashlib

import pytest
import torch

from gpu_agent.errors import (AdapterInvalid, AdapterNotFound, BaseModelMismatch,
                              DigestMismatch, UnsupportedFeature)
from gpu_agent.engine.peft import adapter_dir, load_peft_dir

from .lora_testing import SPEC, make_adapter, write_peft_dir


def _sha(path):
    return hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_valid_dir_loads_with_digest(tmp_path, dtype):
    ad = make_adapter("code-py", 8, dtype=dtype, modules=("q_proj", "v_proj", "up_proj"))
    path = write_peft_dir(tmp_path, ad)
    got = load_peft_dir(path, SPEC, sha256=_sha(path))
    assert (got.name, got.rank, got.alpha, got.base_model) == ("code-py", 8, 16.0, "tiny-base")
    assert got.scale == 2.0
    assert set(got.weights) == set(ad.weights)
    for key, (a, b) in ad.weights.items():
        assert got.weights[key][0].dtype == dtype
        assert torch.equal(got.weights[key][0], a) and torch.equal(got.weights[key][1], b)
    assert got.nbytes == ad.nbytes


def test_rslora_scale(tmp_path):
    path = write_peft_dir(tmp_path, make_adapter("rs", 16, alpha=8, use_rslora=True))
    assert load_peft_dir(path, SPEC).scale == pytest.approx(8 / 4)


def test_base_model_by_path_basename(tmp_path):
    path = write_peft_dir(tmp_path, make_adapter("a", 8),
                          config_overrides={"base_model_name_or_path": "/models/tiny-base/"})
    assert load_peft_dir(path, SPEC).rank == 8


@pytest.mark.parametrize("overrides, error", [
    ({"base_model_name_or_path": "meta-llama/Llama-2-7b"}, BaseModelMismatch),
    ({"base_model_name_or_path": None}, BaseModelMismatch),
    ({"target_modules": ["q_proj", "gate_proj"]}, AdapterInvalid),
    ({"target_modules": ["q_proj"]}, AdapterInvalid),           # k/v/o tensors not targeted
    ({"r": 16}, AdapterInvalid),                                # shapes say 8
    ({"r": 0}, AdapterInvalid),
    ({"use_dora": True}, UnsupportedFeature),
    ({"modules_to_save": ["lm_head"]}, UnsupportedFeature),
    ({"rank_pattern": {"q_proj": 4}}, UnsupportedFeature),
    ({"peft_type": "IA3"}, UnsupportedFeature),
    ({"fan_in_fan_out": True}, UnsupportedFeature),
])
def test_invalid_configs_rejected(tmp_path, overrides, error):
    path = write_peft_dir(tmp_path, make_adapter("bad", 8), config_overrides=overrides)
    with pytest.raises(error):
        load_peft_dir(path, SPEC)


def test_wrong_shapes_rejected(tmp_path):
    bad = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 31)}
    path = write_peft_dir(tmp_path, make_adapter("bad", 8), tensor_overrides=bad)
    with pytest.raises(AdapterInvalid, match="shapes"):
        load_peft_dir(path, SPEC)


def test_layer_out_of_range_and_missing_half(tmp_path):
    extra = {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 32)}
    with pytest.raises(AdapterInvalid, match="layer 7"):
        load_peft_dir(write_peft_dir(tmp_path / "x", make_adapter("a", 8), tensor_overrides=extra), SPEC)
    ad = make_adapter("b", 8)
    path = write_peft_dir(tmp_path / "y", ad)
    from safetensors.torch import load_file, save_file
    t = load_file(str(path / "adapter_model.safetensors"))
    del t["base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight"]
    save_file(t, str(path / "adapter_model.safetensors"))
    with pytest.raises(AdapterInvalid, match="both"):
        load_peft_dir(path, SPEC)


def test_non_lora_tensor_rejected(tmp_path):
    extra = {"base_model.model.lm_head.weight": torch.zeros(4, 32)}
    path = write_peft_dir(tmp_path, make_adapter("a", 8), tensor_overrides=extra)
    with pytest.raises(UnsupportedFeature):
        load_peft_dir(path, SPEC)


def test_digest_mismatch(tmp_path):
    path = write_peft_dir(tmp_path, make_adapter("a", 8))
    with pytest.raises(DigestMismatch):
        load_peft_dir(path, SPEC, sha256="0" * 64)


def test_missing_files_and_garbage(tmp_path):
    with pytest.raises(AdapterNotFound):
        load_peft_dir(tmp_path / "nope", SPEC)
    path = write_peft_dir(tmp_path, make_adapter("g", 8))
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 20)
    with pytest.raises(AdapterInvalid):
        load_peft_dir(path, SPEC)
    (path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterInvalid):
        load_peft_dir(path, SPEC)


@pytest.mark.parametrize("name", ["../etc", "a/b", "..", ".hidden", "", "x" * 200, "a\x00b", "/abs"])
def test_adapter_names_never_become_paths_unchecked(tmp_path, name):
    with pytest.raises(AdapterNotFound):
        adapter_dir(tmp_path, name)


def test_adapter_dir_ok(tmp_path):
    assert adapter_dir(tmp_path, "code-python.v2") == (tmp_path / "code-python.v2").resolve()


def test_old_peft_key_names_with_adapter_name(tmp_path):
    ad = make_adapter("old", 8, modules=("q_proj",))
    renamed = {}
    for (layer, m), (a, b) in ad.weights.items():
        prefix = f"base_model.model.model.layers.{layer}.self_attn.{m}"
        renamed[f"{prefix}.lora_A.default.weight"] = a
        renamed[f"{prefix}.lora_B.default.weight"] = b
    path = write_peft_dir(tmp_path, make_adapter("old", 8, modules=()), tensor_overrides=renamed,
                          config_overrides={"target_modules": ["q_proj"]})
    got = load_peft_dir(path, SPEC)
    assert torch.equal(got.weights[(1, "q_proj")][1], ad.weights[(1, "q_proj")][1])


@pytest.mark.parametrize("key", ["model.layers.x.q_proj.lora_A.weight", "q_proj.lora_A.weight",
                                 "model.layers.0.q_proj.lora_C.weight"])
def test_unparseable_keys_rejected(tmp_path, key):
    path = write_peft_dir(tmp_path, make_adapter("k", 8), tensor_overrides={key: torch.zeros(8, 32)})
    with pytest.raises(UnsupportedFeature):
        load_peft_dir(path, SPEC)


def test_same_header_structure_keeps_each_adapters_own_bytes(tmp_path):
    """Adapters of one rank share a cached header structure, never each other's data."""
    from gpu_agent.engine.pool import AdapterPool

    one, two = make_adapter("one", 16, seed=1), make_adapter("two", 16, seed=2)
    p1, p2 = write_peft_dir(tmp_path, one), write_peft_dir(tmp_path, two)
    assert (p1 / "adapter_model.safetensors").read_bytes()[:200] == (p2 / "adapter_model.safetensors").read_bytes()[:200]
    got1, got2 = load_peft_dir(p1, SPEC), load_peft_dir(p2, SPEC)
    assert got1.payload.matrices is got2.payload.matrices          # structure reused
    pool = AdapterPool(SPEC, 1 << 20)
    e1, e2 = pool.load(got1), pool.load(got2)
    for ad, e in ((one, e1), (two, e2)):
        for key, (a, b) in ad.weights.items():
            pa, pbt = pool.matrices(e, *key)
            assert torch.equal(pa, a) and torch.equal(pbt, b.t())


def test_core_modules_import_without_torch():
    """The gateway imports gpu_agent pieces; torch must load only when used."""
    import subprocess
    import sys

    code = ("import sys, gpu_agent, gpu_agent.errors, gpu_agent.engine.peft, gpu_agent.eviction, "
            "gpu_agent.engine.pool, gpu_agent.engine.lora_ops, gpu_agent.engine.staging; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_header_read_in_pieces_and_digest_still_enforced(tmp_path, monkeypatch):
    """The header comes from pread (one read when it fits _HEAD_READ, else a second one);
    the weights are the file's bytes either way, and a digest is still checked."""
    import gpu_agent.engine.peft as peft_mod

    ad = make_adapter("hdr", 8, modules=("q_proj", "k_proj", "up_proj"))
    path = write_peft_dir(tmp_path, ad)
    digest = _sha(path)
    for head in (16, 1 << 16):
        monkeypatch.setattr(peft_mod, "_HEAD_READ", head)
        peft_mod.clear_structure_cache()
        got = load_peft_dir(path, SPEC, sha256=digest)
        for key, (a, b) in ad.weights.items():
            assert torch.equal(got.weights[key][0], a) and torch.equal(got.weights[key][1], b)
    # one data byte changed: same header (structure cache hit), digest must fail
    f = path / "adapter_model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0xFF
    f.write_bytes(bytes(raw))
    with pytest.raises(DigestMismatch):
        load_peft_dir(path, SPEC, sha256=digest)
    load_peft_dir(path, SPEC)          # without a digest the (valid) file still loads
