"""Out-of-band prefetch signals from the gateway to the agents.

The request path only calls ``PrefetchSink.submit``, which never blocks: signals go into
a bounded queue and a background thread hands them to a ``send`` callable (the agents'
gRPC sender, ``extproc.fleet.agent_link.AgentLink``). A full queue drops the signal and says so (False).
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

__all__ = ["PrefetchSignal", "PrefetchSink", "NullPrefetchSink", "PrefetchQueue"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PrefetchSignal:
    upstream: str
    adapter: str
    digest: str
    priority: int      # higher first; 0 = background
    reason: str        # e.g. "request_cold", "request_unknown"
    # adapters the agent should evict first if this load needs room: the victim the
    # speculation's model of that pool chose ("predicted"); () = the agent's LRU
    evict: tuple[str, ...] = ()
    # a speculation's bet (PrefetchRequest.probability / victim_reuse_probability): the
    # chance the adapter is used while resident, and that its victim is used again soon;
    # the agent's speculation budget weighs them. None: not a bet (a request's own load)
    probability: float | None = None
    victim_reuse_probability: float | None = None


class PrefetchSink(Protocol):
    def submit(self, signal: PrefetchSignal) -> bool:
        """Queue a signal without blocking; False if it was dropped."""
        ...


class NullPrefetchSink:
    """Accepts nothing: no agent is configured. ``submit`` returns False (dropped)."""

    def submit(self, signal: PrefetchSignal) -> bool:
        return False


class PrefetchQueue:
    """Bounded queue + one daemon thread that calls ``send(signal)`` for each signal."""

    def __init__(self, send: Callable[[PrefetchSignal], None], maxsize: int = 1024) -> None:
        self._queue: queue.Queue[PrefetchSignal | None] = queue.Queue(maxsize)
        self._send = send
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
        while True:
            signal = self._queue.get()
            if signal is None:
                return
            try:
                self._send(signal)
            except Exception:  # a failed send must not kill the sender; the agent retries
                log.exception("prefetch send failed for %s", signal.adapter)
