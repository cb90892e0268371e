"""The gateway's Prometheus metrics, served on their own port (``--metrics-listen``).

The request path only adds to plain ints: each thread counts into its own ``_Shard``
(found through a ``threading.local``), so a count costs a dict update and takes no lock
and no ``prometheus_client`` call; only a thread's first request registers its shard
(under a lock, once). ``GatewayCollector`` sums the shards, and reads the counters kept
elsewhere (the agent links, the speculation, the residency board), at scrape time.

Labels are bounded: tenants come from the state file (an unauthenticated request counts
as ``tenant=""``), adapters from the catalog (none selected or an error: ``""``), actions
are ``decide``'s multi_lora actions or an error's code, modes the skill modes; with
``--protocol epp``, endpoints are the ``ip:port`` of the pool's pods the gateway says served
a response (a pod that leaves keeps its series until the gateway restarts).
"""
from __future__ import annotations

import bisect
import threading
import time
from typing import TYPE_CHECKING, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from extproc.errors import ConfigError

if TYPE_CHECKING:   # annotations only: the gateway without agents never imports grpc here
    from extproc.fleet.agent_link import AgentLink
    from extproc.fleet.speculation import GatewaySpeculation
    from extproc.state.residency import ResidencyBoard
    from extproc.state.file_watch import StateFileWatch

__all__ = ["DECISION_BUCKETS_S", "ConfigReloadCollector", "GatewayMetrics", "GatewayCollector", "serve_metrics"]

#: decide() takes a few µs to some tens (docs/gateway.md, "Speed"): buckets from 1 µs to 1 ms
DECISION_BUCKETS_S = (1e-6, 2.5e-6, 5e-6, 1e-5, 2e-5, 3e-5, 5e-5, 7.5e-5, 1e-4, 2.5e-4, 1e-3)
#: a store write reaching the snapshot requests read: ms for SQLite, up to seconds elsewhere
PROPAGATION_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _Shard:
    """One thread's counts; only that thread writes it."""

    __slots__ = ("requests", "errors", "buckets", "decision_sum", "served")

    def __init__(self) -> None:
        self.requests: dict[tuple[str, str, str, str], int] = {}
        self.errors: dict[tuple[int, str], int] = {}
        self.served: dict[tuple[str, str], int] = {}
        self.buckets = [0] * (len(DECISION_BUCKETS_S) + 1)
        self.decision_sum = 0.0


class GatewayMetrics:
    """What the request path counts. ``request``/``error`` are O(1), lock-free after a
    thread's first call; ``totals`` (the scrape) sums the shards."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._shards: list[_Shard] = []
        self._register = threading.Lock()   # a thread's first count only

    def _shard(self) -> _Shard:
        try:
            return self._local.shard
        except AttributeError:
            shard = self._local.shard = _Shard()
            with self._register:
                self._shards.append(shard)
            return shard

    def request(self, tenant: str, adapter: str, action: str, mode: str,
                decision_s: float | None = None) -> None:
        """One inference request's outcome; ``decision_s``: how long ``decide`` took."""
        shard = self._shard()
        key = (tenant, adapter, action, mode)
        shard.requests[key] = shard.requests.get(key, 0) + 1
        if decision_s is not None:
            shard.buckets[bisect.bisect_left(DECISION_BUCKETS_S, decision_s)] += 1
            shard.decision_sum += decision_s

    def error(self, status: int, code: str) -> None:
        shard = self._shard()
        key = (status, code)
        shard.errors[key] = shard.errors.get(key, 0) + 1

    def epp_served(self, endpoint: str, picked_first: str | None) -> None:
        """Endpoint picker protocol: the gateway says ``endpoint`` served a response whose
        request ace picked ``picked_first`` for (None: ace picked none on that stream)."""
        pick = "unpicked" if picked_first is None else "primary" if endpoint == picked_first else "fallback"
        shard = self._shard()
        key = (endpoint, pick)
        shard.served[key] = shard.served.get(key, 0) + 1

    def served_totals(self) -> dict[tuple[str, str], int]:
        """(endpoint, pick) -> responses, over all threads (``epp_served``)."""
        out: dict = {}
        with self._register:
            shards = list(self._shards)
        for shard in shards:
            for key, n in shard.served.copy().items():
                out[key] = out.get(key, 0) + n
        return out

    def totals(self) -> tuple[dict, dict, list[int], float]:
        """(requests, errors, decision buckets (not cumulative), decision sum) over all threads."""
        requests: dict = {}
        errors: dict = {}
        buckets = [0] * (len(DECISION_BUCKETS_S) + 1)
        total = 0.0
        with self._register:
            shards = list(self._shards)
        for shard in shards:
            for key, n in shard.requests.copy().items():   # dict.copy: one C call, atomic under the GIL
                requests[key] = requests.get(key, 0) + n
            for key, n in shard.errors.copy().items():
                errors[key] = errors.get(key, 0) + n
            for i, n in enumerate(shard.buckets):
                buckets[i] += n
            total += shard.decision_sum
        return requests, errors, buckets, total


class GatewayCollector(Collector):
    """Reads everything at scrape time: the request counts, the agent links, the
    speculation's prediction ledger, the residency snapshot's age."""

    def __init__(self, metrics: GatewayMetrics, link: "AgentLink | None" = None,
                 speculation: "GatewaySpeculation | None" = None,
                 board: "ResidencyBoard | None" = None) -> None:
        self.metrics, self.link, self.speculation, self.board = metrics, link, speculation, board

    def collect(self) -> Iterator:
        requests, errors, buckets, total = self.metrics.totals()
        fam = CounterMetricFamily("ace_gateway_requests", "Inference requests by tenant, adapter, "
                                  "multi_lora action (an error's code when refused) and multi_lora mode.",
                                  labels=("tenant", "adapter", "action", "mode"))
        for key, n in sorted(requests.items()):
            fam.add_metric(key, n)
        yield fam
        fam = CounterMetricFamily("ace_gateway_errors", "Error answers the gateway gave, by HTTP status and error code.",
                                  labels=("status", "code"))
        for (status, code), n in sorted(errors.items()):
            fam.add_metric((str(status), code), n)
        yield fam
        cumulative, acc = [], 0
        for bound, n in zip((*map(repr, DECISION_BUCKETS_S), "+Inf"), buckets):
            acc += n
            cumulative.append((bound, acc))
        yield HistogramMetricFamily("ace_gateway_decision_seconds", "Time decide() took per inference request.",
                                    buckets=cumulative, sum_value=total)
        fam = CounterMetricFamily("ace_gateway_epp_served", "Endpoint picker protocol: responses by the "
                                  "endpoint the gateway says served them, and whether that was ace's pick "
                                  "(primary), another endpoint (fallback: a fallback or a retry elsewhere), "
                                  "or a request ace picked none for (unpicked).", labels=("endpoint", "pick"))
        for key, n in sorted(self.metrics.served_totals().items()):
            fam.add_metric(key, n)
        yield fam
        if self.link is not None:
            yield from self._links()
        if self.speculation is not None:
            try:
                counts = self.speculation.counters()
            except RuntimeError:   # its thread added an upstream's speculator mid-read: read again
                counts = self.speculation.counters()
            fam = CounterMetricFamily("ace_gateway_predictions", "Speculative prefetches by outcome: used "
                                      "(a request came for the adapter in time) or wasted.", labels=("outcome",))
            fam.add_metric(("used",), counts.get("predictions_used", 0))
            fam.add_metric(("wasted",), counts.get("predictions_wasted", 0))
            yield fam
        if self.board is not None:
            yield GaugeMetricFamily("ace_gateway_residency_snapshot_age_seconds",
                                    "Seconds since the residency snapshot requests read was published.",
                                    value=max(0.0, time.monotonic() - self.board.published_at))

    def _links(self) -> Iterator:
        signals = CounterMetricFamily("ace_gateway_prefetch_signals", "Prefetch signals to each upstream's agent: "
                                      "sent (answered), dropped (its queue was full), failed (the RPC failed), "
                                      "deferred (a bet held back: a request had just been routed to its victim), "
                                      "withdrawn (still so when its time came), held (a bet held until the "
                                      "demand load of the request that planned it landed), hold_expired (sent "
                                      "at --prefetch-hold-s, the load not seen landing), left_to_engine (a request's own "
                                      "signal not sent: that agent's engine brings the request's adapter itself).",
                                      labels=("upstream", "result"))
        up = GaugeMetricFamily("ace_gateway_agent_link_up", "1 while the upstream's agent residency stream is connected.",
                               labels=("upstream",))
        for name, agent in sorted(self.link.agents.items()):
            signals.add_metric((name, "sent"), agent.sent)
            signals.add_metric((name, "dropped"), agent.queue.dropped)
            signals.add_metric((name, "failed"), agent.failed)
            signals.add_metric((name, "deferred"), agent.deferred)
            signals.add_metric((name, "withdrawn"), agent.withdrawn)
            signals.add_metric((name, "held"), agent.held)
            signals.add_metric((name, "hold_expired"), agent.hold_expired)
            signals.add_metric((name, "left_to_engine"), agent.left_to_engine)
            up.add_metric((name,), 1.0 if agent.connected else 0.0)
        yield signals
        yield up


class ConfigReloadCollector(Collector):
    """The state file's reloads (``extproc.state.file_watch.StateFileWatch``), read at scrape time."""

    def __init__(self, watch: "StateFileWatch") -> None:
        self.watch = watch

    def collect(self) -> Iterator:
        w = self.watch
        yield CounterMetricFamily("ace_gateway_config_reloads", "State file reloads applied (a change or SIGHUP).",
                                  value=w.reloads)
        yield CounterMetricFamily("ace_gateway_config_reload_errors", "State file changes refused (invalid: the "
                                  "last good state is still served; the log names the field).", value=w.errors)
        yield GaugeMetricFamily("ace_gateway_config_last_reload_timestamp_seconds", "Wall time (epoch s) the "
                                "state being served was loaded (start-up or the last good reload).", value=w.loaded_at)


def propagation_histogram(registry: CollectorRegistry) -> Histogram:
    return Histogram("ace_gateway_store_propagation_seconds", "Time from a store write to the snapshot "
                     "requests read showing it.", buckets=PROPAGATION_BUCKETS_S, registry=registry)


def serve_metrics(registry: CollectorRegistry, listen: str):
    """Start ``GET /metrics`` on ``listen`` (host:port, port 0: any) in a daemon thread;
    returns the HTTP server (``server_address`` says the port; ``shutdown()`` stops it).
    prometheus_client's server, bound with SO_REUSEPORT: a successor started on the same
    ports binds while this replica hands over (extproc.transport.handover)."""
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    class MetricsServer(ThreadingWSGIServer):
        allow_reuse_port = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, format, *args) -> None:   # noqa: A002 (the base's signature)
            pass

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        MetricsServer.address_family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0][0]
        server = make_server(host, int(port), make_wsgi_app(registry), MetricsServer,
                             handler_class=QuietHandler)
    except OSError as exc:
        raise ConfigError(f"--metrics-listen {listen}: {exc}") from exc
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
