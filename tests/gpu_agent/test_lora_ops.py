import pytest
import torch

from gpu_agent.engine.lora_ops import apply_lora
from gpu_agent.engine.pool import AdapterPool

from .lora_testing import SPEC, dense_reference, make_adapter

RANKS = (8, 16, 32, 64, 128)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")


def _pool(dtype, budget_mb=8):
    return AdapterPool(SPEC, budget_mb << 20, dtype=dtype)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), (torch.bfloat16, 6e-2)])
@pytest.mark.parametrize("module", MODULES)
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("method", ["segmented", "masked"])
def test_mixed_batch_matches_dense_reference(dtype, atol, module, grouped, method):
    pool = _pool(dtype)
    adapters = {f"r{r}": make_adapter(f"r{r}", r, modules=MODULES, dtype=dtype,
                                      use_rslora=(r == 32), alpha=16) for r in RANKS}
    for ad in adapters.values():
        pool.load(ad)
    names = [*adapters, None]
    if grouped:  # prefill-like: each request's rows consecutive
        rows = [n for n in names for _ in range(3)]
    else:        # decode-like: interleaved
        rows = [names[(7 * i) % len(names)] for i in range(24)]
    fan_in, fan_out = SPEC.modules[module]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(len(rows), fan_in, generator=g).to(dtype)
    w0 = (torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5).to(dtype)
    for layer in range(SPEC.num_layers):
        y = x @ w0.t()
        with pool.batch(rows) as batch:
            assert (batch.perm is None) == grouped
            apply_lora(y, x, pool, batch, layer, module, method=method)
        ref = dense_reference(x, w0, rows, adapters, layer, module)
        torch.testing.assert_close(y.double(), ref, atol=atol, rtol=atol)


def test_rows_without_adapter_untouched_and_empty_batch():
    pool = _pool(torch.float32)
    pool.load(make_adapter("a", 8))
    x = torch.randn(4, 32)
    y = torch.randn(4, 32)
    y0 = y.clone()
    with pool.batch([None, "a", None, None]) as batch:
        apply_lora(y, x, pool, batch, 0, "q_proj")
    assert torch.equal(y[[0, 2, 3]], y0[[0, 2, 3]]) and not torch.equal(y[1], y0[1])
    with pool.batch([None, None]) as batch:
        assert batch.segments == []
        apply_lora(y[:2], x[:2], pool, batch, 0, "q_proj")
    assert torch.equal(y[[0, 2, 3]], y0[[0, 2, 3]])


def test_rslora_scaling_honoured():
    pool = _pool(torch.float32)
    plain = make_adapter("plain", 16, alpha=8, seed=3)
    rs = make_adapter("rs", 16, alpha=8, seed=3, use_rslora=True)
    pool.load(plain)
    pool.load(rs)
    x = torch.randn(1, 32).expand(2, 32).contiguous()
    y = torch.zeros(2, 32)
    with pool.batch(["plain", "rs"]) as batch:
        apply_lora(y, x, pool, batch, 1, "o_proj")
    torch.testing.assert_close(y[1], y[0] * (8 / 16 ** 0.5) / (8 / 16))


def test_scattered_pages_give_same_result():
    """An adapter whose pages are not one run is gathered, with the same result."""
    # Budget for exactly 4 rank-8 adapters (112 pages each)
    per = make_adapter("x0", 8)
    pool = AdapterPool(SPEC, 4 * 112 * 32 * 4, dtype=torch.float32)
    assert pool.pages_for(per) == 112
    for i in range(4):
        pool.load(make_adapter(f"x{i}", 8, seed=i))
    pool.evict("x0")
    pool.evict("x2")
    big = make_adapter("big", 16, seed=9)  # 224 pages: only fits scattered
    entry = pool.load(big)
    assert not entry.contiguous
    pool.check_invariants()
    x = torch.randn(3, 32)
    y = torch.zeros(3, 16)
    with pool.batch(["big", "x1", "big"]) as batch:
        apply_lora(y, x, pool, batch, 1, "k_proj")
    a, b = big.weights[(1, "k_proj")]
    torch.testing.assert_close(y[[0, 2]], big.scale * (x[[0, 2]] @ a.t()) @ b.t(), atol=1e-5, rtol=1e-5)


def test_matrix_split_over_free_runs_is_gathered():
    """A matrix bigger than every free run spans several runs and is gathered."""
    from gpu_agent.engine.peft import LoraAdapter

    pool = AdapterPool(SPEC, 4 * 112 * 32 * 4, dtype=torch.float32)
    for i in range(4):
        pool.load(make_adapter(f"x{i}", 8, seed=i))
    pool.evict("x0")
    pool.evict("x2")                                   # free: two runs of 112 pages
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(48, 32, generator=g), torch.randn(80, 48, generator=g)
    wide = LoraAdapter("wide", 48, 24.0, ("up_proj",), SPEC.name, {(0, "up_proj"): (a, b)})
    entry = pool.load(wide)                            # B^T needs 80*48/32 = 120 pages > 112
    assert not entry.contiguous and entry.gathered_matrices == 1
    pool.check_invariants()
    x = torch.randn(5, 32, generator=g)
    y = torch.zeros(5, 80)
    with pool.batch(["wide", None, "x1", "wide", "wide"]) as batch:
        apply_lora(y, x, pool, batch, 0, "up_proj")
    rows = [0, 3, 4]
    torch.testing.assert_close(y[rows], wide.scale * (x[rows] @ a.t()) @ b.t(), atol=1e-4, rtol=1e-4)
    y1 = torch.zeros(2, 80)
    with pool.batch(["x1", "x1"]) as batch:                # x1 does not target up_proj
        apply_lora(y1, x[:2], pool, batch, 0, "up_proj")
    assert not y1.any()


@pytest.mark.parametrize("method", ["segmented", "masked", None])
def test_adapters_that_skip_a_module_leave_their_rows_untouched_in_every_form(method):
    """A batch mixing adapters that target a module with ones that do not: the masked
    form's columns hold only the targeting adapters, and its mask (cached per batch and
    per pattern) differs between modules; rows of the others and rows without adapter
    keep the base output."""
    pool = _pool(torch.float32)
    full = make_adapter("full", 16, modules=MODULES, seed=1)
    attn = make_adapter("attn", 8, modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=2)
    adapters = {"full": full, "attn": attn}
    for ad in adapters.values():
        pool.load(ad)
    rows = ["attn", "full", None, "attn", "full", "full"]
    g = torch.Generator().manual_seed(4)
    with pool.batch(rows) as batch:
        for module in ("q_proj", "up_proj", "o_proj", "down_proj"):
            fan_in, fan_out = SPEC.modules[module]
            x = torch.randn(len(rows), fan_in, generator=g)
            w0 = torch.randn(fan_out, fan_in, generator=g) / fan_in ** 0.5
            y = x @ w0.t()
            apply_lora(y, x, pool, batch, 1, module, method=method)
            targeting = [n if n is not None and (1, module) in adapters[n].weights else None for n in rows]
            torch.testing.assert_close(y.double(), dense_reference(x, w0, targeting, adapters, 1, module),
                                       atol=1e-4, rtol=1e-4)


def test_an_unknown_method_is_refused():
    pool = _pool(torch.float32)
    pool.load(make_adapter("a", 8))
    with pool.batch(["a"]) as batch, pytest.raises(ValueError, match="method"):
        apply_lora(torch.zeros(1, 32), torch.zeros(1, 32), pool, batch, 0, "q_proj", method="fused")
