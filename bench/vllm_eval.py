"""``make bench ENGINE=vllm``: the trace replayed through real vLLM hosts, arm by arm.

    python -m bench.vllm_eval [--trace FILE] [--requests 240] [--hosts 2] [--max-cpu-loras 4]
        [--arms round_robin,vllm_router,vllm_router_session,affinity,ace] --out reports/vllm_eval.json

Every host is one real vLLM (``tools.vllm_fleet``: ``--enable-lora --max-loras 2
--max-cpu-loras S --max-lora-rank R``, runtime updating on, filesystem resolver, ace's
evicting unload ``tools/vllm_evict``) and one agent with the vLLM connector
(``--vllm-unload-evicts``), whose device tier is vLLM's CPU cache (``S``). Envoy and
one ext_proc sit in front. The vLLM processes start once (a start-up takes minutes on
shared cores: docs/engine.md); each arm begins with every adapter unregistered, fresh
agents, ext_proc and Envoy, and replays the same trace closed-loop (``bench.multi_lora_eval``'s sessions and think times, ``--speed``), streamed,
each request with its session as ``x-ace-session-id`` and as the OpenAI ``user`` field.

Arms:

- ``round_robin``, ``affinity``, ``ace``: the gateway's policies, as ``make bench``
  (``bench.multi_lora_eval.ARMS``);
- ``vllm_router``: ``vllm-router`` (PyPI, its own venv, ``make`` installs it) in front of
  the same vLLM processes with its default policy (``cache_aware``);
  ``vllm_router_session``: ``--policy consistent_hash``, which keys on ``X-Session-ID``
  and the like, else on the body's ``user``: the session the client already sends. The
  client sends what it sends in every arm; nothing adapter-specific is added. The
  agents stay on the hosts and only watch: nothing signals them, and their budget is
  above the catalog, so they unload nothing (vLLM's own CPU LRU does what it does in a
  deployment with no agent; when they unloaded at ``S`` they raced requests nobody told
  them of, a 404 in 2026-12-04's committed run).
- a gateway arm's name + ``+keep`` (``ace+keep``, ``affinity+keep``): the same, with agents
  that keep evicted adapters registered and drop only their weights
  (``--vllm-keep-registered``); its ``registration_check`` is against the hosts' CPU
  caches (the plugin's listing), the agents' device tier in that mode.

Measured from the engines' side: per host, the requests vLLM served
(``vllm:request_success_total``), every read of an adapter into its CPU cache (ace's
measuring plugin, ``tools/vllm_measure``, one log line each: vLLM 0.32 logs
registrations but not the re-read of a registered adapter its CPU LRU had dropped), its
filesystem resolver's registrations ("Resolved and loaded LoRA adapter": a request that
found its adapter unregistered), the agents' loads into it ("Loaded new LoRA adapter")
and unloads, the evictions its cache took from the agent's ranking (ace's evicting
plugin, ``ranked_evictions``), and the vLLM process's CPU seconds over the replay (``engine_busy``: CPU
seconds / wall seconds / the threads each host was given). ``on_demand_loads`` = reads
- the agents' loads (what requests waited for: the resolver's registrations and the
re-reads, ``re_reads``); ``hits`` = served - on-demand loads. Per
request, for the gateway's arms: whether the adapter was registered on the host the
gateway chose when the request left, from the agents' ``WatchResidency`` streams, checked
against the hosts' ``/v1/models`` on every ``--sample-every``-th request
(``registration_check``). TTFT at the client, errors. What bounds each run: ``bounds``
(compulsory loads, Belady), ``miss_causes`` and ``prefetch_reference`` (what each
predictor, from none to each session's actual next step, is worth on the run's routing:
``bench.prefetch_reference``). vLLM's prefix cache is not reset
between arms (``arm_order`` says which ran first); the prompts are tens of tokens.

The machine's pace: ``bench.pace``'s probe runs through each replay (``pace_probe_ms``);
``targets.machine_pace`` compares the arms' runs with it (``bench.report.machine_pace``).
With ``--replays N`` the arms a target compares ace with (``REPLAYED``: the two vllm-router
arms, affinity and ace) run N times each in palindromic order (``bench.multi_lora_eval.
replay_order``: ``..., affinity, ace, ace, affinity, ...`` for 2), so a drift of the
shared cores' speed weighs on all alike; each such arm then carries ``replays`` (each
run's hits and TTFT) and ``pooled`` (over all of its runs), and the targets compare the
pooled figures (``targets.compared``). ``targets.ttft_paired`` compares ace's TTFT with affinity's request
by request (``bench.report.paired_ttft``), beside each arm's drift between its own runs;
``process_cpu_s`` gives each run's CPU seconds by process (``bench.proc_cpu``).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import yaml

from bench import proc_cpu
from bench.bounds import belady_hits, miss_causes
from bench.multi_lora_eval import ARMS as GATEWAY_ARMS, STALL_S, guarded, plot_ttft, replay_order, sessions, \
    speculation_counters, think_s
from bench.multi_lora_eval import state_yaml as bench_state_yaml
from bench.pace import pace_probe, read_probe
from bench.prefetch_reference import prefetch_reference
from bench.report import compared as report_compared, machine_pace, pace_readings, paired_ttft, percentiles
from bench.scenario_fixtures import trace_catalog
from bench.trace import load_trace
from bench.vllm_router import ROUTER_ARMS, vllm_router
from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from tools.vllm_evict.ace_vllm_evict import CACHE_PATH, RANKED_MARK, READ_MARK, REGISTERED as EVICT_REGISTERED
from tools.vllm_fleet import BASE_MODEL, RESOLVED_MARK, VLLM_PLUGINS, VLLMFlags, cpu_seconds, vllm_fleet, vllm_hosts
from tools.vllm_measure.ace_vllm_measure import MARK as CPU_CACHE_READ_MARK, REGISTERED as MEASURE_REGISTERED
from tools.localstack import run_until_stopped

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-agent-token"
ARMS = ("round_robin", "vllm_router", "vllm_router_session", "affinity", "ace")
#: a gateway arm's name + this: its agents keep evicted adapters registered in vLLM and drop
#: only their weights (``--vllm-keep-registered``), e.g. ``ace+keep``
KEEP = "+keep"
#: the arms ``--replays`` repeats: those a target compares ace with (round_robin is only shown)
REPLAYED = ("vllm_router", "vllm_router_session", "affinity", "ace", "affinity" + KEEP, "ace" + KEEP)
AGENT_LOADED_MARK = "Loaded new LoRA adapter"
REMOVED_MARK = "Removed LoRA adapter"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def first_requests(requests: list[dict], n: int) -> list[dict]:
    """Whole sessions, in order of their first step, until ``n`` requests."""
    out: list[dict] = []
    for steps in sessions(requests):
        if len(out) >= n:
            break
        out.extend(steps)
    return sorted(out, key=lambda r: r["t"])


def error_statuses(rows: list[dict]) -> dict[str, int]:
    """The failed requests by what failed them: the HTTP status, or ``transport`` when no
    answer came (``error`` in the row)."""
    failed = Counter("transport" if "error" in r else str(r.get("status"))
                     for r in rows if "error" in r or r.get("status") != 200)
    return dict(sorted(failed.items()))


def state_yaml(path: Path, catalog: Path, tenants: list[str], hosts: list[dict], prefetch: bool) -> dict:
    """``make bench``'s gateway state (``bench.multi_lora_eval.state_yaml``) with vLLM upstreams."""
    keys = bench_state_yaml(path, catalog, tenants, hosts, prefetch)
    state = yaml.safe_load(path.read_text())
    for upstream in state["upstreams"]:
        upstream["flavour"] = "vllm"
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return keys


def host_args(p: argparse.ArgumentParser, out: str) -> None:
    """The options every real-vLLM bench takes: fleet size, the vLLM venv, fixtures, report."""
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--fixtures", type=Path, default=ROOT / ".fixtures")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / out)


class ResidencyViews:
    """Each host's device-resident adapters, as its agent's ``WatchResidency`` stream says."""

    def __init__(self, hosts: list[dict]) -> None:
        self.hosts = hosts
        self.device: dict[str, set[str]] = {h["name"]: set() for h in hosts}
        self._tasks: list[asyncio.Task] = []

    async def _watch(self, host: dict) -> None:
        view = self.device[host["name"]]
        async with grpc.aio.insecure_channel(host["agent"]) as ch:
            stream = pb_grpc.AgentStub(ch).WatchResidency(
                pb.WatchRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
            async for ev in stream:
                if ev.kind == pb.ResidencyEvent.LOAD or not ev.HasField("status"):
                    continue
                if ev.status.tier == pb.TIER_DEVICE and ev.engine_up:
                    view.add(ev.status.adapter)
                else:
                    view.discard(ev.status.adapter)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(h)) for h in self.hosts]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def listed(client: httpx.AsyncClient, host: dict, cached: bool = False) -> set[str]:
    """What the host's vLLM has registered (``/v1/models``), or ``cached``: the registered
    names whose weights its CPU cache holds (ace's evicting plugin's ``CACHE_PATH``)."""
    if cached:
        return set((await client.get(host["engine_url"] + CACHE_PATH)).json()["cached"])
    data = (await client.get(host["engine_url"] + "/v1/models")).json()["data"]
    return {m["id"] for m in data if m.get("parent")}


async def one_request(client: httpx.AsyncClient, base: str, key: str, r: dict, seq: int = 0) -> dict:
    session = f"{r['tenant']}/{r['session']}"
    body = {"model": r["adapter"], "messages": r["messages"], "max_tokens": int(r.get("max_tokens", 16)),
            "temperature": 0, "stream": True, "user": session}
    headers = {"authorization": f"Bearer {key}", "x-ace-session-id": session}
    t0 = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", base + "/v1/chat/completions", json=body, headers=headers) as resp:
            async for chunk in resp.aiter_bytes():
                if ttft is None and chunk.strip():
                    ttft = (time.perf_counter() - t0) * 1000
            status, h = resp.status_code, resp.headers
    except httpx.HTTPError as exc:
        return {"id": r.get("id"), "adapter": r["adapter"], "seq": seq, "error": repr(exc)}
    trace = dict(kv.split("=", 1) for kv in h.get("x-ace-trace-multi-lora", "").split(",") if "=" in kv)
    return {"id": r.get("id"), "adapter": r["adapter"], "seq": seq, "session": session, "step": r.get("step"),
            "status": status, "ttft_ms": ttft, "total_ms": (time.perf_counter() - t0) * 1000,
            "host": trace.get("upstream"), "action": trace.get("action"), "residency": trace.get("residency")}


async def replay(requests: list[dict], base: str, keys: dict, hosts: list[dict], speed: float,
                 sample_every: int, cached: bool = False) -> tuple[list[dict], dict]:
    """Closed-loop sessions; each row also holds what each agent's view said when it left,
    checked against the hosts' registrations (``cached``: their CPU caches, where the
    agents keep names registered and the device tier is the cache)."""
    views = ResidencyViews(hosts)
    views.start()
    rows: list[dict] = []
    check = {"sampled": 0, "agree": 0, "disagree": []}
    t_start, t0 = time.perf_counter(), requests[0]["t"]
    counter = [0]
    inflight: dict[int, float] = {}   # seq -> its send: a request unanswered for STALL_S stops the run
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
        await asyncio.sleep(0.5)  # the streams' INITIAL events

        async def send(r: dict) -> None:
            counter[0] += 1
            seq = counter[0]
            seen = {n: set(v) for n, v in views.device.items()}
            if sample_every and counter[0] % sample_every == 0:
                truth = dict(zip(views.device, await asyncio.gather(*(listed(client, h, cached) for h in hosts))))
                for n in truth:
                    check["sampled"] += 1
                    if truth[n] == views.device[n]:
                        check["agree"] += 1
                    elif len(check["disagree"]) < 10:
                        check["disagree"].append({"host": n, "agent": sorted(views.device[n]), "vllm": sorted(truth[n])})
            inflight[seq] = time.perf_counter()
            try:
                row = await one_request(client, base, keys[r["tenant"]], r, seq)
            finally:
                del inflight[seq]
            if row.get("host") in seen:
                row["registered"] = r["adapter"] in seen[row["host"]]
            rows.append(row)
            if len(rows) % 50 == 0:
                log(f"  {len(rows)}/{len(requests)} requests ({time.perf_counter() - t_start:.0f}s)")

        async def session(steps: list[dict]) -> None:
            delay = (steps[0]["t"] - t0) / speed - (time.perf_counter() - t_start)
            if delay > 0:
                await asyncio.sleep(delay)
            for i, r in enumerate(steps):
                if i:
                    await asyncio.sleep(think_s(steps[i - 1], r) / speed)
                await send(r)

        try:
            await guarded(asyncio.gather(*(session(steps) for steps in sessions(requests))), inflight, STALL_S,
                          "vLLM replay")
        finally:
            await views.stop()
    return rows, check


def served(text: str) -> int:
    return round(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)))


def engine_counts(host: dict) -> dict:
    v = host["vllm"]
    text = v.log.read_text(errors="replace")
    return {"served": served(httpx.get(v.url + "/metrics", timeout=10).text),
            "cpu_cache_reads": text.count(CPU_CACHE_READ_MARK), "resolver_loads": text.count(RESOLVED_MARK),
            "agent_loads": text.count(AGENT_LOADED_MARK) + text.count(READ_MARK),
            "unloads": text.count(REMOVED_MARK),
            "ranked_evictions": text.count(RANKED_MARK), "cpu_s": cpu_seconds(v.proc.pid)}


def add_waited_loads(h: dict, what: str) -> None:
    """Adds to one host's ``engine_counts`` difference what requests waited for: every read
    into the CPU cache but the agents' (each of theirs is one registration), that is the
    resolver's registrations and the re-reads of registered adapters vLLM's CPU LRU had
    dropped (``on_demand_loads``, of which ``re_reads``)."""
    h["on_demand_loads"] = round(h["cpu_cache_reads"] - h["agent_loads"])
    h["re_reads"] = h["on_demand_loads"] - round(h["resolver_loads"])
    if h["re_reads"] < 0:
        raise RuntimeError(f"{what}: fewer reads into vLLM's CPU cache than registrations ({h}): "
                           "is ace's measuring plugin loaded (tools/vllm_measure)?")


def agent_counters(host: dict) -> dict:
    """The agent's prefetch outcomes and evictions (its /metrics), summed over labels but the
    outcome / reason."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(host["metrics"], timeout=10).text
    except httpx.HTTPError:
        return out
    for m in re.finditer(r'^(ace_agent_prefetch_total|ace_agent_evictions_total|ace_agent_prefetch_victims_skipped_total)'
                         r'\{([^}]*)\} (\S+)$', text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        key = m.group(1).removeprefix("ace_agent_").removesuffix("_total") + ":" + (
            labels.get("outcome") or labels.get("reason") or "")
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def belady_misses(sequence: list[str], capacity: int) -> int:
    """Belady's MIN over ``sequence`` with ``capacity`` entries: the fewest loads any
    eviction policy could make for it (each first use is one), with no prefetch."""
    return len(sequence) - belady_hits(sequence, capacity)


def bounds(rows: list[dict], capacity: int, hosts: int) -> dict:
    """What the caches allow on this arm's requests, in the order they were sent: the
    compulsory first loads (fleet: each adapter once; this arm's routing: each (host,
    adapter) once), Belady's MIN per host over the requests this arm sent it (the fewest
    loads of any eviction for that routing, no prefetch) and over one cache of ``hosts`` x
    ``capacity`` (any routing: the catalog against the fleet's caches)."""
    ok = sorted((r for r in rows if "error" not in r and r.get("status") == 200), key=lambda r: r["seq"])
    per_host: dict[str, list[str]] = {}
    for r in ok:
        per_host.setdefault(r.get("host") or "?", []).append(r["adapter"])
    seq = [r["adapter"] for r in ok]
    out = {"requests": len(ok), "compulsory_fleet": len(set(seq)),
           "belady_fleet_cache": belady_misses(seq, capacity * hosts)}
    if "?" not in per_host:
        out["compulsory_this_routing"] = sum(len(set(v)) for v in per_host.values())
        out["belady_this_routing"] = sum(belady_misses(v, capacity) for v in per_host.values())
    return out


def _viewed_rows(rows: list[dict], requests: list[dict]) -> tuple[list[tuple[dict, dict]], dict]:
    """One run's answered requests that the agents' views placed (a host, and whether the
    adapter was registered there when it left), each with its trace request; and the
    trace's ``workflow`` labels by request id. None placed in the vllm-router arms."""
    by_id = {r.get("id"): r for r in requests}
    placed = [(r, by_id[r["id"]]) for r in rows if "error" not in r and r.get("status") == 200 and r.get("host")
              and "registered" in r and r.get("id") in by_id]
    return placed, {i: q.get("workflow", "") for i, q in by_id.items()}


def vllm_miss_causes(rows: list[dict], requests: list[dict], capacity: int) -> dict | None:
    """``bench.bounds.miss_causes`` over one run's rows (``builtin``'s causes, Belady per host
    at vLLM's ``capacity``): a hit is a request whose adapter was registered on its host when
    it left (the agents' views), sent in ``seq`` order; the trace's ``tenant`` and
    ``workflow`` labels tell a tenant's first use, one-offs and strays. None without the
    views (the vllm-router arms)."""
    placed, labels = _viewed_rows(rows, requests)
    if not placed:
        return None
    return miss_causes([{"id": r["id"], "host": r["host"], "adapter": r["adapter"], "tenant": q["tenant"],
                         "session": r["session"], "step": r.get("step"), "sent_s": r["seq"], "hit": r["registered"]}
                        for r, q in placed], capacity, labels=labels)


def vllm_prefetch_reference(rows: list[dict], requests: list[dict], capacity: int) -> dict | None:
    """``bench.prefetch_reference`` over one run's rows (its hosts, in ``seq`` order, on the
    trace's clock, with its ``workflow`` labels) at vLLM's ``capacity``: what each predictor
    is worth on this arm's routing. None without the views (the vllm-router arms)."""
    placed, labels = _viewed_rows(rows, requests)
    if not placed:
        return None
    return prefetch_reference([{"id": r["id"], "host": r["host"], "adapter": r["adapter"], "session": r["session"],
                                "sent_s": r["seq"], "at_s": q["t"]} for r, q in placed], capacity, labels=labels)


def run_arm(args, arm: str, requests: list[dict], catalog: Path, fixtures: Path, work: Path,
            engines: list, replay_no: int = 1) -> tuple[dict, list]:
    tenants = sorted({r["tenant"] for r in requests})
    keep = arm.endswith(KEEP)
    policy, prefetch = GATEWAY_ARMS.get(arm.removesuffix(KEEP), ("extproc.policy.routing:route", False))
    flags = VLLMFlags(args.max_loras, args.max_cpu_loras, args.max_lora_rank)
    run_dir = work / (arm if replay_no == 1 else f"{arm}#{replay_no}")
    run_dir.mkdir(parents=True)
    t_run = time.monotonic()
    for e in engines:  # every arm starts with nothing registered
        e.unload_all()

    def write_state(path: Path, fleet: list[dict]) -> dict:
        return state_yaml(path, catalog, tenants, fleet, prefetch)

    if arm in ROUTER_ARMS:
        # the agents only watch: a budget of the whole catalog, so they never unload (vLLM's
        # own CPU LRU drops what it drops, as in a deployment with no agent; the plugin counts
        # the re-reads). Unloading at S raced requests nobody told them of (a 404).
        flags = VLLMFlags(args.max_loras, len({r["adapter"] for r in requests}), args.max_lora_rank)
    with vllm_fleet(run_dir, catalog, fixtures / "model", fixtures / "adapters", args.vllm_python, args.hosts,
                    flags, write_state, token=TOKEN,
                    agent_args=["--reconcile-interval-s", "0.2", *(["--vllm-keep-registered"] if keep else [])],
                    extproc_args=["--routing-policy", policy], engines=engines) as st:
        log(f"{arm}: agents and gateway up in {time.monotonic() - t_run:.0f}s")
        with contextlib.ExitStack() as front:
            base = st["gateway"]
            if arm in ROUTER_ARMS:
                base = front.enter_context(vllm_router([h["engine_url"] for h in st["hosts"]], ROUTER_ARMS[arm],
                                                        run_dir, Path(args.router_bin)))
            before = {h["name"]: engine_counts(h) for h in st["hosts"]}
            agents_before = {h["name"]: agent_counters(h) for h in st["hosts"]}
            load_avg = os.getloadavg()[0]
            cpu_before = proc_cpu.snapshot()
            t0 = time.monotonic()
            with pace_probe(run_dir / "pace.txt"):
                rows, check = asyncio.run(replay(requests, base, st["state"], st["hosts"], args.speed,
                                                 args.sample_every, cached=keep))
            elapsed = time.monotonic() - t0
            cpu = proc_cpu.account(cpu_before, proc_cpu.snapshot())
            after = {h["name"]: engine_counts(h) for h in st["hosts"]}
            agents = {}
            for h in st["hosts"]:
                now, was = agent_counters(h), agents_before[h["name"]]
                for k, v in now.items():
                    if v - was.get(k, 0.0):
                        agents[k] = agents.get(k, 0.0) + v - was.get(k, 0.0)
    threads = max(1, (os.cpu_count() or 1) // args.hosts)
    per_host = {n: {k: round(after[n][k] - before[n][k], 2) for k in after[n]} for n in after}
    ok = [r for r in rows if "error" not in r and r["status"] == 200]
    served_n = sum(h["served"] for h in per_host.values())
    for h in per_host.values():
        add_waited_loads(h, arm)
    cold = sum(h["on_demand_loads"] for h in per_host.values())
    registered = [r["registered"] for r in ok if "registered" in r]
    entry = {
        "total": len(rows), "errors": len(rows) - len(ok), "error_statuses": error_statuses(rows),
        "served": served_n,
        "hits": served_n - cold, "hit_ratio": (served_n - cold) / served_n if served_n else None,
        "on_demand_loads": cold, "resolver_loads": sum(h["resolver_loads"] for h in per_host.values()),
        "re_reads": sum(h["re_reads"] for h in per_host.values()),
        "agent_loads": sum(h["agent_loads"] for h in per_host.values()),
        "unloads": sum(h["unloads"] for h in per_host.values()),
        "ranked_evictions": sum(h["ranked_evictions"] for h in per_host.values()),
        "registered_at_arrival": ({"requests": len(registered), "registered": sum(registered)} if registered else None),
        "registration_check": {**check, "against": "vLLM's CPU cache" if keep else "vLLM's /v1/models"},
        "agents_keep_registered": keep,
        "agents": {k: round(v) for k, v in sorted(agents.items())},
        "speculation": None if arm in ROUTER_ARMS else speculation_counters(run_dir / "extproc.log"),
        "bounds": bounds(rows, args.max_cpu_loras, args.hosts),
        "miss_causes": vllm_miss_causes(rows, requests, args.max_cpu_loras),
        "prefetch_reference": vllm_prefetch_reference(rows, requests, args.max_cpu_loras),
        "ttft_ms_by_registration": ({
            "registered": percentiles(r["ttft_ms"] for r in ok if r.get("registered") and r["ttft_ms"] is not None),
            "not_registered": percentiles(r["ttft_ms"] for r in ok
                                          if r.get("registered") is False and r["ttft_ms"] is not None)}
            if registered else None),
        "ttft_ms": percentiles(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None),
        "engine_busy": {n: round(h["cpu_s"] / elapsed / threads, 3) for n, h in per_host.items()},
        "per_host": per_host, "replay_s": round(elapsed, 1),
        "process_cpu_s": cpu,
        "pace_probe_ms": read_probe(run_dir / "pace.txt"),
        "machine_load_avg_1m": [round(load_avg, 1), round(os.getloadavg()[0], 1)],
    }
    if arm in ROUTER_ARMS:
        entry["router_policy"] = ROUTER_ARMS[arm]
    log(f"{arm}#{replay_no}: done in {time.monotonic() - t_run:.0f}s: hits {entry['hits']}/{served_n}, "
        f"on-demand {cold}, errors {entry['errors']}, ttft p50/p99 {entry['ttft_ms']['p50']}/{entry['ttft_ms']['p99']}")
    return entry, rows


def pooled_entry(done: list[tuple[dict, list]]) -> dict:
    """``replays`` (each run's hits, on-demand loads, errors, TTFT percentiles and CPU
    seconds by process, ``process_cpu_s``) and
    ``pooled`` (hits and on-demand loads summed, the hit ratio over all runs, TTFT
    percentiles over every run's rows, errors summed, each run's ``pace_probe_ms``) of one
    arm run ``len(done)`` times."""
    entries = [e for e, _ in done]
    ok = [r for _, rows in done for r in rows if "error" not in r and r["status"] == 200]
    served_n = sum(e["served"] for e in entries)
    hits = sum(e["hits"] for e in entries)
    return {
        "replays": [{k: e[k] for k in ("hits", "served", "on_demand_loads", "errors", "ttft_ms", "process_cpu_s")
                     if k in e} for e in entries],
        "pooled": {"replays": len(done), "served": served_n, "hits": hits,
                   "hit_ratio": hits / served_n if served_n else None,
                   "on_demand_loads": sum(e["on_demand_loads"] for e in entries),
                   "errors": sum(e["errors"] for e in entries),
                   "pace_probe_ms": [(e.get("pace_probe_ms") or {}).get("cpu_ms_p50") for e in entries],
                   "ttft_ms": percentiles(r["ttft_ms"] for r in ok if r["ttft_ms"] is not None)},
    }


def compared(entry: dict) -> dict:
    """What the targets read of one arm: ``bench.report.compared`` (errors and TTFT over
    every run where it was replayed), and its hits and on-demand loads over every run too
    (a mean per run): on vLLM they vary from run to run with how the engine's steps and the
    agents' calls interleave."""
    pooled = entry.get("pooled")
    if not pooled:
        return entry
    return {**report_compared(entry), "hit_ratio": pooled["hit_ratio"],
            "on_demand_loads": pooled["on_demand_loads"] / pooled["replays"]}


def targets(entries: dict, rows: dict | None = None) -> dict:
    """Issue 20's targets on vLLM, where the arms they name ran (each as ``compared``
    gives it), beside the machine's pace in each arm's runs and, from ``rows`` (arm ->
    its rows, every run's), ``ttft_paired``: ace's TTFT against affinity's request by
    request (``bench.report.paired_ttft``; resident: registered on its host when it left),
    with each arm's drift between its own runs."""
    arms = {arm: compared(e) for arm, e in entries.items()}
    out: dict = {"no_errors": all(a["errors"] == 0 for a in arms.values())}
    ace, aff = arms.get("ace"), arms.get("affinity")
    routers = [arms[a] for a in ROUTER_ARMS if a in arms]
    if ace and aff:
        both = entries["ace"].get("pooled") and entries["affinity"].get("pooled")
        out["compared"] = f"pooled over {both['replays']} runs each, palindromic order" if both else "one run each"
        # over the arms whose runs the probe timed (every arm's, since it came)
        pace = machine_pace({a: e for a, e in entries.items() if pace_readings(e, "pace_probe_ms")})
        if pace is not None:
            out["machine_pace"] = pace
        if rows:
            out["ttft_paired"] = paired_ttft([{**r, "arm": arm} for arm in ("ace", "affinity")
                                              for r in rows.get(arm, ())],
                                             "ace", "affinity", resident=lambda r: r.get("registered") is True)
        out["hits_over_affinity"] = {"want": 0.10, "got": ace["hit_ratio"] - aff["hit_ratio"],
                                     "met": ace["hit_ratio"] - aff["hit_ratio"] >= 0.10}
        out["on_demand_loads_half_of_affinity"] = {"want": aff["on_demand_loads"] / 2, "got": ace["on_demand_loads"],
                                                   "met": ace["on_demand_loads"] <= aff["on_demand_loads"] / 2}
        out["ttft_no_worse_than_affinity"] = {
            q: ace["ttft_ms"][q] is not None and ace["ttft_ms"][q] <= 1.05 * aff["ttft_ms"][q] + 1.0
            for q in ("p50", "p90", "p99")}
    if ace and routers:
        best = max(r["hit_ratio"] for r in routers)
        out["hits_over_best_vllm_router"] = {"want": 0.30, "got": ace["hit_ratio"] - best,
                                             "met": ace["hit_ratio"] - best >= 0.30}
        out["ttft_p99_below_every_vllm_router"] = all(ace["ttft_ms"]["p99"] < r["ttft_ms"]["p99"] for r in routers)
    return out


def table(report: dict) -> str:
    """The README's table: one row per arm of the report's fleet."""
    (hosts, arms), = report["fleets"].items()
    lines = [f"| arm ({hosts} hosts, {report['requests']} requests, {report['adapters']} adapters) | hits | "
             "vLLM on-demand loads | agent loads | TTFT p50 / p90 / p99 (ms) | errors | engine_busy |",
             "|---|---|---|---|---|---|---|"]
    for arm, e in arms.items():
        t = e["ttft_ms"]
        ttft = " / ".join("-" if t[q] is None else f"{t[q]:.0f}" for q in ("p50", "p90", "p99"))
        busy = ", ".join(f"{v:.2f}" for v in e["engine_busy"].values())
        lines.append(f"| {arm} | {e['hits']}/{e['served']} | {e['on_demand_loads']} | {e['agent_loads']} | {ttft} | "
                     f"{e['errors']} | {busy} |")
    return "\n".join(lines)


def plot(rows_path: Path, out: Path, title: str) -> None:
    """TTFT CDF per arm from the rows file (``make bench``'s plot)."""
    by_arm: dict[str, list[float]] = {}
    for line in rows_path.read_text().splitlines():
        r = json.loads(line)
        if r.get("ttft_ms") is not None:
            by_arm.setdefault(r["arm"], []).append(r["ttft_ms"])
    plot_ttft(by_arm, out, title)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=ROOT / "data" / "multi_lora_eval" / "vllm_hosts.json",
                   help="default: generate.py --scenario vllm (about 24 adapters, 240 requests)")
    p.add_argument("--requests", type=int, default=240, help="whole sessions from the start until this many requests")
    host_args(p, "vllm_eval.json")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--max-loras", type=int, default=2)
    p.add_argument("--max-cpu-loras", type=int, default=4, help="S: vLLM's CPU cache, the agent's device tier")
    p.add_argument("--max-lora-rank", type=int, default=0, help="0: the trace's largest rank")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--sample-every", type=int, default=5)
    p.add_argument("--replays", type=int, default=1,
                   help="runs of each arm a target compares (the vllm-router arms, affinity and ace), in "
                        "palindromic order; the targets compare them pooled")
    p.add_argument("--router-bin", default=str(ROOT / ".venv-router" / "bin" / "vllm-router"))
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted({a for a in arms if a.removesuffix(KEEP) not in ARMS
                      or (a.endswith(KEEP) and a.removesuffix(KEEP) in ROUTER_ARMS)})
    if unknown:
        p.error(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(ARMS)} (a gateway arm + {KEEP!r}: "
                "its agents keep names registered)")
    if args.replays < 1:
        p.error("--replays must be at least 1")
    requests = first_requests(load_trace(args.trace), args.requests)
    args.max_lora_rank = args.max_lora_rank or max(int(r["rank"]) for r in requests)
    work = ROOT / "var" / "vllm_eval" / time.strftime("%Y%m%d-%H%M%S")
    catalog = trace_catalog(requests, args.fixtures, ROOT / "var" / "bench-fixtures", log).resolve()
    fixtures = catalog.parent
    adapters = sorted({r["adapter"] for r in requests})
    log(f"{len(requests)} requests, {len(adapters)} adapters, {args.hosts} hosts, S={args.max_cpu_loras}, "
        f"R={args.max_lora_rank}, arms {arms}")
    results, all_rows = {}, {}
    flags = VLLMFlags(args.max_loras, args.max_cpu_loras, args.max_lora_rank)
    with vllm_hosts(args.vllm_python, fixtures / "model", fixtures / "adapters", work, args.hosts, flags) as engines:
        startup = [round(e.startup_s, 1) for e in engines]
        log(f"vLLM hosts ready after {startup} s")
        unmeasured = [e.name for e in engines if MEASURE_REGISTERED not in e.log.read_text(errors="replace")]
        if unmeasured:
            raise SystemExit(f"vLLM {', '.join(unmeasured)} runs without ace's measuring plugin, so the re-reads "
                             f"of adapters its CPU cache dropped go uncounted: `make bench ENGINE=vllm` installs "
                             f"it (tools/vllm_measure) into {args.vllm_python}'s venv")
        unevicting = [e.name for e in engines if EVICT_REGISTERED not in e.log.read_text(errors="replace")]
        if unevicting:
            raise SystemExit(f"vLLM {', '.join(unevicting)} runs without ace's evicting plugin, so the agents' "
                             f"unloads would leave the weights in its CPU cache: `make bench ENGINE=vllm` "
                             f"installs it (tools/vllm_evict) into {args.vllm_python}'s venv")
        runs = replay_order([args.hosts], arms, args.replays, compared=REPLAYED)
        done: dict[str, list[tuple[dict, list]]] = {}
        for _, arm, k in runs:
            done.setdefault(arm, []).append(run_arm(args, arm, requests, catalog, fixtures, work, engines, k))
        for arm, got in done.items():
            results[arm] = {**got[0][0], **(pooled_entry(got) if len(got) > 1 else {})}
            all_rows[arm] = [{**r, "replay": k} for k, (_, rows) in enumerate(got, 1) for r in rows]
    report = {"engine": "vllm", "trace": str(args.trace.relative_to(ROOT) if args.trace.is_relative_to(ROOT) else args.trace),
              "requests": len(requests), "adapters": len(adapters), "hosts": args.hosts, "speed": args.speed,
              "vllm_flags": VLLMFlags(args.max_loras, args.max_cpu_loras, args.max_lora_rank).args(),
              "vllm_plugins": list(VLLM_PLUGINS),
              "vllm_startup_s": startup,
              "arm_order": [arm if k == 1 else f"{arm}#{k}" for _, arm, k in runs], "cpus": os.cpu_count(),
              "fleets": {str(args.hosts): results}, "targets": targets(results, all_rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    with open(args.out.with_name(args.out.stem + "_rows.jsonl"), "w") as f:
        for arm, rows in all_rows.items():
            for r in rows:
                f.write(json.dumps({"arm": arm, **r}) + "\n")
    plot(args.out.with_name(args.out.stem + "_rows.jsonl"), args.out.with_name(args.out.stem + "_ttft.png"),
         f"real vLLM (CPU), {args.hosts} hosts, {len(requests)} requests, {len(adapters)} adapters, S={args.max_cpu_loras}")
    log(f"wrote {args.out}\n{table(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
