"""The replay speed that keeps every engine host below saturation, and how busy each was.

A fleet whose engines are saturated measures queueing, not adapters. So ``make bench``
chooses the replay speed per fleet size (``--speed auto``, the default):

1. **Pilot**: on the fleet's first stack, before its replay, every host at once runs
   ``PILOT_PER_HOST`` sequential base-model requests straight to its engine (no adapter:
   the pools and the gateway's learning stay cold), at the trace's mean ``max_tokens``;
   ``compute_s`` is the median over hosts of forward-pass seconds per request (the
   engine's ``ace_engine_forward_seconds_total``), times ``LORA_MARGIN`` for the LoRA
   deltas the replay adds. The hosts run together, so the pilot sees the same sharing of
   this machine's cores as the replay.
2. **Speed** (``replay_speed``, pure): the busiest host is assumed to carry
   ``PEAK_SHARE`` / hosts of the requests (placement is uneven: 1.2-1.8x the mean was
   measured at 4 hosts); its busy share is that many requests x ``compute_s`` over the
   trace's span / speed. The speed puts it at ``TARGET_BUSY`` (half the time), never
   above ``MAX_SPEED`` (the 800 report's former fixed speed: faster would shrink think
   times below what prefetch needs).
3. **Measured**: every arm reports ``engine_busy`` per host (forward-pass seconds during
   the replay / the replay's seconds) and ``engine_load_busy`` (the adapter tiers' load
   work, ``ace_engine_adapter_load_seconds_total``, over the same time); the report's
   check says whether affinity's busiest host stayed under ``BUSY_LIMIT``.
"""

from __future__ import annotations

import asyncio
import statistics

import httpx

from bench.report import BUSY_LIMIT

__all__ = ["BUSY_LIMIT", "MAX_SPEED", "TARGET_BUSY", "engine_seconds", "pilot_compute_s", "replay_speed"]

PILOT_PER_HOST = 6
LORA_MARGIN = 1.3
PEAK_SHARE = 1.5
TARGET_BUSY = 0.5
MAX_SPEED = 8.0


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def engine_seconds(client: httpx.AsyncClient, engine_url: str) -> tuple[float, float]:
    """``(forward-pass seconds, load-work seconds)`` the engine has counted so far."""
    text = (await client.get(engine_url + "/metrics")).text
    return (metric_value(text, "ace_engine_forward_seconds_total"),
            metric_value(text, "ace_engine_adapter_load_seconds_total"))


async def pilot_compute_s(hosts: list[dict], requests: list[dict], base_model: str,
                          per_host: int = PILOT_PER_HOST) -> float:
    """Forward-pass seconds per request on this fleet (step 1 of the docstring)."""
    max_tokens = round(statistics.mean(int(r.get("max_tokens", 16)) for r in requests))
    sample = requests[:per_host]

    async def one_host(client: httpx.AsyncClient, engine_url: str) -> float:
        before, _ = await engine_seconds(client, engine_url)
        for r in sample:
            body = {"model": base_model, "messages": r["messages"], "max_tokens": max_tokens, "temperature": 0}
            (await client.post(engine_url + "/v1/chat/completions", json=body)).raise_for_status()
        after, _ = await engine_seconds(client, engine_url)
        return (after - before) / len(sample)

    async with httpx.AsyncClient(timeout=120) as client:
        per = await asyncio.gather(*(one_host(client, h["engine_url"]) for h in hosts))
    return statistics.median(per) * LORA_MARGIN


def replay_speed(requests: list[dict], hosts: int, compute_s: float, *, target: float = TARGET_BUSY,
                 peak_share: float = PEAK_SHARE, max_speed: float = MAX_SPEED) -> tuple[float, dict]:
    """The speed at which the busiest host is busy ``target`` of the time (step 2)."""
    span = max(r["t"] for r in requests) - min(r["t"] for r in requests)
    share = min(1.0, peak_share / hosts)
    work = share * len(requests) * compute_s  # seconds the busiest host computes
    speed = min(max_speed, target * span / work) if work > 0 else max_speed
    speed = max(0.1, round(speed, 2))
    return speed, {"compute_s_per_request": round(compute_s, 5), "peak_share": round(share, 4),
                   "span_s": round(span, 1), "target_busy": target, "max_speed": max_speed,
                   "predicted_busiest_busy": round(work / (span / speed), 3) if span > 0 else None}
