"""Prometheus text of the engine: batching, tokens, adapter tiers, pool occupancy.

Also writes vLLM's ``vllm:lora_requests_info`` gauge (running / waiting adapters), so a
scraper written for vLLM reads this engine the same way. Rendered (and label values
escaped) by ``prometheus_client``.
"""
from __future__ import annotations

import time
from typing import Any, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import Metric

__all__ = ["render_metrics"]


class _Text:
    """The families of one scrape, built at scrape time; a collector for ``generate_latest``."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def metric(self, name: str, kind: str, help_: str, samples: list[tuple[dict, float]]) -> None:
        fam = Metric(name.removesuffix("_total") if kind == "counter" else name, help_, kind)
        for labels, value in samples:
            fam.add_sample(name, {k: str(v) for k, v in labels.items()}, value)
        self.families.append(fam)

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)

    def render(self) -> str:
        return generate_latest(self).decode()


def render_metrics(engine: Any, http_stats: Any) -> str:
    st = engine.batcher.stats
    res = engine.adapters
    pool = engine.pool.stats()
    t = _Text()
    t.metric("ace_engine_forward_passes_total", "counter", "Forward passes (batched steps) run",
             [({}, st.forward_passes)])
    t.metric("ace_engine_batch_rows_total", "counter", "Token rows over all forward passes",
             [({}, st.rows)])
    t.metric("ace_engine_batch_sequences_total", "counter", "Sequence-steps over all forward passes",
             [({}, st.sequences_in_passes)])
    t.metric("ace_engine_batch_sequences_max", "gauge", "Most sequences seen in one forward pass",
             [({}, st.max_sequences_in_pass)])
    t.metric("ace_engine_batch_adapters_max", "gauge", "Most distinct adapters seen in one forward pass",
             [({}, st.max_adapters_in_pass)])
    t.metric("ace_engine_forward_seconds_total", "counter", "Wall time spent in forward passes",
             [({}, round(st.forward_seconds, 6))])
    t.metric("ace_engine_adapter_load_seconds_total", "counter",
             "Wall time of the adapter tiers' load work (read, parse, copy into the pool), prefetch or demand",
             [({}, round(engine.adapters.load_seconds, 6))])
    t.metric("ace_engine_prompt_tokens_total", "counter", "Prompt tokens prefilled", [({}, st.prompt_tokens)])
    t.metric("ace_engine_generation_tokens_total", "counter", "Tokens generated", [({}, st.generated_tokens)])
    t.metric("ace_engine_requests_running", "gauge", "Sequences in the running batch",
             [({}, engine.batcher.num_running)])
    t.metric("ace_engine_requests_waiting", "gauge", "Sequences waiting to join the batch",
             [({}, engine.batcher.num_waiting)])
    t.metric("ace_engine_http_requests_total", "counter", "Completion requests by route and status",
             [({"route": r, "status": s}, n) for (r, s), n in sorted(http_stats.requests.items())])
    t.metric("ace_engine_adapter_cold_loads_total", "counter",
             "Adapter loads into the pool by the tier the adapter came from",
             [({"tier": k}, v) for k, v in sorted(res.loads.items())])
    t.metric("ace_engine_prefetch_preemptions_total", "counter",
             "Prefetch loads paused for a request's load, by the checkpoint where they stopped",
             [({"stage": k}, v) for k, v in sorted(res.order.preemptions.items())])
    t.metric("ace_engine_prefetch_compute_waits_total", "counter",
             "Prefetch loads that waited for the engine's compute (a request accepted, queued or "
             "running); overrun: went on after compute_defer_s",
             [({"outcome": k}, v) for k, v in res.order.compute_wait_outcomes().items()])
    t.metric("ace_engine_prefetch_node_waits_total", "counter",
             "Prefetch loads that waited (at most 100 ms) while the cores the engine runs on were "
             "taken by other tasks (prefetch_node_cpu)",
             [({}, res.order.node_waits)])
    t.metric("ace_engine_prefetch_cancelled_total", "counter",
             "Prefetch loads given up (no_room: room only by evicting what requests use)",
             [({"reason": k}, v) for k, v in sorted(res.order.cancelled.items())])
    t.metric("ace_engine_adapter_evictions_total", "counter",
             "Adapters evicted by tier and reason (budget: room for a load, LRU; hint: room for a "
             "request's load, the gateway's victim; operator: an unload call)",
             [({"tier": tier, "reason": reason}, v) for (tier, reason), v in sorted(res.evictions_by().items())])
    snap = res.snapshot()
    t.metric("ace_engine_adapter_tier", "gauge", "1 for the tier each known adapter is in",
             [({"adapter": n, "tier": s["tier"]}, 1) for n, s in sorted(snap.items())])
    t.metric("ace_engine_adapter_last_cold_load_ms", "gauge", "Measured wait of the adapter's last cold load",
             [({"adapter": n}, round(s["last_cold_load_ms"], 3)) for n, s in sorted(snap.items())
              if s["last_cold_load_ms"] is not None])
    for key in ("pool_bytes", "used_bytes", "pages_total", "pages_used", "adapters", "pinned",
                "evictions", "loads"):
        kind = "counter" if key in ("evictions", "loads") else "gauge"
        name = f"ace_engine_pool_{key}" + ("_total" if kind == "counter" else "")
        t.metric(name, kind, f"Adapter pool {key.replace('_', ' ')}", [({}, pool[key])])
    t.metric("ace_engine_model_bytes", "gauge", "Bytes of the base model's weights",
             [({}, engine.model.nbytes)])
    running = ",".join(sorted(engine.batcher.running_adapters()))
    waiting = ",".join(sorted(engine.batcher.waiting_adapters()))
    t.metric("vllm:lora_requests_info", "gauge", "Running stats on lora requests (vLLM-compatible)",
             [({"max_lora": pool["adapters"], "running_lora_adapters": running,
                "waiting_lora_adapters": waiting}, time.time())])
    t.metric("vllm:num_requests_running", "gauge", "Requests in the running batch (vLLM-compatible)",
             [({"model_name": engine.model_name}, engine.batcher.num_running)])
    t.metric("vllm:num_requests_waiting", "gauge", "Requests waiting (vLLM-compatible)",
             [({"model_name": engine.model_name}, engine.batcher.num_waiting)])
    return t.render()
