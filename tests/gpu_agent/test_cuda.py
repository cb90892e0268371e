"""The pool and the batched op on a CUDA device (``make gpu-check``; skipped without one).

The same contracts as the CPU tests, where a GPU changes how they are met: pages live in
one device tensor, loads copy host -> device on the pool's copy stream, the op reads the
device pages, and churn never reallocates the device memory.
"""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from gpu_agent.errors import PoolExhausted
from gpu_agent.engine.lora_ops import apply_lora
from gpu_agent.engine.pool import AdapterPool

from .lora_testing import SPEC, dense_reference, make_adapter

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

RANKS = (8, 16, 32, 64, 128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")
CUDA = torch.device("cuda")


def _pool(dtype=torch.float32, budget_mb: int = 8) -> AdapterPool:
    return AdapterPool(SPEC, budget_mb << 20, dtype=dtype, device=CUDA)


def test_pages_live_on_the_device_and_loads_are_exact():
    pool = _pool()
    assert pool.pages.device.type == "cuda"
    ads = [make_adapter(f"r{r}", r, modules=MODULES, seed=r) for r in RANKS]
    for ad in ads:
        pool.load(ad)
    torch.cuda.synchronize()
    for ad in ads:
        entry = pool.entry(ad.name)
        for (layer, module), (a, b) in ad.weights.items():
            got_a, got_bt = pool.matrices(entry, layer, module)
            assert got_a.device.type == "cuda"
            torch.testing.assert_close(got_a.cpu(), a, rtol=0, atol=0)
            torch.testing.assert_close(got_bt.t().cpu(), b, rtol=0, atol=0)
    pool.check_invariants()


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-3), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("method", [None, "segmented"])   # None: the masked form, on CUDA
def test_mixed_rank_batch_on_device_matches_the_dense_reference(dtype, atol, grouped, method):
    pool = _pool(dtype)
    adapters = {f"r{r}": make_adapter(f"r{r}", r, modules=MODULES, dtype=dtype, seed=r,
                                      use_rslora=(r == 32), alpha=16) for r in RANKS}
    for ad in adapters.values():
        pool.load(ad)
    names = [*adapters, None]
    rows = ([n for n in names for _ in range(3)] if grouped
            else [names[(7 * i) % len(names)] for i in range(24)])
    g = torch.Generator().manual_seed(1)
    for module in MODULES:
        fan_in, fan_out = SPEC.modules[module]
        x = torch.randn(len(rows), fan_in, generator=g).to(dtype)
        w0 = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
        for layer in range(SPEC.num_layers):
            y = (x @ w0.t()).to(CUDA)
            with pool.batch(rows) as batch:
                apply_lora(y, x.to(CUDA), pool, batch, layer, module, method=method)
            ref = dense_reference(x, w0, rows, adapters, layer, module)
            torch.testing.assert_close(y.double().cpu(), ref, atol=atol, rtol=atol)


def test_churn_never_reallocates_device_memory():
    pool = _pool(budget_mb=2)
    ptr, numel = pool.pages.data_ptr(), pool.pages.numel()
    base = {r: make_adapter(f"t{r}", r, modules=MODULES, seed=r) for r in RANKS}
    rng = random.Random(0)
    failures = 0
    for i in range(500):
        try:
            pool.load(dataclasses.replace(base[rng.choice(RANKS)], name=f"c{i}"))
        except PoolExhausted:
            failures += 1
    torch.cuda.synchronize()
    assert failures == 0
    assert pool.pages.data_ptr() == ptr and pool.pages.numel() == numel
    pool.check_invariants()


def test_a_load_does_not_wait_for_its_copy_and_the_first_batch_waits_on_its_event(tmp_path):
    """The copy is queued on the side stream from pinned memory and the load returns with
    the copy's event recorded (``entry.ready``); the compute stream waits on it before the
    adapter's first batch, so the batch reads every byte without any synchronize."""
    from gpu_agent.engine.peft import load_peft_dir
    from gpu_agent.engine.pool_copy import CopyDone

    from .lora_testing import write_peft_dir

    pool = _pool(budget_mb=64)
    ad = make_adapter("big", 128, modules=MODULES, seed=3)
    loaded = load_peft_dir(write_peft_dir(tmp_path, ad), SPEC, pin_memory=True)
    assert loaded.payload.buffer.is_pinned()
    entry = pool.load(loaded)
    assert isinstance(entry.ready, CopyDone)   # recorded, not waited for
    rows = ["big", None, "big"]
    g = torch.Generator().manual_seed(5)
    for module in MODULES:
        fan_in, fan_out = SPEC.modules[module]
        x = torch.randn(len(rows), fan_in, generator=g)
        w0 = torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5
        for layer in range(SPEC.num_layers):
            y = (x @ w0.t()).to(CUDA)
            with pool.batch(rows) as batch:
                apply_lora(y, x.to(CUDA), pool, batch, layer, module)
            ref = dense_reference(x, w0, rows, {"big": ad}, layer, module)
            torch.testing.assert_close(y.double().cpu(), ref, atol=1e-3, rtol=1e-3)
    torch.cuda.synchronize()
    with pool.batch(["big"]):
        pass
    assert entry.ready is None   # the copy is done: forgotten, its host bytes released


def test_a_batch_runs_on_the_device_while_another_load_is_held_mid_copy(tmp_path):
    """The CPU test's contract on CUDA: the pool's lock is not held across the copy."""
    import threading

    from gpu_agent.engine.peft import load_peft_dir
    from tests.support.wait import scaled, wait_until

    from .lora_testing import write_peft_dir

    pool = _pool(budget_mb=64)
    pool.load(make_adapter("small", 8, modules=MODULES, seed=1))
    big = load_peft_dir(write_peft_dir(tmp_path, make_adapter("big", 128, modules=MODULES, seed=2)), SPEC,
                        pin_memory=True)
    reached, go, calls = threading.Event(), threading.Event(), []

    def hold(stage):
        calls.append(stage)
        if len(calls) == 2:
            reached.set()
            go.wait(scaled(120))
        return False
    loader = threading.Thread(target=pool.load, args=(big,), kwargs={"should_yield": hold})
    loader.start()
    try:
        assert reached.wait(scaled(30))
        done = threading.Event()

        def step():
            y = torch.zeros(2, 32, device=CUDA)
            with pool.batch(["small", "small"]) as batch:
                apply_lora(y, torch.randn(2, 32, device=CUDA), pool, batch, 0, "q_proj")
            torch.cuda.synchronize()
            done.set()
        threading.Thread(target=step, daemon=True).start()
        wait_until(done.is_set, what="a device batch while another copy is held open")
        assert not pool.contains("big")
    finally:
        go.set()
        loader.join(scaled(30))
    assert pool.contains("big")


@pytest.mark.parametrize("file_open", [True, False])
@pytest.mark.parametrize("prefetch", [False, True])
def test_pageable_host_copies_reach_the_device_through_the_staging_buffers(tmp_path, file_open, prefetch):
    """The host tier's copies stay pageable: the pool preads the file (or copies the host
    buffer) into its pinned staging buffers, which it took when it was built, and queues
    the DMA from them; the bytes are exact, several loads share the buffers, and no load
    pins memory (a cudaHostAlloc while serving stalled the forward's launches)."""
    import threading

    from gpu_agent.engine.peft import load_peft_dir
    from gpu_agent.engine.pool_copy import CopyDone, PinnedStaging

    from .lora_testing import write_peft_dir

    pool = _pool(budget_mb=64)
    assert pool.staging is not None and pool.staging.nbytes > 0
    pool.staging = PinnedStaging(slot_bytes=64 << 10, slots=2)   # small: every load wraps the buffers
    ads = [make_adapter(f"p{r}", r, modules=MODULES, seed=r) for r in (128, 64, 32)]
    loaded = [load_peft_dir(write_peft_dir(tmp_path, ad), SPEC) for ad in ads]
    for ad in loaded:
        assert not ad.payload.buffer.is_pinned()
        if not file_open:
            ad.payload.file.close()        # the copy then reads the host buffer
    stats = getattr(torch.cuda, "host_memory_stats", None)
    allocs_before = stats().get("num_host_alloc") if stats else None
    yield_never = (lambda stage: False) if prefetch else None
    entries: dict[str, object] = {}
    threads = [threading.Thread(target=lambda a=a: entries.__setitem__(a.name, pool.load(a, should_yield=yield_never)))
               for a in loaded]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(entries) == sorted(a.name for a in ads)
    assert all(isinstance(e.ready, CopyDone) for e in entries.values())
    assert pool.staging.pieces >= sum(a.nbytes for a in ads) // pool.staging.slot_bytes
    if allocs_before is not None:
        assert stats().get("num_host_alloc") == allocs_before   # nothing pinned while loading
    torch.cuda.synchronize()
    for ad in ads:
        entry = pool.entry(ad.name)
        with pool.batch([ad.name]):
            for (layer, module), (a, b) in ad.weights.items():
                got_a, got_bt = pool.matrices(entry, layer, module)
                torch.testing.assert_close(got_a.cpu(), a, rtol=0, atol=0)
                torch.testing.assert_close(got_bt.t().cpu(), b, rtol=0, atol=0)
    pool.check_invariants()


def test_the_builtin_engine_serves_one_mixed_adapter_batch_on_the_device(fixtures):
    """The engine's path end to end on the GPU: the fixtures' model and pool on CUDA, one
    batch whose rows use adapters of ranks 8-128 (one row none) through the Batcher: every
    row's greedy tokens equal those of the CPU model with that adapter merged, and a
    prefill's logits match the merged reference."""
    import asyncio

    from gpu_agent.engine.batcher import Batcher, GenerationRequest
    from gpu_agent.engine.model import LlamaModel, SequenceStep, greedy_generate, merge_adapter
    from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir
    from gpu_agent.engine.tokenizer import ModelTokenizer

    cpu = LlamaModel.from_dir(fixtures / "model")
    gpu = LlamaModel.from_dir(fixtures / "model", device=CUDA)
    spec = BaseModelSpec("ace-tiny-llama", cpu.cfg.num_layers, cpu.cfg.hidden_size, cpu.cfg.module_shapes())
    pool = AdapterPool(spec, 8 << 20, device=CUDA)
    mixed = ("code-python", "med-notes", "legal-review", "tr-de-en", "fin-risk")
    adapters = {n: load_peft_dir(fixtures / "adapters" / n, spec) for n in mixed}
    for ad in adapters.values():
        pool.load(ad)
    tok = ModelTokenizer(fixtures / "model")
    prompts = {n: tok.encode(f"{n}: summarize the contract and the risk") for n in mixed}
    prompts[None] = tok.encode("Hello, how are you today?")

    names = list(prompts)
    steps = [SequenceStep(prompts[n], gpu.new_cache(64)) for n in names]
    rows = [n for n in names for _ in prompts[n]]
    with pool.batch(rows) as lb:
        logits = gpu.forward(steps, lambda y, x, layer, m: apply_lora(y, x, pool, lb, layer, m))
    for i, n in enumerate(names):
        ref_model = cpu if n is None else merge_adapter(cpu, adapters[n])
        ref = ref_model.forward([SequenceStep(prompts[n], cpu.new_cache(64))])[0]
        torch.testing.assert_close(logits[i].float().cpu(), ref, rtol=1e-3, atol=1e-3)

    n_tokens = 8

    async def run():
        batcher = Batcher(gpu, pool, batch_window_ms=20)

        async def one(name):
            return [ev.token_id async for ev in batcher.generate(GenerationRequest(prompts[name], name, n_tokens))]
        try:
            return dict(zip(names, await asyncio.gather(*[one(n) for n in names]))), batcher.stats
        finally:
            await batcher.stop()

    got, stats = asyncio.run(run())
    assert stats.max_adapters_in_pass == len(mixed)   # really one mixed batch
    for name, toks in got.items():
        ref_model = cpu if name is None else merge_adapter(cpu, adapters[name])
        assert toks == greedy_generate(ref_model, prompts[name], n_tokens), name


def test_the_staging_size_is_split_into_the_pools_buffers():
    from gpu_agent.engine.pool_copy import STAGING_SLOTS

    pool = AdapterPool(SPEC, 8 << 20, device=CUDA, staging_bytes=STAGING_SLOTS << 20)
    assert pool.staging.slot_bytes == 1 << 20 and pool.staging.nbytes == STAGING_SLOTS << 20
