"""A collector's Prometheus text, as a /metrics scrape would show it."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.registry import Collector


def scrape_text(*collectors: Collector) -> str:
    """The text a registry holding ``collectors`` renders."""
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    return generate_latest(registry).decode()
