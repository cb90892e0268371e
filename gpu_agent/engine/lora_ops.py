"""Batched mixed-rank LoRA: one call for a batch whose rows use different adapters.

The torch formulation is SGMV-style: :class:`~gpu_agent.engine.pool.LoraBatch` groups the rows
by adapter once per batch; per adapter segment we run two small matmuls straight on the
pool pages (``A`` and ``B^T`` are views of consecutive pages), so every adapter weight is
read exactly once, no weight is copied or padded to the max rank, and rows without an
adapter cost nothing. On CPU this op is bound by the memory bandwidth of reading the
weights; see ``docs/pool.md`` for the alternatives measured (pad-to-max-rank ``bmm``,
per-row gather, per-adapter loop over ungrouped rows). The same code runs on CUDA
(no Triton kernel yet: see docs/pool.md).
"""

from __future__ import annotations

from typing import Any

from gpu_agent.engine.pool import AdapterPool, LoraBatch

__all__ = ["apply_lora", "lora_delta_reference"]


def apply_lora(y: Any, x: Any, pool: AdapterPool, batch: LoraBatch, layer: int, module: str) -> Any:
    """In place: ``y[i] += scale[a] * (x[i] @ A[a]^T) @ B[a]^T`` with ``a = adapter(i)``.

    ``x [n, in]``, ``y [n, out]`` (rows are tokens); rows without adapter untouched.
    Mixed ranks in one call; A/B are read from the pool pages. Rows whose adapter
    does not target ``(layer, module)`` are untouched too. Returns ``y``.
    """
    import torch

    segments = batch.segments
    if not segments:
        return y
    matrices = pool.matrices
    linear = torch.nn.functional.linear       # x @ A^T with A [r, in] as the weight
    if batch.perm is None:
        # Every adapter's rows are consecutive in x: slice, no gather / scatter.
        for seg in segments:
            mats = matrices(seg.entry, layer, module)
            if mats is None:
                continue           # adapter does not target this module: rows untouched
            a, bt = mats
            t = linear(x[seg.start:seg.end], a)
            y[seg.start:seg.end].addmm_(t, bt, alpha=seg.entry.scale)
        return y
    perm = batch.perm
    sizes = batch.sizes
    xs = torch.index_select(x, 0, perm, out=batch.scratch(x.shape[1], x.dtype, x.device, 0))
    out = batch.scratch(y.shape[1], y.dtype, y.device, 1)
    for seg, xp, o in zip(segments, xs.split(sizes), out.split(sizes)):
        mats = matrices(seg.entry, layer, module)
        if mats is None:
            o.zero_()              # adapter does not target this module: adds nothing
            continue
        a, bt = mats
        # the scale rides on the expand GEMM (alpha); beta=0 ignores o's old contents
        torch.addmm(o, linear(xp, a), bt, beta=0, alpha=seg.entry.scale, out=o)
    y.index_add_(0, perm, out)
    return y


def lora_delta_reference(x: Any, a: Any, b: Any, scale: float) -> Any:
    """``scale * (x @ A^T) @ B^T``: the dense formula the batched op must match."""
    return scale * (x @ a.t()) @ b.t()
