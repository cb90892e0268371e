"""Batched mixed-rank LoRA: one call for a batch whose rows use different adapters.

The torch formulation is SGMV-style: :class:`~gpu_agent.engine.pool.LoraBatch` groups the rows
by adapter once per batch; per adapter segment we run two small matmuls straight on the
pool pages (``A`` and ``B^T`` are views of consecutive pages), so every adapter weight is
read exactly once, no weight is copied or padded to the max rank, and rows without an
adapter cost nothing. On CPU this op is bound by the memory bandwidth of reading the
weights; see ``docs/pool.md`` for the alternatives measured (pad-to-max-rank ``bmm``,
per-row gather, per-adapter loop over ungrouped rows).

On CUDA two small GEMMs per segment are launch-bound (an H200 took 1.1-1.4 ms for 64 rows
over 32 adapters, 15x the base model's dense matmul: docs/pool.md), so a small batch
takes the *masked* form instead: the adapters' ``A`` matrices are concatenated into one
``[sum r, in]`` (and ``B^T`` into ``[sum r, out]``), every row is multiplied by all of
them, a ``[rows, sum r]`` mask keeps each row's own adapter's columns (times its scale),
and one GEMM expands: five launches whatever the number of adapters, at ``segments``
times the FLOPs, which a GPU has to spare while ``rows x sum r`` stays small
(``MASKED_MAX``). No Triton kernel yet (docs/pool.md).
"""

from __future__ import annotations

from typing import Any

from gpu_agent.engine.pool import AdapterPool, LoraBatch

__all__ = ["apply_lora", "lora_delta_reference", "MASKED_MAX"]

#: the masked form (CUDA) while ``rows x sum of ranks`` is at most this: its extra FLOPs
#: (``rows x sum r x (in + out)``, 2 GFLOP at hidden 4096) stay well under the launches
#: it saves, 2 per adapter segment at ~10-20 us each
MASKED_MAX = 1 << 18


def apply_lora(y: Any, x: Any, pool: AdapterPool, batch: LoraBatch, layer: int, module: str,
               *, method: str | None = None) -> Any:
    """In place: ``y[i] += scale[a] * (x[i] @ A[a]^T) @ B[a]^T`` with ``a = adapter(i)``.

    ``x [n, in]``, ``y [n, out]`` (rows are tokens); rows without adapter untouched.
    Mixed ranks in one call; A/B are read from the pool pages. Rows whose adapter
    does not target ``(layer, module)`` are untouched too. Returns ``y``.
    ``method``: ``"segmented"`` (two GEMMs per adapter segment), ``"masked"`` (see the
    module's docstring), or None: masked on CUDA while ``rows x sum r <= MASKED_MAX``,
    else segmented.
    """
    import torch

    segments = batch.segments
    if not segments:
        return y
    matrices = pool.matrices
    linear = torch.nn.functional.linear       # x @ A^T with A [r, in] as the weight
    if method not in (None, "segmented", "masked"):
        raise ValueError(f"method must be 'segmented', 'masked' or None, got {method!r}")
    if method == "masked" or (method is None and x.is_cuda):
        mats = [matrices(seg.entry, layer, module) for seg in segments]
        total = sum(m[0].shape[0] for m in mats if m is not None)
        if method == "masked" or batch.num_rows * total <= MASKED_MAX:
            return _apply_masked(y, x, batch, mats, linear)
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


def _apply_masked(y: Any, x: Any, batch: LoraBatch, mats: list, linear: Any) -> Any:
    """``y += ((x @ A_cat^T) * mask) @ B^T_cat`` over the segments whose adapter targets
    this module (``mats[i]`` None: it does not); the mask is built once per batch and
    per pattern of targeting segments."""
    import torch

    present = [(seg, m) for seg, m in zip(batch.segments, mats) if m is not None]
    if not present:
        return y

    def make_mask() -> Any:
        col_slot: list[int] = []
        col_scale: list[float] = []
        for seg, (a, _) in present:
            col_slot += [seg.entry.slot] * a.shape[0]
            col_scale += [seg.entry.scale] * a.shape[0]
        slots = torch.tensor(col_slot, dtype=torch.int64).to(x.device, non_blocking=True)
        scales = torch.tensor(col_scale, dtype=x.dtype).to(x.device, non_blocking=True)
        return (batch.row_slots[:batch.num_rows, None] == slots[None, :]).to(x.dtype) * scales

    mask = batch.memo(("mask", x.dtype, tuple(m is not None for m in mats)), make_mask)
    a_cat = _cat([a for _, (a, _) in present])      # [sum r, in]
    bt_cat = _cat([bt for _, (_, bt) in present])   # [sum r, out]
    t = linear(x, a_cat)
    t.mul_(mask)
    y.addmm_(t, bt_cat)
    return y


def _cat(parts: list) -> Any:
    """One tensor of ``parts`` along rows (the part itself when alone: no copy)."""
    import torch

    return parts[0] if len(parts) == 1 else torch.cat(parts)


def lora_delta_reference(x: Any, a: Any, b: Any, scale: float) -> Any:
    """``scale * (x @ A^T) @ B^T``: the dense formula the batched op must match."""
    return scale * (x @ a.t()) @ b.t()
