import hashlib

import pytest
import torch

from gpu_agent.errors import AdapterNotFound, DigestMismatch
from gpu_agent.engine.pool import AdapterPool
from gpu_agent.engine.staging import AdapterTiers, HostCache

from .lora_testing import SPEC, make_adapter, write_peft_dir


def test_disk_host_pool_path_and_timings(tmp_path):
    ad = make_adapter("med", 16)
    path = write_peft_dir(tmp_path, ad)
    digest = hashlib.sha256((path / "adapter_model.safetensors").read_bytes()).hexdigest()
    pool = AdapterPool(SPEC, 1 << 20)
    tiers = AdapterTiers(pool, host_budget_bytes=1 << 20)
    assert tiers.where("med") is None
    entry, t = tiers.ensure("med", path, digest)
    assert t.tier == "disk" and t.nbytes == ad.nbytes and t.total_ms >= t.pool_ms > 0
    assert t.read_ms > 0 and t.verify_ms > 0
    a, bt = pool.matrices(entry, 1, "v_proj")
    assert torch.equal(a, ad.weights[(1, "v_proj")][0]) and torch.equal(bt, ad.weights[(1, "v_proj")][1].t())
    assert tiers.ensure("med")[1].tier == "device"
    pool.evict("med")
    assert tiers.where("med") == "host"
    _, t = tiers.ensure("med")
    assert t.tier == "host" and t.read_ms == 0


def test_digest_and_missing(tmp_path):
    path = write_peft_dir(tmp_path, make_adapter("x", 8))
    tiers = AdapterTiers(AdapterPool(SPEC, 1 << 20), 1 << 20)
    with pytest.raises(DigestMismatch):
        tiers.ensure("x", path, "ab" * 32)
    with pytest.raises(AdapterNotFound):
        tiers.ensure("y")


def test_host_cache_lru_by_bytes():
    a, b, c = (make_adapter(n, 8) for n in "abc")
    cache = HostCache(2 * a.nbytes)
    assert cache.put(a) and cache.put(b)
    cache.get("a")
    assert cache.put(c)
    assert cache.names() == ["a", "c"] and cache.used_bytes == 2 * a.nbytes and cache.evictions == 1
    assert not cache.put(make_adapter("big", 64))
    cache.drop("a")
    assert cache.names() == ["c"]


def test_host_budget_zero_keeps_no_parsed_copy(tmp_path):
    """Budget 0: the parsed adapter lives only for its load; after eviction it is read
    from disk again (no host -> pool shortcut)."""
    ad = make_adapter("med", 16)
    path = write_peft_dir(tmp_path, ad)
    pool = AdapterPool(SPEC, 1 << 20)
    tiers = AdapterTiers(pool, host_budget_bytes=0)
    assert tiers.ensure("med", path)[1].tier == "disk"
    assert tiers.host.names() == [] and tiers.host.used_bytes == 0
    pool.evict("med")
    assert tiers.where("med") is None
    with pytest.raises(AdapterNotFound):
        tiers.ensure("med")                 # nothing in memory: it needs its directory
    _, t = tiers.ensure("med", path)
    assert t.tier == "disk" and t.read_ms > 0
