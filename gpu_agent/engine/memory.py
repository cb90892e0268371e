"""Memory accounting: one base model + one adapter pool vs N dedicated instances.

A dedicated deployment runs one copy of the base model per adapter (weights merged or
not); the shared deployment keeps one base model and a paged pool holding the adapters.
Sizes come from real tensors: the checkpoint's safetensors header (or a loaded model's
``nbytes``) and each adapter's ``adapter_model.safetensors``.
"""
from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

__all__ = ["MemoryAccount", "account", "safetensors_bytes", "model_dir_bytes"]

_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
             "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class MemoryAccount:
    base_model_bytes: int
    pool_bytes: int
    adapters: int
    adapter_bytes_total: int
    shared_bytes: int              # base + pool (what this engine holds)
    dedicated_instances: int
    dedicated_bytes: int           # N x base + each one's adapter
    saving_ratio: float            # dedicated / shared
    pool_fits_all: bool            # every adapter resident at once

    def as_dict(self) -> dict:
        return asdict(self)


def safetensors_bytes(path: str | Path) -> int:
    """Tensor bytes in a safetensors file, read from its header only (no torch)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    total = 0
    for key, info in header.items():
        if key == "__metadata__":
            continue
        count = 1
        for d in info["shape"]:
            count *= int(d)
        total += count * _ITEMSIZE[info["dtype"]]
    return total


def model_dir_bytes(model_dir: str | Path) -> int:
    return sum(safetensors_bytes(p) for p in sorted(Path(model_dir).glob("*.safetensors")))


def account(base_model_bytes: int, pool_bytes: int, adapter_bytes: Mapping[str, int],
            n_instances: int | None = None) -> MemoryAccount:
    """Compare base + pool with ``n_instances`` dedicated instances (default: one per adapter).

    With fewer instances than adapters, the dedicated side counts the largest adapters
    (the worst case a dedicated fleet must provision for).
    """
    sizes = sorted(adapter_bytes.values(), reverse=True)
    n = len(sizes) if n_instances is None else n_instances
    dedicated = n * base_model_bytes + sum(sizes[:n])
    shared = base_model_bytes + pool_bytes
    return MemoryAccount(
        base_model_bytes=base_model_bytes, pool_bytes=pool_bytes, adapters=len(sizes),
        adapter_bytes_total=sum(sizes), shared_bytes=shared, dedicated_instances=n,
        dedicated_bytes=dedicated, saving_ratio=dedicated / shared if shared else 0.0,
        pool_fits_all=sum(sizes) <= pool_bytes)
