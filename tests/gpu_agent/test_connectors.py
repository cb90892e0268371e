"""vLLM and SGLang connectors against loopback servers that answer the documented shapes.

SGLang needs a GPU, so its connector is tested only against this local server built from
the documented API (`/load_lora_adapter` with `pinned`, `/unload_lora_adapter`, JSON
`{success, error_message, loaded_adapters}`, 400 on failure). The vLLM connector is also
tested against the real vLLM in tests/integration/test_vllm_connector.py.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from ace_common.catalog import Adapter
from gpu_agent.connectors.base import ConnectorError, EngineUnavailable
from gpu_agent.connectors.sglang import SGLangConnector
from gpu_agent.connectors.vllm import (CACHE_PATH, DROP_PATH, DROPPED, EVICTED, NOT_REGISTERED, RANK_PATH, RANKED,
                                       READ, READ_PATH, VLLMConnector, parse_lora_metrics)
from tests.gpu_agent.agent_support import serve
from tests.support.procs import free_port
from tests.support.wait import async_wait_until


def spec(name: str) -> Adapter:
    return Adapter(name=name, base_model="base", rank=8, target_modules=(), size_bytes=1, owner="public",
                   uri=f"adapters/{name}", sha256="0" * 64)


def sglang_app(max_pinned: int = 1) -> tuple[web.Application, dict]:
    state = {"loaded": {}, "pinned": set(), "calls": []}

    def reply(success: bool, error: str | None = None):
        return web.json_response({"success": success, "error_message": error,
                                  "loaded_adapters": dict(state["loaded"])}, status=200 if success else 400)

    async def load(request):
        body = await request.json()
        state["calls"].append(("load", body))
        name = body["lora_name"]
        if name in state["loaded"]:
            return reply(False, f"LoRA adapter {name} is already loaded")
        if not Path(body["lora_path"]).is_dir():
            return reply(False, f"no adapter at {body['lora_path']}")
        if body.get("pinned"):
            if len(state["pinned"]) >= max_pinned:
                return reply(False, "too many pinned adapters")
            state["pinned"].add(name)
        state["loaded"][name] = body["lora_path"]
        return reply(True)

    async def unload(request):
        body = await request.json()
        state["calls"].append(("unload", body))
        if state["loaded"].pop(body["lora_name"], None) is None:
            return reply(False, f"LoRA adapter {body['lora_name']} is not loaded")
        state["pinned"].discard(body["lora_name"])
        return reply(True)

    async def models(request):
        data = [{"id": "base", "object": "model", "root": "base", "parent": None}]
        data += [{"id": n, "object": "model", "root": p, "parent": "base"} for n, p in state["loaded"].items()]
        return web.json_response({"object": "list", "data": data})

    app = web.Application()
    app.router.add_post("/load_lora_adapter", load)
    app.router.add_post("/unload_lora_adapter", unload)
    app.router.add_get("/v1/models", models)
    return app, state


def test_sglang_load_pinned_unload_and_list(tmp_path):
    async def main():
        app, state = sglang_app(max_pinned=1)
        async with serve(app) as url:
            conn = SGLangConnector(url)
            try:
                await conn.load(spec("a"), tmp_path, pinned=True)
                assert state["calls"][0][1] == {"lora_name": "a", "lora_path": str(tmp_path), "pinned": True}
                await conn.load(spec("a"), tmp_path)                  # already loaded: success
                await conn.load(spec("b"), tmp_path)
                with pytest.raises(ConnectorError, match="pinned"):
                    await conn.load(spec("c"), tmp_path, pinned=True)  # engine refuses a 2nd pin
                with pytest.raises(ConnectorError, match="no adapter"):
                    await conn.load(spec("d"), tmp_path / "missing")
                assert await conn.loaded() == {"a", "b"}
                await conn.unload("b")
                await conn.unload("b")                                # not loaded: success
                assert await conn.loaded() == {"a"}
            finally:
                await conn.close()
    asyncio.run(main())


def test_unreachable_engines_raise_engine_unavailable():
    async def main():
        url = f"http://127.0.0.1:{free_port()}"
        for conn in (SGLangConnector(url, timeout_s=2), VLLMConnector(url, timeout_s=2)):
            try:
                with pytest.raises(EngineUnavailable):
                    await conn.loaded()
                with pytest.raises(EngineUnavailable):
                    await conn.load(spec("a"), Path("/nonexistent"))
            finally:
                await conn.close()
    asyncio.run(main())


def test_vllm_shapes_already_loaded_is_success_and_404_unload_is_success(tmp_path):
    async def main():
        loaded: dict[str, str] = {}

        async def load(request):
            body = await request.json()
            if body["lora_name"] in loaded:
                return web.json_response({"error": {"message": f"The lora adapter '{body['lora_name']}' has already been loaded.",
                                                    "type": "InvalidUserInput", "param": None, "code": 400}}, status=400)
            if body["lora_name"] == "broken":
                return web.json_response({"error": {"message": "boom", "type": "InternalServerError"}}, status=500)
            loaded[body["lora_name"]] = body["lora_path"]
            return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

        async def unload(request):
            body = await request.json()
            if loaded.pop(body["lora_name"], None) is None:
                return web.json_response({"error": {"message": "cannot be found", "code": 404}}, status=404)
            return web.Response(text="Success")

        async def models(request):
            return web.json_response({"data": [{"id": "base", "parent": None}] +
                                      [{"id": n, "root": p, "parent": "base"} for n, p in loaded.items()]})

        app = web.Application()
        app.router.add_post("/v1/load_lora_adapter", load)
        app.router.add_post("/v1/unload_lora_adapter", unload)
        app.router.add_get("/v1/models", models)
        async with serve(app) as url:
            conn = VLLMConnector(url)
            try:
                await conn.load(spec("x"), tmp_path)
                await conn.load(spec("x"), tmp_path)
                with pytest.raises(ConnectorError, match="500"):
                    await conn.load(spec("broken"), tmp_path)
                assert await conn.loaded() == {"x"}
                await conn.unload("x")
                await conn.unload("x")
                assert await conn.loaded() == set()
            finally:
                await conn.close()
    asyncio.run(main())


def test_parse_vllm_lora_metrics_takes_the_newest_series():
    text = (
        '# TYPE vllm:lora_requests_info gauge\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e+09\n'
        'vllm:lora_requests_info{max_lora="2",running_lora_adapters="d",waiting_lora_adapters=""} 1.8e+09\n'
        'vllm:lora_adapter_loaded{adapter_name="d",level="gpu",pinned="false",rank="8"} 1\n'
        'vllm:lora_adapter_loaded{adapter_name="e",level="cpu",pinned="false",rank="8"} 0\n'
    )
    busy, loaded = parse_lora_metrics(text)
    assert busy == {"d"}
    assert loaded == {"d"}
    assert parse_lora_metrics("") == (set(), set())


def test_vllm_prefetch_turn_waits_until_the_engine_runs_nothing():
    """A load runs on vLLM's engine core between steps: a prefetch waits for an idle engine
    (every request it runs would wait for the load), for at most idle_wait_s."""
    async def main():
        state = {"running": 2, "scrapes": 0}

        async def metrics(request):
            state["scrapes"] += 1
            if state["scrapes"] >= 3:
                state["running"] = 0
            return web.Response(text=f'vllm:num_requests_running{{engine="0"}} {state["running"]}\n'
                                     'vllm:num_requests_waiting{engine="0"} 0\n')

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        async with serve(app) as url:
            conn = VLLMConnector(url, idle_wait_s=30.0, idle_poll_s=0.0)
            try:
                assert await conn.prefetch_turn() is True      # busy twice, then idle
                assert state["scrapes"] == 3
                assert await conn.prefetch_turn() is False     # idle at once
                state.update(running=5, scrapes=-10**6)
                conn.idle_wait_s = 0.0
                assert await conn.prefetch_turn() is False     # busy, but no wait allowed
            finally:
                await conn.close()
    asyncio.run(main())


def test_vllm_with_a_resolver_loads_a_requests_adapter_itself():
    """With a LoRA resolver (``--vllm-resolver``) vLLM registers a request's unknown
    adapter itself: the agent leaves a request's own load to it (``loads_on_demand``,
    gpu_agent.residency.admission), as with the builtin engine; without one it makes it."""
    assert VLLMConnector("http://127.0.0.1:1", resolver=True).loads_on_demand is True
    assert VLLMConnector("http://127.0.0.1:1").loads_on_demand is False
    assert VLLMConnector("http://127.0.0.1:1").evicts_own_lru is True


@pytest.mark.parametrize("plugin", [True, False])
def test_vllm_named_victims_hold_only_while_unloads_carry_the_evicting_plugins_mark(plugin, caplog):
    """``--vllm-unload-evicts``: the agent follows named victims on vLLM (``evicts_own_lru``
    False) as long as each unload's answer says the weights left vLLM's CPU cache
    (``EVICTED``, tools/vllm_evict); an answer without it (the plugin is not loaded) turns
    them off for good, with an error logged, since those unloads only forget names."""
    async def main():
        async def unload(request):
            body = await request.json()
            text = f"Success: LoRA adapter '{body['lora_name']}' removed successfully."
            return web.Response(text=f"{text} {EVICTED}" if plugin else text)

        app = web.Application()
        app.router.add_post("/v1/unload_lora_adapter", unload)
        async with serve(app) as url:
            conn = VLLMConnector(url, unload_evicts=True)
            try:
                assert conn.evicts_own_lru is False
                await conn.unload("x")
                assert conn.evicts_own_lru is (not plugin)
                await conn.unload("y")
                assert conn.evicts_own_lru is (not plugin)
            finally:
                await conn.close()
    with caplog.at_level("ERROR", logger="gpu_agent.connectors.vllm"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == (0 if plugin else 1)
    if not plugin:
        assert "ace_evict" in errors[0].getMessage()


def test_the_evicting_plugins_mark_is_the_connectors():
    """The plugin (installed into vLLM's venv) and the connector agree on the marks and
    the ranking route."""
    from tools.vllm_evict import ace_vllm_evict as plugin
    assert (plugin.EVICTED, plugin.RANKED, plugin.RANK_PATH, plugin.CACHE_PATH) == (EVICTED, RANKED, RANK_PATH,
                                                                                   CACHE_PATH)
    assert (plugin.DROP_PATH, plugin.DROPPED, plugin.NOT_REGISTERED, plugin.READ_PATH, plugin.READ) == (
        DROP_PATH, DROPPED, NOT_REGISTERED, READ_PATH, READ)


class FakeVLLM:
    """vLLM's registry and CPU cache as the plugin's routes see them (pure bookkeeping:
    the real routes run in tests/integration/test_vllm_evict.py)."""

    def __init__(self, routes: bool = True):
        self.registered: dict[str, str] = {}
        self.cached: set[str] = set()
        self.calls: list[str] = []
        self.app = web.Application()
        self.app.router.add_post("/v1/load_lora_adapter", self.load)
        self.app.router.add_post("/v1/unload_lora_adapter", self.unload)
        self.app.router.add_get("/v1/models", self.models)
        if routes:
            self.app.router.add_post(DROP_PATH, self.drop)
            self.app.router.add_post(READ_PATH, self.read)
            self.app.router.add_get(CACHE_PATH, self.listing)

    async def load(self, request):
        body = await request.json()
        self.calls.append(f"load {body['lora_name']}")
        if body["lora_name"] in self.registered:
            return web.json_response({"error": {"message": f"The lora adapter '{body['lora_name']}' has already "
                                                           "been loaded."}}, status=400)
        self.registered[body["lora_name"]] = body["lora_path"]
        self.cached.add(body["lora_name"])
        return web.Response(text="Success")

    async def unload(self, request):
        name = (await request.json())["lora_name"]
        self.calls.append(f"unload {name}")
        self.registered.pop(name, None)
        self.cached.discard(name)
        return web.Response(text=f"Success {EVICTED}")

    async def drop(self, request):
        name = (await request.json())["lora_name"]
        self.calls.append(f"drop {name}")
        if name not in self.registered:
            return web.Response(text=f"{NOT_REGISTERED}: {name}")
        self.cached.discard(name)
        return web.Response(text=f"{DROPPED}: {name}")

    async def read(self, request):
        name = (await request.json())["lora_name"]
        self.calls.append(f"read {name}")
        self.cached.add(name)
        return web.Response(text=f"{READ}: {name}")

    async def listing(self, request):
        return web.json_response({"cached": sorted(self.cached & set(self.registered))})

    async def models(self, request):
        return web.json_response({"data": [{"id": n, "parent": "base", "root": p} for n, p in self.registered.items()]})


def test_vllm_keeping_names_registered_moves_only_weights(tmp_path):
    """``keep_registered``: an unload drops the weights and keeps the name; a load of a
    registered name reads its weights back; ``loaded`` is what the cache holds and
    ``registered`` what vLLM serves. An adapter the agent registered from its disk cache
    of a remote store is unregistered as before (its files may be deleted)."""
    local = spec("a")
    remote = Adapter(name="r", base_model="base", rank=8, target_modules=(), size_bytes=1, owner="public",
                     uri="https://store/r", sha256="1" * 64)

    async def main():
        fake = FakeVLLM()
        async with serve(fake.app) as url:
            conn = VLLMConnector(url, unload_evicts=True, keep_registered=True)
            try:
                await conn.load(local, tmp_path)
                await conn.load(remote, tmp_path)
                assert await conn.loaded() == {"a", "r"}
                assert await conn.cached() is None     # loaded() already is the cache
                assert conn.keeps_name("a") and not conn.keeps_name("r")
                await conn.unload("a")
                await conn.unload("r")
                assert await conn.loaded() == set()
                assert await conn.registered() == {"a"}
                await conn.load(local, tmp_path)
                assert await conn.loaded() == {"a"}
                await conn.unload("never-registered")
                return fake.calls
            finally:
                await conn.close()
    assert asyncio.run(main()) == ["load a", "load r", "drop a", "unload r", "load a", "read a",
                                   "drop never-registered"]


def test_vllm_keeping_names_needs_the_plugins_routes(tmp_path, caplog):
    """An engine whose plugin predates the drop / read / listing routes (404): the agent
    unregisters as before, lists ``/v1/models``, and says so once."""
    local = spec("a")

    async def main():
        fake = FakeVLLM(routes=False)
        async with serve(fake.app) as url:
            conn = VLLMConnector(url, unload_evicts=True, keep_registered=True)
            try:
                await conn.load(local, tmp_path)
                await conn.unload("a")
                assert not conn.keeps_registered
                assert await conn.loaded() == set()
                await conn.load(local, tmp_path)
                assert await conn.loaded() == {"a"}
                return fake.calls
            finally:
                await conn.close()
    with caplog.at_level("ERROR", logger="gpu_agent.connectors.vllm"):
        calls = asyncio.run(main())
    assert calls == ["load a", "unload a", "load a"]
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and DROP_PATH in errors[0].getMessage()


@pytest.mark.parametrize("route", [True, False])
def test_vllm_gets_the_gateways_victims_as_its_caches_ranking(route, caplog):
    """With the evicting plugin, a request's victims (``prefer_victims``) go to vLLM's
    ranking route in the background, once per change: vLLM's own reads into its full cache
    then evict them first. Without the route (an older plugin: 404) the agent stops
    sending, with one error logged; without ``unload_evicts`` it never sends."""
    async def main():
        got: list[list[str]] = []

        async def rank(request):
            body = await request.json()
            got.append(body["lora_names"])
            return web.Response(text=f"{RANKED}: {len(body['lora_names'])} of {len(body['lora_names'])} registered")

        app = web.Application()
        if route:
            app.router.add_post(RANK_PATH, rank)
        async with serve(app) as url:
            conn = VLLMConnector(url, unload_evicts=True)
            plain = VLLMConnector(url)
            try:
                conn.prefer_victims("c", ("a", "b"))
                await async_wait_until(lambda: not conn._ranking_tasks)
                conn.prefer_victims("d", ("a", "b"))   # unchanged: not sent again
                conn.prefer_victims("d", ())            # nothing named: nothing sent
                assert not conn._ranking_tasks
                conn.prefer_victims("e", ("b", "a"))
                await async_wait_until(lambda: not conn._ranking_tasks)
                plain.prefer_victims("c", ("a", "b"))
                assert not plain._ranking_tasks
                assert conn.ranks_victims is route
                assert got == ([["a", "b"], ["b", "a"]] if route else [])
            finally:
                await conn.close()
                await plain.close()
    with caplog.at_level("ERROR", logger="gpu_agent.connectors.vllm"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == (0 if route else 1)
    if not route:
        assert RANK_PATH in errors[0].getMessage()


@pytest.mark.parametrize("answer", ["listed", "no_route", "garbled"])
def test_vllm_lists_what_its_cpu_cache_holds_through_the_plugin(answer, caplog):
    """``cached``: the plugin's listing of vLLM's CPU cache. Without the route (an older
    plugin: 404) the agent stops asking, with one error logged; an answer it cannot read
    is None (every registered adapter held, as before); without ``unload_evicts`` nothing
    is asked."""
    async def main():
        asked: list[str] = []

        async def listing(request):
            asked.append(request.method)
            if answer == "garbled":
                return web.json_response({"cached": "a"})
            return web.json_response({"cached": ["a", "c"]})

        app = web.Application()
        if answer != "no_route":
            app.router.add_get(CACHE_PATH, listing)
        async with serve(app) as url:
            conn = VLLMConnector(url, unload_evicts=True)
            plain = VLLMConnector(url)
            try:
                first = await conn.cached()
                second = await conn.cached()
                assert await plain.cached() is None
                return first, second, conn.lists_cache, asked
            finally:
                await conn.close()
                await plain.close()
    with caplog.at_level("WARNING", logger="gpu_agent.connectors.vllm"):
        first, second, lists, asked = asyncio.run(main())
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    if answer == "listed":
        assert first == second == {"a", "c"} and lists and asked == ["GET", "GET"] and not errors
    elif answer == "no_route":
        assert first is second is None and not lists and asked == []
        assert len(errors) == 1 and CACHE_PATH in errors[0].getMessage()
    else:
        assert first is second is None and lists and len(asked) == 2 and not errors
        assert any(CACHE_PATH in r.getMessage() for r in caplog.records if r.levelname == "WARNING")


def test_the_plugins_ranked_victim_skips_what_the_cache_must_keep():
    """The plugin's choice in vLLM's worker (pure): the first ranked adapter that is
    cached, not pinned, not in the step being set up and not used since the ranking came;
    None (the cache's LRU) when there is none."""
    from tools.vllm_evict import ace_vllm_evict as plugin
    saved = (plugin._ranking, plugin._ranked_at, plugin._steps, dict(plugin._last_used))
    try:
        plugin._ranking, plugin._steps, plugin._last_used = (), 10, {1: 3, 2: 4, 3: 5, 4: 11}
        assert plugin.set_ranking(None, ["4", 5, 1, 2, 3]) == 5
        cached = {1, 2, 3, 4}
        assert plugin.ranked_victim(cached, set(), set()) == 1      # 4 was used since; 5 is not cached
        assert plugin.ranked_victim(cached, {1}, set()) == 2        # 1 pinned
        assert plugin.ranked_victim(cached, set(), {1, 2}) == 3     # 1 and 2 in this step
        assert plugin.ranked_victim(cached, set(), {1, 2, 3}) is None
        plugin._ranking = ()
        assert plugin.ranked_victim(cached, set(), set()) is None
        plugin.forget({2, 4})     # what a long-running server keeps: the cached ids' uses
        assert plugin._last_used == {2: 4, 4: 11}
    finally:
        plugin._ranking, plugin._ranked_at, plugin._steps, plugin._last_used = saved
