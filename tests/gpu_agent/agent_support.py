"""Builders for agent tests: a catalog of small fake adapters, a fake engine connector,
a loopback HTTP server that plays the remote tier, and one that serves an engine's
Prometheus /metrics (real-looking vLLM and SGLang texts)."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from pathlib import Path

import yaml
from aiohttp import web

from ace_common.catalog import Adapter
from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineLoad, EngineUnavailable
from gpu_agent.residency.manager import ResidencyBudgets, ResidencyManager


def write_adapter(directory: Path, name: str, nbytes: int = 4096) -> tuple[str, int]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    blob = hashlib.sha256(name.encode()).digest() * (nbytes // 32)
    (directory / "adapter_model.safetensors").write_bytes(blob)
    return hashlib.sha256(blob).hexdigest(), len(blob)


def make_catalog(root: Path, names: list[str], remote_base: str | None = None,
                 nbytes: int = 4096) -> Path:
    """Adapters under root/adapters/<name>; with `remote_base`, their uri is that URL."""
    entries = []
    for name in names:
        digest, size = write_adapter(root / "adapters" / name, name, nbytes)
        uri = f"{remote_base}/{name}" if remote_base else f"adapters/{name}"
        entries.append({"name": name, "base_model": "ace-tiny-llama", "rank": 8, "alpha": 16,
                        "target_modules": ["q_proj"], "size_bytes": size, "owner": "public",
                        "uri": uri, "sha256": digest})
    path = root / "catalog.yaml"
    path.write_text(yaml.safe_dump({"base_model": {"name": "ace-tiny-llama", "path": "model"},
                                    "adapters": entries}))
    return path


class FakeConnector(EngineConnector):
    """An engine in memory: records calls; can be made slow, down, or 'restarted'."""

    kind = "fake"

    def __init__(self, capacity: int | None = None, load_delay_s: float = 0.0):
        self.capacity = capacity
        self.load_delay_s = load_delay_s
        self.held: dict[str, Path] = {}
        self.calls: list[tuple[str, str]] = []
        self.demands: list[bool] = []   # per load: a request's (True) or a prefetch (False)
        self.reads = {"loaded": 0, "engine_load": 0}      # how often the agent asked
        self.busy_set: set[str] = set()
        self.down = False
        self.fail_loads = False
        self.engine_load_value: EngineLoad | None = None  # what engine_load() answers
        self.engine_load_error: Exception | None = None   # ... or raises

    async def load(self, spec: Adapter, path: Path, *, pinned: bool = False,
                   demand: bool = False) -> None:
        self.calls.append(("load", spec.name))
        self.demands.append(demand)
        if self.down:
            raise EngineUnavailable("fake engine down")
        if self.fail_loads:
            raise ConnectorError("fake engine refuses")
        await asyncio.sleep(self.load_delay_s)
        assert (path / "adapter_model.safetensors").is_file()
        self.held[spec.name] = path

    async def unload(self, name: str) -> None:
        self.calls.append(("unload", name))
        if self.down:
            raise EngineUnavailable("fake engine down")
        self.held.pop(name, None)

    async def loaded(self) -> set[str]:
        self.reads["loaded"] += 1
        if self.down:
            raise EngineUnavailable("fake engine down")
        return set(self.held)

    async def busy(self) -> set[str]:
        return set(self.busy_set)

    async def engine_load(self) -> EngineLoad | None:
        self.reads["engine_load"] += 1
        if self.engine_load_error is not None:
            raise self.engine_load_error
        return self.engine_load_value

    def restart(self) -> None:
        self.held.clear()


def make_manager(catalog_path: Path, cache_dir: Path, connector: EngineConnector, **budgets) -> ResidencyManager:
    catalog = Catalog.from_yaml(catalog_path)
    disk_budget = budgets.pop("disk_bytes", 1 << 30)
    budgets.setdefault("reconcile_interval_s", 0)
    clock = budgets.pop("clock", None)
    store = ArtifactStore(catalog, DiskCache(cache_dir, disk_budget))
    if clock is not None:
        return ResidencyManager(catalog, store, connector, ResidencyBudgets(**budgets), clock=clock)
    return ResidencyManager(catalog, store, connector, ResidencyBudgets(**budgets))


@contextlib.asynccontextmanager
async def serve(app: web.Application):
    """Run an aiohttp app on a loopback ephemeral port; yields its base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def static_server(root: Path, corrupt: set[str] = frozenset()):
    """Serve `root` over loopback HTTP; files of adapters in `corrupt` get one byte flipped.
    Yields (base_url, hits) where hits counts GETs per path."""
    hits: dict[str, int] = {}

    async def handle(request: web.Request) -> web.StreamResponse:
        rel = request.match_info["tail"]
        hits[rel] = hits.get(rel, 0) + 1
        path = (root / rel).resolve()
        if not path.is_relative_to(root.resolve()) or not path.is_file():
            raise web.HTTPNotFound()
        data = path.read_bytes()
        if rel.split("/")[0] in corrupt and rel.endswith(".safetensors"):
            data = bytes([data[0] ^ 1]) + data[1:]
        return web.Response(body=data)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    async with serve(app) as url:
        yield url, hits


# Shaped like vLLM 0.x's /metrics with two data-parallel engines (prometheus_client output).
VLLM_TEXT = '''\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12345.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/models/llama"} 3.0
vllm:num_requests_running{engine="1",model_name="/models/llama"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="/models/llama"} 7.0
vllm:num_requests_waiting{engine="1",model_name="/models/llama"} 0.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="/models/llama",reason="capacity"} 7.0
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7e+09
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="/models/llama"} 0.42
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="/models/llama"} 10.0
'''

SGLANG_TEXT = '''\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 11.0
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",pp_rank="0",tp_rank="0"} 0.1
'''


@contextlib.asynccontextmanager
async def metrics_server(state: dict):
    """GET /metrics answers state["text"] with state["status"] (and counts the scrapes)."""
    async def metrics(request):
        state["scrapes"] = state.get("scrapes", 0) + 1
        if state.get("delay_s"):
            await asyncio.sleep(state["delay_s"])
        return web.Response(text=state["text"], status=state.get("status", 200),
                            content_type="text/plain", charset="utf-8")

    async def by_name(request):
        """prometheus_client's ASGI app: only the series of the ``name[]`` metrics asked for."""
        state["by_name"] = state.get("by_name", 0) + 1
        names = set(request.query.getall("name[]", []))
        text = "".join(line + "\n" for line in state["text"].splitlines()
                       if line.split("{")[0].split(" ")[0] in names)
        return web.Response(text=text, status=state.get("status", 200), content_type="text/plain", charset="utf-8")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    if state.get("names"):                      # an engine that serves metrics by name, as vLLM does
        app.router.add_get("/metrics/", by_name)
    async with serve(app) as url:
        yield url


def remote_catalog(fixtures: Path, tmp_path: Path, base: str) -> Path:
    """The fixtures' catalog with every adapter's ``uri`` at ``base`` (an artifact store
    over loopback HTTP) and the base model's path made absolute."""
    doc = yaml.safe_load((fixtures / "catalog.yaml").read_text())
    doc["base_model"]["path"] = str((fixtures / doc["base_model"]["path"]).resolve())
    for a in doc["adapters"]:
        a["uri"] = f"{base}/{a['name']}"
    out = tmp_path / "remote-catalog.yaml"
    out.write_text(yaml.safe_dump(doc))
    return out
