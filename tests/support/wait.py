"""Wait for the event a test checks, never for a fixed time.

Every deadline here is a *failure* bound, not a measurement: a test passes as soon as
its condition holds, and only a test that is really stuck waits the whole deadline. The
deadlines scale with ``ACE_TEST_TIME_SCALE`` (default 1; e.g. 3 on a loaded CI machine),
so the same suite passes on a machine twice as fast or twice as slow.

    wait_until(lambda: agent.resident("a"), what="adapter a resident")
    await async_wait_until(lambda: len(hits) == 2, what="two scrapes")

Where a test must show that something does *not* happen, wait for a positive signal that
proves the system got past the point where it would have happened (a later event, a
counter, a drained queue), then assert the absence.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Callable, TypeVar

__all__ = ["DEFAULT_TIMEOUT", "async_wait_until", "scaled", "time_scale", "wait_until"]

T = TypeVar("T")
DEFAULT_TIMEOUT = 30.0


def time_scale() -> float:
    """The factor every test deadline is multiplied by (``ACE_TEST_TIME_SCALE``, >= 1)."""
    try:
        return max(1.0, float(os.environ.get("ACE_TEST_TIME_SCALE", "1")))
    except ValueError:
        return 1.0


def scaled(seconds: float) -> float:
    """A failure deadline of ``seconds`` on a reference machine, scaled for this one."""
    return seconds * time_scale()


def wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT,
               interval: float = 0.01, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    Raises ``TimeoutError`` naming ``what`` after ``scaled(timeout)`` seconds.
    """
    deadline = time.monotonic() + scaled(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not met within {scaled(timeout):.1f} s")
        time.sleep(interval)


async def async_wait_until(predicate: Callable[[], T], timeout: float = DEFAULT_TIMEOUT,
                           interval: float = 0.01, what: str = "condition") -> T:
    """``wait_until`` for coroutines: yields to the event loop between polls."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + scaled(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if loop.time() > deadline:
            raise TimeoutError(f"{what}: not met within {scaled(timeout):.1f} s")
        await asyncio.sleep(interval)
