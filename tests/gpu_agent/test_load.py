"""The agent's engine-load monitor: what it announces and when, failures made unknown, and
the residency manager running it against a vLLM-shaped /metrics over loopback HTTP."""
from __future__ import annotations

import asyncio
import logging


from gpu_agent.connectors.base import EngineLoad, EngineUnavailable
from gpu_agent.connectors.vllm import VLLMConnector
from gpu_agent.load import LoadChange, LoadMonitor
from tests.gpu_agent.agent_support import (VLLM_TEXT, FakeConnector, make_catalog, make_manager,
                                          metrics_server)
from tests.support.wait import async_wait_until


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def monitor(conn, heartbeat_s=2.0):
    seen: list[EngineLoad | None] = []
    clock = Clock()
    failures = []
    mon = LoadMonitor(conn, 0.01, seen.append, heartbeat_s=heartbeat_s, clock=lambda: 1.5,
                      monotonic=clock, on_failure=lambda: failures.append(1))
    return mon, seen, clock, failures


def test_announces_changes_and_repeats_a_known_load_every_heartbeat():
    async def main():
        conn = FakeConnector()
        mon, seen, clock, _ = monitor(conn)
        assert await mon.sample() is None and seen == []          # unknown from the start: nothing to say
        conn.engine_load_value = EngineLoad(2, 1)
        await mon.sample()
        assert seen == [EngineLoad(2, 1)] and seen[0].measured_unix_ms == 1500
        clock.t += 1.0
        await mon.sample()
        assert len(seen) == 1                                      # same counts, heartbeat not due
        clock.t += 1.0
        await mon.sample()
        assert len(seen) == 2 and seen[1] == EngineLoad(2, 1)      # heartbeat
        conn.engine_load_value = EngineLoad(0, 0)
        await mon.sample()
        assert seen[-1] == EngineLoad(0, 0) and mon.current == EngineLoad(0, 0)
        conn.engine_load_value = None
        await mon.sample()
        assert seen[-1] is None and mon.current is None
        clock.t += 10
        await mon.sample()
        assert seen[-1] is None and len(seen) == 4                 # unknown is not repeated
    asyncio.run(main())


def test_by_default_every_known_measurement_is_announced():
    """The gateway counts its sends since the host's last measurement: it must hear each
    one, an unchanged one too (gpu_agent.load.LOAD_HEARTBEAT_S = 0)."""
    async def main():
        conn = FakeConnector()
        seen: list[EngineLoad | None] = []
        mon = LoadMonitor(conn, 0.01, seen.append, clock=lambda: 1.5, monotonic=Clock())
        conn.engine_load_value = EngineLoad(2, 1)
        for _ in range(3):
            await mon.sample()
        assert seen == [EngineLoad(2, 1)] * 3
        conn.engine_load_value = None
        for _ in range(3):
            await mon.sample()
        assert seen[3:] == [None]                                  # unknown is said once
    asyncio.run(main())


def test_a_failed_measurement_is_unknown_counted_and_logged_rarely(caplog):
    async def main():
        conn = FakeConnector()
        conn.engine_load_value = EngineLoad(3, 0)
        mon, seen, clock, failures = monitor(conn)
        await mon.sample()
        conn.engine_load_error = EngineUnavailable("connection refused")
        with caplog.at_level(logging.DEBUG, logger="gpu_agent.load"):
            for _ in range(5):
                assert await mon.sample() is None
                clock.t += 1.0
        assert seen == [EngineLoad(3, 0), None] and len(failures) == 5
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "connection refused" in warnings[0].getMessage()
        assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4
        conn.engine_load_error = None
        assert await mon.sample() == EngineLoad(3, 0) and seen[-1] == EngineLoad(3, 0)
    asyncio.run(main())


def test_a_broken_connector_never_stops_the_loop():
    async def main():
        conn = FakeConnector()
        conn.engine_load_error = RuntimeError("bug in a connector")
        mon, seen, _, failures = monitor(conn)
        task = asyncio.create_task(mon.run())
        await async_wait_until(lambda: len(failures) >= 3)
        assert not task.done() and seen == []
        conn.engine_load_error = None
        conn.engine_load_value = EngineLoad(1, 1)
        await async_wait_until(lambda: seen == [EngineLoad(1, 1)])
        task.cancel()
    asyncio.run(main())


def test_manager_measures_a_vllm_engine_over_http_and_survives_bad_scrapes(tmp_path):
    async def main():
        state = {"text": VLLM_TEXT}
        async with metrics_server(state) as url:
            conn = VLLMConnector(url, metrics_timeout_s=0.5, metrics_max_age_s=0.0)
            mgr = make_manager(make_catalog(tmp_path, ["a1"]), tmp_path / "cache", conn, load_interval_s=0.02)
            await mgr.start()
            sub = mgr.subscribe()
            try:
                await async_wait_until(lambda: mgr.engine_load == EngineLoad(5, 7))
                assert mgr.engine_load.measured_unix_ms > 0
                text = mgr.metrics.render()
                assert "ace_agent_engine_requests_running 5" in text
                assert "ace_agent_engine_requests_waiting 7" in text
                state["status"] = 503                              # the engine's /metrics breaks
                await async_wait_until(lambda: mgr.engine_load is None)
                assert mgr.metrics.counter("ace_agent_load_read_failures_total") >= 1
                assert "ace_agent_engine_requests_running" not in mgr.metrics.render()
                state.update(status=200, text=VLLM_TEXT.replace("} 7.0", "} 1.0"))
                await async_wait_until(lambda: mgr.engine_load == EngineLoad(5, 1))
                changes = []
                while not sub.queue.empty():
                    item = sub.queue.get_nowait()
                    if isinstance(item, LoadChange):
                        changes.append(item.load)
                assert changes[:3] == [EngineLoad(5, 7), None, EngineLoad(5, 1)]
            finally:
                sub.close()
                await mgr.close()
    asyncio.run(main())


def test_load_interval_zero_measures_nothing(tmp_path):
    async def main():
        conn = FakeConnector()
        conn.engine_load_value = EngineLoad(1, 0)
        mgr = make_manager(make_catalog(tmp_path, ["a1"]), tmp_path / "cache", conn, load_interval_s=0,
                           reconcile_interval_s=0.01)
        await mgr.start()
        try:   # a monitor would measure as soon as it starts; two reconciles later, none did
            await async_wait_until(lambda: conn.reads["loaded"] >= 2, what="two reconciles")
            assert conn.reads["engine_load"] == 0
            assert mgr.engine_load is None
        finally:
            await mgr.close()
    asyncio.run(main())
