"""ace_common.gc_pauses: every collection timed by generation, the histogram a scrape
shows, and the start-up heap frozen out of later collections."""
from __future__ import annotations

import gc
import logging

import pytest

from ace_common.gc_pauses import GcPauseCollector, GcPauses, freeze_enabled, freeze_startup_heap
from tests.support.scrape import scrape_text


def test_a_real_collection_is_timed_under_its_generation():
    pauses = GcPauses().install()
    try:
        before = pauses.snapshot()[2]["count"]
        gc.collect(2)
        after = pauses.snapshot()[2]
    finally:
        pauses.uninstall()
    assert after["count"] == before + 1
    assert after["sum_s"] > 0 and after["max_s"] > 0
    gc.collect(2)   # uninstalled: no longer counted
    assert pauses.snapshot()[2]["count"] == after["count"]


def test_buckets_are_cumulative_and_a_slow_pause_is_logged(caplog):
    pauses = GcPauses(slow_s=0.02, buckets=(0.001, 0.01))
    with caplog.at_level(logging.INFO, logger="ace_common.gc_pauses"):
        pauses.record(0, 0.0005)
        pauses.record(0, 0.005)
        pauses.record(2, 0.057)
    snap = pauses.snapshot()
    assert snap[0]["buckets"] == [(0.001, 1), (0.01, 2), (float("inf"), 2)]
    assert snap[2]["buckets"] == [(0.001, 0), (0.01, 0), (float("inf"), 1)]
    assert snap[2]["max_s"] == 0.057
    assert [r.getMessage() for r in caplog.records] == [
        "garbage collection of generation 2 paused the process 57.0 ms"]
    assert pauses.summary()["gen0"] == {"n": 2, "sum_ms": 5.5, "max_ms": 5.0}


def test_the_scrape_shows_a_histogram_per_generation():
    pauses = GcPauses(buckets=(0.001, 0.01))
    pauses.record(1, 0.002)
    text = scrape_text(GcPauseCollector(pauses, "ace_test_gc_pause_seconds"))
    assert 'ace_test_gc_pause_seconds_bucket{generation="1",le="0.001"} 0.0' in text
    assert 'ace_test_gc_pause_seconds_bucket{generation="1",le="0.01"} 1.0' in text
    assert 'ace_test_gc_pause_seconds_bucket{generation="1",le="+Inf"} 1.0' in text
    assert 'ace_test_gc_pause_seconds_count{generation="2"} 0.0' in text


def test_frozen_start_up_objects_are_left_out_of_later_collections(monkeypatch):
    monkeypatch.delenv("ACE_GC_FREEZE", raising=False)
    class Node:
        pass

    keep = [Node() for _ in range(2000)]   # start-up state that lives on
    assert any(o is keep[0] for o in gc.get_objects())   # walked by a full collection
    try:
        frozen = freeze_startup_heap()
        assert frozen == gc.get_freeze_count() >= len(keep)
        # in the permanent generation now: no generation a collection walks holds it
        assert not any(o is keep[0] for o in gc.get_objects())
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_turned_off_nothing_is_frozen(monkeypatch):
    monkeypatch.setenv("ACE_GC_FREEZE", "off")
    assert freeze_startup_heap() is None
    assert gc.get_freeze_count() == 0


def test_close_uninstalls_and_logs_the_totals(caplog):
    pauses = GcPauses().install()
    pauses.record(1, 0.002)
    with caplog.at_level(logging.INFO, logger="test.gc"):
        pauses.close(logging.getLogger("test.gc"))
    assert pauses._hook not in gc.callbacks
    assert caplog.records[-1].getMessage().startswith('gc pauses: {"gen0": {"max_ms": 0.0, "n": 0')
    assert '"gen1": {"max_ms": 2.0, "n": 1, "sum_ms": 2.0}' in caplog.records[-1].getMessage()


@pytest.mark.parametrize("value, on", [(None, True), ("on", True), ("off", False), ("0", False), ("OFF", False)])
def test_freezing_can_be_turned_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("ACE_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("ACE_GC_FREEZE", value)
    assert freeze_enabled() is on
