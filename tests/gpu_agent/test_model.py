"""The Llama forward and the batched-LoRA path against the merged-weights reference."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from gpu_agent.fixtures import make_fixtures
from gpu_agent.engine.model import LlamaModel, SequenceStep, greedy_generate, merge_adapter
from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir
from gpu_agent.engine.tokenizer import ModelTokenizer

torch.set_num_threads(1)

MIXED = ("code-python", "med-notes", "legal-review", "tr-de-en", "fin-risk")  # r8, 64, 128 rsLoRA, 16, 64


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fx")
    make_fixtures(out)
    return out


@pytest.fixture(scope="module")
def model(fx) -> LlamaModel:
    return LlamaModel.from_dir(fx / "model")


@pytest.fixture(scope="module")
def spec(model) -> BaseModelSpec:
    return BaseModelSpec("ace-tiny-llama", model.cfg.num_layers, model.cfg.hidden_size,
                         model.cfg.module_shapes())


def test_kv_cache_decode_matches_full_recompute(model):
    ids = [1, 40, 41, 42, 43, 44, 45, 46]
    cache = model.new_cache(len(ids))
    model.forward([SequenceStep(ids[:5], cache)])
    step_logits = [model.forward([SequenceStep([t], cache)])[0] for t in ids[5:]]
    for i, got in enumerate(step_logits):
        full = model.forward([SequenceStep(ids[:6 + i], model.new_cache(len(ids)))])[0]
        torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_ragged_batch_rows_are_independent(model):
    a, b = [1, 50, 60, 70], [1, 99]
    alone_a = model.forward([SequenceStep(a, model.new_cache(8))])[0]
    alone_b = model.forward([SequenceStep(b, model.new_cache(8))])[0]
    both = model.forward([SequenceStep(a, model.new_cache(8)), SequenceStep(b, model.new_cache(8))])
    torch.testing.assert_close(both[0], alone_a, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both[1], alone_b, rtol=1e-4, atol=1e-4)


def test_merge_adapter_is_w0_plus_scaled_ba(model, spec, fx):
    ad = load_peft_dir(fx / "adapters/legal-review", spec)  # rsLoRA: scale alpha/sqrt(r)
    merged = merge_adapter(model, ad)
    a, b = ad.weights[(1, "k_proj")]
    w0 = model.w["model.layers.1.self_attn.k_proj.weight"]
    assert ad.scale == pytest.approx(ad.alpha / 128 ** 0.5)
    torch.testing.assert_close(merged.w["model.layers.1.self_attn.k_proj.weight"], w0 + ad.scale * b @ a)
    assert merged.w["model.layers.1.mlp.up_proj.weight"] is model.w["model.layers.1.mlp.up_proj.weight"]


def test_mixed_batch_greedy_equals_merged_reference(model, spec, fx):
    """Each row of one batch uses another adapter (ranks 8-128, one without): every row's
    greedy tokens equal those of the model with that adapter merged into its weights."""
    from gpu_agent.engine.batcher import Batcher, GenerationRequest
    from gpu_agent.engine.pool import AdapterPool

    tok = ModelTokenizer(fx / "model")
    pool = AdapterPool(spec, 8 << 20)
    adapters = {n: load_peft_dir(fx / "adapters" / n, spec) for n in MIXED}
    for ad in adapters.values():
        pool.load(ad)
    prompts = {n: tok.encode(f"{n}: summarize the contract and the risk") for n in MIXED}
    prompts[None] = tok.encode("Hello, how are you today?")
    n_tokens = 8

    async def run():
        batcher = Batcher(model, pool, batch_window_ms=20)
        async def one(name):
            out = []
            async for ev in batcher.generate(GenerationRequest(prompts[name], name, n_tokens)):
                out.append(ev.token_id)
            return out
        try:
            results = await asyncio.gather(*[one(n) for n in prompts])
        finally:
            await batcher.stop()
        return dict(zip(prompts, results)), batcher.stats

    got, stats = asyncio.run(run())
    assert stats.max_adapters_in_pass == len(MIXED)  # really one mixed batch
    assert stats.forward_passes == n_tokens  # one prefill pass + 7 decode passes for all rows
    for name, toks in got.items():
        ref_model = model if name is None else merge_adapter(model, adapters[name])
        assert toks == greedy_generate(ref_model, prompts[name], n_tokens), name
    assert len({tuple(t) for t in got.values()}) == len(got)


def test_batched_lora_logits_match_merged(model, spec, fx):
    from gpu_agent.engine.lora_ops import apply_lora
    from gpu_agent.engine.pool import AdapterPool

    pool = AdapterPool(spec, 8 << 20)
    names = ["code-sql", "tr-fr-en", None, "med-triage"]
    ads = {n: load_peft_dir(fx / "adapters" / n, spec) for n in names if n}
    for ad in ads.values():
        pool.load(ad)
    prompts = [[1, 10 + i, 20 + i, 30 + i, 40 + i][: 3 + i % 3] for i in range(len(names))]
    steps = [SequenceStep(p, model.new_cache(8)) for p in prompts]
    rows = [n for n, p in zip(names, prompts) for _ in p]
    with pool.batch(rows) as lb:
        logits = model.forward(steps, lambda y, x, layer, m: apply_lora(y, x, pool, lb, layer, m))
    for i, n in enumerate(names):
        ref = (model if n is None else merge_adapter(model, ads[n])).forward([SequenceStep(prompts[i], model.new_cache(8))])[0]
        torch.testing.assert_close(logits[i], ref, rtol=1e-3, atol=1e-3)


def test_a_sequence_without_its_adapter_resident_ends_alone(model, spec, fx):
    from gpu_agent.engine.batcher import Batcher, GenerationRequest
    from gpu_agent.engine.pool import AdapterPool

    pool = AdapterPool(spec, 4 << 20)
    pool.load(load_peft_dir(fx / "adapters/code-python", spec))

    async def run():
        b = Batcher(model, pool, batch_window_ms=20)
        async def one(name):
            return [ev async for ev in b.generate(GenerationRequest([1, 40, 41], name, 4))]
        try:
            return await asyncio.gather(one("code-python"), one("not-loaded"))
        finally:
            await b.stop()

    ok, missing = asyncio.run(run())
    assert [e.finish_reason for e in ok] == [None, None, None, "length"]
    assert [e.finish_reason for e in missing] == ["abort"]
