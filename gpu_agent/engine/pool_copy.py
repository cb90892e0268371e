"""Copying an adapter into the pages the pool reserved for it, without holding anything
a forward step needs.

``AdapterPool.load`` reserves the pages under its lock, calls :func:`copy_into_pages`
with the lock released, and publishes the entry under the lock again: a batch's set-up
(``AdapterPool.batch``, every forward step) never waits behind a copy, and a batch never
sees the adapter before its bytes are all there. Every piece of the copy is one call that
releases the GIL for its whole length (``os.preadv`` into the page tensor's memory, or a
torch ``copy_``), so the forward thread's Python runs while the bytes move. A prefetch's
copy goes in ``COPY_CHUNK_BYTES`` chunks and asks ``checkpoint`` between them (it may stop
there: ``LoadYielded``); a request's copy goes in one piece (its reads in parallel parts).

On CUDA the pieces are queued on the pool's side stream and nothing waits for them here:
the copy records a :class:`CopyDone` event, and the compute stream waits on it before the
adapter's first use (``AdapterPool.batch`` / ``matrices``), so the load thread never
stalls the device queue and the forward never reads a page before it is written. The
bytes reach the device through :class:`PinnedStaging`, a few pinned buffers the pool
takes once when it is built: a piece is ``pread`` from the adapter's file (or copied from
its host buffer) into a free buffer, and the DMA from that buffer is queued. Pinning
memory while serving is what stalled forward steps on an H200: each ``cudaHostAlloc``
of a 32-128 MB adapter's host copy held up the other thread's kernel launches for 25-168 ms
(``bench.load_interference``, docs/pool.md); the staging buffers make that a startup
cost. A host buffer that is pinned already (``load_peft_dir(pin_memory=True)``) is
copied from directly.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Callable

import numpy as np

from gpu_agent.errors import AdapterInvalid

__all__ = ["copy_into_pages", "CopyDone", "PinnedStaging", "COPY_CHUNK_BYTES", "PREAD_PART_MIN",
           "STAGING_MIN_SLOT_BYTES", "STAGING_SLOT_BYTES", "STAGING_SLOTS"]

# A prefetch's one-piece copy is cut into chunks of this size, with a yield check between.
COPY_CHUNK_BYTES = 256 << 10
# pread into the pool: parts of at least this many bytes, one per torch intra-op thread
# (at most 4), read concurrently (os.preadv releases the GIL; the kernel copies from
# the page cache with no page-table fill, unlike a fresh mmap).
PREAD_PART_MIN = 4 << 20

# CUDA: the pinned staging buffers (AdapterPool takes them once, when it is built): 16 MiB
# each, so that _pread_into reads one in 4 parallel parts (4 MiB buffers, one part each,
# made a rank-128 cold load 48 ms instead of 19 on the H200).
STAGING_SLOT_BYTES = 16 << 20
STAGING_SLOTS = 4
STAGING_MIN_SLOT_BYTES = 64 << 10     # smaller buffers would make every piece a GIL round trip

_readers = None
_readers_lock = threading.Lock()


class CopyDone:
    """A CUDA copy queued on the side stream: ``event`` completes when the pages are
    written; ``source`` (the host bytes) is kept alive until then."""

    __slots__ = ("event", "source")

    def __init__(self, event: Any, source: Any) -> None:
        self.event = event
        self.source = source

    def order_before_use(self, device: Any) -> bool:
        """Make the calling thread's current stream wait for the copy; True once the copy
        has completed (the caller may forget this object)."""
        import torch

        torch.cuda.current_stream(device).wait_event(self.event)
        if self.event.query():
            self.source = None
            return True
        return False


class PinnedStaging:
    """CUDA: ``slots`` pinned host buffers of ``slot_bytes`` through which pageable bytes
    reach the device, allocated once (no ``cudaHostAlloc`` while serving).

    :meth:`put` fills a free buffer (``pread`` from a file, or a host copy), queues the
    DMA from it on the given stream and records the buffer's event; a buffer is filled
    again only after its event completes. Several loading threads share the buffers
    (a queue of free ones); a load never waits for the compute stream."""

    def __init__(self, slot_bytes: int = STAGING_SLOT_BYTES, slots: int = STAGING_SLOTS) -> None:
        import queue

        import torch

        if slot_bytes <= 0 or slots <= 0:
            raise ValueError(f"staging needs slot_bytes > 0 and slots > 0, got {slot_bytes}, {slots}")
        self.slot_bytes = slot_bytes
        self._bufs = [torch.empty(slot_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._free: "queue.SimpleQueue[int]" = queue.SimpleQueue()
        for i in range(slots):
            self._free.put(i)
        self.pieces = 0          # DMAs queued from the staging buffers (a count for tests and stats)

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * len(self._bufs)

    def put(self, dst: Any, stream: Any, *, fd: int | None = None, offset: int = 0,
            src: Any = None, name: str = "") -> None:
        """Copy ``dst.numel()`` bytes into the device uint8 tensor ``dst``: from file ``fd``
        at ``offset``, or from the host uint8 tensor ``src``; the DMAs are queued on
        ``stream`` (the caller records the event that covers them)."""
        import torch

        n = dst.numel()
        lo = 0
        while lo < n:
            k = min(self.slot_bytes, n - lo)
            i = self._free.get()
            try:
                buf = self._bufs[i][:k]
                self._events[i].synchronize()          # its last DMA has read it
                if fd is not None:
                    _pread_into(fd, buf, offset + lo, name)
                else:
                    buf.copy_(src[lo:lo + k])
                with torch.cuda.stream(stream):
                    dst[lo:lo + k].copy_(buf, non_blocking=True)
                    self._events[i].record(stream)
                self.pieces += 1
            finally:
                self._free.put(i)
            lo += k


def copy_into_pages(pages: Any, adapter: Any, layout: dict, ids: np.ndarray, contiguous: bool,
                    one_copy: bool, *, stream: Any, chunked: bool,
                    checkpoint: Callable[[], None], staging: PinnedStaging | None = None) -> CopyDone | None:
    """Write ``adapter``'s matrices into ``pages[ids]`` as ``layout`` places them.

    ``chunked`` (a prefetch): pieces of at most ``COPY_CHUNK_BYTES`` (or one matrix) with
    ``checkpoint()`` between them. ``stream`` (CUDA): queue on it and return the event the
    compute stream must wait on; None on the CPU (the copy is done when this returns).
    ``staging`` (CUDA): the pinned buffers pageable bytes go through; without it (or for
    a pinned host buffer) the DMA reads the host buffer directly."""
    import torch

    if stream is not None:
        # Freed pages may still be read by kernels queued on the compute stream (a
        # batch's host-side context exits before its GPU work ends): order after them.
        stream.wait_stream(torch.cuda.current_stream(pages.device))
    ctx = torch.cuda.stream(stream) if stream is not None else _NullContext()
    non_blocking = stream is not None
    dtype, device, w = pages.dtype, pages.device, pages.shape[1]
    with ctx:
        if contiguous and one_copy:
            # The adapter's page run is byte-for-byte its file's data section.
            payload = adapter.payload
            start, end = payload.matrices[0].start, payload.matrices[-1].end
            p0 = int(ids[0])
            dst = pages[p0: p0 + len(ids)].view(-1).view(torch.uint8)
            raw = payload.file
            readable = raw is not None and not raw.closed
            stage = staging is not None and not payload.buffer.is_pinned()
            # a prefetch yields between chunks; through the staging buffers a chunk is one
            # buffer (16 MiB, read in parallel parts: ~1 ms on the H200), so the loader takes
            # the GIL far less often than at 256 KiB (docs/bench-history.md, 2026-12-04)
            chunk = staging.slot_bytes if stage else COPY_CHUNK_BYTES
            step = chunk if chunked else max(1, end - start)
            for lo in range(0, end - start, step):
                hi = min(lo + step, end - start)
                if lo:
                    checkpoint()
                if stream is None and readable:
                    _pread_into(raw.fileno(), dst[lo:hi], start + lo, adapter.name)
                elif stage:
                    staging.put(dst[lo:hi], stream, fd=raw.fileno() if readable else None, offset=start + lo,
                                src=None if readable else payload.buffer[start + lo:start + hi], name=adapter.name)
                else:
                    dst[lo:hi].copy_(payload.buffer[start + lo:start + hi], non_blocking=non_blocking)
        elif contiguous:
            p0 = int(ids[0])
            for key, (a, b) in adapter.weights.items():
                checkpoint()
                a_off, a_pages, b_off, b_pages = layout[key]
                _flat(pages, p0 + a_off, a_pages, a.numel()).copy_(a.reshape(-1), non_blocking=non_blocking)
                _flat(pages, p0 + b_off, b_pages, b.numel()).copy_(b.reshape(-1), non_blocking=non_blocking)
        else:
            idx = torch.as_tensor(ids, dtype=torch.int64, device=device)
            for key, (a, b) in adapter.weights.items():
                checkpoint()
                a_off, a_pages, b_off, b_pages = layout[key]
                for off, n, m in ((a_off, a_pages, a), (b_off, b_pages, b)):
                    block = torch.zeros(n * w, dtype=dtype, device=device)
                    block[: m.numel()].copy_(m.reshape(-1), non_blocking=non_blocking)
                    pages.index_copy_(0, idx[off: off + n], block.view(n, w))
    if stream is None:
        return None
    done = torch.cuda.Event()
    done.record(stream)
    return CopyDone(done, adapter)


def _flat(pages: Any, p: int, n: int, numel: int) -> Any:
    """The first ``numel`` elements of pages ``[p, p + n)`` as one flat view."""
    return pages[p: p + n].view(-1)[:numel]


def _reader_pool(n: int):
    global _readers
    with _readers_lock:
        if _readers is None or _readers._max_workers < n:
            from concurrent.futures import ThreadPoolExecutor

            _readers = ThreadPoolExecutor(n, thread_name_prefix="ace-pool-read")
        return _readers


def _pread_full(fd: int, mv: memoryview, offset: int, name: str) -> None:
    done = 0
    while done < len(mv):
        got = os.preadv(fd, [mv[done:]], offset + done)
        if got <= 0:
            raise AdapterInvalid(f"{name}: weights file ended early (file changed after it was read?)")
        done += got


def _pread_into(fd: int, dst: Any, offset: int, name: str) -> None:
    """Fill the CPU uint8 tensor ``dst`` with the file's bytes from ``offset``."""
    import torch

    mv = memoryview(dst.numpy()).cast("B")
    n = len(mv)
    parts = max(1, min(torch.get_num_threads(), 4, n // PREAD_PART_MIN))
    if parts == 1:
        _pread_full(fd, mv, offset, name)
        return
    step = ((n + parts - 1) // parts + 4095) & ~4095        # page-aligned parts
    cuts = [(o, min(o + step, n)) for o in range(0, n, step)]
    ex = _reader_pool(len(cuts) - 1)
    futs = [ex.submit(_pread_full, fd, mv[a:b], offset + a, name) for a, b in cuts[1:]]
    try:
        _pread_full(fd, mv[cuts[0][0]:cuts[0][1]], offset, name)
    finally:
        for f in futs:
            f.result()


class _NullContext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None
