"""Builders for agent tests: a catalog of small fake adapters, a fake engine connector,
and a loopback HTTP server that plays the remote tier."""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
from pathlib import Path

import yaml
from aiohttp import web

from gpu_agent.artifacts import AdapterSpec, ArtifactStore, Catalog, DiskCache
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineUnavailable
from gpu_agent.residency import ResidencyBudgets, ResidencyManager


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
        self.busy_set: set[str] = set()
        self.down = False
        self.fail_loads = False

    async def load(self, spec: AdapterSpec, path: Path, *, pinned: bool = False) -> None:
        self.calls.append(("load", spec.name))
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
        if self.down:
            raise EngineUnavailable("fake engine down")
        return set(self.held)

    async def busy(self) -> set[str]:
        return set(self.busy_set)

    def restart(self) -> None:
        self.held.clear()


def make_manager(catalog_path: Path, cache_dir: Path, connector: EngineConnector, **budgets) -> ResidencyManager:
    catalog = Catalog.from_yaml(catalog_path)
    disk_budget = budgets.pop("disk_bytes", 1 << 30)
    budgets.setdefault("reconcile_interval_s", 0)
    store = ArtifactStore(catalog, DiskCache(cache_dir, disk_budget))
    return ResidencyManager(catalog, store, connector, ResidencyBudgets(**budgets))


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
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", hits
    finally:
        await runner.cleanup()


async def wait_for(predicate, timeout: float = 15.0, interval: float = 0.01):
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(interval)
