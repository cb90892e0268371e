"""Out-of-band prefetch signals from the gateway to the agents.

The request path only calls ``PrefetchSink.submit``, which never blocks: signals go into
a bounded queue and a background thread hands them to a ``send`` callable (the agents'
gRPC sender, ``extproc.fleet.agent_link.AgentLink``). A full queue drops the signal and says so (False).
"""
from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = ["PrefetchSignal", "PrefetchSink", "NullPrefetchSink", "PrefetchQueue", "Retry",
           "REQUEST_COLD", "REQUEST_UNKNOWN"]

log = logging.getLogger(__name__)

# the reasons of a request's own signal (the ingress signal: the adapter the request is
# about to ask that upstream for, not resident there), as opposed to a bet's or a fill's
REQUEST_COLD = "request_cold"         # the board shows the adapter off the device tier
REQUEST_UNKNOWN = "request_unknown"   # the board does not know the adapter there
_REQUEST_REASONS = frozenset((REQUEST_COLD, REQUEST_UNKNOWN))


@dataclass(frozen=True, slots=True)
class PrefetchSignal:
    upstream: str
    adapter: str
    digest: str
    priority: int      # higher first; 0 = background
    reason: str        # REQUEST_COLD, REQUEST_UNKNOWN, or a bet's ("predicted", "fill", ...)
    # adapters the agent should evict first if this load needs room: the victim the
    # speculation's model of that pool chose ("predicted"); () = the agent's LRU
    evict: tuple[str, ...] = ()
    # a speculation's bet (PrefetchRequest.probability / victim_reuse_probability): the
    # chance the adapter is used while resident, and that its victim is used again soon;
    # the agent's speculation budget weighs them. None: not a bet (a request's own load)
    probability: float | None = None
    victim_reuse_probability: float | None = None
    # seconds an adapter a request was routed to on ``upstream`` stays out of ``evict``
    # (``Upstream.victim_grace_s``; the sender applies it: ``AgentLink.spare_routed``)
    spare_s: float = 0.0
    deferred: bool = False   # the sender held it back once already (``AgentLink.spare_routed``)
    # adapters requests were routed to on ``upstream`` within ``spare_s`` (the sender fills
    # it): the agent lets no eviction take them for a while (PrefetchRequest.keep)
    keep: tuple[str, ...] = ()
    # load only into free device room, evicting nothing (PrefetchRequest.room_only): the
    # start-up fill of an empty pool
    room_only: bool = False
    # a bet planned on a request whose own adapter was not resident on its host: the
    # sender holds it until that demand load shows on the device tier (``yields_to`` =
    # (upstream, adapter), from the residency board) or until ``hold_until`` (monotonic
    # seconds), so a speculation never competes with the load of the request that
    # planned it (``AgentLink.held_for_demand``); None: sent at once
    yields_to: tuple[str, str] | None = None
    hold_until: float = 0.0
    held: bool = False   # the sender held it back once already (counted once)

    @property
    def for_request(self) -> bool:
        """A request's own signal (its adapter, on the upstream it goes to), not a bet."""
        return self.probability is None and self.reason in _REQUEST_REASONS


class PrefetchSink(Protocol):
    def submit(self, signal: PrefetchSignal) -> bool:
        """Queue a signal without blocking; False if it was dropped."""
        ...


class NullPrefetchSink:
    """Accepts nothing: no agent is configured. ``submit`` returns False (dropped)."""

    def submit(self, signal: PrefetchSignal) -> bool:
        return False


#: What ``send`` may answer instead of None: send this signal again after so many seconds.
Retry = tuple[PrefetchSignal, float]


class PrefetchQueue:
    """Bounded queue + one daemon thread that calls ``send(signal)`` for each signal.

    ``send`` returns None, or ``(signal, delay_s)``: that signal is handed to ``send`` again
    once ``delay_s`` has passed, from the same thread (at most ``maxsize`` wait so; more are
    dropped and counted)."""

    def __init__(self, send: Callable[[PrefetchSignal], "Retry | None"], maxsize: int = 1024) -> None:
        self._queue: queue.Queue[PrefetchSignal | None] = queue.Queue(maxsize)
        self._send = send
        self._later: list[tuple[float, int, PrefetchSignal]] = []   # heap: (due, seq, signal)
        self._seq = itertools.count()
        self.maxsize = maxsize
        self._thread = threading.Thread(target=self._run, name="prefetch-sender", daemon=True)
        self._thread.start()
        self.dropped = 0

    def submit(self, signal: PrefetchSignal) -> bool:
        try:
            self._queue.put_nowait(signal)
            return True
        except queue.Full:
            self.dropped += 1
            return False

    def close(self, timeout: float = 1.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)

    def _run(self) -> None:
        later = self._later
        while True:
            timeout = max(0.0, later[0][0] - time.monotonic()) if later else None
            try:
                signal = self._queue.get(timeout=timeout)
            except queue.Empty:
                signal = heapq.heappop(later)[2]
            else:
                if signal is None:
                    return
            self._deliver(signal)

    def _deliver(self, signal: PrefetchSignal) -> None:
        try:
            retry = self._send(signal)
        except Exception:  # a failed send must not kill the sender; the agent retries
            log.exception("prefetch send failed for %s", signal.adapter)
            return
        if retry is None:
            return
        if len(self._later) >= self.maxsize:
            self.dropped += 1
            return
        again, delay_s = retry
        heapq.heappush(self._later, (time.monotonic() + max(0.0, delay_s), next(self._seq), again))
