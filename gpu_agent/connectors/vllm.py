"""vLLM's runtime LoRA API (needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True` on the engine).

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}`: 200 text on success; 400
  when the name is already loaded, which is success for us (idempotent load).
- `POST /v1/unload_lora_adapter {"lora_name"}`: 200 text; 404 when unknown (success).
- `GET /v1/models`: adapters are the entries with a `parent` (their base model).
- `GET /metrics`: `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters}`
  (the current series is the one with the largest value, a timestamp) and, in newer vLLM,
  `vllm:lora_adapter_loaded{adapter_name, ...}`; running and waiting adapters are busy.
  The engine's load is `vllm:num_requests_running` + `vllm:num_requests_waiting`
  (summed over their series: one per engine with data parallelism).

`capacity` mirrors the engine's `--max-cpu-loras`: vLLM keeps that many adapters in its
own CPU LRU and silently re-reads evicted ones from `lora_path` on the next request, so
the agent keeps its device tier at the same size and unloads its own LRU adapter
explicitly. Then the agent's view and the engine's agree, and `/v1/models` says so. An
unload only forgets the name (the weights stay cached until that LRU drops them), so the
agent never unloads a victim someone named (``evicts_own_lru``): only its LRU, which
follows vLLM's order of use, keeps the two caches alike. With ace's evicting plugin in
vLLM (``tools/vllm_evict``, ``unload_evicts=True``: agent flag ``--vllm-unload-evicts``) an
unload also drops the weights from that cache, so the agent follows the gateway's named
victims as on any other engine. Each unload's answer carries the plugin's mark
(``EVICTED``); one without it (the plugin is not loaded) turns the named victims off
again, with an error logged, since unloading them would only leave dead weights cached.
The same plugin ranks the cache's victims (``RANK_PATH``): a request's read into vLLM's
full cache runs as soon as vLLM schedules it, mostly before an unload sent at the same
time arrives, and then evicts the cache's LRU. ``prefer_victims`` (a request's ingress
signal, the gateway's victims for this host) sends the ranking in the background, so the
reads after it evict the gateway's victims instead (``ranks_victims``: the agent then
unloads nothing on the request's path; the shrink after the reconcile sees vLLM's new
adapter unloads the ranked name whose weights the read took); an engine that answers
without the plugin's route (404: an older plugin) gets no more rankings, with an error
logged, and the agent unloads a request's named victims at once again.
The plugin also lists what that cache holds (``CACHE_PATH``, ``cached``): a read the
ranking did not steer (no ranked adapter could go, or the ranking changed since) drops an
adapter whose name stays registered, and the agent's shrink would unload another, cached
one (a hit lost, while the dropped one's next request re-reads it anyway). The agent
unregisters such dropped names first (``reason="engine_dropped"``); an engine without the
route (404: an older plugin) is not asked again.

``keep_registered`` (agent flag ``--vllm-keep-registered``, plugin 1.3): the agent never
unregisters an adapter to make room, it drops only its weights (``DROP_PATH``), so the
name's next request re-reads them (+0.9 ms over a cached adapter on the fixtures' model)
instead of going through the filesystem resolver (+2.2 ms, ``make bench-vllm-paths``),
and a load of a registered name reads its weights back (``READ_PATH``). The device tier
is then what vLLM's cache holds (``loaded`` lists it, ``CACHE_PATH``), ``registered``
what vLLM serves by name; a name the cache dropped is a tier lost, not an engine reset.
Only names whose files cannot leave are kept so: an adapter the agent registered from
its disk cache of a remote store (whose budget may delete the files) is unregistered as
before. An engine whose plugin lacks those routes (404) turns the mode off, with an
error logged.

A load or an unload runs on vLLM's engine core between two steps, so every request it
is running waits for it (12-73 ms per load in `make bench ENGINE=vllm` on the shared
CPUs, docs/engine.md). A prefetch's load is therefore put off until the engine runs and
queues nothing (``prefetch_turn``: its load as `/metrics` reports it, polled every
``idle_poll_s``, for at most ``idle_wait_s``; then it goes anyway); a request's own load
is not. Reading `/metrics` costs vLLM's API loop too (4.4 ms for the whole page): every
read goes through one ``MetricsScraper``, which asks for the three metrics read here by
name (0.8 ms), so the load monitor, the idle wait and the busy checks share cheap reads.
"""
from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import httpx

from ace_common.catalog import Adapter
from gpu_agent.connectors.base import (ConnectorError, EngineConnector, EngineLoad, EngineUnavailable,
                                       listed_adapters)
from gpu_agent.connectors.prometheus import VLLM_LOAD, MetricsScraper

__all__ = ["CACHE_PATH", "DROPPED", "DROP_PATH", "EVICTED", "NOT_REGISTERED", "RANKED", "RANK_PATH", "READ",
           "READ_PATH", "VLLMConnector", "parse_lora_metrics"]

log = logging.getLogger(__name__)

#: the evicting plugin's mark in an unload's answer (tools/vllm_evict/ace_vllm_evict.py)
EVICTED = "(ace: dropped from vLLM's LoRA cache)"
#: the same plugin's ranking route, and the start of its answer
RANK_PATH = "/v1/ace/lora_victims"
RANKED = "ace: victims ranked"
#: the same plugin's listing of the adapters in vLLM's CPU cache: {"cached": [name, ...]}
CACHE_PATH = "/v1/ace/lora_cache"
#: the same plugin's routes that drop / read an adapter's weights and keep its name, and
#: the starts of their answers
DROP_PATH = "/v1/ace/lora_drop"
DROPPED = "ace: weights dropped from vLLM's LoRA cache, name kept"
NOT_REGISTERED = "ace: not registered"
READ_PATH = "/v1/ace/lora_read"
READ = "ace: read into vLLM's LoRA cache"

_SERIES = re.compile(r'^(vllm:lora_requests_info|vllm:lora_adapter_loaded)\{([^}]*)\}\s+(\S+)', re.M)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_lora_metrics(text: str) -> tuple[set[str], set[str]]:
    """(busy adapters, loaded adapters) from vLLM's Prometheus text."""
    best: tuple[float, dict[str, str]] | None = None
    loaded: set[str] = set()
    for name, labels, value in _SERIES.findall(text):
        lab = dict(_LABEL.findall(labels))
        try:
            val = float(value)
        except ValueError:
            continue
        if name == "vllm:lora_requests_info":
            if best is None or val > best[0]:
                best = (val, lab)
        elif val > 0 and lab.get("adapter_name"):
            loaded.add(lab["adapter_name"])
    busy: set[str] = set()
    if best is not None:
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            busy.update(a for a in best[1].get(key, "").split(",") if a)
    return busy, loaded


class VLLMConnector(EngineConnector):
    kind = "vllm"
    load_compute_share = 1.0
    evicts_own_lru = True

    def __init__(self, url: str, max_cpu_loras: int | None = 4, timeout_s: float = 30.0,
                 api_key: str | None = None, client: httpx.AsyncClient | None = None,
                 metrics_timeout_s: float = 1.0, idle_wait_s: float = 1.0, idle_poll_s: float = 0.1,
                 metrics_max_age_s: float = 0.1, resolver: bool = False, unload_evicts: bool = False,
                 keep_registered: bool = False):
        self._url = url.rstrip("/")
        # with ace's evicting plugin an unload frees the adapter's place in vLLM's CPU cache:
        # the agent's named victims leave it, not vLLM's LRU (checked on every unload)
        self.evicts_own_lru = not unload_evicts
        # and its cache evicts the ranking the agent sends first (prefer_victims)
        self.ranks_victims = unload_evicts
        # and it lists what that cache holds (cached): registered names it dropped go first
        self.lists_cache = unload_evicts
        # and it drops / reads weights while names stay registered: the device tier is its cache
        self.keeps_registered = unload_evicts and keep_registered
        # names the agent registered from files its disk tier may delete: unregistered on eviction
        self._volatile: set[str] = set()
        self._ranking_sent: tuple[str, ...] = ()
        self._ranking_tasks: set[asyncio.Task] = set()
        # with a LoRA resolver vLLM registers a request's unknown adapter itself: the
        # agent's load of it would only race that one (and unload a victim for it)
        self.loads_on_demand = resolver
        self.capacity = max_cpu_loras
        self.metrics_timeout_s = metrics_timeout_s
        self.idle_wait_s = idle_wait_s
        self.idle_poll_s = idle_poll_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = client or httpx.AsyncClient(base_url=self._url, timeout=timeout_s, headers=headers)
        # every /metrics read goes through it: the load, the busy adapters and the idle
        # wait share one read per metrics_max_age_s (a read costs vLLM's API loop ~4 ms)
        self.metrics = MetricsScraper(self._client, "vLLM", metrics_timeout_s, max_age_s=metrics_max_age_s,
                                      names=(*VLLM_LOAD, "vllm:lora_requests_info"))

    @property
    def url(self) -> str:
        return self._url

    async def close(self) -> None:
        for task in list(self._ranking_tasks):
            task.cancel()
        await asyncio.gather(*self._ranking_tasks, return_exceptions=True)
        await self._client.aclose()

    def prefer_victims(self, loading: str, victims: tuple[str, ...]) -> None:
        """The gateway's victims for this host, coldest first, become vLLM's cache's ranking
        (sent in the background, when it changed): the reads into the full cache from now
        on evict them before its LRU. ``loading`` is the request's adapter, which vLLM
        reads itself."""
        if not self.ranks_victims or self.evicts_own_lru or not victims or victims == self._ranking_sent:
            return
        self._ranking_sent = victims
        task = asyncio.get_running_loop().create_task(self._send_ranking(victims))
        self._ranking_tasks.add(task)
        task.add_done_callback(self._ranking_tasks.discard)

    async def _send_ranking(self, victims: tuple[str, ...]) -> None:
        try:
            resp = await self._post(RANK_PATH, {"lora_names": list(victims)})
        except EngineUnavailable as exc:
            self._ranking_sent = ()
            log.warning("vLLM %s: the victims' ranking was not sent: %s", self._url, exc)
            return
        if resp.status_code == 200 and resp.text.startswith(RANKED):
            return
        self._ranking_sent = ()
        if resp.status_code in (404, 405):
            self.ranks_victims = False
            log.error("vLLM %s has no %s (HTTP %s): ace's evicting plugin there predates the ranking "
                      "(reinstall tools/vllm_evict); named victims still leave by unload, but a request's "
                      "read into the full cache evicts vLLM's LRU first", self._url, RANK_PATH, resp.status_code)
            return
        log.warning("vLLM %s: the victims' ranking was refused: HTTP %s: %s", self._url, resp.status_code,
                    _error_message(resp)[:300])

    async def _post(self, path: str, body: dict) -> httpx.Response:
        try:
            return await self._client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"vLLM {self._url}{path}: {exc!r}") from exc

    async def load(self, spec: Adapter, path: Path, *, pinned: bool = False,
                   demand: bool = False) -> None:
        resp = await self._post("/v1/load_lora_adapter", {"lora_name": spec.name, "lora_path": str(path)})
        if resp.status_code == 200:
            if spec.is_remote:
                self._volatile.add(spec.name)
            return
        message = _error_message(resp)
        if resp.status_code == 400 and "already" in message.lower():
            if self.keeps_registered and not await self._read(spec.name):
                await self.unload(spec.name)   # the plugin cannot read it back: register it anew
                await self.load(spec, path, pinned=pinned, demand=demand)
            return
        if resp.status_code == 404 and not message:
            raise ConnectorError("vLLM has no /v1/load_lora_adapter: start it with "
                                 "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True")
        raise ConnectorError(f"vLLM load {spec.name}: HTTP {resp.status_code}: {message[:300]}")

    async def _read(self, name: str) -> bool:
        """A registered adapter's weights back into vLLM's cache (``READ_PATH``); False when
        the plugin has no such route (the mode is then off, said once)."""
        resp = await self._post(READ_PATH, {"lora_name": name})
        if resp.status_code == 200 and resp.text.startswith(READ):
            return True
        if resp.status_code == 404 and NOT_REGISTERED in _error_message(resp):
            raise ConnectorError(f"vLLM load {name}: registered, then not registered when read")
        if resp.status_code in (404, 405):
            self._keep_off(READ_PATH, resp.status_code)
            return False
        raise ConnectorError(f"vLLM read {name}: HTTP {resp.status_code}: {_error_message(resp)[:300]}")

    def _keep_off(self, path: str, status: int) -> None:
        if self.keeps_registered:
            self.keeps_registered = False
            log.error("vLLM %s has no %s (HTTP %s): ace's evicting plugin there predates it (reinstall "
                      "tools/vllm_evict); evicted adapters are unregistered again", self._url, path, status)

    async def unload(self, name: str) -> None:
        if self.keeps_name(name):
            resp = await self._post(DROP_PATH, {"lora_name": name})
            if resp.status_code == 200 and resp.text.startswith((DROPPED, NOT_REGISTERED)):
                return
            if resp.status_code not in (404, 405):
                raise ConnectorError(f"vLLM drop {name}: HTTP {resp.status_code}: {_error_message(resp)[:300]}")
            self._keep_off(DROP_PATH, resp.status_code)
        resp = await self._post("/v1/unload_lora_adapter", {"lora_name": name})
        self._volatile.discard(name)
        if resp.status_code == 200:
            self._check_evicted(name, resp.text)
            return
        if resp.status_code == 404:
            return
        if resp.status_code == 400 and "not" in _error_message(resp).lower():
            return  # older vLLM: 400 "... cannot be found"
        raise ConnectorError(f"vLLM unload {name}: HTTP {resp.status_code}: {_error_message(resp)[:300]}")

    def _check_evicted(self, name: str, answer: str) -> None:
        """An unload said to evict answered without the plugin's mark: vLLM kept the
        weights cached, so named victims would only leave dead weights there. Back to
        vLLM's LRU for good, said once."""
        if self.evicts_own_lru or EVICTED in answer:
            return
        self.evicts_own_lru = True
        log.error("vLLM %s unloaded %s without dropping it from its CPU cache: ace's evicting plugin is not "
                  "loaded (pip install tools/vllm_evict into vLLM's environment and add ace_evict to "
                  "VLLM_PLUGINS); named victims are off, vLLM's LRU chooses what leaves its cache", self._url, name)

    async def loaded(self) -> set[str]:
        """What the device tier holds: the registered adapters, or (``keeps_registered``)
        those whose weights vLLM's cache holds."""
        if self.keeps_registered:
            names = await self._listing()
            if names is not None:
                return names
            if self.keeps_registered:   # unreadable, not missing: the reconcile tries again
                raise EngineUnavailable(f"vLLM {self._url}{CACHE_PATH}: no listing")
        return await self.registered()

    async def registered(self) -> set[str]:
        """The adapters vLLM serves by name (``GET /v1/models``)."""
        return await listed_adapters(self._client, "vLLM", self._url)

    def keeps_name(self, name: str) -> bool:
        return self.keeps_registered and name not in self._volatile

    async def cached(self) -> set[str] | None:
        """The registered adapters whose weights vLLM's CPU cache holds now (the plugin's
        ``CACHE_PATH``); None without the plugin's route, or when it could not be read, and
        where ``loaded`` already lists that cache (``keeps_registered``)."""
        if not self.lists_cache or self.evicts_own_lru or self.keeps_registered:
            return None
        try:
            return await self._listing()
        except EngineUnavailable as exc:
            log.warning("%s", exc)
            return None

    async def _listing(self) -> set[str] | None:
        """``GET CACHE_PATH`` read by ``_cache_listing``; EngineUnavailable when vLLM does
        not answer."""
        try:
            resp = await self._client.get(CACHE_PATH)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"vLLM {self._url}{CACHE_PATH}: {exc!r}") from exc
        return self._cache_listing(resp)

    def _cache_listing(self, resp: httpx.Response) -> set[str] | None:
        """The names in a ``CACHE_PATH`` answer; None when it has none (404: the route is
        missing, and it is not asked again)."""
        if resp.status_code in (404, 405):
            self.lists_cache = False
            log.error("vLLM %s has no %s (HTTP %s): ace's evicting plugin there predates it (reinstall "
                      "tools/vllm_evict); a registered adapter whose weights vLLM's cache dropped is no "
                      "longer unregistered first", self._url, CACHE_PATH, resp.status_code)
            self._keep_off(CACHE_PATH, resp.status_code)
            return None
        try:
            names = resp.json()["cached"] if resp.status_code == 200 else None
        except (ValueError, KeyError, TypeError):
            names = None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            log.warning("vLLM %s%s: HTTP %s: %s", self._url, CACHE_PATH, resp.status_code, resp.text[:300])
            return None
        return set(names)

    async def busy(self) -> set[str]:
        """The adapters of the requests vLLM runs or queues, read fresh (an eviction
        follows it), or joined to a read in flight; empty when unreadable."""
        try:
            return parse_lora_metrics(await self.metrics.text(max_age_s=0.0))[0]
        except ConnectorError:
            return set()

    async def engine_load(self) -> EngineLoad | None:
        return await self.metrics.load(VLLM_LOAD)

    async def prefetch_turn(self) -> bool:
        """Wait (at most ``idle_wait_s``) until vLLM runs and queues no request: a load now
        would stall them all. True when it had to wait; an unreadable load does not wait."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.idle_wait_s
        waited = False
        while True:
            try:
                load = await self.engine_load()
            except ConnectorError:
                return waited
            if load is None or load.running + load.waiting == 0 or loop.time() >= deadline:
                return waited
            waited = True
            await asyncio.sleep(self.idle_poll_s)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", body))
        return str(err)
    return str(body)
