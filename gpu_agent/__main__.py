"""`python -m gpu_agent serve --catalog ... --engine builtin|vllm|sglang ...`

Starts the residency manager, the gRPC API and /metrics; for `--engine builtin` also the
builtin engine in-process (its OpenAI API on --engine-port). Prints one JSON line with
the bound ports once everything is up (tests and scripts read it), then runs until
SIGTERM/SIGINT.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ace_common.gil import set_switch_interval

if TYPE_CHECKING:
    from gpu_agent.engine.core import EngineSettings
    from gpu_agent.settings import AgentSettings

__all__ = ["main", "run"]


def builtin_engine_settings(settings: AgentSettings) -> EngineSettings:
    """The in-process builtin engine's settings from the agent's flags. The engine's pool
    owns its device tier: the count budget is the pool's, enforced on every load, the
    agent's prefetches and the engine's own on-demand loads alike."""
    from gpu_agent.engine.core import EngineSettings
    return EngineSettings(catalog=Path(settings.catalog), pool_bytes=settings.pool_mb << 20,
                          host_cache_bytes=settings.engine_host_mb << 20,
                          max_adapters=settings.device_max_adapters or None,
                          prefetch_compute_defer_ms=settings.prefetch_compute_defer_ms,
                          prefetch_node_cpu=settings.prefetch_node_cpu)


async def run(settings) -> None:
    from aiohttp import web

    from ace_common.gc_pauses import GcPauseCollector, GcPauses, freeze_startup_heap
    from ace_common.loop_lag import LoopLag, LoopLagCollector
    from ace_common.stack_dump import install_stack_dump
    from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache
    from gpu_agent.connectors import make_connector
    from gpu_agent.metrics import AgentMetrics
    from gpu_agent.residency.manager import ResidencyBudgets, ResidencyManager
    from gpu_agent.service import start_server

    catalog = Catalog.from_yaml(settings.catalog)
    store = ArtifactStore(catalog, DiskCache(settings.cache_dir, settings.disk_budget_mb << 20))
    api_key = None
    if settings.engine_api_key_env:
        import os
        api_key = os.environ.get(settings.engine_api_key_env)
    if settings.engine == "vllm":
        connector = make_connector("vllm", url=settings.engine_url, max_cpu_loras=settings.max_cpu_loras,
                                   api_key=api_key, resolver=settings.vllm_resolver,
                                   unload_evicts=settings.vllm_unload_evicts,
                                   keep_registered=settings.vllm_keep_registered)
    elif settings.engine == "sglang":
        connector = make_connector("sglang", url=settings.engine_url,
                                   max_loaded_loras=settings.max_loaded_loras or None, api_key=api_key)
    else:
        connector = make_connector("builtin", store=store, engine_settings=builtin_engine_settings(settings),
                                   http_host=settings.engine_host, http_port=settings.engine_port)
    drives_device = not connector.self_managed   # builtin: the pool's budgets (above)
    budgets = ResidencyBudgets(
        device_count=(settings.device_max_adapters or None) if drives_device else None,
        device_bytes=(settings.device_budget_mb << 20 or None) if drives_device else None,
        host_bytes=settings.host_budget_mb << 20, queue_size=settings.queue_size,
        workers=settings.workers, reconcile_interval_s=settings.reconcile_interval_s,
        load_interval_s=settings.load_interval_s, link_budget_ms=settings.prefetch_link_budget_ms,
        waste_share=settings.prefetch_waste_share)
    metrics = AgentMetrics()
    gc_pauses = GcPauses().install()
    install_stack_dump()   # kill -USR1: every thread's stack to the log (docs/agent.md)
    metrics.registry.register(GcPauseCollector(gc_pauses, "ace_agent_gc_pause_seconds"))
    loop_lag = LoopLag()   # what every request on this loop waited (docs/agent.md); from start-up's end
    metrics.registry.register(LoopLagCollector(loop_lag, "ace_agent_event_loop_lag_seconds"))
    manager = ResidencyManager(catalog, store, connector, budgets, metrics)
    await manager.start()
    tls = (settings.tls_cert, settings.tls_key, settings.tls_client_ca) if settings.auth == "mtls" else None
    token = settings.token() if settings.auth == "token" else None
    server, grpc_port, health_task = await start_server(manager, settings.grpc_host, settings.grpc_port,
                                                        token=token, tls=tls)
    runner = None
    metrics_port = None
    if settings.metrics_port >= 0:
        app = web.Application()

        async def scrape(_request):
            return web.Response(text=metrics.render(), content_type="text/plain", charset="utf-8")

        app.router.add_get("/metrics", scrape)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, settings.grpc_host, settings.metrics_port)
        await site.start()
        metrics_port = site._server.sockets[0].getsockname()[1]
    freeze_startup_heap(logging.getLogger("gpu_agent"))   # the model, catalog and modules
    loop_lag.start()
    print(json.dumps({"event": "ready", "grpc_port": grpc_port, "metrics_port": metrics_port,
                      "engine": settings.engine, "engine_url": connector.url}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    health_task.cancel()
    await server.stop(grace=1.0)
    if runner is not None:
        await runner.cleanup()
    await manager.close()
    await loop_lag.close()
    gc_pauses.close(logging.getLogger("gpu_agent"))


def main(argv: list[str] | None = None) -> int:
    from gpu_agent.artifacts import Catalog, CatalogError
    from gpu_agent.settings import SettingsError, parse_args

    argv = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m gpu_agent serve --catalog CATALOG [--engine builtin|vllm|sglang] ..."
    if argv in (["-h"], ["--help"]):
        print(usage + "\n(python -m gpu_agent serve --help: every option)")
        return 0
    if not argv or argv[0] != "serve":
        print(usage, file=sys.stderr)
        return 2
    try:
        settings = parse_args(argv[1:])
        Catalog.from_yaml(settings.catalog)      # a bad catalog is a config error: exit 2, one line
    except (SettingsError, CatalogError) as exc:
        print(f"gpu_agent: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_switch_interval(settings.gil_switch_ms)  # a forward's longest wait behind a load's Python
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
