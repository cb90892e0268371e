"""``make bench``: replay a trace through a fleet of engine hosts behind Envoy + ext_proc.

    python -m bench.multi_lora_eval [--trace FILE] [--hosts 1,2,4] [--arms round_robin,affinity,ace]
        [--warm-from FILE] [--speed 8] [--open-loop] --out reports/multi_lora_eval.json

For each fleet size (``--hosts``) and arm (``--arms``), a fresh stack on loopback ports
(``tools.localstack.fleet_stack``): N engine hosts (the GPU agent with the builtin engine
in-process each, its own pool and caches), one ext_proc gateway, one Envoy, and one
artifact store (HTTP server over the adapters' files) shared by all runs. Every arm of
every fleet replays the same trace. Requests go with ``stream: true``; TTFT is the time
to the first streamed chunk, the stall is the engine's ``x-ace-adapter-wait-ms``, the
tier its ``x-ace-adapter-tier``, the host the gateway's ``upstream`` in
``x-ace-trace-multi-lora``.

Arms (``ARMS``):

- **round_robin**: ``--routing-policy extproc.policy.routing:round_robin`` (each request
  to the next host in turn, whatever its adapter), prefetch off: the engines load on
  demand, as behind a plain Service in front of vLLM replicas. Chosen in the gateway
  rather than as an Envoy round-robin cluster so all three arms pay the same Envoy +
  ext_proc path and differ only in the decision.
- **affinity**: ``extproc.policy.routing:route`` (placement + residency-aware routing),
  ``dynamic_lora_prefetch=off``: what a LoRA-affinity picker gives.
- **ace**: the same routing, ``dynamic_lora_prefetch=prod``: ingress signals, the
  gateway's speculation (``extproc.fleet.speculation``) and, with a learned state, the warm set.

The pool of each host, as vLLM's ``--max-loras``: half of the trace's adapters as slots
(``--device-max-adapters``; report field ``pool_adapters``), each able to hold any
adapter: the pool's bytes are the sum of that many largest adapters' files, rounded up
to whole MiB (``--pool-mb``; ``pool_bytes_needed``, ``pool_mb``, ``pool_bytes``). So the
count cap, not the bytes, decides what is evicted. For the committed 800-request trace:
5 of 10 adapters, 2 x 919,616 + 2 x 460,848 + 231,464 B = 2.85 MiB -> 3 MiB.

Cold means cold: the engine keeps no parsed host copy (``--engine-host-mb 0``) and the
disk cache is resident-only (``--disk-budget-mb 0``), so every adapter that becomes
resident again goes the whole way: artifact store over loopback HTTP -> disk cache
(SHA-256 checked while streaming) -> parsed -> pool. Per arm the report counts the
engines' loads by the tier they came from (``loads_by_tier``; a load the agent had
fetched for a prefetch counts as ``disk``) and the store's weight GETs
(``store_fetches``).

Sessions are replayed **closed-loop**: a session's first step is sent at its ``t`` /
``--speed``; each later step when the previous response has ended plus its ``think_s`` /
``--speed``. ``--open-loop`` sends every request at its own ``t`` instead. Each request
carries its session as ``x-ace-session-id`` and as the OpenAI ``user`` field.

Learning is never told the answer: the scored run's gateway never starts from state
learned on the trace it is scored on. By default the ace arm's gateway starts cold (no
``gw.popularity.json``) and learns online. ``--warm-from FILE`` (another day's trace)
starts it from the state a gateway would have learned serving that trace with prefetch
off (``learned_state``: the gateway's own ``TransitionModel`` and request counts fed
the other trace's steps in time order, the pool size per host as the agents' residency
would have taught it, written with the gateway's ``PopularityFile``): its warm set at
start-up and its transition model from the first session on. The report's ``warm_from``
says which (null or the file).

**Replays** (``--replays N``, default 1): the machine's speed drifts during a run (a
hot request's forward pass differed by up to 7% between two arms of one run on the
shared 2-core machine), as much as the TTFT checks' 5% + 1 ms tolerance. With N > 1 the
compared pair, ``affinity`` and ``ace``, replays the trace N times each, every time on a
fresh cold stack, in a palindromic order (all arms, then the pair reversed, then in
order again: ``affinity ace ... ace affinity``), so a drift that is linear in time
weighs on both alike (``replay_order``). Each such entry then carries ``replays`` (each
replay's headline) and ``pooled`` (TTFT and stall percentiles over every replay's rows,
hit ratio, errors summed), and the checks compare ``pooled``; the other fields are the
first replay's.

**Cores** (``--cpu-split on``, the default): the load generator (this process), the
artifact store, Envoy and the ext_proc run on the lowest quarter of the machine's cores
(at least one), the engine hosts on the rest (``bench.cores``), as separate machines
would; ``cpus`` in the report says which. **The load generator** keeps out of what it
measures: its garbage collector is off during a replay (``no_gc_pauses``), it parses only
the engine's timing chunk after the first token, and it measures its own event loop's
lag (``client_loop_lag`` per arm, ``client_lag_ms`` per request: the time its loop ran
late between the send and the first token, which is in the TTFT it reports).

The report (``bench.report``): ``fleets.{hosts}.{arm}`` (``fleet_entry``) with
``checks`` (``fleet_checks``); the top-level fields of the largest fleet with
``baseline`` = ``affinity`` and ``prefetch`` = ``ace`` when both ran; the TTFT plot of
the largest fleet's arms next to it; one row per request in ``*_rows.jsonl``. Progress
goes to stderr as it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import hashlib
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import yaml

from bench.bounds import fleet_bounds, miss_causes
from bench.prefetch_reference import prefetch_reference
from bench import cores, proc_cpu
from bench.pace import pace_probe, read_probe
from bench.pacing import engine_seconds, pilot_compute_s, replay_speed
from bench.report import PACE_MEASURES, build_report, fleet_checks, fleet_entry, format_fleets, format_report, \
    pace_reading, percentiles, ttft_breakdown
from bench.scenario_fixtures import trace_catalog
from bench.trace import TraceError, load_trace
from bench.vllm_router import ROUTER_ARMS, vllm_router
from tools.localstack import run_until_stopped
from ace_common.catalog_schema import read_catalog_file
from ace_common.loop_lag import LoopLag
from gpu_agent.connectors.prometheus import parse_samples

BASE_MODEL = "ace-tiny-llama"
TOKEN = "bench-agent-token"
ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fixtures and config

def remote_catalog(catalog: Path, store_url: str, out: Path, names: set[str]) -> dict:
    """The catalog with every adapter's uri on the artifact store; base model path absolute."""
    read_catalog_file(catalog)      # checked; rewritten as plain YAML below
    data = yaml.safe_load(catalog.read_text())
    base = data["base_model"]
    base["path"] = str((catalog.parent / base["path"]).resolve())
    data["adapters"] = [dict(a, uri=f"{store_url}/{a['uri'].rstrip('/')}", owner="public")
                        for a in data["adapters"] if a["name"] in names]
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return data


def pool_size(names: set[str], sizes: dict[str, int], slots: int | None = None) -> tuple[int, int, int]:
    """``(slots, bytes needed, MiB)`` of a pool with vLLM ``--max-loras`` semantics:
    ``slots`` (default half of the adapters, at least 1), room for the largest that many
    at once."""
    slots = max(1, len(names) // 2) if slots is None else min(slots, len(names))
    needed = sum(sorted((sizes[n] for n in names), reverse=True)[:slots])
    return slots, needed, max(1, math.ceil(needed / (1 << 20)))


# The agent's settings that take every shortcut below the pool away (see the docstring).
COLD_AGENT_ARGS = ("--engine-host-mb", "0", "--disk-budget-mb", "0")


def store_fetches(log_path: Path, start: int = 0) -> tuple[int, int]:
    """``(weight-file GETs answered 200 in the store's log after byte offset start, log size)``."""
    try:
        data = log_path.read_bytes()
    except OSError:
        return 0, start
    text = data[start:].decode(errors="replace")
    n = sum(1 for line in text.splitlines() if "adapter_model.safetensors" in line and '" 200 ' in line)
    return n, len(data)


def engine_counters(text: str) -> tuple[dict[str, int], dict[str, int]]:
    """From an engine's /metrics text: its cold loads by tier
    (``ace_engine_adapter_cold_loads_total``) and its pool's evictions by reason
    (``ace_engine_adapter_evictions_total{tier="device"}``: ``hint``, the gateway's named
    victim for a request's load; ``budget``, the pool's LRU order; ``operator``, an unload
    the agent asked for, e.g. a priced bet's victim)."""
    loads: dict[str, int] = {}
    evictions: dict[str, int] = {}
    for sample in parse_samples(text):
        if sample.name == "ace_engine_adapter_cold_loads_total" and "tier" in sample.labels:
            loads[sample.labels["tier"]] = loads.get(sample.labels["tier"], 0) + int(sample.value)
        elif sample.name == "ace_engine_adapter_evictions_total" and sample.labels.get("tier") == "device":
            reason = sample.labels.get("reason", "?")
            evictions[reason] = evictions.get(reason, 0) + int(sample.value)
    return loads, evictions


async def engine_metrics(engine_url: str) -> str:
    async with httpx.AsyncClient(timeout=10) as client:
        return (await client.get(engine_url + "/metrics")).text


def state_yaml(path: Path, catalog: Path, tenants: list[str], hosts: list[dict], prefetch: bool) -> dict:
    """The gateway's state: the tenants (``multi_lora`` on, prefetch on or off) and one
    upstream per engine host (``hosts``: ``{"name", "engine", "agent"}``)."""
    mode = "prod" if prefetch else "off"
    keys = {t: f"sk-bench-{hashlib.sha256(t.encode()).hexdigest()[:16]}" for t in tenants}
    state = {
        "include": [str(catalog)],
        "tenants": [{"id": t, "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": mode}} for t in tenants],
        "keys": [{"name": f"bench-{t}", "sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t, "skills": {}}
                 for t, k in keys.items()],
        "upstreams": [{"name": h["name"], "address": h["engine"], "flavour": "builtin", "base_model": BASE_MODEL,
                       "hints": "off", "agent": h["agent"]} for h in hosts],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": mode},
    }
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return keys


def agent_env(hosts: int, host_cores: int | None = None) -> dict[str, str]:
    """The hosts' cores (``host_cores``; default the machine's) split between the engine
    hosts (at least one torch thread each): N hosts share this machine, where a real fleet
    gives each its own accelerator; without it N processes x all cores oversubscribe."""
    n = str(max(1, (host_cores or os.cpu_count() or 1) // hosts))
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


# arm -> (routing policy, prefetch on)
ARMS: dict[str, tuple[str, bool]] = {
    "round_robin": ("extproc.policy.routing:round_robin", False),
    "affinity": ("extproc.policy.routing:route", False),
    "ace": ("extproc.policy.routing:route", True),
}
# vLLM's own router in front of the same hosts instead of Envoy + ext_proc (bench.vllm_router);
# run when --arms names them (they need make's .venv-router); the gateway stands by, unused
FRONT_ARMS: dict[str, tuple[str, bool]] = {arm: ("extproc.policy.routing:route", False) for arm in ROUTER_ARMS}


# ---------------------------------------------------------------- the stack

@contextlib.contextmanager
def stack(work: Path, catalog: Path, tenants: list[str], hosts: int, pool_adapters: int, pool_mb: int,
          arm: str, extra_agent_args: Sequence[str] = (), host_cpus: frozenset[int] | None = None):
    """The fleet (``tools.localstack.fleet_stack``): ``hosts`` engine hosts, each pool
    capped, the arm's routing policy and prefetch mode; yields its addresses and keys.
    ``extra_agent_args``: appended to every agent's command line (``--agent-args``);
    ``host_cpus``: the agents' cores (``bench.cores``; None: the caller's)."""
    from tools.localstack import fleet_stack

    policy, prefetch = {**ARMS, **FRONT_ARMS}[arm]

    def write_state(path: Path, fleet: list[dict]) -> dict:
        return state_yaml(path, catalog, tenants, fleet, prefetch)

    agent_args = ["--device-max-adapters", str(pool_adapters), "--pool-mb", str(pool_mb),
                  "--reconcile-interval-s", "0.2", *COLD_AGENT_ARGS, *extra_agent_args]
    with fleet_stack(work, catalog, hosts, write_state, token=TOKEN, agent_args=agent_args,
                     agent_env=agent_env(hosts, len(host_cpus) if host_cpus else None),
                     extproc_args=["--routing-policy", policy], agent_cpus=host_cpus) as st:
        if arm in ROUTER_ARMS:
            with vllm_router([h["engine_url"] for h in st["hosts"]], ROUTER_ARMS[arm], work) as url:
                yield dict(st, keys=st["state"], gateway=url)
            return
        yield dict(st, keys=st["state"])


def speculation_counters(log_path: Path) -> dict | None:
    """The gateway's last ``speculation counters: {...}`` log line (written when it stops)."""
    found = None
    try:
        for line in log_path.read_text(errors="replace").splitlines():
            i = line.find("speculation counters: ")
            if i >= 0:
                found = line[i + len("speculation counters: "):]
    except OSError:
        return None
    return json.loads(found) if found else None


def preemptions(metrics_texts: list[str]) -> int | None:
    """Prefetch loads the agents preempted, summed over hosts' /metrics texts: every
    counter whose name says ``preempt``; None when no agent exposes one."""
    total, seen = 0.0, False
    for text in metrics_texts:
        for line in text.splitlines():
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if line.startswith("#") or "preempt" not in name or name.endswith(("_bucket", "_sum", "_count")):
                continue
            seen = True
            total += float(line.rsplit(" ", 1)[1])
    return int(total) if seen else None


def prefetch_outcomes(metrics_texts: list[str]) -> dict[str, int]:
    """The agents' answers to prefetch signals (``ace_agent_prefetch_total{outcome}``: taken,
    coalesced, left to the engine, or refused with the speculation budget's verdict), and
    what became of taken ones that did not load (``ace_agent_prefetch_cancelled_total{reason}``
    as ``cancelled_<reason>``), summed over hosts."""
    out: Counter = Counter()
    for text in metrics_texts:
        for sample in parse_samples(text):
            if sample.name == "ace_agent_prefetch_total" and "outcome" in sample.labels:
                out[sample.labels["outcome"]] += int(sample.value)
            elif sample.name == "ace_agent_prefetch_cancelled_total" and "reason" in sample.labels:
                out[f"cancelled_{sample.labels['reason']}"] += int(sample.value)
    return dict(sorted(out.items()))


def gc_pauses(metrics_texts: list[str], name: str = "ace_agent_gc_pause_seconds",
              slow_s: float = 0.01) -> dict[str, dict[str, float]]:
    """Garbage collections so far, from /metrics texts (``name{generation}``: the agents'
    ``ace_agent_gc_pause_seconds``, the gateway's ``ace_gateway_gc_pause_seconds``), summed
    over the texts, per generation: ``n``, ``sum_ms`` and ``slow`` (longer than ``slow_s``,
    read from the histogram's bucket at that bound). Subtract two reads (``gc_pause_delta``)
    for a replay's own."""
    out: dict[str, dict[str, float]] = {}
    for text in metrics_texts:
        for sample in parse_samples(text):
            if sample.name.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket") != name:
                continue
            g = out.setdefault(f"gen{sample.labels.get('generation', '?')}", {"n": 0, "sum_ms": 0.0, "slow": 0})
            if sample.name.endswith("_count"):
                g["n"] += int(sample.value)
                g["slow"] += int(sample.value)
            elif sample.name.endswith("_sum"):
                g["sum_ms"] += sample.value * 1e3
            elif sample.name.endswith("_bucket") and float(sample.labels.get("le", "inf")) == slow_s:
                g["slow"] -= int(sample.value)
    return out


def gc_pause_delta(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """``after`` minus ``before`` (two ``gc_pauses`` reads), sum in ms rounded to 0.1."""
    out = {}
    for gen, a in sorted(after.items()):
        b = before.get(gen, {})
        out[gen] = {"n": a["n"] - b.get("n", 0), "sum_ms": round(a["sum_ms"] - b.get("sum_ms", 0.0), 1),
                    "slow": a["slow"] - b.get("slow", 0)}
    return out


LOOP_LAG_METRIC = "ace_agent_event_loop_lag_seconds"
GATEWAY_LOOP_LAG_METRIC = "ace_gateway_event_loop_lag_seconds"
LOOP_LAG_OVER_S = (0.01, 0.025, 0.05)
#: the load generator's own monitor wakes this often: finer than the processes' 20 ms, since
#: its lag is in every TTFT it measures (a stall of d is seen with a chance of ~d / interval)
CLIENT_LAG_INTERVAL_S = 0.005
#: a request of a replay unanswered this long means a process of the stack stopped
#: answering (an agent's event loop stuck, 2026-12-07): the replay stops with an error
#: instead of waiting forever; every request of these benchmarks is answered in ms
STALL_S = 60.0


class StackStalled(RuntimeError):
    """A replayed request went unanswered for ``STALL_S``."""


async def guarded(work: "asyncio.Future", inflight: Mapping[object, float], stall_s: float, what: str,
                  poll_s: float = 1.0) -> None:
    """Await ``work`` while watching ``inflight`` (request -> ``time.perf_counter()`` at
    its send): when the oldest has waited past ``stall_s``, ``work`` is cancelled and
    ``StackStalled`` raised."""
    async def watch() -> None:
        while True:
            await asyncio.sleep(poll_s)
            if inflight and time.perf_counter() - min(inflight.values()) > stall_s:
                raise StackStalled(f"{what}: a request went unanswered for {stall_s:.0f} s: a process of the "
                                   "stack stopped answering (its log is in the run's directory)")

    guard = asyncio.ensure_future(watch())
    try:
        finished, _ = await asyncio.wait({work, guard}, return_when=asyncio.FIRST_COMPLETED)
        if guard in finished:
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            guard.result()
        await work
    finally:
        guard.cancel()
        await asyncio.gather(guard, return_exceptions=True)
#: the engine's timing chunk: the only one parsed after the first token
TIMING_KEY = '"ace_timing"'


def loop_lags(metrics_texts: list[str], name: str = LOOP_LAG_METRIC) -> dict[str, float]:
    """The agents' event-loop lag so far (``ace_common.loop_lag``), summed over the texts:
    ``wakeups``, ``sum_ms`` and ``over_<ms>ms`` (wake-ups later than that, from the
    histogram's buckets at ``LOOP_LAG_OVER_S``). Subtract two reads (``loop_lag_delta``)."""
    wakeups, sum_s, buckets = 0, 0.0, []
    for text in metrics_texts:
        for sample in parse_samples(text):
            if sample.name == f"{name}_count":
                wakeups += int(sample.value)
            elif sample.name == f"{name}_sum":
                sum_s += sample.value
            elif sample.name == f"{name}_bucket":
                buckets.append((sample.labels.get("le", "+Inf"), sample.value))
    return _lag_counts(wakeups, sum_s, buckets)


def _lag_counts(wakeups: int, sum_s: float, cumulative) -> dict[str, float]:
    """``loop_lags``' shape from a lag histogram's count, sum and cumulative ``(le, count)``
    pairs (one histogram's, or several hosts' summed bucket by bucket)."""
    within: dict[float, int] = dict.fromkeys(LOOP_LAG_OVER_S, 0)
    for le, n in cumulative:
        if float(le) in within:
            within[float(le)] += int(n)
    return {"wakeups": wakeups, "sum_ms": sum_s * 1e3,
            **{f"over_{round(bound * 1e3)}ms": wakeups - within[bound] for bound in LOOP_LAG_OVER_S}}


def loop_lag_delta(before: dict, after: dict) -> dict[str, float]:
    """``after`` minus ``before`` (two ``loop_lags`` reads), ``sum_ms`` rounded to 0.1."""
    return {k: round(v - before.get(k, 0), 1) if k == "sum_ms" else v - before.get(k, 0) for k, v in after.items()}


async def pauses_of(st: dict) -> tuple[dict[str, dict], dict[str, dict[str, float] | None]]:
    """From one scrape of every process now: ``{"agents": gc_pauses over every host,
    "gateway": the ext_proc's}``, and ``{"agents": the agents' loop_lags, "gateway": the
    ext_proc's serving loop's (None: no gateway metrics)}``."""
    async with httpx.AsyncClient(timeout=10) as client:
        texts = [(await client.get(h["metrics"])).text for h in st["hosts"]]
        gateway, gateway_lag = {}, None
        if st.get("gateway_metrics"):
            text = (await client.get(st["gateway_metrics"])).text
            gateway = gc_pauses([text], "ace_gateway_gc_pause_seconds")
            gateway_lag = loop_lags([text], GATEWAY_LOOP_LAG_METRIC)
    return {"agents": gc_pauses(texts), "gateway": gateway}, {"agents": loop_lags(texts), "gateway": gateway_lag}


async def agent_counters(metrics_urls: list[str]) -> tuple[int | None, dict[str, int]]:
    """(prefetch loads the agents preempted, their prefetch outcomes), from their /metrics."""
    async with httpx.AsyncClient(timeout=10) as client:
        texts = [(await client.get(url)).text for url in metrics_urls]
    return preemptions(texts), prefetch_outcomes(texts)


def metric(text: str, series: str) -> float:
    """The value of one series (``name`` or ``name{labels}`` as rendered) in a /metrics text; 0 if absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def fleet_ready(hosts: list[dict], expect_prefetches: bool, timeout_s: float = 30.0,
                      settle_s: float = 1.0) -> float:
    """Wait, as a readiness probe would, until no agent has a prefetch queued or loading
    (each accepted prefetch is in its pool, or given up) and that has held for
    ``settle_s``: with a learned state, the warm set is resident before traffic starts,
    without one (prefetch on), the fill of the empty pools (``expect_prefetches``: wait for
    them to arrive at all). Returns the seconds waited (``ready_wait_s``)."""
    t0 = time.monotonic()
    seen, since = None, t0
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() - t0 < timeout_s:
            texts = [(await client.get(h["metrics"])).text for h in hosts]
            accepted = [metric(t, 'ace_agent_prefetch_total{outcome="accepted"}') for t in texts]
            device = [metric(t, 'ace_agent_tier_adapters{tier="device"}') for t in texts]
            # given up after acceptance (a start-up fill that found the pool full by its turn)
            gone = [sum(s.value for s in parse_samples(t) if s.name == "ace_agent_prefetch_cancelled_total")
                    for t in texts]
            done = all(metric(t, "ace_agent_prefetch_queue_depth") == 0 and d + g >= a
                       for t, a, d, g in zip(texts, accepted, device, gone))
            now = time.monotonic()
            if (accepted, device) != seen:
                seen, since = (accepted, device), now
            if done and (sum(accepted) > 0 or not expect_prefetches) and now - since >= settle_s:
                break
            await asyncio.sleep(0.1)
    return time.monotonic() - t0


def learned_state(requests: list[dict], hosts: list[str], slots: int, out: Path) -> Path:
    """The gateway's learned state (``<db>.popularity.json``) after serving ``requests``
    with prefetch off, built offline with the gateway's own learner: each request counts
    for its adapter and teaches the transition model its session step, in time order (as
    ``GatewaySpeculation`` does for ``off`` requests); the pool size it would have
    learned from the agents' residency is each host's ``slots``."""
    from extproc.policy.speculator import SpeculationSettings
    from extproc.fleet.speculation import PopularityFile

    model = SpeculationSettings().transition_model()
    counts: Counter = Counter()
    for r in sorted(requests, key=lambda r: (r["t"], r.get("step", 0))):
        counts[r["adapter"]] += 1.0
        model.observe(r["tenant"], f"{r['tenant']}/{r['session']}", r["adapter"])
    PopularityFile(out).save(dict(counts), {h: slots for h in hosts}, model)
    return out


# ---------------------------------------------------------------- replay

async def one_request(client: httpx.AsyncClient, base: str, key: str, r: dict,
                      lag: LoopLag | None = None) -> dict:
    """One streamed request: TTFT is the time to the first chunk carrying a token (the
    chat stream's opening role chunk comes before any compute); the engine's
    ``ace_timing`` chunk (``stream_options.include_timing``) splits it. Once the first
    token is in, only that chunk is parsed (the load generator's CPU per request is part
    of every TTFT it measures). ``lag``: the load generator's own loop-lag monitor, read
    at the send and at the first token (``client_lag_ms``: how late this loop ran
    meanwhile, which delays the request's send and the first token's read alike)."""
    session = f"{r['tenant']}/{r['session']}"
    body = {"model": r["adapter"], "messages": r["messages"], "max_tokens": int(r.get("max_tokens", 16)),
            "temperature": 0, "stream": True, "stream_options": {"include_timing": True}, "user": session}
    headers = {"authorization": f"Bearer {key}", "x-ace-session-id": session}
    t0 = time.perf_counter()
    lag0 = lag.sum_s if lag is not None else None
    ttft = first_byte = lag_at_ttft = None
    timing: dict = {}
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as resp:
            async for line in resp.aiter_lines():
                if first_byte is None:
                    first_byte = (time.perf_counter() - t0) * 1000
                if not line.startswith("data: {") or (ttft is not None and TIMING_KEY not in line):
                    continue
                chunk = json.loads(line[len("data: "):])
                if ttft is None and any(c.get("delta", {}).get("content") or c.get("finish_reason")
                                        for c in chunk.get("choices") or ()):
                    ttft = (time.perf_counter() - t0) * 1000
                    lag_at_ttft = lag.sum_s if lag is not None else None
                timing = chunk.get("ace_timing") or timing
            status = resp.status_code
            h = resp.headers
    except (httpx.HTTPError, ValueError) as exc:
        return {"id": r.get("id"), "error": str(exc)}
    trace = dict(kv.split("=", 1) for kv in h.get("x-ace-trace-multi-lora", "").split(",") if "=" in kv)
    wait = h.get("x-ace-adapter-wait-ms")
    engine_ms = timing.get("first_token_ms")
    return {
        "id": r.get("id"), "tenant": r["tenant"], "session": r["session"], "step": r.get("step"),
        "adapter": r["adapter"],
        "domain": r["domain"], "status": status, "tier": h.get("x-ace-adapter-tier", "unknown"),
        "wait_ms": float(wait) if wait is not None else None, "ttft_ms": ttft, "first_byte_ms": first_byte,
        "total_ms": (time.perf_counter() - t0) * 1000, "action": trace.get("action"),
        "host": trace.get("upstream"), "sent_s": t0,
        "queue_ms": timing.get("queue_ms"), "compute_ms": timing.get("compute_ms"),
        "loads_ms": timing.get("loads_ms"), "engine_ttft_ms": engine_ms,
        **{f"load_{k}": v for k, v in (timing.get("load") or {}).items()},
        "outside_engine_ms": ttft - engine_ms if ttft is not None and engine_ms is not None else None,
        # the way in (client, Envoy, ext_proc, the engine's HTTP read): the engine's arrival
        # mark is on perf_counter()'s clock, which this machine's processes share
        "to_engine_ms": (timing["arrived_s"] - t0) * 1000 if timing.get("arrived_s") is not None else None,
        "loop_lag_ms": timing.get("loop_lag_ms"),   # the engine's loop late while it held the request
        "client_lag_ms": (round((lag_at_ttft - lag0) * 1000, 3)   # the load generator's loop, send to first token
                          if lag0 is not None and lag_at_ttft is not None else None),
    }


def sessions(requests: list[dict]) -> list[list[dict]]:
    """Requests grouped by (tenant, session), steps in order, sessions by first ``t``."""
    by: dict[tuple, list[dict]] = {}
    for r in requests:
        by.setdefault((r["tenant"], r["session"]), []).append(r)
    out = [sorted(steps, key=lambda r: (r.get("step", 0), r["t"])) for steps in by.values()]
    return sorted(out, key=lambda steps: steps[0]["t"])


def think_s(prev: dict, r: dict) -> float:
    """Seconds between the previous step's answer and this step (closed-loop replay)."""
    think = r.get("think_s")
    return max(0.0, float(think) if think is not None else r["t"] - prev["t"])


@contextlib.contextmanager
def no_gc_pauses() -> Iterator[None]:
    """The load generator's garbage collector off for a replay: a collection stops its
    event loop (a full one took 62 ms here, with every request in flight late by as much
    at the send or the first token), and the objects a replay makes are few enough to
    keep. What existed before is frozen out of the later collections; a collection runs
    before and after."""
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()
        gc.collect()


async def replay(requests: list[dict], st: dict, speed: float, closed_loop: bool = True,
                 label: str = "") -> tuple[list[dict], dict[str, float]]:
    """Every request of ``requests`` through the gateway, paced at ``speed`` (closed loop:
    each session's next step after the previous answer and its think time). Returns the
    rows and the load generator's own loop lag over the replay (``lag_summary``: its
    wake-ups every ``CLIENT_LAG_INTERVAL_S`` and how many ran late), beside which the
    agents' and the gateway's are read from their metrics."""
    rows: list[dict] = []
    t_start = time.perf_counter()
    t0 = requests[0]["t"]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    def done(row: dict) -> None:
        rows.append(row)
        if len(rows) % 100 == 0:
            log(f"  {label}{len(rows)}/{len(requests)} requests ({time.perf_counter() - t_start:.0f}s)")

    async def at(t: float) -> None:
        delay = (t - t0) / speed - (time.perf_counter() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)

    lag = LoopLag(interval_s=CLIENT_LAG_INTERVAL_S)
    inflight: dict[int, float] = {}
    with no_gc_pauses():
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def request(r: dict) -> None:
                key = id(r)
                inflight[key] = time.perf_counter()
                try:
                    done(await one_request(client, st["gateway"], st["keys"][r["tenant"]], r, lag))
                finally:
                    del inflight[key]

            async def send(r: dict) -> None:
                await at(r["t"])
                await request(r)

            async def session(steps: list[dict]) -> None:
                await at(steps[0]["t"])
                for i, r in enumerate(steps):
                    if i:
                        await asyncio.sleep(think_s(steps[i - 1], r) / speed)
                    await request(r)

            lag.start()
            try:
                if closed_loop:
                    work = asyncio.gather(*(session(steps) for steps in sessions(requests)))
                else:
                    work = asyncio.gather(*(send(r) for r in requests))
                await guarded(work, inflight, STALL_S, (label or "replay: ").rstrip(": "))
            finally:
                await lag.close()
    return rows, lag_summary(lag)


def lag_summary(lag: LoopLag) -> dict[str, float]:
    """One ``LoopLag``'s count in ``loop_lags``' shape (``sum_ms`` rounded to 0.1)."""
    h = lag.histogram
    out = _lag_counts(h.n, h.total, h.cumulative())
    out["sum_ms"] = round(out["sum_ms"], 1)
    return out


async def gateway_overhead(st: dict, adapter: str, key: str, n: int = 40) -> float:
    """Median latency through Envoy + ext_proc minus straight to the engine (same request)."""
    body = {"model": adapter, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "temperature": 0}
    async with httpx.AsyncClient(timeout=60) as client:
        async def timed(url: str, headers: dict) -> list[float]:
            out = []
            for _ in range(n):
                t = time.perf_counter()
                r = await client.post(url, json=body, headers=headers)
                out.append((time.perf_counter() - t) * 1000)
                r.raise_for_status()
            return out

        direct = await timed(st["hosts"][0]["engine_url"] + "/v1/chat/completions", {})
        via = await timed(st["gateway"] + "/v1/chat/completions", {"authorization": f"Bearer {key}"})
    return percentiles(via, (50,))["p50"] - percentiles(direct, (50,))["p50"]


def plot_ttft(runs: dict[str, list[float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, xs in runs.items():
        xs = sorted(xs)
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms, log)")
    ax.set_ylabel("share of requests")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "error" not in r and r["status"] == 200 and r["wait_ms"] is not None]


def run_arm(args, requests: list[dict], work: Path, catalog: Path, names: set[str], store: tuple[int, Path],
            hosts: int, arm: str, pool: int, pool_mb: int, warm_file: Path | None, probe: bool,
            speed: float | None, replay_no: int = 1) -> tuple[list, dict, float, dict | None]:
    """One arm on one fleet: a fresh stack, the whole trace, then the counters. With
    ``speed`` None, a pilot on this stack chooses it first (``bench.pacing``); returns the
    rows, the entry, the speed and the calibration (None when given)."""
    store_port, store_log = store
    run_dir = work / (f"{hosts}-{arm}" if replay_no == 1 else f"{hosts}-{arm}-r{replay_no}")
    run_dir.mkdir()
    if warm_file is not None:
        shutil.copy(warm_file, run_dir / "gw.popularity.json")
    tenants = sorted({r["tenant"] for r in requests})
    rcat = run_dir / "catalog.yaml"
    remote_catalog(catalog, f"http://127.0.0.1:{store_port}", rcat, names)
    t_run = time.monotonic()
    _, log_at = store_fetches(store_log)
    label = f"{hosts} hosts {arm}{f' #{replay_no}' if replay_no > 1 else ''}: "
    with stack(run_dir, rcat, tenants, hosts, pool, pool_mb, arm, args.agent_args,
               host_cpus=args.cpus[1] if args.cpus else None) as st:
        log(f"{label}stack up in {time.monotonic() - t_run:.0f}s, replaying {len(requests)} requests")

        async def go():
            ready = await fleet_ready(st["hosts"], expect_prefetches=warm_file is not None or {**ARMS, **FRONT_ARMS}[arm][1])
            log(f"{label}ready after {ready:.1f}s")
            calibration = None
            run_speed = speed
            if run_speed is None:
                compute_s = await pilot_compute_s(st["hosts"], requests, BASE_MODEL)
                run_speed, calibration = replay_speed(requests, hosts, compute_s)
                log(f"{label}pilot: {1000 * compute_s:.1f} ms of forward passes per request -> speed x{run_speed} "
                    f"(busiest host predicted {calibration['predicted_busiest_busy']:.0%} busy)")
            async with httpx.AsyncClient(timeout=10) as client:
                before = {h["name"]: await engine_seconds(client, h["engine_url"]) for h in st["hosts"]}
                cpu_before = proc_cpu.snapshot()
                gc_before, lag_before = await pauses_of(st)
                t0 = time.monotonic()
                with pace_probe(run_dir / "pace.txt", args.cpus[1] if args.cpus else None):
                    rows, client_lag = await replay(requests, st, run_speed, closed_loop=not args.open_loop,
                                                    label=label)
                elapsed = time.monotonic() - t0
                cpu = proc_cpu.account(cpu_before, proc_cpu.snapshot())
                gc_after, lag_after = await pauses_of(st)
                lag = {who: None if lag_after[who] is None or lag_before[who] is None
                       else loop_lag_delta(lag_before[who], lag_after[who]) for who in lag_after}
                lag["client"] = client_lag
                gc_delta = {who: gc_pause_delta(gc_before[who], gc_after[who]) for who in gc_after}
                after = {h["name"]: await engine_seconds(client, h["engine_url"]) for h in st["hosts"]}
            busy = {n: round((after[n][0] - before[n][0]) / elapsed, 4) for n in before}
            load_busy = {n: round((after[n][1] - before[n][1]) / elapsed, 4) for n in before}
            loads: Counter = Counter()
            evictions: Counter = Counter()
            by_host = {}
            for h in st["hosts"]:  # before the overhead probe's requests
                by_host[h["name"]], evicted = engine_counters(await engine_metrics(h["engine_url"]))
                loads.update(by_host[h["name"]])
                evictions.update(evicted)
            preempted, outcomes = await agent_counters([h["metrics"] for h in st["hosts"]])
            ov = None
            if probe:
                t = requests[0]
                ov = await gateway_overhead(st, t["adapter"], st["keys"][t["tenant"]])
            return (rows, dict(loads), by_host, preempted, outcomes, ov, ready, run_speed, calibration, busy, load_busy,
                    cpu, gc_delta, lag, dict(sorted(evictions.items())))

        t_replay = time.monotonic()
        load_avg = os.getloadavg()[0]
        (rows, loads, loads_by_host, preempted, outcomes, overhead, ready, speed, calibration, busy,
         load_busy, cpu, gc_replay, loop_lag, pool_evictions) = asyncio.run(go())
        replay_s = time.monotonic() - t_replay
        fetches, _ = store_fetches(store_log, log_at)
    counters = speculation_counters(run_dir / "extproc.log") or {}  # the gateway has stopped
    ok = ok_rows(rows)
    prefetch = {"sent": counters.get("signals_sent", 0) + counters.get("warm_sent", 0) if counters else None,
                "used": counters.get("prefetch_used"), "wasted": counters.get("prefetch_wasted"),
                "preempted": preempted, "agent_outcomes": outcomes}
    entry = fleet_entry(
        ok, errors=len(rows) - len(ok), requests_per_host=Counter(r["host"] or "unknown" for r in ok),
        loads_by_tier=loads, prefetch=prefetch,
        extra={"loads_by_host": loads_by_host, "pool_evictions": pool_evictions, "store_fetches": fetches, "replay_s": round(replay_s, 1),
               "ready_wait_s": round(ready, 2),
               "machine_load_avg_1m": [round(load_avg, 2), round(os.getloadavg()[0], 2)],
               "rows_by_tier": dict(sorted(Counter(r["tier"] for r in ok).items())),
               "speculation": counters or None, "gateway_overhead_ms": overhead,
               "speed": speed, "engine_busy": busy, "engine_load_busy": load_busy, "process_cpu_s": cpu,
               "pace_probe_ms": read_probe(run_dir / "pace.txt"),
               "gc_pauses": gc_replay, "loop_lag": loop_lag["agents"], "gateway_loop_lag": loop_lag["gateway"],
               "client_loop_lag": loop_lag["client"],
               "ttft_breakdown": ttft_breakdown(ok), "bounds": fleet_bounds(ok, pool),
               "miss_causes": stack_miss_causes(ok, requests, pool),
               "prefetch_reference": stack_prefetch_reference(ok, requests, pool)})
    log(f"{label}done in {time.monotonic() - t_run:.0f}s: resident {entry['resident_hits']}/{entry['total']}, "
        f"effective {entry['effective_hits']}, errors {entry['errors']}, stall p99 {entry['stall_ms']['p99']}, "
        f"ttft p99 {entry['ttft_ms']['p99']}, per host {entry['requests_per_host']}, loads {loads}, "
        f"engine busy {busy}, Belady {entry['bounds']['belady_hits']}")
    return rows, entry, speed, calibration


def stack_miss_causes(ok: list[dict], requests: list[dict], pool: int, stall_eps_ms: float = 1.0) -> dict:
    """``bench.bounds.miss_causes`` over an arm's rows: a hit waited at most ``stall_eps_ms``
    for its adapter (the report's effective hit); a miss is ``late`` when the engine applied
    an adapter a prefetch (or the ingress signal) had started loading; the trace's
    ``workflow`` labels tell one-offs and strays."""
    rows = [{**r, "hit": r["wait_ms"] <= stall_eps_ms,
             "late": r["wait_ms"] > stall_eps_ms and r.get("action") == "adapter_prefetched_applied"} for r in ok]
    return miss_causes(rows, pool, labels={r.get("id"): r.get("workflow", "") for r in requests})


def stack_prefetch_reference(ok: list[dict], requests: list[dict], pool: int) -> dict:
    """``bench.prefetch_reference`` over an arm's rows (its hosts, in the order sent, on the
    trace's clock, with its ``workflow`` labels) at ``pool`` slots a host: what each
    predictor is worth on this arm's routing with loads that take no time."""
    by_id = {r["id"]: r for r in requests}
    rows = [{"id": r["id"], "host": r["host"], "adapter": r["adapter"], "session": r["session"],
             "sent_s": r["sent_s"], "at_s": by_id[r["id"]]["t"]} for r in ok]
    return prefetch_reference(rows, pool, labels={r["id"]: by_id[r["id"]].get("workflow", "") for r in ok})


PAIR = ("affinity", "ace")  # the arms the checks compare: the ones --replays repeats


def replay_order(hosts_list: Sequence[int], arms: Sequence[str], replays: int = 1,
                 compared: Sequence[str] = PAIR) -> list[tuple[int, str, int]]:
    """``(hosts, arm, replay)`` in the order they run: per fleet, every arm once, then
    for each further replay the compared arms (``compared``, default ``PAIR``, those of
    ``arms``) in reverse order of the pass before: with an even number of replays each
    of them sits at the same mean position in the run."""
    out: list[tuple[int, str, int]] = []
    for n in hosts_list:
        out.extend((n, arm, 1) for arm in arms)
        again = [arm for arm in arms if arm in compared]
        for k in range(2, replays + 1):
            again.reverse()
            out.extend((n, arm, k) for arm in again)
    return out


def pooled_entry(done: Sequence[Mapping]) -> dict:
    """``replays`` (each replay's ``order``, hit ratio, errors, stall and TTFT percentiles)
    and ``pooled`` (the percentiles over every replay's rows, the hit ratio over all of
    them, errors summed, each replay's load generator CPU seconds, ``client_cpu_s``, and
    its pace probe's median, ``pace_probe_ms``: the machine's pace, ``bench.report.
    machine_pace``) for one arm replayed ``len(done)`` times."""
    ok = [r for d in done for r in ok_rows(d["rows"])]
    entries = [d["entry"] for d in done]
    total = sum(e["total"] for e in entries)
    return {
        "replays": [{"order": d["order"], "effective_hit_ratio": d["entry"]["effective_hit_ratio"],
                     "errors": d["entry"]["errors"], "stall_ms": d["entry"]["stall_ms"],
                     "ttft_ms": d["entry"]["ttft_ms"]} for d in done],
        "pooled": {"replays": len(done), "requests": len(ok), "errors": sum(e["errors"] for e in entries),
                   **{field: [pace_reading(e, field) for e in entries] for field in PACE_MEASURES},
                   "effective_hit_ratio": sum(e["effective_hits"] for e in entries) / total if total else None,
                   "stall_ms": percentiles(r["wait_ms"] for r in ok),
                   "ttft_ms": percentiles(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None)},
    }


def parse_list(text: str, allowed: tuple, kind) -> list:
    out = [kind(x) for x in text.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed] if allowed else []
    if bad or not out:
        raise ValueError(f"{bad or text!r}: choose from {', '.join(map(str, allowed))}")
    return out


def run(args) -> int:
    try:
        requests = load_trace(args.trace)
        warm_requests = load_trace(args.warm_from) if args.warm_from else None
        hosts_list = parse_list(args.hosts, (), int)
        arms = parse_list(args.arms, (*ARMS, *FRONT_ARMS), str)
        if any(n < 1 for n in hosts_list):
            raise ValueError("--hosts: at least 1 host")
        if args.slots is not None and args.slots < 1:
            raise ValueError("--slots: at least 1 slot")
        if args.replays < 1:
            raise ValueError("--replays: at least 1")
        if args.speed != "auto":
            try:
                ok = float(args.speed) > 0
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(f"--speed: a positive number or auto, got {args.speed!r}")
    except (TraceError, ValueError) as exc:
        log(f"error: {exc}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="ace-bench-"))
    t_all = time.monotonic()
    failed = False
    try:
        catalog = trace_catalog(requests + (warm_requests or []), Path(args.fixtures), log=log)
        names = {r["adapter"] for r in requests}
        sizes_all = {a.name: a.size_bytes for a in read_catalog_file(catalog).adapters}
        pool, pool_needed, pool_mb = pool_size(names, sizes_all, args.slots)
        from tests.support.procs import free_port, python, running, wait_port

        store_port = free_port()
        cmd = [python(), "-m", "http.server", str(store_port), "--bind", "127.0.0.1", "--directory",
               str(catalog.parent)]
        store_log = work / "store.log"
        runs = replay_order(hosts_list, arms, args.replays)
        log(f"fleet benchmark: {len(requests)} requests, hosts {hosts_list}, arms {arms}, pool {pool} of "
            f"{len(names)} adapters / {pool_mb} MiB per host, speed {args.speed}, ace learns "
            f"{'from ' + str(args.warm_from) if args.warm_from else 'online from a cold start'}"
            + (f"; cores: request path {sorted(args.cpus[0])}, hosts {sorted(args.cpus[1])}" if args.cpus else ""))
        top = max(hosts_list)
        results: dict[str, dict[str, dict]] = {}
        all_rows: dict[tuple[int, str], list] = {}
        replays: dict[tuple[int, str], list[dict]] = {}
        speeds: dict[int, float | None] = {n: None if args.speed == "auto" else float(args.speed) for n in hosts_list}
        calibrations: dict[str, dict] = {}
        with cores.pinned(args.cpus[0] if args.cpus else None), running(cmd, store_log) as store:
            wait_port(store_port, timeout=30, proc=store, log=store_log)
            for i, (n, arm, k) in enumerate(runs, 1):
                log(f"[{i}/{len(runs)}] {n} hosts, arm {arm}{f' (replay {k})' if k > 1 else ''} "
                    f"({time.monotonic() - t_all:.0f}s so far)")
                warm_file = None
                if warm_requests is not None and {**ARMS, **FRONT_ARMS}[arm][1]:
                    warm_file = learned_state(warm_requests, [f"engine-{k}" for k in range(1, n + 1)], pool,
                                              work / f"learned-{n}.popularity.json")
                rows, entry, speeds[n], cal = run_arm(args, requests, work, catalog, names, (store_port, store_log),
                                                      n, arm, pool, pool_mb, warm_file,
                                                      probe=(n == top and arm == "ace" and k == 1), speed=speeds[n],
                                                      replay_no=k)
                if cal is not None:
                    calibrations[str(n)] = cal
                replays.setdefault((n, arm), []).append({"order": i, "rows": rows, "entry": entry})
                if k == 1:
                    results.setdefault(str(n), {})[arm] = entry
                all_rows.setdefault((n, arm), []).extend(dict(r, replay=k) for r in rows)
        for (n, arm), done in replays.items():
            if len(done) > 1:
                results[str(n)][arm].update(pooled_entry(done))
        report = fleet_report(args, requests, results, all_rows, top, catalog, names, pool, pool_needed, pool_mb)
        report["replay_order"] = [f"{n}:{arm}#{k}" for n, arm, k in runs]
        report["speed_by_hosts"] = {str(n): speeds[n] for n in hosts_list}
        report["speed_calibration"] = calibrations
        report["wall_s"] = round(time.monotonic() - t_all, 1)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        with out.with_name(out.stem + "_rows.jsonl").open("w") as f:
            for (n, arm), rows in all_rows.items():
                for row in rows:
                    f.write(json.dumps({"hosts": n, "arm": arm, **row}) + "\n")
        plot_ttft({arm: [r["ttft_ms"] for r in ok_rows(all_rows[(top, arm)]) if r["ttft_ms"] is not None]
                   for arm in arms},
                  out.with_suffix(".png"), f"TTFT, {top} engine hosts behind Envoy + ext_proc, per arm")
        if "total" in report:
            print(format_report(report))
            print()
        print(format_fleets(report["fleets"], report["warm_from"]))
        log(f"wrote {out} and {out.with_suffix('.png')} in {report['wall_s']:.0f}s")
        return 0
    except Exception:
        failed = True   # keep the processes' logs of a run that broke
        raise
    finally:
        if not (args.keep or failed):
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}" + (" (the run failed: every process's log is there)" if failed else ""))


def fleet_report(args, requests: list[dict], results: dict, all_rows: dict, top: int, catalog: Path, names: set[str],
                 pool: int, pool_needed: int, pool_mb: int) -> dict:
    """``fleets`` and its checks; the top-level fields from the largest fleet's
    ``affinity`` (baseline) and ``ace`` (prefetch) arms when both ran."""
    data = yaml.safe_load(catalog.read_text())
    adapters = [a for a in data["adapters"] if a["name"] in names]
    common = {
        "trace": str(args.trace), "sessions": len(sessions(requests)), "speed": args.speed, "slots": args.slots, "scenario": args.scenario, "warm_from": str(args.warm_from) if args.warm_from else None,
        "fleets": results, "checks": fleet_checks(results, args.scenario),
        "fleet_hosts": top, "pool_adapters": pool, "pool_mb": pool_mb, "pool_bytes": pool_mb << 20,
        "pool_bytes_needed": pool_needed, "adapters": len(names), "agent_cold_args": list(COLD_AGENT_ARGS),
        "agent_extra_args": args.agent_args,
        "cpus": ({"request_path": sorted(args.cpus[0]), "hosts": sorted(args.cpus[1])} if args.cpus else None),
        "replay": "open-loop" if args.open_loop else "closed-loop sessions (think_s)",
        "replays": args.replays,
        "arms": {arm: {"routing_policy": policy, "dynamic_lora_prefetch": "prod" if on else "off"}
                 for arm, (policy, on) in {**ARMS, **FRONT_ARMS}.items()},
        "adapter_sizes": {a["name"]: a["size_bytes"] for a in adapters},
    }
    arms = results.get(str(top), {})
    if "affinity" not in arms or "ace" not in arms:
        return common
    base_rows, pre_rows = (ok_rows([r for r in all_rows[(top, arm)] if r.get("replay", 1) == 1])
                           for arm in ("affinity", "ace"))
    cold = [r["wait_ms"] for r in base_rows if r["tier"] in ("remote", "disk")]
    warm = [r["wait_ms"] for r in base_rows + pre_rows if r["tier"] == "host"]
    warm_source = "host->pool swaps"
    if not warm:
        warm = [r["wait_ms"] for r in pre_rows if r["action"] == "adapter_prefetched_applied"]
        warm_source = "requests on prefetched adapters"
    model_bytes = sum(p.stat().st_size for p in (catalog.parent / "model").glob("*.safetensors"))
    ace, aff = arms["ace"], arms["affinity"]
    return build_report(
        base_rows, pre_rows, cold_swap_samples_ms=cold, warm_swap_samples_ms=warm,
        base_bytes=model_bytes, pool_bytes=pool_mb << 20, adapter_bytes=[a["size_bytes"] for a in adapters],
        gateway_overhead_ms=ace.get("gateway_overhead_ms"),
        extra={
            **common,
            "errors": {"baseline": aff["errors"], "prefetch": ace["errors"]},
            "warm_swap_source": warm_source, "cold_swaps": len(cold), "warm_swaps": len(warm),
            "rows_by_tier": {"baseline": aff["rows_by_tier"], "prefetch": ace["rows_by_tier"]},
            "loads_by_tier": {"baseline": aff["loads_by_tier"], "prefetch": ace["loads_by_tier"]},
            "store_fetches": {"baseline": aff["store_fetches"], "prefetch": ace["store_fetches"]},
            "model_shape": json.loads((catalog.parent / "model" / "config.json").read_text()),
            "speculation_driver": "gateway: extproc.fleet.speculation.GatewaySpeculation (counters from its log)",
            "replay_s": {"baseline": aff["replay_s"], "prefetch": ace["replay_s"]},
            "speculation": ace.get("speculation"),
        },
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multi_lora_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "data/multi_lora_eval/multi_lora_eval_800.json"),
                    help="trace file (JSON or JSON Lines, docs/trace-format.md)")
    ap.add_argument("--out", default="reports/multi_lora_eval.json", help="JSON report; the TTFT plot goes next to it")
    ap.add_argument("--fixtures", default=".fixtures", help="fixtures directory (python -m gpu_agent.fixtures)")
    ap.add_argument("--hosts", default="1,2,4", help="fleet sizes to run, comma-separated (make bench HOSTS=)")
    ap.add_argument("--arms", default=",".join(ARMS),
                    help=f"arms to run on each fleet, comma-separated, of {', '.join(ARMS)} (make bench ARMS=)")
    ap.add_argument("--warm-from", default=None,
                    help="a trace of another day: the ace arm's gateway starts with the state learned on it "
                         "(default: it starts cold and learns online; make bench WARM_FROM=)")
    ap.add_argument("--speed", default="auto",
                    help="replay speed-up of the trace's clock: a number, or auto (default): per fleet size, the "
                         "speed at which the busiest engine is busy about half the time (bench.pacing), at most 8")
    ap.add_argument("--scenario", choices=("800", "hundreds", "sixteen"), default="800",
                    help="whose targets the 4-host checks hold the ace arm to (make bench SCENARIO=)")
    ap.add_argument("--slots", type=int, default=None,
                    help="adapter slots of each host's pool (default: half of the trace's adapters; make bench SLOTS=)")
    ap.add_argument("--open-loop", action="store_true",
                    help="send every request at its own t (default: sessions closed-loop, think_s after each answer)")
    ap.add_argument("--agent-args", type=shlex.split, default=[],
                    help="extra arguments for every agent, e.g. '--prefetch-waste-share 0.5' (make bench AGENT_ARGS=)")
    ap.add_argument("--replays", type=int, default=1,
                    help="replays of the trace for affinity and ace each, in palindromic order; the checks compare "
                         "their pooled percentiles (default 1; make bench REPLAYS=)")
    ap.add_argument("--cpu-split", choices=("on", "off"), default="on",
                    help="on (default): the load generator, store, Envoy and ext_proc on the lowest quarter of "
                         "the cores (at least one), the engine hosts on the rest, as separate machines would be "
                         "(bench.cores); off: every process on every core (make bench CPU_SPLIT=)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs) after the run")
    args = ap.parse_args(argv)
    have = cores.available()
    args.cpus = cores.split(have) if args.cpu_split == "on" and have is not None else None
    return run(args)


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
