"""Fixtures: deterministic bytes, the layout of docs/contracts.md, adapters that matter."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from gpu_agent.fixtures import ADAPTERS, BASE_MODEL_NAME, CHAT_TEMPLATE, TINY_LLAMA, make_adapter, make_fixtures

torch.set_num_threads(1)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx")
    make_fixtures(out)
    return out


def test_two_runs_write_identical_bytes(fx, tmp_path):
    make_fixtures(tmp_path / "again")
    first, second = _digests(fx), _digests(tmp_path / "again")
    assert first == second
    assert len(first) == 6 + 2 * len(ADAPTERS) + 1  # model files, adapter pairs, catalog


def test_model_dir_is_a_llama_checkpoint(fx):
    cfg = json.loads((fx / "model/config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"], cfg["vocab_size"]) == (128, 2, 4, 2, 256, 512)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == cfg["head_dim"] == 32  # vLLM CPU needs 32
    with safe_open(str(fx / "model/model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.1.self_attn.k_proj.weight").shape == (64, 128)
    for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
              "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight",
              "model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert k in keys
    assert len(keys) == 3 + 2 * 9


def test_tokenizer_is_printable_ascii_metaspace_with_chat_template(fx):
    from gpu_agent.engine.tokenizer import ModelTokenizer

    tj = json.loads((fx / "model/tokenizer.json").read_text())
    assert tj["model"]["type"] == "BPE" and tj["pre_tokenizer"]["type"] == "Metaspace"
    tc = json.loads((fx / "model/tokenizer_config.json").read_text())
    assert tc["chat_template"] == CHAT_TEMPLATE and tc["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = ModelTokenizer(fx / "model")
    assert tok.vocab_size == 512
    text = "Translate from German to English: Guten Morgen! SELECT * FROM t;"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id and tok.decode(ids) == text
    chat = tok.render_chat([{"role": "user", "content": "hi"}])
    assert chat == "<s><|user|>hi</s><|assistant|>"
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[0] == tok.bos_id


def test_catalog_matches_files_and_table(fx):
    cat = yaml.safe_load((fx / "catalog.yaml").read_text())
    assert cat["base_model"] == {"name": BASE_MODEL_NAME, "path": "model"}
    rows = {a["name"]: a for a in cat["adapters"]}
    assert list(rows) == [a.name for a in ADAPTERS]
    assert {a.rank for a in ADAPTERS} == {8, 16, 32, 64, 128}
    assert {a.domain for a in ADAPTERS} == {"coding", "medical", "legal", "finance", "translation"}
    for a in ADAPTERS:
        row = rows[a.name]
        weights = fx / row["uri"] / "adapter_model.safetensors"
        assert row["sha256"] == hashlib.sha256(weights.read_bytes()).hexdigest()
        assert row["size_bytes"] == weights.stat().st_size
        assert row["rank"] == a.rank and row["owner"] == a.owner and row["base_model"] == BASE_MODEL_NAME
        expected_owner = {"code": "acme", "med": "medco"}.get(a.name.split("-")[0], "public")
        assert row["owner"] == expected_owner
        cfg = json.loads((fx / row["uri"] / "adapter_config.json").read_text())
        assert cfg["peft_type"] == "LORA" and cfg["r"] == a.rank and cfg["lora_alpha"] == row["alpha"]
        assert cfg["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
        assert cfg["use_rslora"] == a.use_rslora
    assert any(a.use_rslora for a in ADAPTERS)


def test_adapter_tensors_follow_peft_naming(fx):
    with safe_open(str(fx / "adapters/code-sql/adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
        assert len(keys) == 2 * 4 * 2
        a = f.get_tensor("base_model.model.model.layers.1.self_attn.v_proj.lora_A.weight")
        b = f.get_tensor("base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight")
    assert a.shape == (32, 128) and b.shape == (64, 32) and b.abs().sum() > 0


def test_every_adapter_changes_greedy_output(fx):
    from gpu_agent.engine.model import LlamaModel, greedy_generate, merge_adapter
    from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir
    from gpu_agent.engine.tokenizer import ModelTokenizer

    model = LlamaModel.from_dir(fx / "model")
    spec = BaseModelSpec(BASE_MODEL_NAME, 2, 128, model.cfg.module_shapes())
    prompt = ModelTokenizer(fx / "model").encode("Please summarize the report")
    base = greedy_generate(model, prompt, 6)
    outputs = {}
    for a in ADAPTERS:
        adapter = load_peft_dir(fx / "adapters" / a.name, spec)
        outputs[a.name] = tuple(greedy_generate(merge_adapter(model, adapter), prompt, 6))
        assert list(outputs[a.name]) != base, a.name
    assert len(set(outputs.values())) == len(ADAPTERS)  # and they differ from each other


def test_make_adapter_for_another_base_shape(tmp_path):
    from dataclasses import replace

    big = replace(TINY_LLAMA, name="other", hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=32)
    files = make_adapter(tmp_path, "x", 4, seed=7, target_modules=["q_proj", "o_proj"], base=big)
    again = make_adapter(tmp_path / "b", "x", 4, seed=7, target_modules=["q_proj", "o_proj"], base=big)
    assert files.sha256 == again.sha256 and files.size_bytes == (tmp_path / "x/adapter_model.safetensors").stat().st_size
    cfg = json.loads((tmp_path / "x/adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == "other" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    with pytest.raises(ValueError):
        make_adapter(tmp_path, "y", 4, target_modules=["gate_proj"])
