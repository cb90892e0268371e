"""The builtin connector: the agent drives the in-process builtin engine's residency seam."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache
from gpu_agent.connectors.builtin import BuiltinConnector
from gpu_agent.residency.manager import ResidencyBudgets, ResidencyManager, ResidencyOutcome, ResidencyResult
from ace_common.tiers import Tier
from tests.support.wait import async_wait_until

DONE = ResidencyResult(ResidencyOutcome.DONE)

pytest.importorskip("torch")


def run(coro):
    return asyncio.run(coro)


async def make(fixtures, tmp_path, http_port=None, pool_bytes=64 << 20, max_adapters=None,
               reconcile_interval_s=0.1):
    from gpu_agent.engine.core import EngineSettings

    catalog = Catalog.from_yaml(fixtures / "catalog.yaml")
    store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
    conn = BuiltinConnector(store, EngineSettings(catalog=fixtures / "catalog.yaml", pool_bytes=pool_bytes,
                                                  max_adapters=max_adapters, batch_window_ms=0.0),
                            http_port=http_port)
    mgr = ResidencyManager(catalog, store, conn, ResidencyBudgets(reconcile_interval_s=reconcile_interval_s))
    await mgr.start()
    return mgr, conn


async def full_pool_of_two(fixtures, tmp_path, loaded, **kwargs):
    """A manager over a builtin pool of two adapters, both slots taken by ``loaded``."""
    mgr, conn = await make(fixtures, tmp_path, max_adapters=2, **kwargs)
    try:
        for name in loaded:
            await mgr.ensure_resident(name)
    except BaseException:
        await mgr.close()
        raise
    return mgr, conn


def replay_device_changes(sub, tiers: dict) -> tuple[dict, int]:
    """The subscription's queued changes applied to ``tiers`` (name -> tier) in order:
    the tiers at the end, and the most adapters an observer saw on the device at once.
    Closes the subscription."""
    tiers, most = dict(tiers), 0
    for _ in range(sub.queue.qsize()):
        change = sub.queue.get_nowait()
        if hasattr(change, "tier"):
            tiers[change.name] = change.tier
            most = max(most, sum(t is Tier.DEVICE for t in tiers.values()))
    sub.close()
    return tiers, most


def test_prefetch_loads_into_the_pool_and_requests_find_it_there(fixtures, tmp_path):
    async def main():
        mgr, conn = await make(fixtures, tmp_path, http_port=0)
        try:
            assert mgr.view("code-sql").tier is Tier.DISK
            assert mgr.prefetch("code-sql").outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("code-sql").tier is Tier.DEVICE, timeout=30)
            assert conn.engine.adapters.tier("code-sql") == "device"
            assert mgr.view("code-sql").cold_load_ms > 0
            stats = conn.pool_stats()
            assert stats["pages_used"] > 0 and stats["pages_free"] >= 0
            text = mgr.metrics.render()
            assert "ace_agent_pool_pages_used" in text and "ace_agent_pool_pages_free" in text
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                body = {"prompt": "SELECT", "max_tokens": 2, "temperature": 0}
                hot = await client.post("/v1/completions", json={**body, "model": "code-sql"})
                cold = await client.post("/v1/completions", json={**body, "model": "legal-review"})
            assert hot.status_code == 200 and hot.headers["x-ace-adapter-tier"] == "device"
            assert cold.status_code == 200 and cold.headers["x-ace-adapter-tier"] in ("disk", "host")
            # the engine's on-demand load is picked up by the agent's reconcile
            await async_wait_until(lambda: mgr.view("legal-review").tier is Tier.DEVICE, timeout=5)
            evicted = (await mgr.evict("code-sql")).ok
            assert evicted and conn.engine.adapters.tier("code-sql") != "device"
            assert mgr.view("code-sql").tier in (Tier.HOST, Tier.DISK)
        finally:
            await mgr.close()
    run(main())


def test_the_pool_alone_decides_what_leaves_the_device_by_what_requests_used(fixtures, tmp_path):
    """One owner of the builtin engine's device tier: its pool. The agent prefetches A, then
    B, into a pool of two adapters; requests straight to the engine (which the agent never
    sees) use A; the prefetch of C then evicts B, the least recently *used*, where an
    agent-side LRU would have taken A, the least recently loaded through the agent. The
    agent counts the pool's decision (engine_gone) and evicts nothing by a budget of its own."""
    A, B, C = "code-sql", "med-triage", "fin-reports"

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), http_port=0)
        try:
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                r = await client.post("/v1/completions", json={"model": A, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and r.headers["x-ace-adapter-tier"] == "device"
            assert mgr.prefetch(C).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view(C).tier is Tier.DEVICE, timeout=30, what="C prefetched")
            assert conn.engine.adapters.tier(A) == "device" and conn.engine.adapters.tier(B) != "device"
            await async_wait_until(lambda: mgr.metrics.counter("ace_agent_evictions_total", tier="device",
                                                               reason="engine_gone") == 1,
                                   what="the agent mirrored the pool's eviction of B")
            assert mgr.view(B).tier is not Tier.DEVICE and mgr.view(A).tier is Tier.DEVICE
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="budget") == 0
            assert conn.engine.adapters.evictions_by() == {("device", "budget"): 1}
        finally:
            await mgr.close()
    run(main())


def test_the_view_never_shows_more_adapters_than_the_pool_holds(fixtures, tmp_path):
    """A prefetch into a full pool of two, naming no victim: the pool lets one go by itself.
    The residency stream announces its departure before C's arrival, with no reconcile
    between them (its interval is longer than the test), so no observer ever sees three
    adapters on a device that holds two (the gateway learns a pool's size from the most it
    saw at once)."""
    A, B, C = "code-sql", "med-triage", "fin-reports"

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), reconcile_interval_s=3600)
        try:
            sub = mgr.subscribe()
            assert mgr.prefetch(C).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view(C).tier is Tier.DEVICE, timeout=30, what="C prefetched")
            tiers, most = replay_device_changes(sub, {A: Tier.DEVICE, B: Tier.DEVICE})
            kept = set(conn.engine.pool.resident())
            assert len(kept) == 2 and C in kept
            assert {n for n, t in tiers.items() if t is Tier.DEVICE} == kept
            assert most == 2
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="engine_gone") == 1
        finally:
            await mgr.close()
    run(main())


def test_the_view_follows_the_engines_own_loads_as_they_happen(fixtures, tmp_path):
    """A request's own load in the engine (no agent load, no reconcile: its interval is
    longer than the test) evicts the pool's LRU adapter and brings the request's in. The
    residency stream announces both at once, the departure first; before, the agent learned
    of them at the next reconcile (2 s by default), and the gateway's pool model, synced
    from that view, dropped the new adapter and named the gone one as a victim."""
    A, B, C = "code-sql", "med-triage", "fin-reports"

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), http_port=0, reconcile_interval_s=3600)
        try:
            sub = mgr.subscribe()
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                r = await client.post("/v1/completions", json={"model": C, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
            kept = set(conn.engine.pool.resident())
            assert len(kept) == 2 and C in kept
            await async_wait_until(lambda: {n for n in (A, B, C) if mgr.view(n).tier is Tier.DEVICE} == kept,
                                   timeout=30, what="the view follows the engine's own load")
            assert mgr.view(C).loaded_by == "engine"
            _, most = replay_device_changes(sub, {A: Tier.DEVICE, B: Tier.DEVICE})
            assert most == 2
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="engine_gone") == 1
        finally:
            await mgr.close()
    run(main())


def test_a_requests_own_load_in_the_engine_evicts_the_gateways_victim_not_the_lru(fixtures, tmp_path):
    """The gateway's ingress signal for a cold request names the victims its model of the
    pool would evict (lowest predicted use). The builtin engine loads that request's adapter
    itself; that load evicts the hinted victim B, where the pool's LRU would take A."""
    A, B, C = "code-sql", "med-triage", "fin-reports"

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), http_port=0)  # A: the LRU
        try:
            got = mgr.prefetch(C, priority=1, reason="request_cold", evict=[B])
            assert got.reason == "engine_loads_on_demand"
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                r = await client.post("/v1/completions", json={"model": C, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200
            adapters = conn.engine.adapters
            assert adapters.tier(A) == "device" and adapters.tier(B) != "device" and adapters.tier(C) == "device"
            assert adapters.evictions_by() == {("device", "hint"): 1}
            # the hint was spent on that load: the next one evicts by LRU again (A)
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                r = await client.post("/v1/completions", json={"model": B, "prompt": "x", "max_tokens": 1})
            assert r.status_code == 200 and adapters.tier(A) != "device"
            assert adapters.evictions_by() == {("device", "hint"): 1, ("device", "budget"): 1}
        finally:
            await mgr.close()
    run(main())


def test_the_victims_that_come_with_a_request_are_what_its_load_evicts_first(fixtures, tmp_path):
    """The gateway sends a cold request to the builtin engine with its victims in the body
    (``EVICT_FIRST``) instead of a Prefetch RPC: the engine's own load evicts them first
    (B, where the LRU would take A), and a value that is not a list of names is ignored.
    The agent announces that its engine needs no request signal."""
    from ace_common.engine_fields import EVICT_FIRST

    A, B, C, D = "code-sql", "med-triage", "fin-reports", "legal-review"

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), http_port=0)  # A: the LRU
        try:
            assert mgr.request_signals_redundant
            adapters = conn.engine.adapters
            async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                r = await client.post("/v1/completions", json={"model": C, "prompt": "x", "max_tokens": 1,
                                                               EVICT_FIRST: ["nope", B]})
                assert r.status_code == 200
                assert adapters.tier(A) == "device" and adapters.tier(B) != "device"
                assert adapters.evictions_by() == {("device", "hint"): 1}
                r = await client.post("/v1/completions", json={"model": D, "prompt": "x", "max_tokens": 1,
                                                               EVICT_FIRST: "not a list"})
            assert r.status_code == 200 and adapters.tier(D) == "device"
        finally:
            await mgr.close()
    run(main())


def test_a_load_whose_own_hint_never_came_evicts_the_latest_victims_named(fixtures, tmp_path):
    """A request's load often starts before its signal's hint reaches the engine, or its
    decision named none: that load evicts the victims last named for any load (the
    gateway's latest view of this pool), not the pool's LRU; a victim a request claimed
    since it was named is spared."""
    A, B, C, D, X = "code-sql", "med-triage", "fin-reports", "legal-review", "code-python"

    async def complete(conn, name):
        async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
            r = await client.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200

    async def main():
        mgr, conn = await full_pool_of_two(fixtures, tmp_path, (A, B), http_port=0)  # A: the LRU
        try:
            adapters = conn.engine.adapters
            mgr.prefetch(X, priority=1, reason="request_cold", evict=[B])  # named for X's load
            await complete(conn, C)                  # C's own load came with no hint
            assert adapters.tier(A) == "device" and adapters.tier(B) != "device"
            assert adapters.evictions_by() == {("device", "hint"): 1}
            mgr.prefetch(X, priority=1, reason="request_cold", evict=[A])
            await complete(conn, A)                  # a request wants A after it was named
            await complete(conn, D)                  # so D's load spares it: the LRU (C) goes
            assert adapters.tier(A) == "device" and adapters.tier(C) != "device"
            assert adapters.evictions_by() == {("device", "hint"): 1, ("device", "budget"): 1}
        finally:
            await mgr.close()
    run(main())


def test_a_self_managed_engine_takes_no_device_budget_from_the_agent(fixtures, tmp_path):
    """Two budgets on one tier were two owners: the manager refuses them, and so do the
    agent's settings for the builtin engine's byte budget (its pool's size is --pool-mb)."""
    from gpu_agent.engine.core import EngineSettings
    from gpu_agent.settings import AgentSettings, SettingsError

    catalog = Catalog.from_yaml(fixtures / "catalog.yaml")
    store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
    conn = BuiltinConnector(store, EngineSettings(catalog=fixtures / "catalog.yaml"))
    for budgets in (ResidencyBudgets(device_count=2), ResidencyBudgets(device_bytes=1 << 20)):
        with pytest.raises(SettingsError, match="owns its device tier"):
            ResidencyManager(catalog, store, conn, budgets)
    with pytest.raises(SettingsError, match="--pool-mb"):
        AgentSettings(catalog=fixtures / "catalog.yaml", engine="builtin", auth="none",
                      device_budget_mb=64).validate()


def test_pool_self_eviction_drops_a_tier_without_reload_storm(fixtures, tmp_path):
    async def main():
        # a pool with room for about one large adapter: loading the next evicts by the pool's LRU
        mgr, conn = await make(fixtures, tmp_path, pool_bytes=1 << 20)
        try:
            await mgr.ensure_resident("legal-review")   # rank 128
            await mgr.ensure_resident("tr-fr-en")       # rank 128: pool evicts legal-review
            assert conn.engine.adapters.tier("legal-review") != "device"
            # the reconcile that sees it gone counts a device eviction (the pool's own),
            # where an engine that lost it would count a reset and prefetch it back
            await async_wait_until(lambda: mgr.metrics.counter("ace_agent_evictions_total", tier="device",
                                                               reason="engine_gone") >= 1,
                                   what="the reconcile counted the pool's eviction")
            assert mgr.view("legal-review").tier in (Tier.HOST, Tier.DISK)
            assert mgr.metrics.counter("ace_agent_engine_resets_total") == 0
            assert mgr.metrics.counter("ace_agent_prefetch_total", outcome="accepted") == 0   # no reload
            assert conn.engine.adapters.tier("tr-fr-en") == "device"
        finally:
            await mgr.close()
    run(main())


def test_pinning_a_resident_adapter_pins_it_in_the_engine_pool(fixtures, tmp_path):
    """The builtin pool evicts by itself: an agent Pin of an adapter already on the device
    must reach the pool, or the pool's LRU takes the 'pinned' adapter (and Unpin releases it)."""
    async def main():
        mgr, conn = await make(fixtures, tmp_path)
        try:
            await mgr.ensure_resident("code-sql")
            assert mgr.pin("code-sql") == DONE
            res = conn.engine.adapters
            assert res.snapshot()["code-sql"]["pinned"] and conn.engine.pool.entry("code-sql").pinned
            assert mgr.unpin("code-sql") == DONE
            assert not conn.engine.pool.entry("code-sql").pinned
        finally:
            await mgr.close()
    run(main())


def test_a_prefetch_hint_chooses_what_the_engine_pool_evicts(fixtures, tmp_path):
    """The builtin pool evicts by itself (pages, no count budget): a hinted adapter goes
    instead of the pool's LRU when the load needs pages, and nothing goes while it fits."""
    async def main():
        # pages: rank 16 = 224, rank 8 = 112 (hidden 128, fp32 pool: 512 B a page)
        mgr, conn = await make(fixtures, tmp_path, pool_bytes=(2 * 224 + 112 - 1) * 512)
        pool = conn.engine.pool
        try:
            await mgr.ensure_resident("med-triage")      # LRU
            await mgr.ensure_resident("tr-de-en")
            assert pool.stats()["pages_free"] < 112
            assert mgr.prefetch("code-python", evict=["tr-de-en"]).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("code-python").tier is Tier.DEVICE, timeout=30)
            assert set(pool.resident()) == {"med-triage", "code-python"}
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="hint") == 1
            # room for a rank 8 again after evicting one: a hint is not taken while it fits
            await mgr.evict("med-triage")
            mgr.prefetch("fin-reports", evict=["code-python"])
            await async_wait_until(lambda: mgr.view("fin-reports").tier is Tier.DEVICE, timeout=30)
            assert set(pool.resident()) == {"code-python", "fin-reports"}
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="hint") == 1
        finally:
            await mgr.close()
    run(main())


def test_cold_settings_every_reload_goes_the_whole_way(fixtures, tmp_path):
    """The bench's cold settings (engine host tier 0, resident-only disk tier): an adapter
    the pool evicted loses its disk copy at once, and a request for it again fetches it from
    the store (tier ``remote``), never a host or disk shortcut."""
    import yaml

    from gpu_agent.engine.core import EngineSettings
    from tests.gpu_agent.agent_support import static_server

    async def main():
        async with static_server(fixtures / "adapters") as (base, hits):
            doc = yaml.safe_load((fixtures / "catalog.yaml").read_text())
            doc["base_model"]["path"] = str((fixtures / doc["base_model"]["path"]).resolve())
            for a in doc["adapters"]:
                a["uri"] = f"{base}/{a['name']}"
            cat_path = tmp_path / "remote.yaml"
            cat_path.write_text(yaml.safe_dump(doc))
            catalog = Catalog.from_yaml(cat_path)
            store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 0))
            conn = BuiltinConnector(store, EngineSettings(catalog=cat_path, pool_bytes=4 << 20, host_cache_bytes=0,
                                                          max_adapters=1, batch_window_ms=0.0), http_port=0)
            mgr = ResidencyManager(catalog, store, conn, ResidencyBudgets(reconcile_interval_s=0.1))
            await mgr.start()
            try:
                async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                    async def ask(model):
                        r = await client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1})
                        assert r.status_code == 200, r.text
                        return r.headers["x-ace-adapter-tier"]

                    assert [await ask(m) for m in ("code-sql", "code-sql", "med-notes")] == ["remote", "device", "remote"]
                    await async_wait_until(lambda: store.local_path(catalog.get("code-sql")) is None, timeout=5)
                    assert [p.name for p in (tmp_path / "cache").iterdir()] == [catalog.get("med-notes").sha256]
                    assert await ask("code-sql") == "remote"
                assert hits["code-sql/adapter_model.safetensors"] == 2
                res = conn.engine.adapters
                assert res.loads["remote"] == 3 and res.loads["host"] == res.loads["disk"] == 0
                assert res.tiers.host.names() == []
                await async_wait_until(lambda: mgr.view("med-notes").tier is Tier.REMOTE, timeout=5)
            finally:
                await mgr.close()
    run(main())


def test_the_engine_load_is_the_batchers_running_and_waiting_sequences(fixtures, tmp_path):
    """Read in memory off the request path: four requests through a batch of two are two
    running and two waiting; the agent's load monitor publishes it, and 0/0 once done."""
    from gpu_agent.connectors.base import EngineLoad
    from gpu_agent.engine.core import EngineSettings

    async def main():
        catalog = Catalog.from_yaml(fixtures / "catalog.yaml")
        store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
        conn = BuiltinConnector(store, EngineSettings(catalog=fixtures / "catalog.yaml", max_batch_sequences=2,
                                                      batch_window_ms=0.0))
        mgr = ResidencyManager(catalog, store, conn, ResidencyBudgets(reconcile_interval_s=0, load_interval_s=0.005))
        await mgr.start()
        try:
            assert await conn.engine_load() == EngineLoad(0, 0)

            async def generate():
                async for _ in conn.engine.generate(None, [5, 6, 7], max_tokens=48, ignore_eos=True):
                    pass

            sub = mgr.subscribe()
            tasks = [asyncio.create_task(generate()) for _ in range(4)]
            seen = set()
            while not all(t.done() for t in tasks):
                seen.add(await conn.engine_load())
                await asyncio.sleep(0.002)
            await asyncio.gather(*tasks)
            assert EngineLoad(2, 2) in seen or EngineLoad(2, 1) in seen, seen
            assert all(load.running <= 2 and load.requests <= 4 for load in seen)
            await async_wait_until(lambda: mgr.engine_load == EngineLoad(0, 0), timeout=5)
            announced = [sub.queue.get_nowait().load for _ in range(sub.queue.qsize())]
            assert any(load is not None and load.running == 2 for load in announced), announced
            sub.close()
        finally:
            await mgr.close()
    run(main())
