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

A request that needs an adapter a prefetch is loading joins that load and promotes it
(:meth:`promote`): it no longer yields. A prefetch that finds no room without evicting
what requests hold or are about to use is given up (``cancelled{reason="no_room"}``):
unlike a request, it never waits for room.

The same rule holds for the CPU (:class:`LoadThreads`): loads run off the event loop and
off the forward thread, a request's on a thread of normal priority, a prefetch's on one
the OS schedules after everything else of the engine (nice + ``PREFETCH_NICE``), so on a
busy host a prefetch's disk read and copy take only CPU time the forward does not want.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

__all__ = ["LoadOrder", "LoadTicket", "LoadThreads", "PREFETCH_NICE"]

log = logging.getLogger("gpu_agent.engine")

#: How much nicer (Linux thread niceness) a prefetch's load thread is than the engine's.
PREFETCH_NICE = 10


@dataclass
class LoadTicket:
    """One load in flight; ``prefetch`` turns False when a request joins it."""

    name: str
    prefetch: bool


class LoadOrder:
    def __init__(self, prefetch_slots: int = 1):
        if prefetch_slots < 1:
            raise ValueError("prefetch_slots must be >= 1")
        self.prefetch_slots = prefetch_slots
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
        self._notify()
        try:
            yield
        finally:
            self.demand_in_flight -= 1
            self._notify()

    def promote(self, ticket: LoadTicket) -> None:
        """A request joined this prefetch's load: from now on it does not yield."""
        if ticket.prefetch:
            ticket.prefetch = False
            self._notify()

    # ---- a prefetch --------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def prefetch_slot(self, ticket: LoadTicket) -> AsyncIterator[None]:
        """One of the ``prefetch_slots``, entered only while no request's load is in
        flight. A load promoted while it waits goes at once, without a slot (a request
        waits for it, and the prefetch holding the slot may be paused for that request)."""
        while ticket.prefetch and (self.prefetches_running >= self.prefetch_slots
                                   or self.demand_in_flight > 0):
            changed = self._changed
            await changed.wait()
        took = ticket.prefetch
        if took:
            self.prefetches_running += 1
        try:
            yield
        finally:
            if took:
                self.prefetches_running -= 1
                self._notify()

    def should_yield(self, ticket: LoadTicket, stage: str) -> bool:
        """True when the prefetch must stop at this checkpoint (thread-safe read)."""
        hook = self.checkpoint_hook
        if hook is not None and ticket.prefetch:
            hook(ticket.name, stage)
        return ticket.prefetch and self.demand_in_flight > 0

    async def pause(self, ticket: LoadTicket, stage: str) -> None:
        """The prefetch stopped at ``stage``: count it, and wait for its turn again."""
        self.preemptions[stage] = self.preemptions.get(stage, 0) + 1
        await self.turn(ticket)

    async def turn(self, ticket: LoadTicket) -> None:
        """Wait until no request's load is in flight (or the load was promoted)."""
        while ticket.prefetch and self.demand_in_flight > 0:
            changed = self._changed
            await changed.wait()

    async def idle(self) -> bool:
        """Wait until no request's load is in flight; True when it had to wait (the
        agent asks before it takes its device lock for a prefetch)."""
        waited = False
        while self.demand_in_flight > 0:
            waited = True
            changed = self._changed
            self.idle_waiters += 1
            try:
                await changed.wait()
            finally:
                self.idle_waiters -= 1
        return waited

    def cancel(self, reason: str) -> None:
        self.cancelled[reason] = self.cancelled.get(reason, 0) + 1

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


class LoadThreads:
    """The threads the engine's loads run on (never the event loop, never the forward's):
    ``demand`` for a request's load, ``prefetch`` (lower OS priority) for a prefetch's."""

    def __init__(self) -> None:
        self._demand = ThreadPoolExecutor(1, thread_name_prefix="ace-load")
        self._prefetch = ThreadPoolExecutor(1, thread_name_prefix="ace-prefetch-load",
                                            initializer=_lower_priority)

    async def run(self, prefetch: bool, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        pool = self._prefetch if prefetch else self._demand
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args, **kwargs))

    def close(self) -> None:
        self._demand.shutdown(wait=False, cancel_futures=True)
        self._prefetch.shutdown(wait=False, cancel_futures=True)


def _lower_priority() -> None:
    """Make the calling thread nicer by ``PREFETCH_NICE`` (Linux: niceness is per thread;
    elsewhere setpriority would change the whole process, so nothing is done)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + PREFETCH_NICE))
    except OSError as exc:  # a sandbox without setpriority: loads still run, at normal priority
        log.info("could not lower the prefetch load thread's priority: %s", exc)
