"""A load never blocks a forward step: the pool's copy runs without its lock.

Every interleaving is driven by a hold in the load's own yield checkpoint, asked between
chunks of the copy (on the loading thread), never by a sleep: while the copy is held open
mid-way, batches of resident adapters are set up and computed, the adapter being copied is
invisible, and its reserved pages are neither evicted nor handed to another load.
"""
from __future__ import annotations

import threading

import pytest
import torch

from gpu_agent.errors import AdapterNotResident, PoolExhausted
from gpu_agent.engine.lora_ops import apply_lora
from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir
from gpu_agent.engine.pool import COPY_CHUNK_BYTES, AdapterPool
from tests.support.wait import scaled, wait_until

from .lora_testing import make_adapter, write_peft_dir

# hidden 256: a rank-64 adapter on q/k/v/o over 2 layers is 16 x 64 KiB = 1 MiB, 4 copy chunks
WIDE = BaseModelSpec("tiny-base", 2, 256, {m: (256, 256) for m in ("q_proj", "k_proj", "v_proj", "o_proj")})
HOLD_S = 120  # longer than any failure deadline below: a copy held on old code outlives the test's wait


class HeldCopy:
    """``should_yield`` of a prefetch's load that holds the copy at its ``hold_at``-th
    checkpoint (1st: before anything is evicted; 2nd: after the first chunk) until ``go``."""

    def __init__(self, hold_at: int = 2):
        self.hold_at, self.calls = hold_at, 0
        self.reached, self.go = threading.Event(), threading.Event()

    def __call__(self, stage: str) -> bool:
        self.calls += 1
        if self.calls == self.hold_at:
            self.reached.set()
            self.go.wait(scaled(HOLD_S))
        return False


def _big(tmp_path, name="big", seed=1):
    ad = make_adapter(name, 64, spec=WIDE, seed=seed)
    loaded = load_peft_dir(write_peft_dir(tmp_path, ad), WIDE)
    assert loaded.nbytes > 2 * COPY_CHUNK_BYTES
    return ad, loaded


def _start_load(pool, adapter, hold: HeldCopy) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        try:
            out["entry"] = pool.load(adapter, should_yield=hold)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc
    t = threading.Thread(target=run, name="test-load")
    t.start()
    return t, out


def _in_thread(fn) -> tuple[threading.Event, dict]:
    done, out = threading.Event(), {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["error"] = exc
        done.set()
    threading.Thread(target=run, name="test-forward", daemon=True).start()
    return done, out


def test_a_forward_step_on_a_resident_adapter_runs_while_a_load_is_held_mid_copy(tmp_path):
    pool = AdapterPool(WIDE, 8 << 20)
    small = make_adapter("small", 8, spec=WIDE)
    pool.load(small)
    ad, loaded = _big(tmp_path)
    hold = HeldCopy()
    loader, result = _start_load(pool, loaded, hold)
    try:
        assert hold.reached.wait(scaled(30)), "the load never reached its second copy checkpoint"
        x = torch.randn(3, 256)

        def forward_step():
            y = torch.zeros(3, 256)
            with pool.batch(["small", None, "small"]) as lb:
                for layer in range(WIDE.num_layers):
                    apply_lora(y, x, pool, lb, layer, "q_proj")
            return y
        done, out = _in_thread(forward_step)
        wait_until(done.is_set, what="a forward step while another adapter's copy is held open")
        assert "error" not in out, out
        want = sum(small.scale * (x @ a.t()) @ b.t()
                   for a, b in (small.weights[(layer, "q_proj")] for layer in range(WIDE.num_layers)))
        torch.testing.assert_close(out["value"][0], want[0], rtol=1e-4, atol=1e-5)
        assert torch.count_nonzero(out["value"][1]) == 0
        # the adapter being copied is not visible yet; what is resident still answers
        assert not pool.contains("big") and pool.resident() == ["small"]
        with pytest.raises(AdapterNotResident):
            with pool.batch(["big"]):
                pass
        assert pool.stats()["copying"] == 1
        pool.check_invariants()
        assert loader.is_alive()
    finally:
        hold.go.set()
        loader.join(scaled(30))
    assert "error" not in result, result
    entry = result["entry"]
    assert pool.contains("big") and pool.stats()["copying"] == 0
    for key, (a, b) in ad.weights.items():
        pa, pbt = pool.matrices(entry, *key)
        assert torch.equal(pa, a) and torch.equal(pbt, b.t())
    pool.check_invariants()


def test_pages_being_copied_into_are_never_evicted_nor_given_to_another_load(tmp_path):
    ad, loaded = _big(tmp_path)
    # room for the big adapter and a few small ones, no more
    probe = AdapterPool(WIDE, 8 << 20)
    pages = probe.pages_for(loaded) + 2 * probe.pages_for(make_adapter("s", 8, spec=WIDE))
    pool = AdapterPool(WIDE, pages * probe.page_bytes)
    pool.load(make_adapter("s0", 8, spec=WIDE))
    pool.load(make_adapter("s1", 8, spec=WIDE))
    pool.evict("s1")
    hold = HeldCopy()
    loader, result = _start_load(pool, loaded, hold)
    try:
        assert hold.reached.wait(scaled(30))
        # a second big adapter needs the pages being copied into: it may take s0, never them
        _, other = _big(tmp_path / "o", name="big2", seed=2)
        done, out = _in_thread(lambda: pool.load(other, should_yield=lambda stage: False))
        wait_until(done.is_set, what="the competing load's answer")
        assert isinstance(out.get("error"), PoolExhausted), out
        pool.check_invariants()
        # a demand load of the same adapter waits for the copy under way and shares it
        same, shared = _in_thread(lambda: pool.load(loaded))
        assert not same.is_set() and loader.is_alive()
    finally:
        hold.go.set()
        loader.join(scaled(30))
    wait_until(same.is_set, what="the second caller of the same load")
    assert shared["value"] is result["entry"] and pool.stats()["loads"] == 3   # s0, s1, big once
    for key, (a, b) in ad.weights.items():
        pa, pbt = pool.matrices(result["entry"], *key)
        assert torch.equal(pa, a) and torch.equal(pbt, b.t())
    pool.check_invariants()


def test_a_failed_copy_frees_its_reserved_pages_and_place(tmp_path):
    pool = AdapterPool(WIDE, 8 << 20, max_adapters=1)
    _, loaded = _big(tmp_path)

    def stop_mid_copy(stage, calls=[]):
        calls.append(stage)
        return len(calls) == 2      # yield after the first chunk
    from gpu_agent.errors import LoadYielded
    with pytest.raises(LoadYielded):
        pool.load(loaded, should_yield=stop_mid_copy)
    st = pool.stats()
    assert st["pages_used"] == 0 and st["copying"] == 0 and not pool.contains("big")
    pool.check_invariants()
    pool.load(make_adapter("small", 8, spec=WIDE))     # the count's one place is free again
