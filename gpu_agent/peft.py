"""PEFT LoRA adapters: read, validate against the served base model, hold on the host.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(see ``shared/ENGINES.md``). :func:`load_peft_dir` reads the safetensors file with ONE
``readinto`` into a single host buffer (pinned when asked, for fast H2D copies), hashes
that same buffer when a digest is given, and returns tensors that are zero-copy views
of it: disk -> host is one copy, host -> pool one more.

Torch is imported lazily so that importing this module (e.g. for :class:`BaseModelSpec`)
stays cheap and torch-free.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import (
    AdapterInvalid,
    AdapterNotFound,
    BaseModelMismatch,
    DigestMismatch,
    UnsupportedFeature,
)

__all__ = [
    "BaseModelSpec",
    "LoraAdapter",
    "load_peft_dir",
    "adapter_dir",
    "check_adapter_name",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (optionally
# lora_A.<adapter>.weight in files saved by old PEFT versions).
_KEY_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?([A-Za-z0-9_]+)\.lora_([AB])(?:\.[A-Za-z0-9_]+)?\.weight$")
_ST_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


@dataclass(frozen=True)
class BaseModelSpec:
    """The served base model as the adapter pool sees it.

    ``modules`` maps a LoRA-targetable linear module name (``q_proj``) to its
    ``(in_features, out_features)``; every layer has the same modules.
    """

    name: str
    num_layers: int
    hidden_size: int
    modules: dict[str, tuple[int, int]]

    def shape_of(self, module: str) -> tuple[int, int]:
        return self.modules[module]


@dataclass
class LoraAdapter:
    """One LoRA adapter in host memory.

    ``weights[(layer, module)] = (A, B)`` with ``A: [r, in]`` and ``B: [out, r]``, so
    the forward is ``y += scale * (x @ A.T) @ B.T``.
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str
    weights: dict[tuple[int, str], tuple[Any, Any]]
    use_rslora: bool = False
    sha256: str | None = None
    source: str | None = None
    _buffer: Any = field(default=None, repr=False)  # keeps the host buffer alive

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


def check_adapter_name(name: str) -> str:
    """Return ``name`` if it is a safe single path component, else raise AdapterNotFound."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        raise AdapterNotFound(f"invalid adapter name {name!r}")
    return name


def adapter_dir(root: str | os.PathLike[str], name: str) -> Path:
    """The directory of adapter ``name`` under ``root``; the name is checked first so a
    request can never make us read outside ``root``."""
    check_adapter_name(name)
    root_p = Path(root).resolve()
    path = (root_p / name).resolve()
    if path.parent != root_p:
        raise AdapterNotFound(f"adapter {name!r} resolves outside {root_p}")
    return path


def _read_config(path: Path) -> dict[str, Any]:
    try:
        with open(path / CONFIG_FILE, "rb") as f:
            cfg = json.load(f)
    except FileNotFoundError as exc:
        raise AdapterNotFound(f"{path}: no {CONFIG_FILE}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{path}/{CONFIG_FILE}: not JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterInvalid(f"{path}/{CONFIG_FILE}: not a JSON object")
    return cfg


def _check_features(cfg: dict[str, Any], where: str) -> None:
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedFeature(f"{where}: peft_type {peft_type} (only LORA)")
    if cfg.get("use_dora"):
        raise UnsupportedFeature(f"{where}: DoRA (use_dora) is not supported")
    if cfg.get("modules_to_save"):
        raise UnsupportedFeature(f"{where}: modules_to_save is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise UnsupportedFeature(f"{where}: rank_pattern/alpha_pattern is not supported")
    if cfg.get("fan_in_fan_out"):
        raise UnsupportedFeature(f"{where}: fan_in_fan_out (Conv1D layout) is not supported")
    if cfg.get("bias", "none") not in (None, "none"):
        raise UnsupportedFeature(f"{where}: LoRA bias {cfg.get('bias')!r} is not supported")
    if cfg.get("layers_to_transform") is not None:
        raise UnsupportedFeature(f"{where}: layers_to_transform is not supported")


def _target_modules(cfg: dict[str, Any], spec: BaseModelSpec, where: str) -> tuple[str, ...]:
    tm = cfg.get("target_modules")
    if tm is None:
        raise AdapterInvalid(f"{where}: target_modules missing")
    if isinstance(tm, str):
        if tm == "all-linear":
            return tuple(spec.modules)
        try:
            pat = re.compile(tm)
        except re.error as exc:
            raise AdapterInvalid(f"{where}: target_modules regex {tm!r}: {exc}") from exc
        # PEFT matches the regex against full module names; ours are the short names.
        found = tuple(m for m in spec.modules if pat.fullmatch(m) or pat.search(f".{m}"))
        if not found:
            raise AdapterInvalid(f"{where}: target_modules {tm!r} matches no module of {spec.name}")
        return found
    if not isinstance(tm, list) or not all(isinstance(m, str) for m in tm):
        raise AdapterInvalid(f"{where}: target_modules must be a list of names")
    unknown = sorted(set(tm) - set(spec.modules))
    if unknown:
        raise AdapterInvalid(
            f"{where}: target modules {unknown} not in base model {spec.name} "
            f"(has {sorted(spec.modules)})")
    return tuple(tm)


def _same_base(declared: Any, spec: BaseModelSpec) -> bool:
    if not isinstance(declared, str) or not declared:
        return False
    return declared == spec.name or declared.rstrip("/").rsplit("/", 1)[-1] == spec.name


def _read_safetensors(path: Path, sha256: str | None, pin_memory: bool,
                      timings: dict[str, float] | None = None):
    """Read the file into one uint8 host tensor; return (buffer, header, data_offset)."""
    import torch

    t0 = time.perf_counter()
    try:
        size = os.path.getsize(path)
        f = open(path, "rb", buffering=0)
    except FileNotFoundError as exc:
        raise AdapterNotFound(f"{path.parent}: no {WEIGHTS_FILE}") from exc
    with f:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=pin_memory)
        view = memoryview(buf.numpy())
        got = 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    if got != size:
        raise AdapterInvalid(f"{path}: short read ({got} of {size} bytes)")
    t1 = time.perf_counter()
    if sha256 is not None:
        digest = hashlib.sha256(view).hexdigest()
        if digest != sha256.lower():
            raise DigestMismatch(f"{path}: sha256 {digest} != expected {sha256}")
    if timings is not None:
        timings["read_ms"] = (t1 - t0) * 1e3
        timings["verify_ms"] = (time.perf_counter() - t1) * 1e3
    if size < 8:
        raise AdapterInvalid(f"{path}: not a safetensors file")
    (hlen,) = struct.unpack("<Q", bytes(view[:8]))
    if hlen > size - 8:
        raise AdapterInvalid(f"{path}: safetensors header length {hlen} exceeds file")
    try:
        header = json.loads(bytes(view[8:8 + hlen]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{path}: bad safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterInvalid(f"{path}: bad safetensors header")
    return buf, header, 8 + hlen


def _tensor_view(buf, info: Any, base: int, key: str, where: str):
    import torch

    try:
        dtype = getattr(torch, _ST_DTYPES[info["dtype"]])
        shape = [int(s) for s in info["shape"]]
        start, end = (int(o) for o in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterInvalid(f"{where}: tensor {key}: unsupported or malformed entry") from exc
    nbytes = math.prod(shape) * dtype.itemsize
    if start < 0 or end - start != nbytes or base + end > buf.numel():
        raise AdapterInvalid(f"{where}: tensor {key}: offsets do not match its shape")
    raw = buf[base + start: base + end]
    if (base + start) % dtype.itemsize:
        raw = raw.clone()  # unaligned (not written by safetensors >= 0.3): one small copy
    return raw.view(dtype).view(shape)


def load_peft_dir(path: str | os.PathLike[str], spec: BaseModelSpec, sha256: str | None = None,
                  *, name: str | None = None, pin_memory: bool = False,
                  timings: dict[str, float] | None = None) -> LoraAdapter:
    """Load and validate a PEFT LoRA directory for ``spec``.

    Checks: peft_type LORA without DoRA / modules_to_save / rank_pattern / bias /
    fan_in_fan_out; base model name; target modules are modules of ``spec``; every
    tensor belongs to a known layer and target module; shapes ``A [r, in]`` and
    ``B [out, r]`` with the config's ``r``; both halves present. ``sha256`` (hex of
    adapter_model.safetensors) is verified when given -- pass it when the file enters
    from outside, not on every load from the local cache. ``timings``, when given,
    receives ``read_ms`` (disk -> host) and ``verify_ms`` (SHA-256).
    """
    p = Path(path)
    where = str(p)
    adapter_name = check_adapter_name(name if name is not None else p.name)
    cfg = _read_config(p)
    _check_features(cfg, where)
    if not _same_base(cfg.get("base_model_name_or_path"), spec):
        raise BaseModelMismatch(
            f"{where}: trained for base model {cfg.get('base_model_name_or_path')!r}, "
            f"this agent serves {spec.name!r}")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
        raise AdapterInvalid(f"{where}: rank r must be a positive integer, got {rank!r}")
    alpha = cfg.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise AdapterInvalid(f"{where}: lora_alpha must be a number, got {alpha!r}")
    targets = _target_modules(cfg, spec, where)

    buf, header, base = _read_safetensors(p / WEIGHTS_FILE, sha256, pin_memory, timings)
    halves: dict[tuple[int, str], dict[str, Any]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        m = _KEY_RE.search(key)
        if m is None:
            raise UnsupportedFeature(f"{where}: tensor {key!r} is not a LoRA A/B weight")
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise AdapterInvalid(f"{where}: tensor {key!r}: module {module!r} not in target_modules")
        if layer >= spec.num_layers:
            raise AdapterInvalid(f"{where}: tensor {key!r}: layer {layer} >= {spec.num_layers}")
        t = _tensor_view(buf, info, base, key, where)
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise AdapterInvalid(f"{where}: no LoRA weights")
    weights: dict[tuple[int, str], tuple[Any, Any]] = {}
    for (layer, module), ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterInvalid(f"{where}: layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = spec.modules[module]
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterInvalid(
                f"{where}: layer {layer} {module}: shapes A{tuple(a.shape)} B{tuple(b.shape)}, "
                f"expected A({rank}, {fan_in}) B({fan_out}, {rank})")
        weights[(layer, module)] = (a, b)
    return LoraAdapter(
        name=adapter_name, rank=rank, alpha=float(alpha), target_modules=targets,
        base_model=spec.name, weights=weights, use_rslora=bool(cfg.get("use_rslora", False)),
        sha256=sha256, source=where, _buffer=buf)
