"""The agent's counters and histograms, rendered in Prometheus text format at /metrics.

Small on purpose (no client library): counters and histograms keyed by one label set,
plus gauges read from callbacks at scrape time (pool pages, tier occupancy).
"""
from __future__ import annotations

import bisect
from typing import Callable, Iterable

__all__ = ["AgentMetrics", "Histogram", "LOAD_BUCKETS_S"]

LOAD_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    items = [f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
             for k, v in pairs]
    return "{" + ",".join(items) + "}" if items else ""


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LOAD_BUCKETS_S):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def render(self, name: str, labels: tuple[tuple[str, str], ...]) -> list[str]:
        lines, acc = [], 0
        for bound, count in zip(self.buckets, self.counts):
            acc += count
            lines.append(f"{name}_bucket{_labels(labels + (('le', repr(bound)),))} {acc}")
        lines.append(f"{name}_bucket{_labels(labels + (('le', '+Inf'),))} {self.n}")
        lines.append(f"{name}_sum{_labels(labels)} {self.total:.6f}")
        lines.append(f"{name}_count{_labels(labels)} {self.n}")
        return lines


class AgentMetrics:
    """Everything /metrics shows. Not thread-safe: used from the agent's event loop."""

    _HELP = {
        "ace_agent_tier_hits_total": ("counter", "Residency requests answered from this tier (tier = where the adapter was found)."),
        "ace_agent_tier_misses_total": ("counter", "Residency requests that did not find the adapter in this tier."),
        "ace_agent_evictions_total": ("counter", "Adapters evicted from a tier (reason=\"hint\": named by a Prefetch's evict list)."),
        "ace_agent_load_seconds": ("histogram", "Measured time of one load stage (fetch, verify, read, device) or a whole cold load (cold)."),
        "ace_agent_prefetch_total": ("counter", "Prefetch requests by outcome."),
        "ace_agent_load_failures_total": ("counter", "Loads that failed, by reason."),
        "ace_agent_load_read_failures_total": ("counter", "Engine load measurements that failed (the load was published as unknown)."),
        "ace_agent_engine_resets_total": ("counter", "Times the engine lost adapters the agent had loaded (restart) and residency was rebuilt."),
        "ace_agent_prefetch_preemptions_total": ("counter", "Prefetch loads that paused for a request's load, by the stage where they stopped (agent: before the device stage; fetch, read, copy: in the builtin engine, copy = a partial pool copy discarded)."),
        "ace_agent_prefetch_cancelled_total": ("counter", "Prefetch loads given up (builtin engine), by reason (no_room: room only by evicting what requests hold or are about to use)."),
        "ace_agent_prefetch_victims_skipped_total": ("counter", "Hinted victims (Prefetch.evict) not evicted because a request was about to use them (reason=in_use)."),
    }

    def __init__(self) -> None:
        self._counters: dict[tuple[str, tuple], float] = {}
        self._hists: dict[tuple[str, tuple], Histogram] = {}
        self._gauges: list[Callable[[], dict[str, tuple[str, float]]]] = []
        self._collectors: list[Callable[[], None]] = []

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        self._counters[key] = self._counters.get(key, 0.0) + value

    def observe(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        hist = self._hists.get(key)
        if hist is None:
            hist = self._hists[key] = Histogram()
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

    def add_gauges(self, source: Callable[[], dict[str, tuple[str, float]]]) -> None:
        """`source()` -> {"metric{labels}": (help, value)}, read at every scrape."""
        self._gauges.append(source)

    def render(self) -> str:
        self.collect()
        out: list[str] = []
        seen: set[str] = set()

        def head(name: str) -> None:
            if name not in seen and name in self._HELP:
                kind, text = self._HELP[name]
                out.append(f"# HELP {name} {text}")
                out.append(f"# TYPE {name} {kind}")
                seen.add(name)

        for (name, labels), value in sorted(self._counters.items()):
            head(name)
            out.append(f"{name}{_labels(labels)} {value:g}")
        for (name, labels), hist in sorted(self._hists.items(), key=lambda kv: kv[0]):
            head(name)
            out.extend(hist.render(name, labels))
        for source in self._gauges:
            for series, (text, value) in sorted(source().items()):
                base = series.split("{", 1)[0]
                if base not in seen:
                    out.append(f"# HELP {base} {text}")
                    out.append(f"# TYPE {base} gauge")
                    seen.add(base)
                out.append(f"{series} {value:g}")
        return "\n".join(out) + "\n"
