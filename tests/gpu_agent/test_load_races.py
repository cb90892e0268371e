"""Races between the agent's loads and the builtin engine's own loads of one adapter.

Regression tests for two benchmark findings:

- A request's on-demand load and a prefetch fetched the same remote digest at once; the
  second rename of its `.partial-` directory failed (`OSError: Directory not empty`) and
  the request got an HTTP 500. Concurrent fetches of one digest now share one download,
  a verified copy already in place is success, and an internal load failure is a 503.
- The builtin engine's on-demand loads ignored the device count budget; the pool now
  enforces `max_adapters` on every load (LRU, never pinned or in use).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache
from gpu_agent.errors import AdapterBusy, PoolExhausted
from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager, remote_catalog, write_adapter
from tests.support.wait import async_wait_until

NAMES = ["a1", "a2", "a3"]


def run(coro):
    return asyncio.run(coro)


@contextlib.asynccontextmanager
async def slow_server(root: Path, delay_s: float = 0.2):
    """`root` over loopback HTTP, each GET delayed so that concurrent fetches overlap."""
    hits: dict[str, int] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["tail"]
        hits[rel] = hits.get(rel, 0) + 1
        await asyncio.sleep(delay_s)
        path = (root / rel).resolve()
        if not path.is_relative_to(root.resolve()) or not path.is_file():
            raise web.HTTPNotFound()
        return web.Response(body=path.read_bytes())

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", hits
    finally:
        await runner.cleanup()


# ---- bug 1: one digest fetched twice at once ----------------------------------------------

def test_concurrent_fetches_of_one_digest_share_one_download(tmp_path):
    async def main():
        async with slow_server(tmp_path / "adapters") as (base, hits):
            catalog = Catalog.from_yaml(make_catalog(tmp_path, NAMES, remote_base=base))
            store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
            spec = catalog.get("a1")
            try:
                results = await asyncio.gather(*(store.ensure_local(spec, set()) for _ in range(3)))
            finally:
                await store.aclose()
            paths = {p for p, _ in results}
            assert paths == {tmp_path / "cache" / spec.sha256}
            assert hits["a1/adapter_model.safetensors"] == 1     # one download, three waiters
            assert [p.name for p in (tmp_path / "cache").iterdir()] == [spec.sha256]  # no .partial- left
    run(main())


def test_one_waiter_cancelled_does_not_cancel_the_shared_download(tmp_path):
    async def main():
        async with slow_server(tmp_path / "adapters") as (base, hits):
            catalog = Catalog.from_yaml(make_catalog(tmp_path, NAMES, remote_base=base))
            store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
            spec = catalog.get("a2")
            try:
                first = asyncio.ensure_future(store.ensure_local(spec, set()))
                second = asyncio.ensure_future(store.ensure_local(spec, set()))
                await async_wait_until(lambda: any(k.startswith("a2/") for k in hits), what="the download under way")
                first.cancel()                       # e.g. the client of the request went away
                path, fetched = await second
                assert fetched and path == tmp_path / "cache" / spec.sha256
                assert hits["a2/adapter_model.safetensors"] == 1
            finally:
                await store.aclose()
    run(main())


def test_admit_keeps_a_verified_copy_that_won_the_race_and_replaces_a_torn_one(tmp_path):
    cache = DiskCache(tmp_path / "cache", 1 << 30)
    digest, size = write_adapter(tmp_path / "src", "a1")
    # another fetcher (this process or one sharing the cache) completed the same digest
    shutil.copytree(tmp_path / "src", tmp_path / "cache" / digest)
    staged = tmp_path / "cache" / f".partial-{digest}-1"
    shutil.copytree(tmp_path / "src", staged)
    assert cache.admit(digest, staged) == tmp_path / "cache" / digest
    assert not staged.exists() and digest in cache and cache.used_bytes == size
    # a torn copy (weights missing) in the way is replaced by the verified staged one
    cache.remove(digest)
    (tmp_path / "cache" / digest).mkdir()
    (tmp_path / "cache" / digest / "adapter_config.json").write_text("{}")
    staged = tmp_path / "cache" / f".partial-{digest}-2"
    shutil.copytree(tmp_path / "src", staged)
    final = cache.admit(digest, staged)
    assert (final / "adapter_model.safetensors").read_bytes() == (tmp_path / "src" / "adapter_model.safetensors").read_bytes()
    assert not staged.exists()


def test_manager_prefetch_and_a_second_fetch_path_of_one_digest_do_not_collide(tmp_path):
    async def main():
        async with slow_server(tmp_path / "adapters") as (base, hits):
            mgr = make_manager(make_catalog(tmp_path, NAMES, remote_base=base), tmp_path / "cache",
                               FakeConnector())
            await mgr.start()
            try:
                spec = mgr.catalog.get("a3")
                # the agent's load and an engine-side fetch (StoreSource passes no protected set)
                await asyncio.gather(mgr.ensure_resident("a3"), mgr.store.ensure_local(spec, set()))
                assert hits["a3/adapter_model.safetensors"] == 1
                assert mgr.metrics.counter("ace_agent_load_failures_total", reason="OSError") == 0
            finally:
                await mgr.close()
    run(main())


def test_request_and_prefetch_of_one_remote_adapter_at_once_both_succeed(fixtures, tmp_path):
    """Through the agent with the builtin engine: a request's on-demand load and a prefetch
    of the same remote adapter at the same moment; before the fix the request got a 500."""
    from gpu_agent.connectors.builtin import BuiltinConnector
    from gpu_agent.engine.core import EngineSettings
    from gpu_agent.residency.manager import ResidencyBudgets, ResidencyManager
    from ace_common.tiers import Tier

    async def main():
        async with slow_server(fixtures / "adapters", delay_s=0.3) as (base, hits):
            cat_path = remote_catalog(fixtures, tmp_path, base)
            catalog = Catalog.from_yaml(cat_path)
            store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 1 << 30))
            conn = BuiltinConnector(store, EngineSettings(catalog=cat_path, pool_bytes=16 << 20,
                                                          batch_window_ms=0.0), http_port=0)
            mgr = ResidencyManager(catalog, store, conn, ResidencyBudgets(reconcile_interval_s=0))
            await mgr.start()
            try:
                async with httpx.AsyncClient(base_url=conn.url, timeout=60) as client:
                    body = {"model": "code-sql", "prompt": "SELECT", "max_tokens": 2}
                    req = asyncio.ensure_future(client.post("/v1/completions", json=body))
                    await async_wait_until(lambda: any(k.startswith("code-sql/") for k in hits),
                                           what="the request's fetch under way")
                    mgr.prefetch("code-sql", reason="predicted")
                    r = await req
                assert r.status_code == 200, r.text
                assert r.headers["x-ace-adapter-tier"] == "remote"
                await async_wait_until(lambda: mgr.view("code-sql").tier is Tier.DEVICE)
                assert hits["code-sql/adapter_model.safetensors"] == 1
            finally:
                await mgr.close()
    run(main())


def test_an_internal_load_failure_is_a_logged_503_not_a_500(fixtures, caplog):
    from gpu_agent.engine import Engine, EngineSettings, serve

    class BrokenSource:
        def tier(self, entry):
            return "remote"

        def fetches_in_flight(self):
            return 0

        async def local_dir(self, entry):
            raise OSError(39, "Directory not empty", "/cache/.partial-x")

    async def main():
        engine = Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", pool_bytes=4 << 20),
                               source=BrokenSource())
        runner, port = await serve(engine, "127.0.0.1", 0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                return await client.post("/v1/completions",
                                         json={"model": "code-sql", "prompt": "SELECT", "max_tokens": 2})
        finally:
            await runner.cleanup()

    with caplog.at_level(logging.ERROR, logger="gpu_agent.engine"):
        r = run(main())
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["param"] == "model"
    assert err["code"] == "adapter_load_failed"
    assert "code-sql" in err["message"] and "Directory not empty" in err["message"]
    assert any("code-sql" in rec.getMessage() for rec in caplog.records)


# ---- bug 2: the count budget on every load path ------------------------------------------

def _pool(fixtures: Path, max_adapters: int | None):
    import torch

    from gpu_agent.engine.adapters import read_catalog
    from gpu_agent.engine.model import LlamaModel
    from gpu_agent.engine.peft import BaseModelSpec, load_peft_dir
    from gpu_agent.engine.pool import AdapterPool

    _, model_dir, entries = read_catalog(fixtures / "catalog.yaml")
    model = LlamaModel.from_dir(model_dir, device="cpu", dtype=torch.float32)
    spec = BaseModelSpec(name="ace-tiny-llama", num_layers=model.cfg.num_layers,
                         hidden_size=model.cfg.hidden_size, modules=model.cfg.module_shapes())
    pool = AdapterPool(spec, 64 << 20, max_adapters=max_adapters)
    adapters = {n: load_peft_dir(e.local_dir(fixtures), spec, None, name=n) for n, e in entries.items()}
    return pool, adapters


def test_pool_count_limit_evicts_lru_never_pinned_or_in_use(fixtures):
    pool, ads = _pool(fixtures, max_adapters=2)
    pool.load(ads["code-sql"], pin=True)
    pool.load(ads["med-triage"])
    pool.load(ads["fin-reports"])                       # med-triage (LRU, unpinned) goes
    assert set(pool.resident()) == {"code-sql", "fin-reports"}
    with pool.batch(["fin-reports"]):                   # in use: nothing may go
        with pytest.raises(PoolExhausted):
            pool.load(ads["tr-de-en"])
        assert set(pool.resident()) == {"code-sql", "fin-reports"}
    pool.load(ads["tr-de-en"])                          # now fin-reports may go
    assert set(pool.resident()) == {"code-sql", "tr-de-en"}
    assert pool.stats()["adapters"] == 2 and pool.stats()["max_adapters"] == 2
    with pytest.raises(AdapterBusy):
        pool.evict("code-sql")
    pool.check_invariants()


def test_engine_on_demand_loads_respect_max_adapters(fixtures):
    from gpu_agent.engine import Engine, EngineSettings

    async def main():
        engine = Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", pool_bytes=64 << 20,
                                              max_adapters=2))
        try:
            res = engine.adapters
            for name in ("code-sql", "med-triage", "fin-reports", "tr-de-en"):
                await res.ensure_resident(name)
                assert sum(res.tier(n) == "device" for n in res.names()) <= 2
            assert res.tier("tr-de-en") == "device" and res.tier("fin-reports") == "device"
            # a pinned adapter survives; pin itself loads atomically
            await res.ensure_pinned("code-python")
            await res.ensure_resident("code-sql")
            await res.ensure_resident("med-notes")
            assert res.tier("code-python") == "device"
            assert sum(res.tier(n) == "device" for n in res.names()) == 2
        finally:
            await engine.close()
    run(main())
