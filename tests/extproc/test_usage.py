"""extproc.observe.usage: the per (tenant, adapter) minute ring, with a fake clock and plain decisions."""
from __future__ import annotations

import threading

from extproc.state.catalog import Adapter, Upstream
from extproc.domain.decision import Decision
from extproc.domain.prefetch import PrefetchSignal
from extproc.state.residency import UNKNOWN, TierReport
from extproc.observe.usage import STALL_BOUNDS_MS, WINDOW_MINUTES, UsageRing, stall_percentile

UP = Upstream(name="h1", address="127.0.0.1:1", flavour="vllm", base_model="b")
A = Adapter(name="a1", base_model="b", rank=8, target_modules=("q_proj",), size_bytes=1, owner="public",
            uri="x", sha256="0" * 64)


class Clock:
    def __init__(self, t: float = 1_000_020.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def decision(res: TierReport, action: str = "adapter_resident_applied", signal: bool = False,
             adapter: Adapter | None = A) -> Decision:
    sig = PrefetchSignal(upstream="h1", adapter="a1", digest="0" * 64, priority=1, reason="request_cold") if signal else None
    return Decision(upstream=UP, adapter=adapter, selected_by="model", skills={}, residency=res,
                    multi_lora_action=action, multi_lora_would=None, prefetch_action="x", prefetch_signal=sig)


POOL = TierReport(tier="device", cold_load_ms=12.0)
PREFETCHED = TierReport(tier="device", cold_load_ms=12.0, prefetched=True)
DISK = TierReport(tier="disk", cold_load_ms=30.0)
HOST = TierReport(tier="host", cold_load_ms=1.5)


def test_counts_hits_stall_and_prefetches_per_minute():
    clock = Clock()
    ring = UsageRing(clock)
    ring.record("acme", decision(POOL), None)
    ring.record("acme", decision(PREFETCHED, "adapter_prefetched_applied"), None)
    ring.record("acme", decision(DISK, "adapter_cold_loaded", signal=True), True)
    ring.record("acme", decision(DISK, "adapter_cold_loaded", signal=True), False)   # dropped signal: not counted
    ring.record("acme", decision(UNKNOWN, "adapter_applied"), None)
    clock.t += 60
    ring.record("acme", decision(HOST, "adapter_staged_applied"), None)
    ring.record("acme", decision(UNKNOWN, adapter=None), None)                     # no adapter: nothing
    out = ring.series("acme", ["a1", "a2"], 3600)
    a1 = out["adapters"]["a1"]
    assert out["window_s"] == 3600 and len(a1["per_minute"]["requests"]) == WINDOW_MINUTES
    assert a1["per_minute"]["requests"][-2:] == [5, 1]
    assert a1["per_minute"]["hits"][-2:] == [2, 0]
    assert a1["totals"] == {"requests": 6, "hits": 2, "unknown": 1, "prefetch_signalled": 1, "prefetch_used": 1}
    assert a1["effective_hit_ratio"] == 2 / 5
    # stalls known: 0, 0, 30, 30, 1.5 -> buckets 0, 0, 50, 50, 2
    assert a1["expected_stall_ms"] == {"p50": 2.0, "p90": 50.0, "p99": 50.0}
    assert a1["prefetch_unused"] == 0
    assert out["adapters"]["a2"]["totals"]["requests"] == 0
    assert out["adapters"]["a2"]["effective_hit_ratio"] is None
    assert ring.series("globex", ["a1"])["adapters"]["a1"]["totals"]["requests"] == 0


def test_an_hour_later_the_old_minute_is_gone_and_the_window_narrows():
    clock = Clock()
    ring = UsageRing(clock)
    ring.record("acme", decision(POOL), None)
    assert ring.series("acme", ["a1"], 60)["adapters"]["a1"]["totals"]["requests"] == 1
    clock.t += 120
    assert ring.series("acme", ["a1"], 60)["adapters"]["a1"]["totals"]["requests"] == 0
    assert ring.series("acme", ["a1"], 180)["adapters"]["a1"]["totals"]["requests"] == 1
    clock.t += 60 * WINDOW_MINUTES          # same slot, an hour on: replaced, not added to
    ring.record("acme", decision(POOL), None)
    assert ring.series("acme", ["a1"])["adapters"]["a1"]["totals"]["requests"] == 1


def test_threads_write_their_own_shards_and_the_reader_sums_them():
    ring = UsageRing(Clock())

    def work():
        for _ in range(500):
            ring.record("acme", decision(POOL), None)
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ring.series("acme", ["a1"])["adapters"]["a1"]["totals"]["hits"] == 2000


def test_stall_percentile_is_the_bucket_bound():
    hist = [0] * (len(STALL_BOUNDS_MS) + 1)
    assert stall_percentile(hist, 0.5) is None
    hist[0], hist[-1] = 9, 1
    assert stall_percentile(hist, 0.5) == 0.0
    assert stall_percentile(hist, 0.99) == float("inf")
