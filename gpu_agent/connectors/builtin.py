"""The builtin engine (gpu_agent.engine), run in-process and driven through its residency seam.

The engine keeps its own tiers (paged device pool, parsed host copies); the agent gives it
an `AdapterSource` backed by the agent's `ArtifactStore`, so remote fetches, the disk
cache and digest checks are the agent's, and the engine only ever reads verified
directories. The pool owns the device tier: it evicts by its own record of use whenever a
load needs room (the agent's prefetches and the engine's requests alike), so this
connector is `self_managed` (the agent keeps no device budget; an adapter that left the
pool just dropped a tier). The connector hears
every such departure and tells the store (`ArtifactStore.left_device`), so a resident-only
disk cache (`--disk-budget-mb 0`) drops the files at once.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable

from ace_common.catalog import Adapter
from gpu_agent.artifacts import ArtifactStore
from gpu_agent.connectors.base import ConnectorError, EngineConnector, EngineLoad
from gpu_agent.errors import AdapterBusy

__all__ = ["BuiltinConnector", "StoreSource"]

log = logging.getLogger(__name__)


class StoreSource:
    """`gpu_agent.engine.adapters.AdapterSource` over the agent's artifact store."""

    def __init__(self, store: ArtifactStore):
        self.store = store

    def tier(self, entry: Any) -> str:
        spec = self.store.catalog.get(entry.name)
        if spec is None:  # registered at run time from a local directory
            return "remote" if entry.is_remote else "disk"
        return "remote" if spec.is_remote and not self.store.has_local(spec) else "disk"

    def fetches_in_flight(self) -> int:
        """Fetches under way in the store (the engine's and the agent's prefetches')."""
        return self.store.fetches_in_flight

    async def local_dir(self, entry: Any) -> tuple[Path, bool]:
        spec = self.store.catalog.get(entry.name)
        if spec is None:
            return entry.local_dir(), True
        path, _ = await self.store.ensure_local(spec, set())
        return path, False  # the store verified the digest when the files entered


#: The share of a load's time the builtin engine's forward passes lose to it when both run
#: on the CPU: the load's fetch, digest, parse and copy are CPU work on the cores the
#: forward uses, so all of it, as on vLLM (docs/agent.md, "The speculation budget"; shares
#: 0, 0.5 and 1 side by side in docs/bench-history.md, 2026-12-03 "A wasted load's cost on
#: the CPU"). On CUDA the copy runs on a side stream and the forward loses ~none.
CPU_LOAD_COMPUTE_SHARE = 1.0


class BuiltinConnector(EngineConnector):
    kind = "builtin"
    self_managed = True
    loads_on_demand = True
    request_signals_redundant = True

    @property
    def load_compute_share(self) -> float:  # type: ignore[override]
        pool = getattr(self.engine, "pool", None)
        device = getattr(getattr(pool, "device", None), "type", "cpu")
        return CPU_LOAD_COMPUTE_SHARE if device == "cpu" else 0.0

    def __init__(self, store: ArtifactStore, engine_settings: Any = None, engine: Any = None,
                 http_host: str = "127.0.0.1", http_port: int | None = None):
        """`engine`: an existing `gpu_agent.engine.Engine`; otherwise one is created from
        `engine_settings` at `start()`. `http_port`: also serve its OpenAI API (0 = ephemeral)."""
        self.store = store
        self._settings = engine_settings
        self.engine = engine
        self._http = (http_host, http_port)
        self._runner = None
        self._url: str | None = None

    async def start(self) -> None:
        if self.engine is None:
            from gpu_agent.engine.core import Engine
            self.engine = Engine.create(self._settings, source=StoreSource(self.store))
        # the disk tier never evicts the files of an adapter the engine holds or is loading
        self.store.protect_with(self._engine_digests)
        self.engine.adapters.on_left_pool(self._left_pool)
        host, port = self._http
        if port is not None and self._runner is None:
            from gpu_agent.engine import server as engine_server
            self._runner, bound = await engine_server.start(self.engine, host, port)
            self._url = f"http://{host}:{bound}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # the engine app's cleanup closes the engine
            self._runner = None
        elif self.engine is not None:
            await self.engine.close()

    @property
    def url(self) -> str | None:
        return self._url

    def _engine_digests(self) -> set[str]:
        """Digests of the adapters the engine's pool holds or is loading now."""
        if self.engine is None:
            return set()
        out = set()
        for name in self.engine.adapters.loading() | set(self.engine.pool.resident()):
            spec = self.store.catalog.get(name)
            if spec is not None:
                out.add(spec.sha256)
        return out

    def _left_pool(self, name: str) -> None:
        spec = self.store.catalog.get(name)
        if spec is not None and self.store.left_device(spec, keep=self._engine_digests()):
            log.debug("adapter %s left the pool: disk copy dropped (resident-only disk tier)", name)

    async def load(self, spec: Adapter, path: Path, *, pinned: bool = False,
                   demand: bool = False) -> None:
        """A prefetch (``demand=False``) goes after, and yields to, the engine's request
        loads (`gpu_agent.engine.load_order`); it fails rather than wait for room."""
        try:
            if pinned:  # load and pin atomically: the pool's LRU may not take it in between
                await self.engine.adapters.ensure_pinned(spec.name, prefetch=not demand)
            else:
                await self.engine.adapters.ensure_resident(spec.name, prefetch=not demand)
        except Exception as exc:
            raise ConnectorError(f"builtin load {spec.name}: {exc}") from exc

    def prefer_victims(self, loading: str, victims: tuple[str, ...]) -> None:
        self.engine.adapters.prefer_victims(loading, victims)

    def watch_device(self, changed: Callable[[str], None]) -> bool:
        """The pool's every load and eviction (its own LRU's for a request's load too),
        as they happen: the agent's view needs no reconcile to follow them."""
        self.engine.adapters.on_pool_change(changed)
        return True

    def set_pinned(self, name: str, pinned: bool) -> None:
        res = self.engine.adapters
        try:
            if pinned:
                res.pin(name)
            else:
                res.unpin(name)
        except Exception as exc:  # not resident (any more)
            raise ConnectorError(f"builtin pin {name}: {exc}") from exc

    async def unload(self, name: str) -> None:
        try:
            self.engine.adapters.evict(name)
        except AdapterBusy as exc:
            raise ConnectorError(str(exc)) from exc

    async def needs_room(self, spec: Adapter) -> bool:
        """The pool is at its adapter count, or has fewer free pages than `spec` needs.
        Pages are counted on the parsed adapter: the engine's host copy, else the verified
        local files read for it (mapped, not copied). Not readable: False (the load that
        follows reports why, and the pool's own LRU makes any room as before)."""
        res, pool = self.engine.adapters, self.engine.pool
        if pool.contains(spec.name):
            return False
        if pool.max_adapters is not None and len(pool.resident()) >= pool.max_adapters:
            return True
        adapter = res.tiers.host.get(spec.name)
        if adapter is None:
            path = self.store.local_path(spec)
            if path is None:
                return False
            from gpu_agent.engine.peft import load_peft_dir
            try:
                adapter = await asyncio.to_thread(load_peft_dir, path, pool.spec, None, name=spec.name)
            except Exception:  # noqa: BLE001 - see the docstring
                return False
        return pool.pages_for(adapter) > pool.stats()["pages_free"]

    async def loaded(self) -> set[str]:
        """The adapters in the engine's pool (the reconcile asks every interval: the pool's
        own list, not a walk of the whole catalog)."""
        res = self.engine.adapters
        return {n for n in self.engine.pool.resident() if res.knows(n)}

    async def busy(self) -> set[str]:
        """Held, claimed (a request the engine accepted is about to use it), loading, or
        named by the batcher's running/waiting sequences."""
        res, batcher = self.engine.adapters, self.engine.batcher
        return ({n for n in res.names() if res.held(n)} | res.claimed_names() | res.loading()
                | set(batcher.running_adapters()) | set(batcher.waiting_adapters()))

    async def prefetch_turn(self) -> bool:
        if self.engine is None:
            return False
        return await self.engine.adapters.order.idle()

    def demand_loads(self) -> int:
        return self.engine.adapters.order.demand_in_flight if self.engine is not None else 0

    def has_room(self, spec: Adapter) -> bool | None:
        """Free count and free pages for `spec`'s bytes (pages are rounded per matrix: a
        near-full pool may still need room; the load then evicts as it always does)."""
        if self.engine is None:
            return None
        st = self.engine.pool.stats()
        limit = st["max_adapters"]
        if limit is not None and st["adapters"] + st["copying"] >= limit:
            return False
        return spec.size_bytes <= st["pages_free"] * st["page_bytes"]

    def load_order_stats(self) -> dict[str, dict[str, int] | int]:
        if self.engine is None:
            return {}
        order = self.engine.adapters.order
        return {"preemptions": dict(order.preemptions), "cancelled": dict(order.cancelled),
                "compute_waits": order.compute_wait_outcomes(), "node_waits": order.node_waits}

    async def engine_load(self) -> EngineLoad | None:
        """The batcher's own counts, read in memory. Requests still waiting for their
        adapter's cold load have not reached the batcher and are not counted."""
        if self.engine is None:
            return None
        batcher = self.engine.batcher
        return EngineLoad(running=batcher.num_running, waiting=batcher.num_waiting)

    def in_host(self, name: str) -> bool:
        res = self.engine.adapters
        return res.knows(name) and res.tier(name) == "host"

    def pool_stats(self) -> dict[str, int]:
        stats = self.engine.pool.stats()
        return {k: int(stats[k]) for k in ("pages_total", "pages_used", "pages_free", "used_bytes")
                if k in stats}
