"""A vLLM general plugin: the agent, not the CPU cache's LRU, decides what leaves vLLM's
LoRA cache.

vLLM 0.32 keeps a LoRA adapter's weights in a CPU LRU cache (``--max-cpu-loras``). Two
things there ignore the gateway's choice of victim:

- ``/v1/unload_lora_adapter`` only forgets the name: the weights stay cached until the
  LRU drops them. With this plugin the route also calls ``EngineClient.remove_lora`` (the
  cache and the GPU slot) and says so in its answer (``EVICTED``).
- A read into the full cache (a request's adapter through the filesystem resolver, or a
  registered adapter the cache had dropped) evicts the least recently used adapter. It
  runs in the engine's step, as soon as the request is scheduled, so an unload sent at
  the same time by the agent mostly arrives after it (75% of the agent's evictions ahead
  in one ``make bench ENGINE=vllm`` run): the LRU adapter leaves, then the named one too.
  With this plugin ``POST /v1/ace/lora_victims {"lora_names": [...]}`` (``RANK_PATH``)
  sets a standing ranking, coldest first, in the engine's worker (``collective_rpc``);
  the cache's next eviction takes the first ranked adapter that is cached, not pinned,
  not in the step being set up, and not used since the ranking came (``RANKED_MARK``
  in vLLM's log), and the LRU only when none is. The agent sends the gateway's victims
  ahead of the loads they are for.
- A read the ranking did not steer (no ranked adapter could go, or the ranking changed
  since) still drops an adapter whose name stays registered. ``GET /v1/ace/lora_cache``
  (``CACHE_PATH``) answers ``{"cached": [name, ...]}``: the registered names whose weights
  the cache holds now (``EngineClient.list_loras``), so that the agent unregisters a
  dropped name before a cached one.
- A name that stays registered costs its next request a re-read (+0.9 ms on the
  fixtures' model, ``make bench-vllm-paths``), one unregistered the filesystem resolver's
  registration (+2.2 ms). ``POST /v1/ace/lora_drop {"lora_name"}`` (``DROP_PATH``) drops an
  adapter's weights from the cache and keeps its name registered (``DROPPED`` in the
  answer; an unknown name: ``NOT_REGISTERED``, nothing to drop), and ``POST
  /v1/ace/lora_read {"lora_name"}`` (``READ_PATH``) reads a registered adapter into the
  cache again (``READ_MARK`` in vLLM's log, the name after it), so that an agent can keep
  every name registered and move only weights (``--vllm-keep-registered``).

Deploy: ``pip install ./tools/vllm_evict`` into vLLM's environment and name it in
``VLLM_PLUGINS`` (with the resolver: ``VLLM_PLUGINS=lora_filesystem_resolver,ace_evict``);
the routes exist where vLLM's runtime LoRA routes do
(``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), behind the same API key. It changes nothing
else: loads, requests and the resolver are vLLM's own. An adapter a request is running
with is read back by vLLM at its next step (the agent never unloads one it sees busy).
"""
import json

#: appended to the unload route's answer when the weights were dropped from the cache
EVICTED = "(ace: dropped from vLLM's LoRA cache)"
REGISTERED = "ace-evict: plugin registered"
#: the ranking route, and the start of its answer
RANK_PATH = "/v1/ace/lora_victims"
RANKED = "ace: victims ranked"
#: the cache's listing route
CACHE_PATH = "/v1/ace/lora_cache"
#: drop a registered adapter's weights, keep its name; the start of the answer, and the
#: answer for a name that is not registered
DROP_PATH = "/v1/ace/lora_drop"
DROPPED = "ace: weights dropped from vLLM's LoRA cache, name kept"
NOT_REGISTERED = "ace: not registered"
#: read a registered adapter into the cache; the start of the answer, and the log line
READ_PATH = "/v1/ace/lora_read"
READ = "ace: read into vLLM's LoRA cache"
READ_MARK = "ace-evict: read registered LoRA adapter"
#: logged in the engine's process when the cache evicts a ranked adapter (then its id)
RANKED_MARK = "ace-evict: cache evicted the ranked victim"
#: the most names one ranking holds
MAX_RANKED = 64
#: past this many adapter ids seen, those no longer cached are forgotten (the resolver
#: gives a name registered again a new id: a long-running server sees ids without end)
MAX_TRACKED = 4096

# The engine worker's state (one per process; the worker's calls run on one thread):
# the ranking's adapter ids, coldest first, the step count when it came, and the step
# that last used each adapter.
_ranking: tuple = ()
_ranked_at = 0
_steps = 0
_last_used: dict = {}


def set_ranking(worker, ids) -> int:
    """Runs in the engine's worker (``collective_rpc("ace_set_lora_victims", ...)``)."""
    global _ranking, _ranked_at
    _ranking = tuple(int(i) for i in ids)[:MAX_RANKED]
    _ranked_at = _steps
    return len(_ranking)


def ranked_victim(cached, pinned, busy) -> "int | None":
    """The first ranked adapter id the cache may evict now: cached, not pinned, not in the
    step being set up (``busy``), not used since the ranking came; None: the LRU's turn."""
    for lora_id in _ranking:
        if (lora_id in cached and lora_id not in pinned and lora_id not in busy
                and _last_used.get(lora_id, 0) <= _ranked_at):
            return lora_id
    return None


def forget(keep) -> None:
    """Drop every adapter id's last use but ``keep``'s (the cached ones)."""
    for lora_id in [i for i in _last_used if i not in keep]:
        del _last_used[lora_id]


def _patch_worker() -> None:
    from vllm.lora import model_manager, worker_manager
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    manager = worker_manager.LRUCacheWorkerLoRAManager
    if getattr(manager._apply_adapters, "ace_ranked", False):
        return
    apply = manager._apply_adapters

    def _apply_adapters(self, lora_requests):
        global _steps
        _steps += 1
        ids = {r.lora_int_id for r in lora_requests if r}
        for lora_id in ids:
            _last_used[lora_id] = _steps
        if len(_last_used) > MAX_TRACKED:
            forget(self._adapter_manager.list_adapters().keys() | ids)
        self._adapter_manager.ace_busy = ids
        try:
            return apply(self, lora_requests)
        finally:
            # between steps (an agent's load) nothing is being set up; a running request's
            # adapter is kept by its last use, which came after any ranking that names it
            self._adapter_manager.ace_busy = ()

    cache_manager = model_manager.LRUCacheLoRAModelManager
    remove_oldest = cache_manager.remove_oldest_adapter

    def remove_oldest_adapter(self):
        cache = self._registered_adapters
        victim = ranked_victim(cache, getattr(cache, "pinned_items", ()), getattr(self, "ace_busy", ()))
        if victim is None:
            return remove_oldest(self)
        self.remove_adapter(victim)
        print(f"{RANKED_MARK} {victim}", flush=True)
        return True

    _apply_adapters.ace_ranked = True
    manager._apply_adapters = _apply_adapters
    cache_manager.remove_oldest_adapter = remove_oldest_adapter
    WorkerWrapperBase.ace_set_lora_victims = set_ranking


def _patch_api() -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    unload = OpenAIServingModels.unload_lora_adapter
    if getattr(unload, "ace_evicts", False):
        return

    async def unload_lora_adapter(self, request, *args, **kwargs):
        known = self.lora_requests.get(request.lora_name)
        answer = await unload(self, request, *args, **kwargs)
        if known is None or not isinstance(answer, str):
            return answer  # an error answer, or nothing was registered: unchanged
        # the name is forgotten; a request naming it again registers a new id (the
        # resolver), so the id dropped here is only the unloaded one
        await self.engine_client.remove_lora(known.lora_int_id)
        return f"{answer} {EVICTED}"

    unload_lora_adapter.ace_evicts = True
    OpenAIServingModels.unload_lora_adapter = unload_lora_adapter
    _add_routes()


def _add_routes() -> None:
    """``RANK_PATH``, ``CACHE_PATH``, ``DROP_PATH`` and ``READ_PATH`` on the router of vLLM's runtime LoRA routes
    (included by the app only where those are on)."""
    from fastapi import Request
    from fastapi.responses import JSONResponse, Response

    from vllm.entrypoints.openai.models.api_router import models
    from vllm.entrypoints.serve.lora import api_router

    if any(getattr(route, "path", None) == RANK_PATH for route in api_router.router.routes):
        return

    def bad(message: str, param: str = "lora_names") -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {
            "message": message, "type": "BadRequestError", "param": param, "code": 400}})

    async def registered_one(raw_request: Request):
        """(the handler, the name, its registration or None) of a ``{"lora_name"}`` body, or
        the 400 answer to a body that is not one."""
        try:
            body = json.loads(await raw_request.body())
        except ValueError:
            return bad("the body is not JSON", "lora_name")
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return bad('expected {"lora_name": name}', "lora_name")
        handler = models(raw_request)
        return handler, name, handler.lora_requests.get(name)

    async def rank_lora_victims(raw_request: Request):
        try:
            body = json.loads(await raw_request.body())
        except ValueError:
            return bad("the body is not JSON")
        names = body.get("lora_names") if isinstance(body, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            return bad('expected {"lora_names": [name, ...]}, coldest first')
        if len(names) > MAX_RANKED:
            return bad(f"at most {MAX_RANKED} names")
        handler = models(raw_request)
        known = [handler.lora_requests[n] for n in names if n in handler.lora_requests]
        await handler.engine_client.collective_rpc("ace_set_lora_victims",
                                                   args=([r.lora_int_id for r in known],))
        return Response(status_code=200, content=f"{RANKED}: {len(known)} of {len(names)} registered")

    async def list_lora_cache(raw_request: Request):
        handler = models(raw_request)
        ids = await handler.engine_client.list_loras()
        cached = sorted(name for name, r in list(handler.lora_requests.items()) if r.lora_int_id in ids)
        return JSONResponse(content={"cached": cached})

    def by_name(act):
        """A route of a ``{"lora_name"}`` body: ``act(handler, name, registration or None)``."""
        async def route(raw_request: Request):
            got = await registered_one(raw_request)
            return await act(*got) if isinstance(got, tuple) else got
        return route

    async def drop_lora(handler, name, known):
        if known is None:
            return Response(status_code=200, content=f"{NOT_REGISTERED}: {name}")
        await handler.engine_client.remove_lora(known.lora_int_id)
        return Response(status_code=200, content=f"{DROPPED}: {name}")

    async def read_lora(handler, name, known):
        if known is None:
            return JSONResponse(status_code=404, content={"error": {
                "message": f"{NOT_REGISTERED}: {name}", "type": "NotFoundError", "param": "lora_name", "code": 404}})
        print(f"{READ_MARK} {name}", flush=True)
        await handler.engine_client.add_lora(known)
        return Response(status_code=200, content=f"{READ}: {name}")

    api_router.router.add_api_route(RANK_PATH, rank_lora_victims, methods=["POST"])
    api_router.router.add_api_route(CACHE_PATH, list_lora_cache, methods=["GET"])
    api_router.router.add_api_route(DROP_PATH, by_name(drop_lora), methods=["POST"])
    api_router.router.add_api_route(READ_PATH, by_name(read_lora), methods=["POST"])


def register() -> None:
    """vLLM calls this in each of its processes (possibly more than once): the routes act
    in the API server's process, the cache's eviction in the engine worker's."""
    try:
        _patch_worker()
        _patch_api()
    except ImportError:  # another vLLM layout: change nothing (the agent sees no EVICTED)
        return
    print(REGISTERED, flush=True)
