import random

import pytest
import torch

from gpu_agent.errors import AdapterBusy, AdapterInvalid, AdapterNotResident, PoolExhausted
from gpu_agent.engine.peft import BaseModelSpec
from gpu_agent.engine.pool import EMPTY_SLOT, AdapterPool

from .lora_testing import SPEC, make_adapter

# pages per rank-r adapter on q/k/v/o over 2 layers: (2r for q and o, 1.5r for k and v: out 16 < W 32) * 2
PAGES_PER_RANK = 14


def test_one_tensor_mixed_ranks_and_layout():
    pool = AdapterPool(SPEC, 1 << 20, dtype=torch.float32)
    assert pool.pages.shape == (pool.num_pages, SPEC.hidden_size)
    assert pool.num_pages == (1 << 20) // (32 * 4)
    for r in (8, 16, 32, 64, 128):
        e = pool.load(make_adapter(f"r{r}", r))
        assert len(e.page_ids) == r * PAGES_PER_RANK and e.contiguous
    # up_proj B [80, 8] takes 80*8/32 = 20 pages; down_proj A [8, 80] too.
    wide = make_adapter("wide", 8, modules=("up_proj", "down_proj"))
    assert pool.pages_for(wide) == 2 * (8 + 20 + 20 + 8)  # numel / W per matrix
    pool.load(wide)
    a, bt = pool.matrices(pool.entry("wide"), 1, "up_proj")
    assert a.shape == (8, 32) and bt.shape == (8, 80)
    assert a.data_ptr() >= pool.pages.data_ptr()  # views, not copies
    assert torch.equal(bt, wide.weights[(1, "up_proj")][1].t())
    pool.check_invariants()
    st = pool.stats()
    assert st["adapters"] == 6 and st["pages_used"] + st["pages_free"] == pool.num_pages
    assert st["pool_bytes"] == pool.pages.numel() * 4


def test_load_is_idempotent_and_pin_upgrades():
    pool = AdapterPool(SPEC, 1 << 20)
    e1 = pool.load(make_adapter("a", 8))
    e2 = pool.load(make_adapter("a", 8), pin=True)
    assert e1 is e2 and e2.pinned and pool.stats()["loads"] == 1


def test_explicit_errors():
    pool = AdapterPool(SPEC, 64 * PAGES_PER_RANK * 128)  # exactly one rank-64 adapter
    with pytest.raises(PoolExhausted):
        pool.load(make_adapter("huge", 128))
    pool.load(make_adapter("a", 64), pin=True)
    with pytest.raises(PoolExhausted, match="pinned or in use"):
        pool.load(make_adapter("b", 8))
    with pytest.raises(AdapterBusy):
        pool.evict("a")
    with pytest.raises(AdapterNotResident):
        pool.evict("zzz")
    with pytest.raises(AdapterNotResident):
        with pool.batch(["zzz"]):
            pass
    other = BaseModelSpec("other", 2, 32, SPEC.modules)
    with pytest.raises(AdapterInvalid):
        pool.load(make_adapter("o", 8, spec=other))
    with pytest.raises(PoolExhausted):
        AdapterPool(SPEC, 10)


def test_in_use_never_evicted():
    pool = AdapterPool(SPEC, 2 * 8 * PAGES_PER_RANK * 128)   # two rank-8 adapters
    pool.load(make_adapter("a", 8))
    pool.load(make_adapter("b", 8))
    with pool.batch(["a", None, "b"]) as batch:
        assert batch.row_slots.tolist() == [pool.entry("a").slot, EMPTY_SLOT, pool.entry("b").slot]
        with pytest.raises(PoolExhausted):
            pool.load(make_adapter("c", 8))
        with pytest.raises(AdapterBusy):
            pool.evict("a")
    pool.load(make_adapter("c", 8))          # now "a" (LRU) goes
    assert pool.resident() == ["b", "c"] and pool.stats()["evictions"] == 1


def test_unpin_makes_evictable_and_slots_are_reused():
    pool = AdapterPool(SPEC, 8 * PAGES_PER_RANK * 128)
    s = pool.load(make_adapter("a", 8), pin=True).slot
    pool.unpin("a")
    e = pool.load(make_adapter("b", 8))
    assert not pool.contains("a") and e.slot == s
    assert pool.slot_scales[s].item() == pytest.approx(2.0)


def test_no_fragmentation_random_sequences():
    """After arbitrary load/evict sequences any request that fits in free pages succeeds,
    and the page tables stay consistent."""
    rng = random.Random(7)
    pool = AdapterPool(SPEC, 300 * PAGES_PER_RANK * 128)
    adapters = {r: make_adapter(f"t{r}", r) for r in (8, 16, 32, 64, 128)}
    n = 0
    for step in range(400):
        resident = pool.resident()
        if resident and rng.random() < 0.45:
            pool.evict(rng.choice(resident))
        else:
            r = rng.choice(list(adapters))
            ad = adapters[r]
            ad.name = f"t{n}"
            n += 1
            need = pool.pages_for(ad)
            if need <= pool.stats()["pages_free"]:
                pool.load(ad)                     # must succeed without eviction
                assert pool.stats()["evictions"] == 0
        pool.check_invariants()
    assert pool.stats()["scattered_loads"] > 0  # the sequence did exercise scattered pages
    # and every resident adapter's pages still hold its own weights
    for name in pool.resident():
        e = pool.entry(name)
        a, _ = pool.matrices(e, 0, "q_proj")
        assert a.shape == (e.rank, 32)


def test_batch_grouping_and_in_use_counts():
    pool = AdapterPool(SPEC, 1 << 20)
    for n in "abc":
        pool.load(make_adapter(n, 8))
    with pool.batch(["a", "a", None, "b", "b"]) as batch:
        assert batch.perm is None
        assert [(s.entry.name, s.start, s.end) for s in batch.segments] == [("a", 0, 2), ("b", 3, 5)]
    with pool.batch(["a", "b", "a", None, "c"]) as batch:
        assert batch.perm.tolist() == [0, 2, 1, 4]
        assert [(s.entry.name, s.start, s.end) for s in batch.segments] == [("a", 0, 2), ("b", 2, 3), ("c", 3, 4)]
        assert pool.stats()["in_use"] == 3
    assert pool.stats()["in_use"] == 0
    with pool.batch(["a"] * 5000) as batch:     # grows the preallocated index tensors
        assert batch.row_slots.numel() == 5000


@pytest.mark.parametrize("rank, file_dtype, pool_dtype", [
    (8, torch.float32, torch.float32),    # pool image == file bytes: one memcpy
    (8, torch.bfloat16, torch.float32),   # cast per matrix
    (3, torch.float32, torch.float32),    # k/v B [16, 3] does not fill whole pages
])
def test_loaded_from_disk_all_copy_paths(tmp_path, rank, file_dtype, pool_dtype):
    from gpu_agent.engine.peft import load_peft_dir

    from .lora_testing import write_peft_dir

    ad = make_adapter("d", rank, dtype=file_dtype, modules=("q_proj", "k_proj", "up_proj"))
    loaded = load_peft_dir(write_peft_dir(tmp_path, ad), SPEC)
    pool = AdapterPool(SPEC, 1 << 20, dtype=pool_dtype)
    pool.load(make_adapter("other", 8))           # so "d" does not start at page 0
    pool.evict("other")
    pool.load(make_adapter("first", 8))
    e = pool.load(loaded)
    pool.check_invariants()
    for key, (a, b) in ad.weights.items():
        pa, pbt = pool.matrices(e, *key)
        assert torch.equal(pa, a.to(pool_dtype)) and torch.equal(pbt, b.t().to(pool_dtype))


def test_concurrent_batches_do_not_share_index_tensors():
    pool = AdapterPool(SPEC, 1 << 20)
    for n in "ab":
        pool.load(make_adapter(n, 8))
    with pool.batch(["a", "b", "a"]) as first:
        with pool.batch(["b", "a", "b", "b"]) as second:
            assert first.row_slots.data_ptr() != second.row_slots.data_ptr()
            assert second.perm.tolist() == [0, 2, 3, 1]
        assert first.perm.tolist() == [0, 2, 1]
        assert first.row_slots.tolist() == [pool.entry(n).slot for n in "aba"]
    with pool.batch(["a"]) as third:               # the shared buffers are free again
        assert third.row_slots.data_ptr() == pool._row_slots.data_ptr()


def test_disk_load_into_scattered_pages_same_bytes(tmp_path):
    """A file-backed adapter placed in scattered free pages holds the same bytes as the
    one-memcpy path (contiguous) and as the in-memory adapter; releases keep the bitmap."""
    from gpu_agent.engine.peft import load_peft_dir

    from .lora_testing import write_peft_dir

    ad = make_adapter("d", 8, modules=("q_proj", "k_proj", "o_proj"))
    loaded = load_peft_dir(write_peft_dir(tmp_path, ad), SPEC)
    pool = AdapterPool(SPEC, 1 << 20)
    need = pool.pages_for(loaded)
    one = AdapterPool(SPEC, 1 << 20)
    e1 = one.load(loaded)
    assert e1.contiguous
    # fill the pool with small adapters, then free every other one: no run fits `d`
    small = []
    i = 0
    while pool.stats()["pages_free"] >= pool.pages_for(make_adapter("s", 1, modules=("q_proj",))):
        pool.load(make_adapter(f"s{i}", 1, modules=("q_proj",)))
        small.append(f"s{i}")
        i += 1
    for n in small[::2]:
        pool.evict(n)
    assert pool.stats()["pages_free"] >= need
    e = pool.load(loaded)
    assert not e.contiguous
    pool.check_invariants()
    for key, (a, b) in ad.weights.items():
        pa, pbt = pool.matrices(e, *key)
        qa, qbt = one.matrices(e1, *key)
        assert torch.equal(pa, a) and torch.equal(pbt, b.t())
        assert torch.equal(pa, qa) and torch.equal(pbt, qbt)
    pool.evict("d")
    one.evict("d")
    pool.check_invariants()
    one.check_invariants()
    assert one.stats()["pages_free"] == one.num_pages


@pytest.mark.parametrize("part_min, close_file", [(None, False), (4096, False), (None, True)])
def test_pread_into_pages_same_bytes_as_mapping(tmp_path, monkeypatch, part_min, close_file):
    """CPU one-copy loads pread the file into the page run (in parts when large); with
    the file closed they copy from the mapping. Same bytes either way."""
    import gpu_agent.engine.pool_copy as pool_mod
    from gpu_agent.engine.peft import load_peft_dir

    from .lora_testing import write_peft_dir

    if part_min is not None:
        monkeypatch.setattr(pool_mod, "PREAD_PART_MIN", part_min)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    ad = make_adapter("d", 16, modules=("q_proj", "o_proj"))
    loaded = load_peft_dir(write_peft_dir(tmp_path, ad), SPEC)
    assert loaded.payload.file is not None
    if close_file:
        loaded.payload.file.close()
    pool = AdapterPool(SPEC, 1 << 20)
    pool.load(make_adapter("first", 8))
    e = pool.load(loaded)
    assert e.contiguous and loaded.payload.plans[(pool.row_width, pool.dtype)][2]   # one-copy path
    for key, (a, b) in ad.weights.items():
        pa, pbt = pool.matrices(e, *key)
        assert torch.equal(pa, a) and torch.equal(pbt, b.t())
    start, end = loaded.payload.matrices[0].start, loaded.payload.matrices[-1].end
    p0 = int(e.page_ids[0])
    got = pool.pages[p0: p0 + len(e.page_ids)].view(-1).view(torch.uint8)
    assert torch.equal(got, loaded.payload.buffer[start:end])


def test_release_listeners_hear_every_adapter_that_leaves():
    pool = AdapterPool(SPEC, 2 * 8 * PAGES_PER_RANK * 128, max_adapters=2)   # two rank-8 adapters
    left: list[tuple[str, str]] = []
    pool.release_listeners.append(lambda name, reason: left.append((name, reason.value)))
    for name in "abc":
        pool.load(make_adapter(name, 8))    # "c" evicts "a" (LRU, count cap)
    pool.evict("b")
    assert left == [("a", "budget"), ("b", "operator")] and pool.resident() == ["c"]
