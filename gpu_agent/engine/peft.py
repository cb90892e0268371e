"""PEFT LoRA adapters: read, validate against the served base model, hold on the host.

An adapter directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
(docs/contracts.md, "Fixtures"; ``gpu_agent.fixtures`` writes them). :func:`load_peft_dir` maps the safetensors file (or copies
it once into pinned memory for CUDA hosts), hashes those same bytes when a digest is
given, and returns tensors that are zero-copy views of them: the copy into the pool
is the only memcpy of a cold load.

Torch is imported lazily so that importing this module (e.g. for :class:`BaseModelSpec`)
stays cheap and torch-free.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import re
import struct
import threading
import zlib
from collections import OrderedDict
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, NamedTuple

from gpu_agent.errors import (
    AdapterInvalid,
    AdapterNotFound,
    BaseModelMismatch,
    DigestMismatch,
    UnsupportedFeature,
)

__all__ = [
    "BaseModelSpec",
    "LoraAdapter",
    "FilePayload",
    "Matrix",
    "load_peft_dir",
    "adapter_dir",
    "check_adapter_name",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
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


class Matrix(NamedTuple):
    """Where one LoRA matrix lies in a :class:`FilePayload` buffer (byte offsets)."""

    key: tuple[int, str]
    half: str                  # "A" [r, in] or "B" [out, r]
    shape: tuple[int, int]
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


@dataclass(frozen=True)
class FilePayload:
    """The adapter's bytes as read: one uint8 host tensor (the mapped file, or a pinned
    copy) and every matrix's place in it, in file order. Lets the pool copy a whole
    adapter with one memcpy when its layout matches the file's."""

    buffer: Any
    dtype: Any                                 # torch dtype shared by all matrices
    matrices: tuple[Matrix, ...]
    back_to_back: bool                         # matrices fill [matrices[0].start, matrices[-1].end)
    nbytes: int = 0                            # sum of the matrices' bytes
    plans: dict = field(default_factory=dict, compare=False)  # pool layouts, shared per structure
    file: Any = field(default=None, compare=False)  # the open weights file (pread), or None


class _PayloadWeights(Mapping):
    """``weights`` of a loaded adapter: tensor views into the payload, made on first use
    (a cold load into the pool needs none of them)."""

    def __init__(self, payload: FilePayload) -> None:
        self._payload = payload
        self._idx: dict[tuple[int, str], dict[str, Matrix]] | None = None
        self._cache: dict[tuple[int, str], tuple[Any, Any]] = {}

    @property
    def _index(self) -> dict[tuple[int, str], dict[str, Matrix]]:
        if self._idx is None:
            idx: dict[tuple[int, str], dict[str, Matrix]] = {}
            for m in self._payload.matrices:
                idx.setdefault(m.key, {})[m.half] = m
            self._idx = idx
        return self._idx

    def __getitem__(self, key: tuple[int, str]) -> tuple[Any, Any]:
        ab = self._cache.get(key)
        if ab is None:
            halves = self._index[key]
            ab = (self._view(halves["A"]), self._view(halves["B"]))
            self._cache[key] = ab
        return ab

    def _view(self, m: Matrix) -> Any:
        raw = self._payload.buffer[m.start:m.end]
        if m.start % self._payload.dtype.itemsize:
            raw = raw.clone()  # unaligned (not written by safetensors >= 0.3): one small copy
        return raw.view(self._payload.dtype).view(m.shape)

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)


@dataclass
class LoraAdapter:
    """One LoRA adapter in host memory.

    ``weights[(layer, module)] = (A, B)`` with ``A: [r, in]`` and ``B: [out, r]``, so
    the forward is ``y += scale * (x @ A.T) @ B.T``. Adapters read from disk also carry
    their ``payload`` (the raw bytes and where each matrix lies).
    """

    name: str
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str
    weights: Mapping[tuple[int, str], tuple[Any, Any]]
    use_rslora: bool = False
    sha256: str | None = None
    source: str | None = None
    payload: FilePayload | None = field(default=None, repr=False)
    validated_for: BaseModelSpec | None = field(default=None, repr=False)  # shapes checked against

    @property
    def scale(self) -> float:
        """alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    @property
    def nbytes(self) -> int:
        if self.payload is not None:
            return self.payload.nbytes
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())

    def matrix_shapes(self) -> Iterator[tuple[tuple[int, str], str, tuple[int, int]]]:
        """(key, "A"|"B", shape) of every matrix, without materialising tensors."""
        if self.payload is not None:
            for m in self.payload.matrices:
                yield m.key, m.half, m.shape
            return
        for key, (a, b) in self.weights.items():
            yield key, "A", tuple(a.shape)
            yield key, "B", tuple(b.shape)


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


def _read_small(path: str) -> bytes:
    """The whole of a small file with three syscalls (open, read, close): cheaper than
    ``open()``'s buffered file object, which matters in a VM where syscalls are costly."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        chunks = []
        while True:
            b = os.read(fd, 1 << 16)
            if not b:
                break
            chunks.append(b)
            if len(b) < 1 << 16:
                break          # a regular file: a short read is its end
        return b"".join(chunks) if len(chunks) != 1 else chunks[0]
    finally:
        os.close(fd)


def _read_config(path: str) -> dict[str, Any]:
    cfg_path = os.path.join(path, CONFIG_FILE)
    try:
        cfg = json.loads(_read_small(cfg_path))
    except FileNotFoundError as exc:
        raise AdapterNotFound(f"{path}: no {CONFIG_FILE}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{cfg_path}: not JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterInvalid(f"{cfg_path}: not a JSON object")
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


class _OpenFile:
    """An open file descriptor owned by a payload (the pool preads from it); closed by
    ``close()`` or when the payload is dropped."""

    __slots__ = ("_fd",)

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @property
    def closed(self) -> bool:
        return self._fd < 0

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError("file is closed")
        return self._fd

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except OSError:
            pass


_HEAD_READ = 1 << 16   # first read of a safetensors file: length + (usually) the whole header


def _read_safetensors(path: str, sha256: str | None, pin_memory: bool,
                      timings: dict[str, float] | None = None):
    """Map the file as one uint8 host tensor; return (buffer, header bytes, data_offset).

    The file is mapped copy-on-write (private): tensors are views of the page cache,
    so disk -> host costs no copy and host -> pool is the only memcpy. With
    ``pin_memory`` (CUDA hosts) the bytes are copied once into pinned memory instead.
    The header is read with one ``pread`` (not through the mapping: no page faults
    for it). Adapter files are immutable once written (the agent writes new versions
    to a new file and renames), so the mapping never sees a truncated file.
    """
    import torch

    t0 = time.perf_counter()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise AdapterNotFound(f"{os.path.dirname(path)}: no {WEIGHTS_FILE}") from exc
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise AdapterInvalid(f"{path}: not a safetensors file")
        head = os.pread(fd, _HEAD_READ, 0)
        (hlen,) = struct.unpack_from("<Q", head)
        if hlen > size - 8:
            raise AdapterInvalid(f"{path}: safetensors header length {hlen} exceeds file")
        if 8 + hlen <= len(head):
            header = head[8:8 + hlen]
        else:
            header = head[8:] + os.pread(fd, 8 + hlen - len(head), len(head))
            if len(header) != hlen:
                raise AdapterInvalid(f"{path}: short read of the safetensors header")
        mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
        # CPU: keep the file open so the pool can pread the data straight into its pages
        # (a fresh mapping's page-table fill costs ~0.6 ms per 16 MB in this VM); the
        # mapping stays for lazy tensor views. Closed when the payload is dropped.
        raw = None if pin_memory else _OpenFile(fd)
    except BaseException:
        os.close(fd)
        raise
    if raw is None:
        os.close(fd)
    buf = torch.frombuffer(mapped, dtype=torch.uint8)
    if pin_memory:
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True).copy_(buf)
    t1 = time.perf_counter()
    if sha256 is not None:
        # Hash the bytes the pool will copy (the mapping / the pinned copy), header included.
        src = memoryview(buf.numpy()) if pin_memory else memoryview(mapped)
        digest = hashlib.sha256(src).hexdigest()
        if digest != sha256.lower() or src[8:8 + hlen] != header:   # parsed header == hashed one
            if raw is not None:
                raw.close()
            if digest != sha256.lower():
                raise DigestMismatch(f"{path}: sha256 {digest} != expected {sha256}")
            raise DigestMismatch(f"{path}: file changed while being read")
    if timings is not None:
        timings["read_ms"] = (t1 - t0) * 1e3
        timings["verify_ms"] = (time.perf_counter() - t1) * 1e3
    return buf, header, 8 + hlen, raw


_HALVES = {"lora_A": "A", "lora_B": "B"}
_TORCH_DTYPES: dict[str, Any] = {}


def _parse_key(key: str) -> tuple[int, str, str] | None:
    """(layer, module, "A"|"B") of ``...layers.{i}.<path>.{module}.lora_{A|B}[.<name>].weight``."""
    parts = key.split(".")
    if len(parts) < 5 or parts[-1] != "weight":
        return None
    i = -2 if parts[-2] in _HALVES else -3    # old PEFT: lora_A.<adapter name>.weight
    half = _HALVES.get(parts[i])
    try:
        li = parts.index("layers")
        layer = int(parts[li + 1])
    except (ValueError, IndexError):
        return None
    if half is None or li + 2 > len(parts) + i - 1 or layer < 0:
        return None
    return layer, parts[i - 1], half


def _torch_dtype(name: Any, key: str, where: str) -> Any:
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        import torch

        if name not in _ST_DTYPES:
            raise AdapterInvalid(f"{where}: tensor {key}: unsupported dtype {name!r}")
        dtype = _TORCH_DTYPES[name] = getattr(torch, _ST_DTYPES[name])
    return dtype


class _Structure(NamedTuple):
    dtype: Any
    matrices: tuple[Matrix, ...]
    back_to_back: bool
    nbytes: int
    plans: dict = {}     # replaced per instance: pool layouts computed for this structure


# Validated structures by header bytes: adapters of one rank and target set for one
# base model share byte-identical safetensors headers, so the second such adapter
# skips JSON parsing and per-tensor validation. Bounded; guarded by a lock.
_STRUCTURES: "OrderedDict[tuple, tuple[bytes, _Structure]]" = OrderedDict()
_STRUCTURES_MAX = 256
_STRUCTURES_LOCK = threading.Lock()


def clear_structure_cache() -> None:
    """Forget validated header structures (benchmarks measure a first load with it)."""
    with _STRUCTURES_LOCK:
        _STRUCTURES.clear()


_SPEC_KEYS: dict[int, tuple[BaseModelSpec, tuple]] = {}


def _spec_key(spec: BaseModelSpec) -> tuple:
    """The parts of ``spec`` a validated structure depends on (computed once per spec)."""
    hit = _SPEC_KEYS.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    key = (spec.name, spec.num_layers, spec.hidden_size, tuple(sorted(spec.modules.items())))
    if len(_SPEC_KEYS) > 64:
        _SPEC_KEYS.clear()
    _SPEC_KEYS[id(spec)] = (spec, key)      # holds spec: its id is not reused meanwhile
    return key


def _payload(buf: Any, header_bytes: bytes, base: int, spec: BaseModelSpec, rank: int,
             targets: tuple[str, ...], where: str, raw: Any = None) -> FilePayload:
    size = buf.numel()
    # Keyed by a CRC of the header (cheaper than hashing the bytes object); a hit is
    # confirmed by comparing the full header bytes.
    key = (zlib.crc32(header_bytes), len(header_bytes), size, rank, targets, _spec_key(spec))
    with _STRUCTURES_LOCK:
        hit = _STRUCTURES.get(key)
        if hit is not None and hit[0] == header_bytes:
            _STRUCTURES.move_to_end(key)
            st = hit[1]
        else:
            st = None
    if st is None:
        st = _structure(header_bytes, base, size, spec, rank, targets, where)
        st = st._replace(plans={})
        with _STRUCTURES_LOCK:
            _STRUCTURES[key] = (header_bytes, st)
            while len(_STRUCTURES) > _STRUCTURES_MAX:
                _STRUCTURES.popitem(last=False)
    return FilePayload(buf, st.dtype, st.matrices, st.back_to_back, st.nbytes, st.plans, raw)


def _structure(header_bytes: bytes, base: int, size: int, spec: BaseModelSpec, rank: int,
               targets: tuple[str, ...], where: str) -> _Structure:
    """Validate the header against the model: every tensor a LoRA A/B of a known layer
    and target module with the right shape, both halves present, one dtype."""
    try:
        header = json.loads(header_bytes)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterInvalid(f"{where}: bad safetensors header: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterInvalid(f"{where}: bad safetensors header")
    matrices: list[Matrix] = []
    halves: dict[tuple[int, str], dict[str, Matrix]] = {}
    modules = spec.modules
    num_layers = spec.num_layers
    dtype_name = None
    dtype = None
    for key, info in header.items():
        if key == "__metadata__":
            continue
        parsed = _parse_key(key)
        if parsed is None:
            raise UnsupportedFeature(f"{where}: tensor {key!r} is not a LoRA A/B weight")
        layer, module, half = parsed
        if module not in targets:
            raise AdapterInvalid(f"{where}: tensor {key!r}: module {module!r} not in target_modules")
        if layer >= num_layers:
            raise AdapterInvalid(f"{where}: tensor {key!r}: layer {layer} >= {num_layers}")
        try:
            name_ = info["dtype"]
            shape = info["shape"]
            start, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise AdapterInvalid(f"{where}: tensor {key}: malformed header entry") from exc
        if name_ != dtype_name:
            if dtype_name is not None:
                raise UnsupportedFeature(f"{where}: mixed tensor dtypes {dtype_name} and {name_}")
            dtype_name, dtype = name_, _torch_dtype(name_, key, where)
        fan_in, fan_out = modules[module]
        want = [rank, fan_in] if half == "A" else [fan_out, rank]
        if shape != want:
            raise AdapterInvalid(
                f"{where}: layer {layer} {module}: lora_{half} shapes {shape}, expected {want} "
                f"(A is [r, in], B is [out, r], r={rank})")
        if (type(start) is not int or type(end) is not int or start < 0
                or end - start != want[0] * want[1] * dtype.itemsize or base + end > size):
            raise AdapterInvalid(f"{where}: tensor {key}: offsets do not match its shape")
        k = (layer, module)
        seen = halves.setdefault(k, {})
        if half in seen:
            raise AdapterInvalid(f"{where}: layer {layer} {module}: lora_{half} given twice")
        mat = Matrix(k, half, (want[0], want[1]), base + start, base + end)
        seen[half] = mat
        matrices.append(mat)
    if not matrices:
        raise AdapterInvalid(f"{where}: no LoRA weights")
    for (layer, module), ab in halves.items():
        if len(ab) != 2:
            raise AdapterInvalid(f"{where}: layer {layer} {module}: lora_A and lora_B must both be present")
    matrices.sort(key=lambda mt: mt.start)
    back_to_back = all(a.end == b.start for a, b in zip(matrices, matrices[1:]))
    return _Structure(dtype, tuple(matrices), back_to_back, sum(mt.end - mt.start for mt in matrices))


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
    where = os.path.normpath(os.fspath(path))
    adapter_name = check_adapter_name(name if name is not None else os.path.basename(where))
    cfg = _read_config(where)
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

    buf, header_bytes, base, raw = _read_safetensors(os.path.join(where, WEIGHTS_FILE), sha256, pin_memory,
                                                     timings)
    try:
        payload = _payload(buf, header_bytes, base, spec, rank, targets, where, raw)
    except BaseException:
        if raw is not None:
            raw.close()
        raise
    return LoraAdapter(
        name=adapter_name, rank=rank, alpha=float(alpha), target_modules=targets,
        base_model=spec.name, weights=_PayloadWeights(payload),
        use_rslora=bool(cfg.get("use_rslora", False)), sha256=sha256, source=where, payload=payload,
        validated_for=spec)
