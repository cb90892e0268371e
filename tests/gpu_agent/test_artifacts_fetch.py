"""The remote tier's fetch (gpu_agent.artifacts.ArtifactStore over aiohttp), against a real
loopback HTTP server: what lands in the cache, and a clear FetchError (never a torn cache
entry) for every way a store can answer badly."""
from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache, FetchError
from gpu_agent.errors import DigestMismatch
from tests.gpu_agent.agent_support import make_catalog, serve, static_server


def _store(tmp_path, base: str, names=("a", "b"), budget=1 << 30) -> tuple[ArtifactStore, Catalog]:
    catalog = Catalog.from_yaml(make_catalog(tmp_path / "src", list(names), remote_base=base))
    return ArtifactStore(catalog, DiskCache(tmp_path / "cache", budget)), catalog


def _no_partials(tmp_path) -> bool:
    return not any(p.name.startswith(".partial-") for p in (tmp_path / "cache").iterdir())


async def _fetch_fails(tmp_path, url: str, error: type[Exception], match: str | None = None,
                       timeout_s: float | None = None) -> None:
    """Fetching adapter ``a`` from ``url`` raises ``error``; nothing of it stays behind."""
    store, catalog = _store(tmp_path, url)
    if timeout_s is not None:
        store._timeout = timeout_s
    try:
        with pytest.raises(error, match=match):
            await store.ensure_local(catalog.get("a"), set())
    finally:
        await store.aclose()
    assert store.local_path(catalog.get("a")) is None and _no_partials(tmp_path)


def test_fetch_lands_verified_files_and_reuses_one_session(tmp_path):
    async def scenario():
        # the served tree is the catalog's own adapters folder
        catalog_root = tmp_path / "src"
        make_catalog(catalog_root, ["a", "b"])
        async with static_server(catalog_root / "adapters") as (url, hits):
            store, catalog = _store(tmp_path, url)
            try:
                for name in ("a", "b"):
                    path, fetched = await store.ensure_local(catalog.get(name), set())
                    assert fetched and (path / "adapter_model.safetensors").read_bytes() == \
                        (catalog_root / "adapters" / name / "adapter_model.safetensors").read_bytes()
                    assert (await store.ensure_local(catalog.get(name), set())) == (path, False)
                assert hits == {f"{n}/{f}": 1 for n in ("a", "b")
                                for f in ("adapter_config.json", "adapter_model.safetensors")}
                session = store._session
                assert session is not None and not session.closed
            finally:
                await store.aclose()
            assert session.closed and store._session is None
            assert _no_partials(tmp_path)
    asyncio.run(scenario())


@pytest.mark.parametrize("answer, message", [
    (lambda r: web.Response(status=404), "HTTP 404"),
    (lambda r: web.Response(status=503), "HTTP 503"),
    # a redirect is not followed: the catalog names where the bytes come from
    (lambda r: web.HTTPFound("http://127.0.0.1:9/elsewhere"), "HTTP 302"),
])
def test_a_bad_answer_is_a_fetch_error_and_leaves_nothing(tmp_path, answer, message):
    async def scenario():
        async def handle(request):
            resp = answer(request)
            if isinstance(resp, web.HTTPException) and 300 <= resp.status < 400:
                raise resp
            return resp
        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        async with serve(app) as url:
            await _fetch_fails(tmp_path, url, FetchError, message)
    asyncio.run(scenario())


def test_a_body_longer_than_the_catalog_says_is_cut_off(tmp_path):
    async def scenario():
        async def big(request):
            if request.path.endswith(".json"):
                return web.Response(text="{}")
            return web.Response(body=b"x" * (3 << 20))  # size_bytes is 4 KiB: limit is +1 MiB
        app = web.Application()
        app.router.add_get("/{tail:.*}", big)
        async with serve(app) as url:
            await _fetch_fails(tmp_path, url, FetchError, "more than")
    asyncio.run(scenario())


def test_wrong_bytes_are_a_digest_mismatch(tmp_path):
    async def scenario():
        catalog_root = tmp_path / "src"
        make_catalog(catalog_root, ["a", "b"])
        async with static_server(catalog_root / "adapters", corrupt={"a"}) as (url, _hits):
            store, catalog = _store(tmp_path, url)
            try:
                with pytest.raises(DigestMismatch):
                    await store.ensure_local(catalog.get("a"), set())
                assert (await store.ensure_local(catalog.get("b"), set()))[1]
            finally:
                await store.aclose()
        assert store.local_path(catalog.get("a")) is None and _no_partials(tmp_path)
    asyncio.run(scenario())


def test_a_refused_connection_and_a_silent_store_are_fetch_errors(tmp_path):
    async def scenario():
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        await _fetch_fails(tmp_path / "refused", f"http://127.0.0.1:{port}", FetchError, "GET http://127.0.0.1")

        never = asyncio.Event()

        async def silent(request):
            await never.wait()  # answers nothing until the client gives up
            return web.Response()
        app = web.Application()
        app.router.add_get("/{tail:.*}", silent)
        async with serve(app) as url:
            try:
                await _fetch_fails(tmp_path / "silent", url, FetchError, "no answer within 0.2 s", timeout_s=0.2)
            finally:
                never.set()
    asyncio.run(scenario())


def test_both_files_are_asked_for_at_once(tmp_path):
    """A remote store's first byte costs a round trip per object: the config and the
    weights are requested together. The store here answers the config only once the
    weights' request has arrived (a fetch that asks one after the other gets a 503)."""
    async def scenario():
        catalog_root = tmp_path / "src"
        make_catalog(catalog_root, ["a"])
        weights_asked = asyncio.Event()

        async def handle(request):
            rel = request.match_info["tail"]
            if rel.endswith(".safetensors"):
                weights_asked.set()
            else:
                try:
                    await asyncio.wait_for(weights_asked.wait(), timeout=10)
                except asyncio.TimeoutError:
                    return web.Response(status=503)
            return web.Response(body=(catalog_root / "adapters" / rel).read_bytes())
        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        async with serve(app) as url:
            store, catalog = _store(tmp_path, url, names=("a",))
            try:
                path, fetched = await store.ensure_local(catalog.get("a"), set())
            finally:
                await store.aclose()
        assert fetched and (path / "adapter_config.json").read_bytes() == \
            (catalog_root / "adapters" / "a" / "adapter_config.json").read_bytes()
    asyncio.run(scenario())


def test_one_failed_file_stops_the_other_and_leaves_nothing(tmp_path):
    """The config's 404 is the fetch's error at once: it does not wait for the weights,
    whose download is stopped (nothing is written after the partial folder is gone)."""
    async def scenario():
        never = asyncio.Event()
        weights_asked = asyncio.Event()

        async def handle(request):
            if request.match_info["tail"].endswith(".safetensors"):
                weights_asked.set()
                await never.wait()  # the weights never come
                return web.Response(body=b"")
            await weights_asked.wait()
            return web.Response(status=404)
        app = web.Application()
        app.router.add_get("/{tail:.*}", handle)
        async with serve(app) as url:
            try:
                # a fetch that asks one file after the other never gets its config's
                # answer: it fails on the client's timeout instead
                await _fetch_fails(tmp_path, url, FetchError, "HTTP 404", timeout_s=20)
                pending = [t for t in asyncio.all_tasks() if "_download" in repr(t.get_coro())]
                assert pending == []
            finally:
                never.set()
    asyncio.run(scenario())


def test_asking_whether_files_are_on_disk_leaves_the_lru_order_alone(tmp_path):
    """The reconcile, a residency view and the engine's tier ask about every adapter often;
    asking is not using: the disk cache still evicts the least recently *fetched or read*
    copy (before, every question moved the asked copy to the end of the LRU)."""
    from gpu_agent.connectors.builtin import StoreSource

    async def scenario():
        catalog_root = tmp_path / "src"
        make_catalog(catalog_root, ["a", "b", "c"])
        async with static_server(catalog_root / "adapters") as (url, _):
            store, catalog = _store(tmp_path, url, names=("a", "b", "c"))
            a, b, c = (catalog.get(n) for n in "abc")
            store.cache.budget_bytes = a.size_bytes + b.size_bytes  # room for two
            try:
                for spec in (a, b):  # a is the older
                    await store.ensure_local(spec, set())
                assert store.has_local(a) and store.has_local(b) and not store.has_local(c)
                assert StoreSource(store).tier(a) == "disk" and StoreSource(store).tier(c) == "remote"
                await store.ensure_local(c, set())  # room for c: the least recently used goes
                assert not store.has_local(a) and store.has_local(b) and store.has_local(c)
                assert store.local_path(b) is not None  # reading b's files is a use ...
                await store.ensure_local(a, set())  # ... so c goes now
                assert store.has_local(b) and not store.has_local(c)
            finally:
                await store.aclose()
    asyncio.run(scenario())
