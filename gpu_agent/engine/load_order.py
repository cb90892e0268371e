"""Which of the engine's adapter loads goes first: a request's, always.

Two kinds of load reach the engine's residency: a request's (on demand: a client waits
for it) and a prefetch (the agent moves an adapter up ahead of any request). A prefetch
must never cost a request anything, so :class:`LoadOrder` keeps three rules:

- a request's load starts at once, however many prefetches are queued or running;
- at most ``prefetch_slots`` prefetches load at a time, and one starts only while no
  request's load is in flight;
- a running prefetch asks :meth:`should_yield` at every checkpoint (after its fetch,
  before its read, before it evicts anything for its pool copy, between chunks of the
  copy): while a request's load is in flight it stops there (a *preemption*, counted
  by stage), waits until no request's load is left, and goes on.

A prefetch also stays off the engine's compute: while ``compute_busy()`` (the engine has
a request accepted, queued or running: its batcher and its claims) a prefetch neither
starts nor passes a checkpoint, for at most ``compute_defer_s`` in all (then it yields to
requests' loads only, so a saturated engine still gets its prefetches, as vLLM's
connector waits at most ``idle_wait_s``). The engine calls :meth:`notify` when it goes
idle. Why: a prefetch's parse and copy share the process (the GIL, the event loop, the
CPU) with the forward; deferred behind a request's load only, it resumed exactly when that
request's first forward pass began, and delayed it (docs/bench-history.md, 2026-12-02,
"Prefetch off the compute"). The engines beside this one on the node are not in its
batcher: with ``node_busy`` set (``gpu_agent.engine.node_cpu``), a prefetch also waits
while the cores it runs on are taken by other tasks, for at most ``NODE_DEFER_S`` (looking again
every ``NODE_POLL_S``, since nothing notifies when another engine's pass ends).

A request that needs an adapter a prefetch is loading joins that load and promotes it
(:meth:`promote`): it no longer yields. A prefetch that finds no room without evicting
what requests hold or are about to use is given up (``cancelled{reason="no_room"}``):
unlike a request, it never waits for room.

Loads run on :class:`LoadThreads`, off the event loop and off the forward thread: a
request's on one thread, a prefetch's on another, which can be made nicer
(``prefetch_nice``, Linux niceness per thread). It is 0 by default: the load threads
share the GIL with the forward, and a nicer thread that the OS preempts while it holds
the GIL (or the pool's lock) makes the forward wait until it runs again. On 2 cores
shared by ~17 runnable tasks, nice 10 doubled the forward step's p99 and halved nothing
(docs/bench-history.md, 2026-12-02).
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

__all__ = ["NODE_DEFER_S", "NODE_POLL_S", "LoadOrder", "LoadTicket", "LoadThreads"]

log = logging.getLogger("gpu_agent.engine")

#: How often a prefetch waiting for the engine's compute looks at the node's cores again
#: (``LoadOrder.node_busy``: nothing notifies when another engine's pass ends).
NODE_POLL_S = 0.005
#: The longest a prefetch waits for the node's cores (its own engine's compute: up to
#: ``compute_defer_s``): a bet held longer loads against a pool that moved on since it
#: was priced (held up to 1 s, ace lost 2 of its ~5 points on a held-out hundreds day:
#: docs/bench-history.md, "Bets wait for the node's cores").
NODE_DEFER_S = 0.1


@dataclass
class LoadTicket:
    """One load in flight; ``prefetch`` turns False when a request joins it."""

    name: str
    prefetch: bool
    # monotonic time after which it no longer waits for the engine's compute (set the first
    # time it does), and whether it went past it
    compute_deadline: float | None = None
    compute_overrun: bool = False
    # set the first time it waits for the node's cores; after it, it no longer does
    node_deadline: float | None = None
    # where the load's time went, in seconds (a request's ``ace_timing.load``): the source's
    # fetch, the tiers' read/parse/copy on a load thread, and pauses (a prefetch yielding),
    # plus what else was loading on this engine, and downloading in its source, when it started
    fetch_s: float = 0.0
    tiers_s: float = 0.0
    paused_s: float = 0.0
    others_loading: int = 0
    fetches_at_start: int = 0


class LoadOrder:
    def __init__(self, prefetch_slots: int = 1, compute_defer_s: float = 1.0,
                 compute_busy: Callable[[], bool] | None = None,
                 node_busy: Callable[[], bool] | None = None):
        if prefetch_slots < 1:
            raise ValueError("prefetch_slots must be >= 1")
        if compute_defer_s < 0:
            raise ValueError("compute_defer_s must be >= 0")
        self.prefetch_slots = prefetch_slots
        self.compute_defer_s = compute_defer_s
        # the engine has a request accepted, queued or running (read from load threads too)
        self.compute_busy: Callable[[], bool] = compute_busy or (lambda: False)
        # the cores this process runs on are taken by others (``gpu_agent.engine.node_cpu``): no
        # notify() says when that ends, so a prefetch waiting on it looks again every
        # NODE_POLL_S; None: the node is not watched
        self.node_busy: Callable[[], bool] | None = node_busy
        self.node_waits = 0         # prefetches that waited for the node's cores
        self.compute_waits = 0      # times a prefetch waited for the engine's compute
        self.compute_overruns = 0   # prefetches that went on after compute_defer_s
        self.demand_in_flight = 0   # read from load threads: an int, written on the loop only
        self.prefetches_running = 0
        self.idle_waiters = 0       # callers of idle() waiting now
        self._changed = asyncio.Event()  # replaced on every change: one wake-up per change
        self.preemptions: dict[str, int] = {}
        self.cancelled: dict[str, int] = {}
        # Tests only: called with (name, stage) at every checkpoint of a prefetch, on the
        # thread that reaches it (the event loop for ``fetch``, a load thread otherwise).
        self.checkpoint_hook: Callable[[str, str], None] | None = None

    # ---- a request's load --------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def demand(self) -> AsyncIterator[None]:
        """Held for the whole of a request's load (its waits for room included)."""
        self.demand_in_flight += 1
        self.notify()
        try:
            yield
        finally:
            self.demand_in_flight -= 1
            self.notify()

    def promote(self, ticket: LoadTicket) -> None:
        """A request joined this prefetch's load: from now on it does not yield."""
        if ticket.prefetch:
            ticket.prefetch = False
            self.notify()

    # ---- a prefetch --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def prefetch_slot(self, ticket: LoadTicket) -> AsyncIterator[None]:
        """One of the ``prefetch_slots``, entered only while no request's load is in
        flight. A load promoted while it waits goes at once, without a slot (a request
        waits for it, and the prefetch holding the slot may be paused for that request)."""
        while ticket.prefetch and (self.prefetches_running >= self.prefetch_slots
                                   or self.demand_in_flight > 0 or self._behind_compute(ticket)):
            await self._wait_change(ticket)
        took = ticket.prefetch
        if took:
            self.prefetches_running += 1
        try:
            yield
        finally:
            if took:
                self.prefetches_running -= 1
                self.notify()

    def should_yield(self, ticket: LoadTicket, stage: str) -> bool:
        """True when the prefetch must stop at this checkpoint (thread-safe read)."""
        hook = self.checkpoint_hook
        if hook is not None and ticket.prefetch:
            hook(ticket.name, stage)
        return ticket.prefetch and (self.demand_in_flight > 0 or self._behind_compute(ticket))

    async def pause(self, ticket: LoadTicket, stage: str) -> None:
        """The prefetch stopped at ``stage``: count it, and wait for its turn again."""
        self.preemptions[stage] = self.preemptions.get(stage, 0) + 1
        t0 = time.perf_counter()
        try:
            await self.turn(ticket)
        finally:
            ticket.paused_s += time.perf_counter() - t0

    async def turn(self, ticket: LoadTicket) -> None:
        """Wait until no request's load is in flight and the engine computes nothing (for
        at most ``compute_defer_s`` of the ticket's), or the load was promoted."""
        while ticket.prefetch and (self.demand_in_flight > 0 or self._behind_compute(ticket)):
            await self._wait_change(ticket)

    async def idle(self) -> bool:
        """Wait until no request's load is in flight and the engine computes nothing (that
        part for at most ``compute_defer_s``); True when it had to wait (the agent asks
        before it fetches a prefetch's files and before it takes its device lock)."""
        ticket = LoadTicket("", True)
        waited = False
        while self.demand_in_flight > 0 or self._behind_compute(ticket):
            waited = True
            self.idle_waiters += 1
            try:
                await self._wait_change(ticket)
            finally:
                self.idle_waiters -= 1
        return waited

    def compute_wait_outcomes(self) -> dict[str, int]:
        """Prefetches that waited for the engine's compute, by how the wait ended."""
        return {"idle": self.compute_waits - self.compute_overruns, "overrun": self.compute_overruns}

    def _behind_compute(self, ticket: LoadTicket) -> bool:
        """The prefetch must wait for the engine's compute, or the node's, now (thread-safe
        read)."""
        if not self.compute_busy():
            node = self.node_busy
            if node is None or not node():
                return False
            now = time.monotonic()
            if ticket.node_deadline is None:
                ticket.node_deadline = now + min(NODE_DEFER_S, self.compute_defer_s)
                self.node_waits += 1
            return now < ticket.node_deadline
        now = time.monotonic()
        if ticket.compute_deadline is None:
            ticket.compute_deadline = now + self.compute_defer_s
            self.compute_waits += 1
        if now < ticket.compute_deadline:
            return True
        if not ticket.compute_overrun:  # past it: counted once, never waits again
            ticket.compute_overrun = True
            self.compute_overruns += 1
        return False

    async def _wait_change(self, ticket: LoadTicket) -> None:
        """Wait for the next change, or for the ticket's compute deadline to pass, or (while
        it waits for the node's cores) for the next look at them."""
        changed = self._changed
        now = time.monotonic()
        timeouts = []
        if ticket.compute_deadline is not None and not ticket.compute_overrun:
            if now < ticket.compute_deadline:
                timeouts.append(ticket.compute_deadline - now)
            elif not self.demand_in_flight:
                return  # it passed since the caller looked: the caller marks the overrun and goes
            # else: while a request's load is in flight the caller does not look at the
            # deadline, so returning at once would spin the event loop that load needs to
            # end; that load's end is the change to wait for
        if self.node_busy is not None and ticket.node_deadline is not None and now < ticket.node_deadline:
            timeouts.append(min(NODE_POLL_S, ticket.node_deadline - now))
        if not timeouts:
            await changed.wait()
            return
        try:
            await asyncio.wait_for(changed.wait(), min(timeouts))
        except asyncio.TimeoutError:
            pass

    def cancel(self, reason: str) -> None:
        self.cancelled[reason] = self.cancelled.get(reason, 0) + 1

    def notify(self) -> None:
        """Something a waiting prefetch depends on changed (a request's load began or ended,
        a slot freed, the engine went idle): one wake-up for every waiter."""
        self._changed.set()
        self._changed = asyncio.Event()


class LoadThreads:
    """The threads the engine's loads run on (never the event loop, never the forward's):
    one for a request's load, one for a prefetch's (``prefetch_nice`` nicer)."""

    def __init__(self, prefetch_nice: int = 0) -> None:
        if prefetch_nice < 0:
            raise ValueError("prefetch_nice must be >= 0 (a load never runs before the forward)")
        self._demand = ThreadPoolExecutor(1, thread_name_prefix="ace-load")
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ace-prefetch-load",
                                            initializer=_lower_priority, initargs=(prefetch_nice,))

    async def run(self, prefetch: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pool = self._prefetch if prefetch else self._demand
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._demand.shutdown(wait=False, cancel_futures=True)
        self._prefetch.shutdown(wait=False, cancel_futures=True)


def _lower_priority(nice: int) -> None:
    """Make the calling thread nicer by ``nice`` (Linux: niceness is per thread; elsewhere
    setpriority would change the whole process, so nothing is done)."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # a sandbox without setpriority: loads still run, at normal priority
        log.info("could not lower the prefetch load thread's priority: %s", exc)
