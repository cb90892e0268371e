"""The engine's load (running and waiting requests), measured off the request path.

A background loop asks the connector every ``interval_s`` (vLLM/SGLang: a ``/metrics``
scrape; builtin: the batcher's counts in memory), keeps the latest measurement as
``current`` and announces it (``on_change``): by default every known measurement, so that
the gateway can tell a silent agent from an idle engine and knows when each measurement
arrived (it adds the requests it routed to the host since the last one); with
``heartbeat_s`` > 0, only a changed load or one ``heartbeat_s`` after the last
announcement. A failed measurement is never fatal: the load becomes unknown (None), is
announced once as such, and the failure is logged at most once per ``LOG_EVERY_S`` (the rest
at debug level).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

from gpu_agent.connectors.base import EngineConnector, EngineLoad

__all__ = ["LoadChange", "LoadMonitor", "LOAD_HEARTBEAT_S"]

log = logging.getLogger(__name__)

#: Longest gap between two announcements of an unchanged known load; 0 = announce every
#: measurement. The gateway counts the requests it sent to a host since the host's last
#: announced measurement (extproc.state.residency.host_load): an unchanged measurement it never
#: hears would let that count run on. It forgets a load not heard about for 5 s.
LOAD_HEARTBEAT_S = 0.0
LOG_EVERY_S = 60.0


@dataclass(frozen=True)
class LoadChange:
    """An announcement for observers: the engine's load now (None = unknown)."""

    load: EngineLoad | None


class LoadMonitor:
    def __init__(self, connector: EngineConnector, interval_s: float,
                 on_change: Callable[[EngineLoad | None], None], *,
                 heartbeat_s: float = LOAD_HEARTBEAT_S, on_failure: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic):
        self.connector = connector
        self.interval_s = interval_s
        self.heartbeat_s = heartbeat_s
        self.current: EngineLoad | None = None
        self._on_change = on_change
        self._on_failure = on_failure
        self._clock, self._monotonic = clock, monotonic
        self._announced: EngineLoad | None = None
        self._announced_at: float | None = None
        self._failing = False
        self._logged_at: float | None = None

    async def sample(self) -> EngineLoad | None:
        """One measurement: store it, announce it if it changed or the heartbeat is due."""
        try:
            load = await self.connector.engine_load()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bad scrape makes the load unknown, nothing more
            load = None
            self._failed(exc)
        else:
            if self._failing:
                log.info("engine load readable again")
            self._failing = False
        if load is not None:
            load = replace(load, measured_unix_ms=int(self._clock() * 1000))
        self.current = load
        now = self._monotonic()
        due = load is not None and (self._announced_at is None or now - self._announced_at >= self.heartbeat_s)
        if load != self._announced or due:
            self._announced, self._announced_at = load, now
            self._on_change(load)
        return load

    def _failed(self, exc: Exception) -> None:
        if self._on_failure is not None:
            self._on_failure()
        now = self._monotonic()
        if not self._failing or self._logged_at is None or now - self._logged_at >= LOG_EVERY_S:
            log.warning("cannot read the engine's load (published as unknown): %s", exc)
            self._logged_at = now
        else:
            log.debug("cannot read the engine's load: %s", exc)
        self._failing = True

    async def run(self) -> None:
        """Measure every ``interval_s`` until cancelled."""
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)
