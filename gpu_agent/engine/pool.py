"""Unified paged adapter pool (the S-LoRA idea).

ONE preallocated tensor ``pages [num_pages, W]`` holds every resident adapter, where the
row width ``W`` is the model's hidden size. Every LoRA matrix is stored exactly as PEFT
wrote it (row-major, ``A [r, in]`` and ``B [out, r]``) in its own run of
``ceil(numel / W)`` pages, so for a module with in = out = W a rank-r adapter takes r
pages for A and r pages for B (S-LoRA's "r rows of H per matrix"); k/v projections
under GQA (out < W) take fewer, MLP modules (in or out > W) more. A matrix is
``pages[p : p + n].view(-1)[:numel].view(shape)``: a view, no copy. Loading is a plain
memcpy per matrix (no transpose: a transposed copy of B measured ~20x slower than a
flat one), and the batched op reads ``B^T`` as a transposed view.

Every page has the same size, so ranks 8..128 share one pool and one allocator and
any request that fits in the free pages succeeds (no external fragmentation). The
allocator prefers one contiguous run per adapter (best fit over free runs) so every
matrix is a view; when free pages are scattered it takes any free pages, and a matrix
whose pages are not consecutive is gathered (``index_select``) when a batch uses it
(``stats()['scattered_adapters']`` says how often).

A load takes the pool's lock twice, briefly: to reserve its pages (evicting what the
owner chooses) and to publish its entry; the copy runs between, with the lock released
(``gpu_agent.engine.pool_copy``). So a forward step's ``batch()`` never waits behind a load in
flight, reserved pages belong to no entry (no batch reads them, no eviction frees them),
and an adapter is visible to batches only once all of its bytes are in place (on CUDA:
once the compute stream is ordered after its copy's event).

Slot table in both directions (``_slots[slot] -> entry`` with ``EMPTY`` = None,
``_entries[name] -> entry`` with ``entry.slot``), a per-slot scale tensor, and
preallocated per-batch index tensors that are only copied into.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from gpu_agent.errors import AdapterBusy, AdapterInvalid, AdapterNotResident, LoadYielded, PoolExhausted
from gpu_agent.eviction import Candidate, EvictionPolicy, EvictReason, LRUPolicy, Shortfall, plan_evictions
from gpu_agent.engine.peft import BaseModelSpec, LoraAdapter
from gpu_agent.engine.pool_copy import (COPY_CHUNK_BYTES, STAGING_SLOT_BYTES, STAGING_SLOTS, CopyDone, PinnedStaging,
                                        copy_into_pages)

__all__ = ["AdapterPool", "LoraBatch", "Segment", "PoolEntry", "EMPTY_SLOT", "VictimChooser",
           "COPY_CHUNK_BYTES"]

#: ``choose(loading, shortfall, candidates in policy order) -> names to evict``: the
#: owner's decision (``gpu_agent.eviction.plan_evictions`` and its own protections).
VictimChooser = Callable[[str, Shortfall, Sequence[Candidate]], Sequence[str]]

EMPTY_SLOT = -1  # row_slots value of a row without adapter


@dataclass
class PoolEntry:
    """One resident adapter: its slot, its pages and (lazily) views of its matrices."""

    name: str
    slot: int
    rank: int
    scale: float
    nbytes: int
    page_ids: np.ndarray             # logical order -> physical page
    contiguous: bool                 # page_ids is one run: every matrix is a view
    layout: dict[tuple[int, str], list[int]]  # (layer, module) -> [a_off, a_pages, b_off, b_pages]
    pinned: bool = False
    in_use: int = 0
    load_ms: float = 0.0
    gathered_matrices: int = 0       # matrices whose pages are not consecutive (read by gather)
    ready: CopyDone | None = None    # CUDA: the copy still queued on the side stream
    _mats: dict[tuple[int, str], tuple[Any, Any]] = field(default_factory=dict, repr=False)


@dataclass(eq=False)
class _Copy:
    """Pages reserved for an adapter whose bytes are being copied (no entry yet)."""

    name: str
    ids: np.ndarray
    contiguous: bool
    layout: dict[tuple[int, str], list[int]]
    one_copy: bool
    t0: float
    done: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, end)`` of the grouped batch that use ``entry``."""

    entry: PoolEntry
    start: int
    end: int


class LoraBatch:
    """Kernel metadata of one forward: which rows use which resident adapter.

    ``row_slots[i]`` is the pool slot of row i (``EMPTY_SLOT`` for none);
    ``slot_scales[s]`` the scale of slot s. Rows are grouped by adapter once per batch:
    ``segments`` are runs of ``perm`` (rows sorted by adapter); when every adapter's
    rows are already consecutive, ``perm`` is None and segments index ``x`` directly.
    """

    __slots__ = ("pool", "num_rows", "row_slots", "slot_scales", "perm", "segments", "sizes", "entries",
                 "_scratch")

    def __init__(self, pool: "AdapterPool", num_rows: int, row_slots: Any, perm: Any,
                 segments: list[Segment], entries: list[PoolEntry]) -> None:
        self.pool = pool
        self.num_rows = num_rows
        self.row_slots = row_slots
        self.slot_scales = pool.slot_scales
        self.perm = perm
        self.segments = segments
        self.sizes = [s.end - s.start for s in segments]   # for Tensor.split over grouped rows
        self.entries = entries
        self._scratch: dict[tuple[int, Any], Any] = {}

    def scratch(self, width: int, dtype: Any, device: Any, which: int) -> Any:
        """A ``[grouped rows, width]`` work buffer reused by every layer of this forward
        (a fresh 1 MB tensor per call costs page faults on CPU)."""
        key = (which, dtype)
        n = len(self.perm) if self.perm is not None else self.num_rows
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < n * width:
            import torch
            buf = torch.empty(n * width, dtype=dtype, device=device)
            self._scratch[key] = buf
        return buf[: n * width].view(n, width)

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` once per batch for ``key`` (what every layer of this forward shares,
        e.g. the masked LoRA form's row mask), then the same object."""
        got = self._scratch.get(key)
        if got is None:
            got = self._scratch[key] = make()
        return got

    def weights(self, seg: Segment, layer: int, module: str) -> tuple[Any, Any]:
        """(A [r, in], B^T [r, out]) of the segment's adapter, read from pool pages."""
        return self.pool.matrices(seg.entry, layer, module)


class AdapterPool:
    """Paged pool of LoRA adapters for one base model: the mechanism (pages, slots,
    batches), never the eviction decision.

    ``staging_bytes`` (CUDA): the pinned host memory taken now for loads
    (``PinnedStaging``, in ``STAGING_SLOTS`` buffers).

    ``budget_bytes`` is the size of the single page tensor; ``eviction`` is the record of
    use that orders candidates (LRU default). ``max_adapters`` (optional) also bounds how
    many adapters are resident at once: every load, whoever asks for it, makes room to
    stay within it, or fails with PoolExhausted.

    When a load needs room (pages, or the count), the pool asks ``choose_victims`` (set by
    its owner, the engine's adapter store; default ``gpu_agent.eviction.plan_evictions``)
    which adapters go, and frees exactly those. Pinned and in-use adapters are never
    candidates (the pool refuses to free pages a batch reads); the owner adds its own
    protections (adapters that requests are about to use).

    ``release_listeners`` are called with the name of every adapter that leaves the pool
    and why (``EvictReason.BUDGET``: room for a load; ``OPERATOR``: :meth:`evict`), and
    ``admit_listeners`` with the name of every adapter that enters it (its copy done, it
    is an entry batches can name), with the pool lock held and on the thread that changed
    the pool: they must only hand the name off (no blocking, no pool calls).
    """

    def __init__(self, spec: BaseModelSpec, budget_bytes: int, *, dtype: Any = None,
                 device: Any = None, eviction: EvictionPolicy | None = None,
                 max_rows: int = 4096, max_adapters: int | None = None,
                 staging_bytes: int = STAGING_SLOTS * STAGING_SLOT_BYTES) -> None:
        import torch

        if max_adapters is not None and max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1 (or None), got {max_adapters}")
        self.spec = spec
        self.max_adapters = max_adapters
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype if dtype is not None else torch.float32
        self.row_width = spec.hidden_size
        self.page_bytes = self.row_width * torch.empty((), dtype=self.dtype).element_size()
        self.num_pages = int(budget_bytes // self.page_bytes)
        if self.num_pages <= 0:
            raise PoolExhausted(f"budget {budget_bytes} B holds no page of {self.page_bytes} B")
        self.pages = torch.zeros(self.num_pages, self.row_width, dtype=self.dtype, device=self.device)
        self.policy: EvictionPolicy = eviction if eviction is not None else LRUPolicy()
        self._free = np.ones(self.num_pages, dtype=bool)   # free-page bitmap
        self._num_free = self.num_pages
        self._entries: dict[str, PoolEntry] = {}
        self._slots: list[PoolEntry | None] = []          # None = EMPTY slot
        self._free_slots: list[int] = []
        self.slot_scales = torch.zeros(64, dtype=torch.float32, device=self.device)
        self._row_slots = torch.full((max_rows,), EMPTY_SLOT, dtype=torch.int64, device=self.device)
        self._perm = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self._index_busy = False
        self._lock = threading.RLock()
        self._copying: dict[str, _Copy] = {}        # reserved pages being copied into, by name
        self._copy_ended = threading.Condition(self._lock)
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # CUDA: pinned buffers taken now, so that no load pins memory while batches run
        self.staging = (PinnedStaging(staging_bytes // STAGING_SLOTS, STAGING_SLOTS)
                        if self.device.type == "cuda" else None)
        self.evictions = 0
        self.loads = 0
        self.load_ms_total = 0.0
        self.scattered_loads = 0
        self.gathered_matrices = 0
        self.release_listeners: list[Callable[[str, EvictReason], None]] = []
        self.admit_listeners: list[Callable[[str], None]] = []
        # The owner's eviction decision (called with the pool lock held, on the loading thread).
        self.choose_victims: VictimChooser = _plan

    # ---- layout ---------------------------------------------------------------------
    def _plan(self, adapter: LoraAdapter) -> tuple[dict[tuple[int, str], list[int]], int, bool]:
        """Page layout of ``adapter``: ``{key: [a_off, a_pages, b_off, b_pages]}``, the
        page count, and whether its pool image equals its file bytes (one memcpy).

        Matrices are placed in file order (sorted keys, A then B, for in-memory adapters),
        each in its own ``ceil(numel / W)`` pages.
        """
        w = self.row_width
        payload = adapter.payload
        if payload is not None:
            cached = payload.plans.get((w, self.dtype))
            if cached is not None:
                return cached      # same header structure seen before: same layout
            order = [(m.key, m.half, m.numel) for m in payload.matrices]
        else:
            order = [(key, half, shape[0] * shape[1]) for key, half, shape in adapter.matrix_shapes()]
            order.sort(key=lambda o: (o[0], o[1]))
        layout: dict[tuple[int, str], list[int]] = {}
        off = 0
        exact = True
        for key, half, numel in order:
            n = -(-numel // w)
            exact = exact and n * w == numel
            slot = layout.setdefault(key, [0, 0, 0, 0])
            j = 0 if half == "A" else 2
            slot[j], slot[j + 1] = off, n
            off += n
        one_copy = bool(payload is not None and exact and payload.back_to_back
                        and payload.dtype == self.dtype)
        if payload is not None:
            payload.plans[(w, self.dtype)] = (layout, off, one_copy)   # read-only from here on
        return layout, off, one_copy

    def pages_for(self, adapter: LoraAdapter) -> int:
        """Pages ``adapter`` needs in this pool."""
        return self._plan(adapter)[1]

    # ---- allocation -----------------------------------------------------------------
    def _alloc(self, n: int, layout: dict[tuple[int, str], list[int]]) -> tuple[np.ndarray, bool]:
        """n free pages in logical order: a best-fit contiguous run if one exists; else
        every matrix best-fit into its own free run (so it is still a view), and only
        a matrix larger than every remaining run is spread over several runs."""
        free = self._free
        padded = np.concatenate(([False], free, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        fits = np.flatnonzero(lengths >= n)
        if fits.size:
            best = fits[np.argmin(lengths[fits])]
            ids = np.arange(starts[best], starts[best] + n)
            contiguous = True
        else:
            ids = np.empty(n, dtype=np.int64)
            mats = sorted(((v[j + 1], v[j]) for v in layout.values() for j in (0, 2)), reverse=True)
            left: list[tuple[int, int]] = []
            for size, off in mats:                       # biggest matrices first, best fit
                if size == 0:
                    continue
                cand = np.where(lengths >= size, lengths, np.iinfo(np.int64).max)
                best = int(np.argmin(cand))
                if lengths[best] < size:
                    left.append((off, size))
                    continue
                ids[off: off + size] = np.arange(starts[best], starts[best] + size)
                starts[best] += size
                lengths[best] -= size
            if left:                                     # spread over the remaining runs
                rest = np.concatenate([np.arange(st, st + ln) for st, ln in zip(starts, lengths) if ln])
                k = 0
                for off, size in left:
                    ids[off: off + size] = rest[k: k + size]
                    k += size
            contiguous = False
        if contiguous:
            free[ids[0]: ids[0] + n] = False      # a slice: no fancy indexing
        else:
            free[ids] = False
        self._num_free -= n
        return ids, contiguous

    def _release(self, entry: PoolEntry, reason: EvictReason) -> None:
        ids = entry.page_ids
        if entry.contiguous:
            self._free[ids[0]: ids[0] + len(ids)] = True
        else:
            self._free[ids] = True
        self._num_free += len(entry.page_ids)
        self._slots[entry.slot] = None
        self._free_slots.append(entry.slot)
        self.slot_scales[entry.slot] = 0.0
        del self._entries[entry.name]
        self.policy.on_remove(entry.name)
        for listener in self.release_listeners:
            listener(entry.name, reason)

    def _evict_for(self, loading: str, short: Shortfall) -> None:
        """Free what the owner chooses for ``short``; never a pinned or in-use adapter."""
        if short.met:
            return
        order = [Candidate(e.name, len(e.page_ids), not (e.pinned or e.in_use))
                 for e in (self._entries.get(n) for n in list(self.policy.candidates())) if e is not None]
        for name in self.choose_victims(loading, short, order):
            entry = self._entries.get(name)
            if entry is None or entry.pinned or entry.in_use:
                continue  # mechanism guard: the pages of a batch are never freed
            self._release(entry, EvictReason.BUDGET)
            self.evictions += 1

    def _make_room(self, n: int, loading: str) -> None:
        if n > self.num_pages:
            raise PoolExhausted(f"{loading}: needs {n} pages, pool has {self.num_pages}")
        self._evict_for(loading, Shortfall(size=n - self._num_free))
        if self._num_free < n:
            raise PoolExhausted(
                f"{loading}: needs {n} pages, {self._num_free} free and the rest pinned or in use")

    def _make_count_room(self, loading: str) -> None:
        """Make room (the owner's choice) until one more adapter fits the count."""
        limit = self.max_adapters
        if limit is None:
            return
        placed = len(self._entries) + len(self._copying)   # a copy in flight holds its place
        self._evict_for(loading, Shortfall(count=placed + 1 - limit))
        placed = len(self._entries) + len(self._copying)
        if placed >= limit:
            raise PoolExhausted(
                f"{loading}: {placed} adapters resident or loading (max {limit}), all pinned or in use")

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._slots.append(None)
        slot = len(self._slots) - 1
        if slot >= self.slot_scales.numel():
            import torch
            grown = torch.zeros(2 * self.slot_scales.numel(), dtype=torch.float32, device=self.device)
            grown[: self.slot_scales.numel()] = self.slot_scales
            self.slot_scales = grown
        return slot

    # ---- public API -----------------------------------------------------------------
    def _validate(self, adapter: LoraAdapter) -> None:
        if adapter.base_model != self.spec.name:
            raise AdapterInvalid(f"{adapter.name}: for base model {adapter.base_model!r}, pool serves {self.spec.name!r}")
        if adapter.validated_for is self.spec or adapter.validated_for == self.spec:
            return  # load_peft_dir already checked every shape against this model
        modules = self.spec.modules
        r = adapter.rank
        for (layer, module), half, shape in adapter.matrix_shapes():
            if module not in modules or not 0 <= layer < self.spec.num_layers:
                raise AdapterInvalid(f"{adapter.name}: layer {layer} module {module!r} not in {self.spec.name}")
            fan_in, fan_out = modules[module]
            if shape != ((r, fan_in) if half == "A" else (fan_out, r)):
                raise AdapterInvalid(f"{adapter.name}: layer {layer} {module}: lora_{half} shape {shape}")

    def load(self, adapter: LoraAdapter, pin: bool = False,
             should_yield: Callable[[str], bool] | None = None) -> PoolEntry:
        """Make ``adapter`` resident (evicting unpinned, unused, unclaimed adapters as needed).

        Idempotent for a resident name; a second caller for a name being copied waits for
        that copy and shares its entry. Raises PoolExhausted when the pages cannot be
        found, AdapterInvalid when the adapter does not fit the served model.
        ``should_yield("copy")`` (a prefetch): asked before anything is evicted and between
        chunks of the copy (``COPY_CHUNK_BYTES``); True frees the pages taken so far and
        raises ``LoadYielded`` (stage ``copy``).

        The lock is held only to reserve the pages and to publish the entry, never across
        the copy (``gpu_agent.engine.pool_copy``): batches of resident adapters go on meanwhile.
        """
        while True:
            with self._lock:
                entry = self._entries.get(adapter.name)
                if entry is not None:
                    self.policy.on_access(adapter.name)
                    entry.pinned = entry.pinned or pin
                    return entry
                other = self._copying.get(adapter.name)
                if other is None:
                    job = self._reserve(adapter, should_yield)
                    break
            other.done.wait()  # the same adapter is being copied by another thread: share it

        def checkpoint() -> None:
            if should_yield is not None and should_yield("copy"):
                raise LoadYielded(adapter.name, "copy")

        try:
            ready = copy_into_pages(self.pages, adapter, job.layout, job.ids, job.contiguous, job.one_copy,
                                    stream=self._copy_stream, chunked=should_yield is not None,
                                    checkpoint=checkpoint, staging=self.staging)
        except BaseException:
            with self._lock:
                self._end_copy(job, free_pages=True)
            raise
        with self._lock:
            return self._publish(job, adapter, pin, ready)

    def _reserve(self, adapter: LoraAdapter, should_yield: Callable[[str], bool] | None) -> "_Copy":
        """Under the lock: make room and take the pages ``adapter`` will be copied into.
        Reserved pages belong to no entry: no batch reads them and no eviction frees them."""
        self._validate(adapter)
        t0 = time.perf_counter()
        layout, n, one_copy = self._plan(adapter)
        if n > self.num_pages:  # never fits: fail before evicting anything
            raise PoolExhausted(f"{adapter.name}: needs {n} pages, pool has {self.num_pages}")
        if should_yield is not None and should_yield("copy"):
            raise LoadYielded(adapter.name, "copy")
        while True:
            try:
                self._make_count_room(adapter.name)
                self._make_room(n, adapter.name)
                break
            except PoolExhausted:
                # Another copy holds pages (or a place in the count) that may become
                # evictable once it is published; a request's load waits for it, as it
                # waited for the lock before. A prefetch never waits for room.
                if should_yield is not None or not self._copying:
                    raise
                self._copy_ended.wait()
        ids, contiguous = self._alloc(n, layout)
        job = _Copy(adapter.name, ids, contiguous, layout, one_copy, t0)
        self._copying[adapter.name] = job
        return job

    def _end_copy(self, job: "_Copy", free_pages: bool) -> None:
        if free_pages:
            ids = job.ids
            if job.contiguous:
                self._free[ids[0]: ids[0] + len(ids)] = True
            else:
                self._free[ids] = True
            self._num_free += len(ids)
        del self._copying[job.name]
        job.done.set()
        self._copy_ended.notify_all()

    def _publish(self, job: "_Copy", adapter: LoraAdapter, pin: bool, ready: CopyDone | None) -> PoolEntry:
        """Under the lock: the copied adapter becomes an entry batches can name."""
        ids, contiguous, layout = job.ids, job.contiguous, job.layout
        slot = self._take_slot()
        entry = PoolEntry(name=adapter.name, slot=slot, rank=adapter.rank, scale=adapter.scale,
                          nbytes=adapter.nbytes, page_ids=ids, contiguous=contiguous,
                          layout=layout, pinned=pin, ready=ready)
        self._slots[slot] = entry
        self.slot_scales[slot] = adapter.scale
        self._entries[adapter.name] = entry
        self.policy.on_load(adapter.name)
        entry.load_ms = (time.perf_counter() - job.t0) * 1e3
        self.loads += 1
        self.load_ms_total += entry.load_ms
        self.scattered_loads += not contiguous
        if not contiguous:
            entry.gathered_matrices = sum(
                not _consecutive(ids[v[j]: v[j] + v[j + 1]]) for v in layout.values() for j in (0, 2))
            self.gathered_matrices += entry.gathered_matrices
        self._end_copy(job, free_pages=False)
        for listener in self.admit_listeners:
            listener(adapter.name)
        return entry

    def _flat(self, p: int, n: int, numel: int):
        """The first ``numel`` elements of pages ``[p, p + n)`` as one flat view."""
        return self.pages[p: p + n].view(-1)[:numel]

    def _ready_for_use(self, entry: PoolEntry) -> None:
        """CUDA: the calling thread's stream waits for the entry's copy (its first uses)."""
        ready = entry.ready
        if ready is not None and ready.order_before_use(self.device):
            entry.ready = None

    def matrices(self, entry: PoolEntry, layer: int, module: str) -> tuple[Any, Any] | None:
        """(A [r, in], B^T [r, out]) of a resident adapter: views of the pool pages
        (B^T is a transposed view of B [out, r]), or gathered copies when the
        matrix's pages are scattered; None when the adapter does not target it."""
        key = (layer, module)
        mats = entry._mats.get(key)
        if mats is not None:
            return mats
        where = entry.layout.get(key)
        if where is None:
            return None  # the adapter does not target this layer/module
        self._ready_for_use(entry)
        a_off, a_pages, b_off, b_pages = where
        fan_in, fan_out = self.spec.modules[module]
        r = entry.rank
        ids = entry.page_ids
        out = []
        cacheable = True
        for off, n, shape in ((a_off, a_pages, (r, fan_in)), (b_off, b_pages, (fan_out, r))):
            run = ids[off: off + n]
            numel = shape[0] * shape[1]
            if entry.contiguous or _consecutive(run):
                out.append(self._flat(int(run[0]), n, numel).view(shape))
            else:
                import torch
                idx = torch.as_tensor(run, dtype=torch.int64, device=self.device)
                out.append(self.pages.index_select(0, idx).view(-1)[:numel].view(shape))
                cacheable = False  # a gathered copy would go stale if the pages change
        mats = (out[0], out[1].t())
        if cacheable:
            entry._mats[key] = mats
        return mats

    def contains(self, name: str) -> bool:
        return name in self._entries

    def entry(self, name: str) -> PoolEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise AdapterNotResident(f"adapter {name!r} is not resident") from None

    def touch(self, name: str) -> bool:
        """Resident lookup: True (and counts as an access) when ``name`` is in the pool."""
        with self._lock:
            if name in self._entries:
                self.policy.on_access(name)
                return True
            return False

    def resident(self) -> list[str]:
        return list(self._entries)

    def evict(self, name: str, reason: EvictReason = EvictReason.OPERATOR) -> None:
        """Remove ``name``; AdapterBusy if pinned or in use, AdapterNotResident if absent."""
        with self._lock:
            entry = self.entry(name)
            if entry.pinned or entry.in_use:
                raise AdapterBusy(f"adapter {name!r} is {'pinned' if entry.pinned else 'in use'}")
            self._release(entry, reason)

    def pin(self, name: str) -> None:
        with self._lock:
            self.entry(name).pinned = True

    def unpin(self, name: str) -> None:
        with self._lock:
            self.entry(name).pinned = False

    @contextmanager
    def batch(self, row_adapters: Sequence[str | None]) -> Iterator[LoraBatch]:
        """Kernel metadata for rows naming adapters (None = base model only); the
        adapters are marked in use (not evictable) until the block exits."""
        import torch

        n = len(row_adapters)
        with self._lock:
            entries: dict[str, PoolEntry] = {}
            for name in row_adapters:
                if name is not None and name not in entries:
                    entries[name] = self.entry(name)
            for e in entries.values():
                e.in_use += 1
                self.policy.on_access(e.name)
                self._ready_for_use(e)   # CUDA: this forward's kernels go after the copy
            # The preallocated index tensors serve one open batch at a time; a second
            # concurrent batch gets its own.
            shared = not self._index_busy
            if shared:
                self._index_busy = True
                if n > self._row_slots.numel():
                    self._row_slots = torch.full((2 * n,), EMPTY_SLOT, dtype=torch.int64, device=self.device)
                    self._perm = torch.zeros(2 * n, dtype=torch.int64, device=self.device)
                row_buf, perm_buf = self._row_slots, self._perm
        try:
            if not shared:
                row_buf = torch.empty(n, dtype=torch.int64, device=self.device)
                perm_buf = torch.empty(n, dtype=torch.int64, device=self.device)
            slots = [entries[a].slot if a is not None else EMPTY_SLOT for a in row_adapters]
            # Group rows by adapter (stable: order of first appearance, then row order).
            groups: dict[str, list[int]] = {}
            for i, a in enumerate(row_adapters):
                if a is not None:
                    groups.setdefault(a, []).append(i)
            order: list[int] = []
            segments: list[Segment] = []
            consecutive = True
            for a, rows in groups.items():
                if rows[-1] - rows[0] + 1 != len(rows):
                    consecutive = False
                segments.append(Segment(entries[a], len(order), len(order) + len(rows)))
                order.extend(rows)
            if consecutive:
                segments = [Segment(s.entry, order[s.start], order[s.start] + s.end - s.start) for s in segments]
                perm = None
            else:
                perm = perm_buf[: len(order)]
                perm.copy_(torch.tensor(order, dtype=torch.int64), non_blocking=True)
            row_slots = row_buf[:n]
            row_slots.copy_(torch.tensor(slots, dtype=torch.int64), non_blocking=True)
            yield LoraBatch(self, n, row_slots, perm, segments, list(entries.values()))
        finally:
            with self._lock:
                for e in entries.values():
                    e.in_use -= 1
                if shared:
                    self._index_busy = False

    def stats(self) -> dict[str, Any]:
        with self._lock:
            used = self.num_pages - self._num_free
            return {
                "pages_total": self.num_pages,
                "pages_used": used,
                "pages_free": self._num_free,
                "page_bytes": self.page_bytes,
                "pool_bytes": self.num_pages * self.page_bytes,
                "used_bytes": used * self.page_bytes,
                "adapter_bytes": sum(e.nbytes for e in self._entries.values()),
                "adapters": len(self._entries),
                "max_adapters": self.max_adapters,
                "pinned": sum(e.pinned for e in self._entries.values()),
                "in_use": sum(bool(e.in_use) for e in self._entries.values()),
                "copying": len(self._copying),
                "loads": self.loads,
                "evictions": self.evictions,
                "scattered_adapters": sum(not e.contiguous for e in self._entries.values()),
                "scattered_loads": self.scattered_loads,
                "gathered_matrices_loaded": self.gathered_matrices,
                "load_ms_total": self.load_ms_total,
            }

    # ---- checks (tests) -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raise AssertionError if page tables and the free bitmap disagree (tests)."""
        owner = np.full(self.num_pages, -1)
        for job in self._copying.values():
            if np.any(owner[job.ids] != -1):
                raise AssertionError(f"{job.name}: reserved page owned twice")
            owner[job.ids] = -2
        for e in self._entries.values():
            if np.any(owner[e.page_ids] != -1):
                raise AssertionError(f"{e.name}: page owned twice")
            owner[e.page_ids] = e.slot
            if self._slots[e.slot] is not e:
                raise AssertionError(f"{e.name}: slot table disagrees")
            if len(e.page_ids) != sum(v[1] + v[3] for v in e.layout.values()):
                raise AssertionError(f"{e.name}: page count")
        if not np.array_equal(owner == -1, self._free) or int(self._free.sum()) != self._num_free:
            raise AssertionError("free bitmap disagrees with page tables")


def _plan(loading: str, short: Shortfall, order: Sequence[Candidate]) -> list[str]:
    """The default owner's choice: the policy order, first to go first."""
    return plan_evictions(order, short)


def _consecutive(run: np.ndarray) -> bool:
    return len(run) == 0 or int(run[-1]) - int(run[0]) == len(run) - 1 and bool(np.all(np.diff(run) == 1))
