"""ResidencyManager with a fake in-memory engine; the remote tier is a real loopback HTTP server."""
from __future__ import annotations

import asyncio

import pytest

from gpu_agent.artifacts import ArtifactStore, Catalog, CatalogError, DiskCache
from gpu_agent.errors import AdapterNotFound, DigestMismatch
from gpu_agent.residency.manager import ResidencyOutcome, ResidencyResult
from ace_common.tiers import Tier

from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager, static_server
from tests.support.wait import async_wait_until

DONE = ResidencyResult(ResidencyOutcome.DONE)

NAMES = ["a1", "a2", "a3", "a4"]


def run(coro):
    return asyncio.run(coro)


def test_prefetch_moves_local_adapter_to_device_and_records_cold_load(tmp_path):
    async def main():
        eng = FakeConnector()
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            assert mgr.view("a1").tier is Tier.DISK
            assert mgr.view("a1").cold_load_ms is None
            res = mgr.prefetch("a1", reason="test")
            assert res.outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a1").tier is Tier.DEVICE)
            view = mgr.view("a1")
            assert view.cold_load_ms is not None and view.cold_load_ms > 0
            assert view.bytes == 4096
            assert "a1" in eng.held
            assert mgr.prefetch("a1").outcome is ResidencyOutcome.ALREADY_RESIDENT
        finally:
            await mgr.close()
    run(main())


def test_unknown_and_digest_mismatch_and_unsafe_names_are_rejected(tmp_path):
    async def main():
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", FakeConnector())
        await mgr.start()
        try:
            assert mgr.prefetch("nope").reason == "unknown_adapter"
            assert mgr.prefetch("../a1").reason == "unknown_adapter"
            assert mgr.prefetch("a1/../../etc").reason == "unknown_adapter"
            r = mgr.prefetch("a1", digest="0" * 64)
            assert (r.outcome, r.reason) == (ResidencyOutcome.REJECTED, "digest_mismatch")
            assert mgr.view("../a1").tier is Tier.ABSENT
        finally:
            await mgr.close()
    run(main())


def test_duplicates_coalesce_and_queue_is_bounded(tmp_path):
    async def main():
        eng = FakeConnector(load_delay_s=0.2)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, queue_size=2)
        await mgr.start()
        try:
            outcomes = [mgr.prefetch("a1") for _ in range(5)]
            assert outcomes[0].outcome is ResidencyOutcome.ACCEPTED
            assert all(o.reason == "coalesced" for o in outcomes[1:])
            assert mgr.prefetch("a2").outcome is ResidencyOutcome.ACCEPTED
            # a1 is running now, a2 queued (nothing below yields to the loop until the wait)
            await async_wait_until(lambda: ("load", "a1") in eng.calls, what="a1 loading")
            assert mgr.prefetch("a3").outcome is ResidencyOutcome.ACCEPTED
            r = mgr.prefetch("a4")
            assert (r.outcome, r.reason) == (ResidencyOutcome.REJECTED, "queue_full")
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE)
            assert [c for c in eng.calls if c == ("load", "a1")] == [("load", "a1")]
        finally:
            await mgr.close()
    run(main())


def test_higher_priority_runs_first(tmp_path):
    async def main():
        eng = FakeConnector(load_delay_s=0.05)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            mgr.prefetch("a1", priority=0)
            await async_wait_until(lambda: ("load", "a1") in eng.calls, what="a1 loading")
            mgr.prefetch("a2", priority=1)
            mgr.prefetch("a3", priority=9)
            await async_wait_until(lambda: all(mgr.view(n).tier is Tier.DEVICE for n in ("a1", "a2", "a3")))
            assert [n for op, n in eng.calls if op == "load"] == ["a1", "a3", "a2"]
        finally:
            await mgr.close()
    run(main())


def test_device_count_budget_evicts_lru_but_never_pinned_or_busy(tmp_path):
    async def main():
        eng = FakeConnector(capacity=2)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            assert mgr.pin("a1") == DONE
            await async_wait_until(lambda: mgr.view("a1").tier is Tier.DEVICE)
            await mgr.ensure_resident("a2")
            await mgr.ensure_resident("a3")          # evicts a2 (a1 pinned)
            assert set(eng.held) == {"a1", "a3"}
            assert ("unload", "a2") in eng.calls
            eng.busy_set = {"a3"}
            with pytest.raises(Exception, match="pinned or busy"):
                await mgr.ensure_resident("a4")       # a1 pinned, a3 busy: nothing may go
            assert set(eng.held) == {"a1", "a3"}
            eng.busy_set = set()
            mgr.unpin("a1")
            await mgr.ensure_resident("a4")           # now LRU a1 goes
            assert set(eng.held) == {"a3", "a4"}
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="budget") == 2
        finally:
            await mgr.close()
    run(main())


def test_evict_refuses_pinned_and_drops_tiers(tmp_path):
    async def main():
        eng = FakeConnector()
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, host_bytes=1 << 20)
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            mgr.pin("a1")
            assert await mgr.evict("a1") == ResidencyResult(ResidencyOutcome.REJECTED, "pinned")
            mgr.unpin("a1")
            assert await mgr.evict("a1", Tier.HOST) == DONE
            assert mgr.view("a1").tier is Tier.HOST
            assert await mgr.evict("a1", Tier.DISK) == DONE
            assert mgr.view("a1").tier is Tier.DISK
            assert "a1" not in eng.held
            count = mgr.metrics.counter
            assert (count("ace_agent_evictions_total", tier="device", reason="operator"),
                    count("ace_agent_evictions_total", tier="host", reason="operator")) == (1, 1)
        finally:
            await mgr.close()
    run(main())


def test_host_tier_budget_is_lru(tmp_path):
    async def main():
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", FakeConnector(capacity=1),
                           host_bytes=2 * 4096)
        await mgr.start()
        try:
            for name in ("a1", "a2", "a3"):
                await mgr.ensure_resident(name)
            assert mgr.view("a3").tier is Tier.DEVICE
            assert mgr.view("a2").tier is Tier.HOST
            assert mgr.view("a1").tier is Tier.DISK    # fell out of host (2 x 4 KiB budget)
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="host", reason="budget") == 1
        finally:
            await mgr.close()
    run(main())


def test_remote_tier_fetch_verifies_digest_and_caches_on_disk(tmp_path):
    async def main():
        async with static_server(tmp_path / "adapters") as (base, hits):
            cat = make_catalog(tmp_path, NAMES, remote_base=base)
            eng = FakeConnector()
            mgr = make_manager(cat, tmp_path / "cache", eng)
            await mgr.start()
            try:
                assert mgr.view("a1").tier is Tier.REMOTE
                await mgr.ensure_resident("a1")
                assert mgr.view("a1").tier is Tier.DEVICE
                # weights landed in the cache under their digest, not their name
                digest = mgr.view("a1").digest
                assert eng.held["a1"] == tmp_path / "cache" / digest
                await mgr.evict("a1")
                assert mgr.view("a1").tier is Tier.DISK
                await mgr.ensure_resident("a1")           # from disk: no second download
                assert hits["a1/adapter_model.safetensors"] == 1
                await mgr.evict("a1", Tier.REMOTE)
                assert mgr.view("a1").tier is Tier.REMOTE
                assert not (tmp_path / "cache" / digest).exists()
            finally:
                await mgr.close()
    run(main())


def test_remote_digest_mismatch_is_refused_and_nothing_is_cached(tmp_path):
    async def main():
        async with static_server(tmp_path / "adapters", corrupt={"a2"}) as (base, _):
            mgr = make_manager(make_catalog(tmp_path, NAMES, remote_base=base), tmp_path / "cache", FakeConnector())
            await mgr.start()
            try:
                with pytest.raises(DigestMismatch):
                    await mgr.ensure_resident("a2")
                assert mgr.view("a2").tier is Tier.REMOTE
                assert [p.name for p in (tmp_path / "cache").iterdir()] == []
                assert mgr.metrics.counter("ace_agent_load_failures_total", reason="digest_mismatch") == 1
            finally:
                await mgr.close()
    run(main())


def test_local_digest_mismatch_is_refused(tmp_path):
    async def main():
        cat = make_catalog(tmp_path, NAMES)
        (tmp_path / "adapters" / "a3" / "adapter_model.safetensors").write_bytes(b"tampered")
        eng = FakeConnector()
        mgr = make_manager(cat, tmp_path / "cache", eng)
        await mgr.start()
        try:
            with pytest.raises(DigestMismatch):
                await mgr.ensure_resident("a3")
            assert "a3" not in eng.held
        finally:
            await mgr.close()
    run(main())


def test_disk_cache_budget_evicts_lru_remote_copies(tmp_path):
    async def main():
        async with static_server(tmp_path / "adapters") as (base, _):
            cat = make_catalog(tmp_path, NAMES, remote_base=base)
            mgr = make_manager(cat, tmp_path / "cache", FakeConnector(capacity=1), disk_bytes=2 * 4096)
            await mgr.start()
            try:
                for name in ("a1", "a2", "a3"):
                    await mgr.ensure_resident(name)
                tiers = {n: mgr.view(n).tier for n in ("a1", "a2", "a3")}
                assert tiers == {"a1": Tier.REMOTE, "a2": Tier.DISK, "a3": Tier.DEVICE}
                assert mgr.store.cache.used_bytes <= 2 * 4096
                assert mgr.metrics.counter("ace_agent_evictions_total", tier="disk", reason="budget") == 1
            finally:
                await mgr.close()
    run(main())


def test_disk_budget_zero_keeps_only_resident_files(tmp_path):
    """Resident-only disk tier (budget 0): a fetch first drops every file whose adapter is
    not resident, loading or pinned; an adapter that comes back is fetched again."""
    async def main():
        async with static_server(tmp_path / "adapters") as (base, hits):
            cat = make_catalog(tmp_path, NAMES, remote_base=base)
            mgr = make_manager(cat, tmp_path / "cache", FakeConnector(capacity=1), disk_bytes=0)
            await mgr.start()
            try:
                for name in ("a1", "a2", "a3"):
                    await mgr.ensure_resident(name)
                # a1's file went at a3's fetch; a2 left the device after it (other engines:
                # dropped at the next fetch)
                tiers = {n: mgr.view(n).tier for n in ("a1", "a2", "a3")}
                assert tiers == {"a1": Tier.REMOTE, "a2": Tier.DISK, "a3": Tier.DEVICE}
                await mgr.ensure_resident("a1")
                assert hits["a1/adapter_model.safetensors"] == 2       # the whole way again
                assert {n: mgr.view(n).tier for n in ("a2", "a3")} == {"a2": Tier.REMOTE, "a3": Tier.DISK}
                assert mgr.metrics.counter("ace_agent_evictions_total", tier="disk", reason="left_device") == 2
            finally:
                await mgr.close()
    run(main())


def test_left_device_drops_files_only_from_a_resident_only_cache(tmp_path):
    async def main():
        async with static_server(tmp_path / "adapters") as (base, _):
            cat = Catalog.from_yaml(make_catalog(tmp_path, NAMES, remote_base=base))
            spec = cat.get("a1")
            for budget, dropped in ((1 << 20, False), (0, True)):
                store = ArtifactStore(cat, DiskCache(tmp_path / f"cache-{budget}", budget))
                try:
                    path, fetched = await store.ensure_local(spec, set())
                    assert fetched and path.is_dir()
                    assert store.left_device(spec, keep={spec.sha256}) is False   # still held
                    assert store.left_device(spec) is dropped
                    assert (store.local_path(spec) is None) is dropped and path.exists() is not dropped
                finally:
                    await store.aclose()
    run(main())


def test_catalog_refuses_path_traversal(tmp_path):
    cat = make_catalog(tmp_path, ["ok"])
    text = cat.read_text().replace("uri: adapters/ok", "uri: ../../etc")
    cat.write_text(text)
    catalog = Catalog.from_yaml(cat)
    with pytest.raises(AdapterNotFound):
        catalog.local_dir(catalog.get("ok"))
    bad = cat.read_text().replace("name: ok", "name: ../evil")
    cat.write_text(bad)
    with pytest.raises(CatalogError):
        Catalog.from_yaml(cat)


def test_engine_restart_is_noticed_and_residency_rebuilt(tmp_path):
    async def main():
        eng = FakeConnector()
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, reconcile_interval_s=0.05)
        await mgr.start()
        sub = mgr.subscribe()
        try:
            await mgr.ensure_resident("a1")
            await mgr.ensure_resident("a2")
            eng.down = True
            await async_wait_until(lambda: not mgr.engine_up)
            eng.down = False
            eng.restart()                       # came back with no adapters
            await async_wait_until(lambda: mgr.metrics.counter("ace_agent_engine_resets_total") == 1)
            await async_wait_until(lambda: set(eng.held) == {"a1", "a2"})
            assert mgr.view("a1").tier is Tier.DEVICE
            seen = []

            def a1_left_and_came_back() -> bool:
                # the DEVICE change is published when the load task ends, a moment after
                # the manager's view says so: read the queue until it arrives
                while not sub.queue.empty():
                    seen.append(sub.queue.get_nowait())
                a1 = [v.tier for v in seen if v and v.name == "a1"]
                return Tier.DISK in a1 and a1[-1] is Tier.DEVICE

            await async_wait_until(a1_left_and_came_back, what="observers saw a1 leave the device and come back")
        finally:
            sub.close()
            await mgr.close()
    run(main())


def test_engine_down_fails_prefetch_without_crashing(tmp_path):
    async def main():
        eng = FakeConnector()
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            eng.down = True
            assert mgr.prefetch("a1").outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.metrics.counter("ace_agent_load_failures_total",
                                                       reason="engine_unavailable") == 1)
            eng.down = False
            mgr.prefetch("a1")
            await async_wait_until(lambda: mgr.view("a1").tier is Tier.DEVICE)
        finally:
            await mgr.close()
    run(main())


def test_metrics_render_prometheus_text(tmp_path):
    async def main():
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", FakeConnector())
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            await mgr.ensure_resident("a1")
            text = mgr.metrics.render()
            assert 'ace_agent_tier_hits_total{tier="device"} 1' in text
            assert 'ace_agent_tier_misses_total{tier="device"} 1' in text
            assert 'ace_agent_load_seconds_bucket{le="+Inf",stage="cold"} 1' in text
            assert 'ace_agent_tier_adapters{tier="device"} 1' in text
            assert "# TYPE ace_agent_load_seconds histogram" in text
        finally:
            await mgr.close()
    run(main())


def test_loaded_by_says_why_an_adapter_is_on_the_device(tmp_path):
    async def main():
        eng = FakeConnector()
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            mgr.prefetch("a1", reason="predicted")
            await async_wait_until(lambda: mgr.view("a1").tier is Tier.DEVICE)
            assert mgr.view("a1").loaded_by == "prefetch"
            await mgr.ensure_resident("a2")
            assert mgr.view("a2").loaded_by == "request"
            mgr.pin("a3")
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE)
            assert mgr.view("a3").loaded_by == "pin"
            assert mgr.view("a4").loaded_by == ""
        finally:
            await mgr.close()
    run(main())


def test_adapters_the_engine_loaded_itself_are_adopted_within_budget(tmp_path):
    async def main():
        eng = FakeConnector(capacity=2)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            eng.held.update({"a2": tmp_path, "a3": tmp_path, "not-in-catalog": tmp_path})  # on-demand loads
            await mgr.reconcile()
            # the engine just loaded a2 and a3 for requests: both stay (most recent), loaded by
            # the engine; the budget holds again by unloading a1, used through us before them
            assert [mgr.view(n).tier for n in ("a2", "a3")] == [Tier.DEVICE, Tier.DEVICE]
            assert {mgr.view(n).loaded_by for n in ("a2", "a3")} == {"engine"}
            assert mgr.view("a1").tier is not Tier.DEVICE
            assert len([n for n in NAMES if mgr.view(n).tier is Tier.DEVICE]) == 2
            assert "not-in-catalog" in eng.held          # not ours to manage
        finally:
            await mgr.close()
    run(main())


def test_an_adapter_the_engine_just_loaded_is_nobodys_victim_within_its_grace(tmp_path):
    """vllm_router_session met it: vLLM's resolver loaded three adapters for queued requests,
    the reconcile adopted them (S = 2) and unloaded one of them at once, and its request
    failed (404). Within ``adopt_grace_s`` neither the shrink nor a load takes them; the
    first reconcile after the grace restores the budget."""
    from gpu_agent.errors import PoolExhausted

    async def main():
        now = [100.0]
        eng = FakeConnector(capacity=1)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, adopt_grace_s=2.0,
                           clock=lambda: now[0])
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            eng.held.update({"a2": tmp_path, "a3": tmp_path})        # the resolver, for two requests
            await mgr.reconcile()
            assert mgr.view("a1").tier is not Tier.DEVICE            # ours, used before them: it goes
            assert {"a2", "a3"} <= set(eng.held)                     # theirs stay, over the budget of 1
            assert not any(c == ("unload", n) for c in eng.calls for n in ("a2", "a3"))
            with pytest.raises(PoolExhausted):
                await mgr.ensure_resident("a4")                      # no victim within the grace
            await mgr.reconcile()
            assert {"a2", "a3"} <= set(eng.held)
            now[0] += 2.5                                            # the grace is over
            await mgr.reconcile()
            assert len([n for n in NAMES if mgr.view(n).tier is Tier.DEVICE]) == 1
        finally:
            await mgr.close()
    run(main())


def test_a_priced_prefetch_whose_hinted_victim_is_in_use_is_given_up_not_paid_with_the_lru(tmp_path):
    """The bet (probability against victim_reuse_probability) priced the hinted victim; when a
    request is about to use it, taking the LRU adapter instead would be a bet nobody made."""
    async def main():
        eng = FakeConnector(capacity=2)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            await mgr.ensure_resident("a2")
            eng.busy_set = {"a2"}
            got = mgr.prefetch("a3", evict=["a2"], probability=1.0, victim_reuse_probability=0.0)
            assert got.outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(
                lambda: mgr.metrics.counter("ace_agent_prefetch_cancelled_total", reason="victim_in_use") == 1,
                what="the prefetch given up")
            assert [mgr.view(n).tier for n in ("a1", "a2")] == [Tier.DEVICE, Tier.DEVICE]
            assert mgr.view("a3").tier is not Tier.DEVICE and ("unload", "a1") not in eng.calls
            # the same hint without a probability (an older sender) still makes room from the LRU
            mgr.prefetch("a3", evict=["a2"])
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE, what="a3 loaded")
            assert ("unload", "a1") in eng.calls
        finally:
            await mgr.close()
    run(main())


def test_the_reconcile_moves_what_the_engine_runs_to_the_most_recently_used_end(tmp_path):
    """vLLM serves its requests without the agent: its running/waiting adapters are the use
    the agent's LRU order would otherwise never see (it would evict in order of loads)."""
    async def main():
        eng = FakeConnector(capacity=2)
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng)
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            await mgr.ensure_resident("a2")
            eng.busy_set = {"a1"}          # requests use a1 now
            await mgr.reconcile()
            eng.busy_set = set()           # ... and are done
            await mgr.ensure_resident("a3")
            assert ("unload", "a2") in eng.calls and ("unload", "a1") not in eng.calls
        finally:
            await mgr.close()
    run(main())


@pytest.mark.parametrize("self_managed, spared", [(False, {"a2"}), (True, set())])
def test_what_the_engine_loaded_itself_is_spared_only_where_its_busy_set_lags(tmp_path, self_managed, spared):
    """vLLM lists a request as running or waiting only some time after it arrives, so what
    its resolver just loaded is nobody's victim for ``adopt_grace_s``. A self-managed engine
    (builtin) names a request's adapter busy from the moment it accepts the request: there
    the grace only kept the gateway's prefetches from their chosen victims."""
    async def main():
        eng = FakeConnector()
        eng.self_managed = self_managed
        mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, adopt_grace_s=2.0,
                           clock=lambda: 100.0)
        await mgr.start()
        try:
            await mgr.ensure_resident("a1")
            eng.held.update({"a2": tmp_path})                          # loaded on demand by the engine
            await mgr.reconcile()
            assert mgr.view("a2").loaded_by == "engine"
            assert mgr.holdings.spared() == spared
        finally:
            await mgr.close()
    run(main())
