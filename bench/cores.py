"""Which cores the fleet benchmark's processes run on: the request path apart from the
engine hosts.

In a deployment the clients, Envoy and the gateway run on other machines than the engine
hosts. On one machine they share its cores, and a burst that keeps the hosts' cores busy
(forward passes, adapter fetches and copies) delays the request path as well: on this
2-core machine, at the hundreds scenario's bursts, the load generator's event loop, the
agents' and the requests' way to and from the engines were late together by 25-60 ms
(docs/bench-history.md, 2026-12-06), a TTFT tail that measured the machine, not the
adapters. So ``make bench`` runs the request path (load generator, artifact store, Envoy,
ext_proc, vLLM's router) on its own cores and the engine hosts on the rest
(``--cpu-split on``, the default; ``off``: every process on every core, as before).

``split`` is the choice (pure); ``pinned`` puts the calling thread, and so every process
it starts from then on, on some cores for a block; ``tools.localstack.running(cpus=)``
starts one process on others. Linux only (``os.sched_setaffinity``): elsewhere there is
no split and nothing is pinned.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Collection, Iterator

__all__ = ["available", "pinned", "split"]


def available() -> frozenset[int] | None:
    """The cores this process may run on; None where affinity is not supported."""
    get = getattr(os, "sched_getaffinity", None)
    return frozenset(get(0)) if get is not None else None


def split(cpus: Collection[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """``(request path, engine hosts)``: the lowest quarter of ``cpus`` (at least one) for
    the request path, the rest for the hosts; None with fewer than 2 cores (nothing to
    split)."""
    ordered = sorted(cpus)
    if len(ordered) < 2:
        return None
    k = max(1, len(ordered) // 4)
    return frozenset(ordered[:k]), frozenset(ordered[k:])


@contextlib.contextmanager
def pinned(cpus: Collection[int] | None) -> Iterator[None]:
    """The calling thread on ``cpus`` for the block (processes it starts inherit that),
    then back on the cores it had; None: nothing changes."""
    if cpus is None or available() is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
