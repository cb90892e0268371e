"""ace_common.loop_lag: a loop that is blocked shows as lag, the histogram a scrape shows,
and the task stops cleanly."""
from __future__ import annotations

import asyncio
import time

import pytest

from ace_common.loop_lag import LoopLag, LoopLagCollector
from tests.support.scrape import scrape_text
from tests.support.wait import async_wait_until


def test_a_blocked_loop_is_measured_as_lag():
    async def scenario():
        lag = LoopLag(interval_s=0.005).start()
        try:
            await async_wait_until(lambda: lag.samples >= 1, what="a first wake-up")
            seen = lag.samples
            # the lag task sleeps now with a wake-up due within 5 ms: block the loop past it
            time.sleep(0.08)
            await async_wait_until(lambda: lag.samples > seen, what="the wake-up after the block")
            assert lag.max_s >= 0.075 - 0.005
            assert lag.histogram.cumulative()[-1] == ("+Inf", lag.samples)
        finally:
            await lag.close()
        stopped = lag.samples
        await asyncio.sleep(0.02)
        assert lag.samples == stopped and lag._task is None   # closed: no more wake-ups

    asyncio.run(scenario())


def test_the_scrape_shows_a_cumulative_histogram_and_the_longest_lag():
    lag = LoopLag(buckets=(0.001, 0.01))
    for s in (0.0005, 0.004, 0.02):
        lag.record(s)
    text = scrape_text(LoopLagCollector(lag, "ace_test_loop_lag_seconds"))
    assert 'ace_test_loop_lag_seconds_bucket{le="0.001"} 1.0' in text
    assert 'ace_test_loop_lag_seconds_bucket{le="0.01"} 2.0' in text
    assert 'ace_test_loop_lag_seconds_bucket{le="+Inf"} 3.0' in text
    assert "ace_test_loop_lag_seconds_count 3.0" in text
    assert "ace_test_loop_lag_seconds_max 0.02" in text


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        LoopLag(interval_s=0)


def test_a_loop_has_at_most_one_running_monitor():
    async def scenario():
        assert LoopLag.running() is None
        lag = LoopLag().start()
        try:
            assert LoopLag.running() is lag and lag.start() is lag   # started once
            with pytest.raises(RuntimeError, match="already has"):
                LoopLag().start()
        finally:
            await lag.close()
        assert LoopLag.running() is None
        again = LoopLag().start()   # closed: another may start
        await again.close()

    asyncio.run(scenario())
    assert LoopLag.running() is None   # outside any loop
