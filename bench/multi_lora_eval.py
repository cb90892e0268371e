"""``make bench``: replay a trace through the whole local stack, prefetch off then on.

    python -m bench.multi_lora_eval [--trace FILE] [--speed 4] [--open-loop] --out reports/multi_lora_eval.json

Per run, a fresh stack on loopback ports: an artifact store (HTTP server over the
adapters' files), the GPU agent with the builtin engine in-process, the ext_proc gateway
(``extproc.policy.routing:route``) and Envoy. Requests go with ``stream: true``; TTFT is
the time to the first streamed chunk, the stall is the engine's ``x-ace-adapter-wait-ms``
and the tier its ``x-ace-adapter-tier``.

The pool, as vLLM's ``--max-loras``: half of the trace's adapters as slots
(``--device-max-adapters``; report field ``pool_adapters``), each able to hold any
adapter: the pool's bytes are the sum of that many largest adapters' files (an upper
bound of their pages), rounded up to whole MiB (``--pool-mb``; report fields
``pool_bytes_needed``, ``pool_mb``, ``pool_bytes``). So the slots always fit, and the
count cap, not the bytes, decides what is evicted (the rounding's spare bytes could hold
a small extra adapter; the cap does not let it in). For the committed 800-request trace:
5 of 10 adapters, 2 x 919,616 + 2 x 460,848 + 231,464 B = 2.85 MiB -> 3 MiB.

Cold means cold: no warm shortcut below the pool. The engine keeps no parsed host copy
(``--engine-host-mb 0``) and the disk cache is resident-only (``--disk-budget-mb 0``: an
adapter's files are dropped when it leaves the pool), so every adapter that becomes
resident again goes the whole way: artifact store over loopback HTTP -> disk cache
(SHA-256 checked while streaming) -> parsed -> pool, and reports tier ``remote``. The
report counts, per run, the requests by tier (``rows_by_tier``), the engine's loads by
the tier they came from (``loads_by_tier``) and the artifact store's weight GETs
(``store_fetches``) to show it: no ``host`` loads, and a GET for every load. A load the
agent prefetched counts as ``disk`` in the engine: the agent fetched the files a moment
before (150-request check: baseline 57 loads, all ``remote``, 57 GETs; prefetch 56
``remote`` + 34 ``disk``, 92 GETs).

Sessions are replayed **closed-loop** (agents wait for an answer before the next step):
a session's first step is sent at its ``t`` / ``--speed``; each later step when the
previous response has ended plus its ``think_s`` / ``--speed`` (without ``think_s``: the
gap between the two steps' ``t``). ``--open-loop`` sends every request at its own ``t``
instead. Each request carries its session as ``x-ace-session-id`` and as the OpenAI
``user`` field (the one-message Envoy route forwards only the headers it lists, so the
gateway reads ``user`` there).

- **baseline**: skill ``dynamic_lora_prefetch=off``: the engine loads on demand; the
  gateway neither signals nor speculates.
- **prefetch**: ``dynamic_lora_prefetch=prod``: the gateway signals the agent at ingress
  and speculates (``extproc.speculation``: every request's session step feeds the
  gateway's Speculator, its prefetches go through the gateway's AgentLink). The
  gateway's counters come from its log (``speculation counters``) when it stops.

Warm set: the baseline run starts cold (no history). Its gateway counts the requests it
serves per adapter and the pool size it saw, and learns the sessions' transitions (its
prefetch is off, but ``off`` requests still teach the transition model), all in
``gw.popularity.json``, written when it stops; the prefetch run's gateway starts with
that file, as a restarted gateway starts with yesterday's history: at start-up it
prefetches the most requested adapters, up to the pool size it learned, and predicts
the workflows the baseline learned from the first session on (``--no-warm-set``: start
the prefetch run cold too, with neither). Both come from the same trace, so they are
"yesterday = today": aggregate counts (per adapter, and of which adapter followed which
in a session), no order of the sessions, no timing. The report (``bench.report``) is
printed and written with a TTFT plot; its ``warm_set_from`` is the whole file, the
transitions included.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import yaml

from bench.report import build_report, format_report, percentiles
from bench.trace import TraceError, load_trace
from gpu_agent.catalog_schema import read_catalog_file

BASE_MODEL = "ace-tiny-llama"
TOKEN = "bench-agent-token"
ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- fixtures and config

def bench_fixtures(requests: list[dict], fixtures: Path, work: Path) -> Path:
    """A catalog with every adapter the trace names, at its rank: the committed fixtures
    when they match, else freshly made ones (deterministic, public)."""
    from gpu_agent.fixtures import AdapterDef, make_fixtures

    wanted = {}
    for r in requests:
        wanted.setdefault(r["adapter"], (r["rank"], r["domain"]))
    catalog = fixtures / "catalog.yaml"
    if catalog.exists():
        have = {a.name: a.rank for a in read_catalog_file(catalog).adapters}
        if all(have.get(name) == rank for name, (rank, _) in wanted.items()):
            return catalog
    log(f"making fixture adapters for {len(wanted)} adapters under {work / 'fixtures'}")
    defs = [AdapterDef(name, rank, domain, "public") for name, (rank, domain) in wanted.items()]
    return make_fixtures(work / "fixtures", defs)


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


def pool_size(names: set[str], sizes: dict[str, int]) -> tuple[int, int, int]:
    """``(slots, bytes needed, MiB)`` of a pool with vLLM ``--max-loras`` semantics: half of
    the adapters (at least 1) as slots, room for the largest that many at once."""
    slots = max(1, len(names) // 2)
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


async def engine_loads(engine_url: str) -> dict[str, int]:
    """The engine's ``ace_engine_adapter_cold_loads_total`` by tier (its /metrics)."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(engine_url + "/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("ace_engine_adapter_cold_loads_total{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            out[tier] = int(float(line.rsplit(" ", 1)[1]))
    return out


def state_yaml(path: Path, catalog: Path, tenants: list[str], engine: str, agent: str, prefetch: bool) -> dict:
    mode = "prod" if prefetch else "off"
    keys = {t: f"sk-bench-{hashlib.sha256(t.encode()).hexdigest()[:16]}" for t in tenants}
    state = {
        "include": [str(catalog)],
        "tenants": [{"id": t, "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": mode}} for t in tenants],
        "keys": [{"name": f"bench-{t}", "sha256": hashlib.sha256(k.encode()).hexdigest(), "tenant": t, "skills": {}}
                 for t, k in keys.items()],
        "upstreams": [{"name": "engine-1", "address": engine, "flavour": "builtin", "base_model": BASE_MODEL,
                       "hints": "off", "agent": agent}],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": mode},
    }
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return keys


# ---------------------------------------------------------------- the stack

@contextlib.contextmanager
def stack(work: Path, catalog: Path, tenants: list[str], pool_adapters: int, pool_mb: int, prefetch: bool):
    """The local stack (``tools.localstack.gateway_stack``) with the pool capped and the
    residency-aware routing policy; yields its addresses and the tenants' keys."""
    from tools.localstack import gateway_stack

    def write_state(path: Path, engine: str, agent: str) -> dict:
        return state_yaml(path, catalog, tenants, engine, agent, prefetch)

    agent_args = ["--device-max-adapters", str(pool_adapters), "--pool-mb", str(pool_mb),
                  "--reconcile-interval-s", "0.2", *COLD_AGENT_ARGS]
    with gateway_stack(work, catalog, write_state, token=TOKEN, agent_args=agent_args,
                       extproc_args=["--routing-policy", "extproc.policy.routing:route"]) as st:
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


# ---------------------------------------------------------------- replay

async def one_request(client: httpx.AsyncClient, base: str, key: str, r: dict) -> dict:
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
            status = resp.status_code
            h = resp.headers
    except httpx.HTTPError as exc:
        return {"id": r.get("id"), "error": str(exc)}
    trace = dict(kv.split("=", 1) for kv in h.get("x-ace-trace-multi-lora", "").split(",") if "=" in kv)
    wait = h.get("x-ace-adapter-wait-ms")
    return {
        "id": r.get("id"), "tenant": r["tenant"], "session": r["session"], "step": r.get("step"),
        "adapter": r["adapter"],
        "domain": r["domain"], "status": status, "tier": h.get("x-ace-adapter-tier", "unknown"),
        "wait_ms": float(wait) if wait is not None else None, "ttft_ms": ttft,
        "total_ms": (time.perf_counter() - t0) * 1000, "action": trace.get("action"),
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


async def replay(requests: list[dict], st: dict, speed: float, closed_loop: bool = True) -> list[dict]:
    rows: list[dict] = []
    t_start = time.perf_counter()
    t0 = requests[0]["t"]
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    def done(row: dict) -> None:
        rows.append(row)
        if len(rows) % 100 == 0:
            log(f"  {len(rows)}/{len(requests)} requests ({time.perf_counter() - t_start:.0f}s)")

    async def at(t: float) -> None:
        delay = (t - t0) / speed - (time.perf_counter() - t_start)
        if delay > 0:
            await asyncio.sleep(delay)

    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        async def send(r: dict) -> None:
            await at(r["t"])
            done(await one_request(client, st["gateway"], st["keys"][r["tenant"]], r))

        async def session(steps: list[dict]) -> None:
            await at(steps[0]["t"])
            for i, r in enumerate(steps):
                if i:
                    await asyncio.sleep(think_s(steps[i - 1], r) / speed)
                done(await one_request(client, st["gateway"], st["keys"][r["tenant"]], r))

        if closed_loop:
            await asyncio.gather(*(session(steps) for steps in sessions(requests)))
        else:
            await asyncio.gather(*(send(r) for r in requests))
    return rows


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

        direct = await timed(st["engine"] + "/v1/chat/completions", {})
        via = await timed(st["gateway"] + "/v1/chat/completions", {"authorization": f"Bearer {key}"})
    return percentiles(via, (50,))["p50"] - percentiles(direct, (50,))["p50"]


def plot_ttft(runs: dict[str, list[float]], path: Path) -> None:
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
    ax.set_title("TTFT through Envoy + ext_proc + agent + builtin engine")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args) -> int:
    try:
        requests = load_trace(args.trace)
    except TraceError as exc:
        log(f"error: {exc}")
        return 2
    work = Path(tempfile.mkdtemp(prefix="ace-bench-"))
    try:
        catalog = bench_fixtures(requests, Path(args.fixtures), work)
        names = {r["adapter"] for r in requests}
        sizes_all = {a.name: a.size_bytes for a in read_catalog_file(catalog).adapters}
        pool, pool_needed, pool_mb = pool_size(names, sizes_all)
        tenants = sorted({r["tenant"] for r in requests})
        from tests.support.procs import free_port, python, running, wait_port

        store_port = free_port()
        root = catalog.parent
        cmd = [python(), "-m", "http.server", str(store_port), "--bind", "127.0.0.1", "--directory", str(root)]
        store_log = work / "store.log"
        with running(cmd, store_log) as store:
            wait_port(store_port, timeout=30, proc=store, log=store_log)
            results = {}
            overhead = None
            warm_set = None
            data = None
            for name, prefetch in (("baseline", False), ("prefetch", True)):
                run_dir = work / name
                run_dir.mkdir()
                warm_file = work / "baseline" / "gw.popularity.json"
                if prefetch and not args.no_warm_set and warm_file.exists():
                    shutil.copy(warm_file, run_dir / "gw.popularity.json")
                    warm_set = json.loads(warm_file.read_text())
                rcat = run_dir / "catalog.yaml"
                data = remote_catalog(catalog, f"http://127.0.0.1:{store_port}", rcat, names)
                log(f"{name}: {len(requests)} requests, pool {pool} of {len(names)} adapters / {pool_mb} MiB, "
                    f"speed x{args.speed}")
                t_run = time.monotonic()
                _, log_at = store_fetches(store_log)
                with stack(run_dir, rcat, tenants, pool, pool_mb, prefetch) as st:
                    async def go():
                        rows = await replay(requests, st, args.speed, closed_loop=not args.open_loop)
                        loads = await engine_loads(st["engine"])  # before the overhead probe's requests
                        ov = None
                        if prefetch:
                            t = requests[0]
                            ov = await gateway_overhead(st, t["adapter"], st["keys"][t["tenant"]])
                        return rows, loads, ov

                    rows, loads, ov = asyncio.run(go())
                    fetches, _ = store_fetches(store_log, log_at)
                    if ov is not None:
                        overhead = ov
                # the stack has stopped: the gateway logged its final counters
                extra = {"replay_s": round(time.monotonic() - t_run, 1), "loads_by_tier": loads,
                         "store_fetches": fetches}
                log(f"{name}: engine loads by tier {loads}, store weight GETs {fetches}")
                counters = speculation_counters(run_dir / "extproc.log")
                if prefetch:
                    extra["speculation"] = counters
                results[name] = (rows, extra)
        ok = {k: [r for r in rows if "error" not in r and r["status"] == 200 and r["wait_ms"] is not None]
              for k, (rows, _) in results.items()}
        errors = {k: len(rows) - len(ok[k]) for k, (rows, _) in results.items()}
        base_rows, pre_rows = ok["baseline"], ok["prefetch"]
        cold = [r["wait_ms"] for r in base_rows if r["tier"] in ("remote", "disk")]
        # warm: a swap that did not go the whole way: host memory -> pool, measured on both
        # runs; without any (the cold settings keep no host copy), the wait of requests
        # whose adapter a prefetch made resident
        warm = [r["wait_ms"] for r in base_rows + pre_rows if r["tier"] == "host"]
        warm_source = "host->pool swaps"
        if not warm:
            warm = [r["wait_ms"] for r in pre_rows if r["action"] == "adapter_prefetched_applied"]
            warm_source = "requests on prefetched adapters"
        sizes = [a["size_bytes"] for a in data["adapters"]]
        model_bytes = sum(p.stat().st_size for p in (catalog.parent / "model").glob("*.safetensors"))
        report = build_report(
            base_rows, pre_rows, cold_swap_samples_ms=cold, warm_swap_samples_ms=warm,
            base_bytes=model_bytes, pool_bytes=pool_mb << 20, adapter_bytes=sizes,
            gateway_overhead_ms=overhead,
            extra={
                "trace": str(args.trace), "speed": args.speed, "errors": errors,
                "warm_swap_source": warm_source, "cold_swaps": len(cold), "warm_swaps": len(warm),
                "pool_adapters": pool, "pool_mb": pool_mb, "pool_bytes": pool_mb << 20,
                "pool_bytes_needed": pool_needed, "adapters": len(names),
                "agent_cold_args": list(COLD_AGENT_ARGS),
                "rows_by_tier": {k: dict(sorted(Counter(r["tier"] for r in rs).items())) for k, rs in ok.items()},
                "loads_by_tier": {k: extra.get("loads_by_tier") for k, (_, extra) in results.items()},
                "store_fetches": {k: extra.get("store_fetches") for k, (_, extra) in results.items()},
                "model_shape": json.loads((catalog.parent / "model" / "config.json").read_text()),
                "adapter_sizes": {a["name"]: a["size_bytes"] for a in data["adapters"]},
                "speculation_driver": "gateway: extproc.speculation.GatewaySpeculation (counters from its log)",
                "replay": "open-loop" if args.open_loop else "closed-loop sessions (think_s)",
                "sessions": len(sessions(requests)),
                "replay_s": {k: extra.get("replay_s") for k, (_, extra) in results.items()},
                "speculation": results["prefetch"][1].get("speculation"),
                "warm_set_from": warm_set,
            },
        )
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        with out.with_name(out.stem + "_rows.jsonl").open("w") as f:
            for name, (rows, _) in results.items():
                for row in rows:
                    f.write(json.dumps({"run": name, **row}) + "\n")
        plot_ttft({"prefetch off": [r["ttft_ms"] for r in base_rows if r["ttft_ms"] is not None],
                   "prefetch on": [r["ttft_ms"] for r in pre_rows if r["ttft_ms"] is not None]},
                  out.with_suffix(".png"))
        print(format_report(report))
        log(f"wrote {out} and {out.with_suffix('.png')}")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            log(f"kept {work}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.multi_lora_eval", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(ROOT / "data/multi_lora_eval/multi_lora_eval_800.json"),
                    help="trace file (JSON or JSON Lines, docs/trace-format.md)")
    ap.add_argument("--out", default="reports/multi_lora_eval.json", help="JSON report; the TTFT plot goes next to it")
    ap.add_argument("--fixtures", default=".fixtures", help="fixtures directory (python -m gpu_agent.fixtures)")
    ap.add_argument("--speed", type=float, default=4.0, help="replay speed-up of the trace's clock")
    ap.add_argument("--no-warm-set", action="store_true",
                    help="start the prefetch run without the baseline gateway's popularity counts")
    ap.add_argument("--open-loop", action="store_true",
                    help="send every request at its own t (default: sessions closed-loop, think_s after each answer)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs) after the run")
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
