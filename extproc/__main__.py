"""``python -m extproc --config state.yaml [--catalog catalog.yaml] ...``"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any, Coroutine

from ace_common.gc_pauses import GcPauseCollector, GcPauses, freeze_startup_heap
from ace_common.gil import set_switch_interval
from ace_common.loop_lag import LoopLag, LoopLagCollector
from ace_common.stack_dump import install_stack_dump
from extproc.fleet.discovery import HostDiscovery, make_source
from extproc.errors import ConfigError
from extproc.transport.health_port import HealthPort
from extproc.observe.metrics import (ConfigReloadCollector, GatewayCollector, GatewayMetrics, propagation_histogram,
                             serve_metrics)
from extproc.domain.prefetch import NullPrefetchSink
from extproc.policy.routing import load_policy
from extproc.app.context import Gateway
from extproc.transport.grpc_servers import serve, serve_aio, serve_h2
from extproc.transport.serving_cert import load_cert, self_signed
from extproc.settings import Settings
from extproc.state.file_watch import StateFileWatch
from extproc.state.store import Store


def popularity_path(db: Path) -> Path:
    """Request counts persisted beside the SQLite file (``gw.sqlite3`` -> ``gw.popularity.json``)."""
    return Path(db).with_suffix(".popularity.json")


def start_metrics(listen: str, gateway: Gateway, link, speculation, reloads: StateFileWatch,
                  gc_pauses: GcPauses | None = None, loop_lag: LoopLag | None = None):
    """/metrics on its own port, in a daemon thread: one registry for this gateway."""
    from prometheus_client import CollectorRegistry
    registry = CollectorRegistry()
    registry.register(GatewayCollector(gateway.metrics, link, speculation, link.board if link else None))
    registry.register(ConfigReloadCollector(reloads))
    if gc_pauses is not None:
        registry.register(GcPauseCollector(gc_pauses, "ace_gateway_gc_pause_seconds"))
    if loop_lag is not None:
        registry.register(LoopLagCollector(loop_lag, "ace_gateway_event_loop_lag_seconds"))
    gateway.store.on_snapshot(propagation_histogram(registry).observe)
    server = serve_metrics(registry, listen)
    logging.getLogger("extproc").info("metrics on http://%s:%d/metrics", *server.server_address[:2])
    return server


async def _measured(serving: Coroutine[Any, Any, None], loop_lag: LoopLag) -> None:
    """``serving`` with the serving loop's lag measured (``ace_common.loop_lag``): every
    stream of the asyncio servers (h2, aio) is handled on that one loop, so a late loop (a
    background thread holding the GIL, a starved core) delays each request by as much."""
    loop_lag.start()
    try:
        await serving
    finally:
        await loop_lag.close()


def main(argv: list[str] | None = None) -> int:
    try:
        settings = Settings.from_args(argv)
        logging.basicConfig(level=settings.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        loop_lag = LoopLag()   # the serving loop's (h2, aio); from start-up's end
        install_stack_dump()   # kill -USR1: every thread's stack to the log (docs/gateway.md)
        metrics_server = health = reloads = None
        store = Store(settings.config, settings.state_db(), settings.catalog,
                      upstreams_required=not settings.discovers)
        # watched once the configuration is known good: a state file's error is one line
        # on stderr, never preceded by a slow collection of the imports' garbage
        gc_pauses = GcPauses().install()
        # the state file again on a change or SIGHUP (never half-applied: extproc.state.file_watch)
        reloads = StateFileWatch(store, settings.config_poll_s).start()
        signal.signal(signal.SIGHUP, lambda signum, frame: reloads.wake())
        agents = {u.name: u.agent for u in store.snapshot.upstreams if u.agent}
        # discovered hosts come and go: route as for several from the start
        route = load_policy(settings.routing_policy, 2 if settings.discovers else len(store.snapshot.upstreams))
        link = speculation = source = None
        template = settings.upstream_template()
        if agents or (settings.discovers and template.agent_port):
            # upstreams with a GPU agent: prefetch to it, residency from it, speculate
            from extproc.fleet.agent_link import AgentLink
            from extproc.fleet.speculation import (GatewaySpeculation, PopularityFile, SpeculationPlanner,
                                                  route_by_policy)
            from extproc.policy.speculator import SpeculationSettings
            link = AgentLink(agents, token=os.environ.get("ACE_AGENT_TOKEN") or None,
                             tls=settings.agent_tls(), queue_size=settings.prefetch_queue).start()
            popularity = PopularityFile(popularity_path(settings.db))
            _, slots = popularity.load()
            planner = SpeculationPlanner(SpeculationSettings(context_steps=settings.prediction_context_steps,
                                                             smoothing=settings.prediction_smoothing),
                                         route=route_by_policy(route), slots=slots, hold_s=settings.prefetch_hold_s)
            speculation = GatewaySpeculation(store, link.board, link, planner, popularity=popularity,
                                             fill=settings.startup_fill == "on").start()
            link.on_refused = speculation.refused
            set_switch_interval(settings.gil_switch_ms)  # the request path's longest wait behind it
        gateway = Gateway(store, residency=link.board if link else None,
                          prefetch=link or NullPrefetchSink(), route=route, speculation=speculation,
                          metrics=GatewayMetrics(), shed_load=settings.shed_load,
                          epp_fallbacks=settings.epp_fallbacks)
        tls = None
        if settings.serves_tls:
            tls = (load_cert(settings.tls_cert, settings.tls_key) if settings.tls_cert
                   else self_signed())
        if settings.metrics_listen != "off":
            metrics_server = start_metrics(settings.metrics_listen, gateway, link, speculation, reloads, gc_pauses,
                                           loop_lag if settings.server in ("aio", "h2") else None)
        source = make_source(settings.discovery, settings.discovery_interval_s)
        if source is not None:
            source.start(HostDiscovery(store, template, link).publish)
        if settings.health_address:   # plaintext, for the kubelet: told serving/draining by the server
            health = HealthPort(settings.health_address).start()
    except ConfigError as exc:
        print(f"extproc: configuration error: {exc}", file=sys.stderr)
        return 2
    freeze_startup_heap(logging.getLogger("extproc"))   # out of every later collection (ace_common.gc_pauses)
    try:
        if settings.server == "aio":
            asyncio.run(_measured(serve_aio(gateway, settings.listen, protocol=settings.protocol, tls=tls,
                                            lifecycle=health, handover_s=settings.drain_handover_s), loop_lag))
        elif settings.server == "h2":
            asyncio.run(_measured(serve_h2(gateway, settings.listen, max_streams=settings.h2_max_streams,
                                           protocol=settings.protocol, tls=tls, lifecycle=health,
                                           handover_s=settings.drain_handover_s), loop_lag))
        else:
            serve(gateway, settings.listen, settings.workers, protocol=settings.protocol, tls=tls,
                  lifecycle=health, handover_s=settings.drain_handover_s)
    finally:
        if health is not None:
            health.stop()
        if source is not None:
            source.close()
        if metrics_server is not None:
            metrics_server.shutdown()
        if speculation is not None:
            speculation.close()
        if reloads is not None:
            reloads.close()
        if link is not None:
            link.close()
        store.close()
        gc_pauses.close(logging.getLogger("extproc"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
