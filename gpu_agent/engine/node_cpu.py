"""Whether the node's cores are all taken: the part of a prefetch's wait that no one engine
sees (:mod:`gpu_agent.engine.load_order`).

An engine's own compute is in its batcher; the engines beside it on the same node (one
per GPU on a GPU node, several builtin engines on one CPU machine), the gateway or a
tokenizer are not. A prefetch's fetch, parse and copy take a core: when every core is
running something else, it takes one from a forward pass somewhere on the node, and the
request that pass serves waits. :meth:`NodeCpu.busy` reads the kernel's count of
runnable tasks now (``/proc/loadavg``'s fourth field, one short read) and says busy while
the others (the caller itself is one of them) fill every core this process may use. The
count is the whole machine's: a process pinned to fewer cores than the machine has (the
fleet benchmark's CPU split, ``bench/cores.py``) also counts tasks that run elsewhere, and
waits more than it needs to, never less.
Where the file cannot be read (not Linux), the node is never busy: prefetches wait for
their own engine only, as before.
"""
from __future__ import annotations

import os

__all__ = ["NodeCpu"]

_LOADAVG = "/proc/loadavg"


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class NodeCpu:
    """``busy()``: every core (``cores``; default: those this process may run on) runs a
    task other than the caller."""

    def __init__(self, cores: int | None = None, path: str = _LOADAVG) -> None:
        self.cores = cores if cores is not None else _cores()
        if self.cores < 1:
            raise ValueError("cores must be >= 1")
        self.path = path
        self._readable = True

    def runnable(self) -> int | None:
        """Runnable tasks on the node now, the caller included; None when unreadable."""
        if not self._readable:
            return None
        try:
            with open(self.path, "rb") as f:
                text = f.read(128)
            return int(text.split()[3].split(b"/")[0])
        except (OSError, IndexError, ValueError):
            self._readable = False  # not Linux, or no /proc: never busy from here on
            return None

    def busy(self) -> bool:
        n = self.runnable()
        return n is not None and n - 1 >= self.cores
