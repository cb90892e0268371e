"""The agent's counters and histograms, served in Prometheus text format at /metrics.

Each ``AgentMetrics`` owns a ``prometheus_client`` registry (several agents in one process
do not collide) with one collector: the counts and histograms kept here (event-loop
code adds to plain dicts: no lock), counters copied in from elsewhere (``set_counter``,
by ``add_collector`` callbacks) and gauges read from callbacks at scrape time (pool pages,
tier occupancy). The library renders the text, escaping label values.
"""
from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ace_common.histogram import Histogram

__all__ = ["AgentMetrics", "Gauge", "Histogram", "LOAD_BUCKETS_S"]

LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

#: one gauge series a gauge source reports: (name, help, labels, value)
Gauge = tuple[str, str, dict[str, str], float]


class AgentMetrics:
    """Everything /metrics shows. Not thread-safe: used from the agent's event loop."""

    _HELP = {
        "ace_agent_tier_hits_total": ("counter", "Residency requests answered from this tier (tier = where the adapter was found)."),
        "ace_agent_tier_misses_total": ("counter", "Residency requests that did not find the adapter in this tier."),
        "ace_agent_evictions_total": ("counter", "Adapters evicted from a tier (device, host, disk), by reason: budget (room for a load, LRU), hint (named by a Prefetch's evict list), operator (Evict), engine_gone (the builtin engine's pool evicted it itself, or vLLM's cache dropped the weights of a name the agent keeps registered), engine_dropped (unregistered first: vLLM's CPU cache had already dropped its weights), left_device (a resident-only disk tier)."),
        "ace_agent_load_seconds": ("histogram", "Measured time of one load stage (fetch, verify, read, device) or a whole cold load (cold)."),
        "ace_agent_prefetch_total": ("counter", "Prefetch requests by outcome (left_to_engine: a request's own prefetch to an engine that loads it itself when the request arrives; its files fetched ahead, nothing loaded)."),
        "ace_agent_load_failures_total": ("counter", "Loads that failed, by reason."),
        "ace_agent_load_read_failures_total": ("counter", "Engine load measurements that failed (the load was published as unknown)."),
        "ace_agent_engine_resets_total": ("counter", "Times the engine lost adapters the agent had loaded (restart) and residency was rebuilt."),
        "ace_agent_prefetch_preemptions_total": ("counter", "Prefetch loads that paused for a request's load or the engine's compute, by the stage where they stopped (agent_fetch: before the agent fetched its files; agent: before the device stage; fetch, read, copy: in the builtin engine, copy = a partial pool copy discarded)."),
        "ace_agent_prefetch_compute_waits_total": ("counter", "Builtin engine: prefetch loads that waited for the engine's compute (a request accepted, queued or running); outcome=overrun: went on after the engine's compute_defer_s."),
        "ace_agent_prefetch_node_waits_total": ("counter", "Builtin engine: prefetch loads that waited (at most 100 ms) because the cores the engine runs on were taken by other tasks (the engines beside this one; --prefetch-node-cpu)."),
        "ace_agent_prefetch_cancelled_total": ("counter", "Prefetch loads given up, by reason (no_room, builtin engine: room only by evicting what requests hold or are about to use; victim_in_use: a priced prefetch whose hinted victims a request is about to use)."),
        "ace_agent_prefetch_victims_skipped_total": ("counter", "Hinted victims (Prefetch.evict) not evicted because a request was about to use them (reason=in_use)."),
    }

    def __init__(self) -> None:
        self._counters: dict[tuple[str, tuple], float] = {}
        self._hists: dict[tuple[str, tuple], Histogram] = {}
        self._gauges: list[Callable[[], list[Gauge]]] = []
        self._collectors: list[Callable[[], None]] = []
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_AgentCollector(self))

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self._counters[key] = self._counters.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        hist = self._hists.get(key)
        if hist is None:
            hist = self._hists[key] = Histogram(LOAD_BUCKETS_S)
        hist.observe(value)

    def set_counter(self, name: str, value: float, **labels: str) -> None:
        """A counter kept elsewhere (an engine's own), copied in by a collector."""
        self._counters[(name, tuple(sorted(labels.items())))] = float(value)

    def add_collector(self, collect: Callable[[], None]) -> None:
        """`collect()` runs before every render (and every `counter` read) to copy in
        counters kept elsewhere (`set_counter`)."""
        self._collectors.append(collect)

    def collect(self) -> None:
        for collect in self._collectors:
            collect()

    def counter(self, name: str, **labels: str) -> float:
        self.collect()
        return self._counters.get((name, tuple(sorted(labels.items()))), 0.0)

    def add_gauges(self, source: Callable[[], list[Gauge]]) -> None:
        """``source()`` -> [(name, help, labels, value)], read at every scrape."""
        self._gauges.append(source)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


class _AgentCollector(Collector):
    """One family per metric name; its series may carry different label names (an
    eviction with or without ``reason``), so samples are added one by one."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.m
        m.collect()
        families: dict[str, Metric] = {}

        def family(name: str, kind: str, text: str | None = None) -> Metric:
            fam = families.get(name)
            if fam is None:
                base = name.removesuffix("_total") if kind == "counter" else name
                text = text if text is not None else m._HELP.get(name, ("", name))[1]
                fam = families[name] = Metric(base, text, kind)
            return fam

        for (name, labels), value in sorted(m._counters.items()):
            family(name, "counter").add_sample(name, dict(labels), value)
        for (name, labels), hist in sorted(m._hists.items(), key=lambda kv: kv[0]):
            fam = family(name, "histogram")
            for le, count in hist.cumulative():
                fam.add_sample(name + "_bucket", {**dict(labels), "le": le}, count)
            fam.add_sample(name + "_count", dict(labels), hist.n)
            fam.add_sample(name + "_sum", dict(labels), hist.total)
        for source in m._gauges:
            for name, text, labels, value in sorted(source(), key=lambda g: (g[0], sorted(g[2].items()))):
                family(name, "gauge", text).add_sample(name, {k: str(v) for k, v in labels.items()}, value)
        for name, (kind, _) in m._HELP.items():   # every metric declared, with series or not yet
            family(name, kind)
        yield from families.values()
