"""``make bench-inference-perf``: the inference extension's benchmark tool drives ace and vllm-router.

    python -m bench.inference_perf [--targets ace,vllm_router] [--rate 2] [--duration 120]
        --out reports/inference_perf.json

``inference-perf`` (PyPI, Python >= 3.12, its own venv ``.venv-inference-perf``: make
installs it, unpatched) runs its LoRA traffic split, the inference extension's
regression shape: 15 adapters, 5 of them sharing 60% of the requests, 5 sharing 30%, 5
sharing 10%; constant rate, streamed completions, random prompts (its ``random`` data
generator: no dataset download) tokenized with the fixtures' tokenizer. Each target
gets a fresh fleet of real vLLM hosts with the same flags (``tools.vllm_fleet``,
``--max-loras 3 --max-cpu-loras 3``: 3 slots per host):

- ``ace``: through Envoy + ext_proc (residency-aware routing, prefetch on). The tool lists
  ``GET /v1/models`` without its API key before a LoRA run and needs every adapter
  listed, so the gateway's state turns on ``public_model_list`` (docs/gateway.md, off by
  default: its risk is written there) and the adapters are public;
- ``vllm_router``: ``vllm-router`` (default policy) in front of the same kind of hosts,
  started as a vLLM user fronting them with vllm-router would: the router forwards the
  tool's ``GET /v1/models`` to one engine, which lists only what it has registered, so
  every engine registers the 15 adapters at start-up (``--lora-modules name=path``);
  vLLM's CPU cache (3) then re-reads the others from disk as they are used, which vLLM
  0.32 neither logs nor counts. No agent runs beside them.
- ``ace+keep`` (not in the default targets): ``ace`` with agents that keep evicted
  adapters registered and drop only their weights (``--vllm-keep-registered``), so its
  misses are re-reads, as vllm-router's are, instead of the resolver's registrations.

The report holds, per target, the tool's own reports as it wrote them (its
``summary_lifecycle_metrics.json`` and per-adapter files, by file name) and what the
engines counted (requests served, vLLM's own on-demand loads, the agents' loads).
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.scenario_fixtures import trace_catalog
from bench.vllm_eval import TOKEN, add_waited_loads, engine_counts, host_args
from bench.vllm_router import vllm_router
from tools.vllm_fleet import BASE_MODEL, VLLMFlags, vllm_fleet, vllm_hosts
from tools.localstack import run_until_stopped

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("ace", "vllm_router", "ace+keep")
#: what ``make bench-inference-perf`` runs
DEFAULT_TARGETS = ("ace", "vllm_router")
KEY = "sk-bench-inference-perf-0001"
GROUPS = ((5, 0.60), (5, 0.30), (5, 0.10))  # (adapters, share of the traffic)
FRONTS = {
    "ace": "Envoy + ext_proc (public_model_list on), one agent per vLLM; adapters loaded at runtime "
           "(agent prefetch, else vLLM's filesystem resolver)",
    "vllm_router": "vllm-router 0.1.17 (cache_aware), every adapter registered at vLLM start-up "
                   "(--lora-modules), no agent",
    "ace+keep": "ace, with agents that keep evicted adapters registered and drop only their weights "
                "(--vllm-keep-registered)",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def adapters() -> list[tuple[str, float]]:
    """(name, split) for the 15 adapters; the splits sum to 1."""
    out, i = [], 0
    for count, share in GROUPS:
        for _ in range(count):
            i += 1
            out.append((f"ip-adapter-{i:02d}", round(share / count, 6)))
    return out


def state_yaml(path: Path, catalog: Path, hosts: list[dict], public_models: bool) -> dict:
    """The gateway's state; ``public_models``: the ace target's unauthenticated model list
    (the vllm_router target does not go through the gateway and leaves it off)."""
    state = {
        "include": [str(catalog)],
        "tenants": [{"id": "perf", "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"}}],
        "keys": [{"name": "perf", "sha256": hashlib.sha256(KEY.encode()).hexdigest(), "tenant": "perf", "skills": {}}],
        "upstreams": [{"name": h["name"], "address": h["engine"], "flavour": "vllm", "base_model": BASE_MODEL,
                       "hints": "off", "agent": h["agent"]} for h in hosts],
        "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "prod"},
    }
    if public_models:
        state["public_model_list"] = True
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return state


def tool_config(base_url: str, model_dir: Path, out_dir: Path, args) -> dict:
    n = max(1, int(args.rate * args.duration))
    return {
        "load": {"type": "constant", "stages": [{"rate": args.rate, "duration": args.duration}],
                 "num_workers": 1, "worker_max_concurrency": 8, "base_seed": 20261202,
                 "lora_traffic_split": [{"name": name, "split": split} for name, split in adapters()]},
        "api": {"type": "completion", "streaming": True},
        "server": {"type": "vllm", "model_name": BASE_MODEL, "base_url": base_url, "api_key": KEY, "ignore_eos": True},
        "tokenizer": {"pretrained_model_name_or_path": str(model_dir)},
        "data": {"type": "random",
                 "input_distribution": {"min": 10, "max": 40, "mean": 20, "std_dev": 5, "total_count": n},
                 "output_distribution": {"min": 4, "max": 8, "mean": 6, "std_dev": 1, "total_count": n}},
        "report": {"request_lifecycle": {"summary": True, "per_stage": True, "per_request": False,
                                         "per_adapter": True, "per_adapter_stage": False}},
        "storage": {"local_storage": {"path": str(out_dir)}},
    }


def run_target(args, target: str, catalog: Path, work: Path) -> dict:
    run_dir = work / target
    run_dir.mkdir(parents=True)
    flags = VLLMFlags(max_loras=3, max_cpu_loras=3, max_lora_rank=8)
    fixtures = catalog.parent
    t0 = time.monotonic()
    with contextlib.ExitStack() as stack:
        if target.startswith("ace"):
            st = stack.enter_context(vllm_fleet(
                run_dir, catalog, fixtures / "model", fixtures / "adapters", args.vllm_python, args.hosts, flags,
                lambda path, hosts: state_yaml(path, catalog, hosts, True), token=TOKEN,
                agent_args=["--reconcile-interval-s", "0.2",
                            *(["--vllm-keep-registered"] if target == "ace+keep" else [])]))
            base, hosts = st["gateway"], st["hosts"]
        else:
            # What a vLLM user fronting vLLM with vllm-router does: every adapter of the
            # catalog listed at start-up (--lora-modules), so that /v1/models, which the
            # router forwards to one engine, names them all; no agent, no gateway.
            modules = [(name, fixtures / "adapters" / name) for name, _ in adapters()]
            engines = stack.enter_context(vllm_hosts(args.vllm_python, fixtures / "model", fixtures / "adapters",
                                                     run_dir, args.hosts, flags, lora_modules=modules))
            hosts = [{"name": f"engine-{i}", "vllm": e, "engine_url": e.url} for i, e in enumerate(engines, 1)]
            base = stack.enter_context(vllm_router([h["engine_url"] for h in hosts], "cache_aware", run_dir))
        log(f"{target}: fleet up in {time.monotonic() - t0:.0f}s")
        before = {h["name"]: engine_counts(h) for h in hosts}
        cfg = run_dir / "inference-perf.yaml"
        reports = run_dir / "reports"
        cfg.write_text(yaml.safe_dump(tool_config(base, fixtures / "model", reports, args), sort_keys=False))
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        load_avg = os.getloadavg()[0]
        t1 = time.monotonic()
        with open(run_dir / "inference-perf.log", "wb") as out:
            rc = subprocess.run([args.tool, "-c", str(cfg)], cwd=run_dir, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=args.duration * 10 + 600).returncode
        elapsed = time.monotonic() - t1
        after = {h["name"]: engine_counts(h) for h in hosts}
        registered = {h["name"]: len(h["vllm"].adapters()) for h in hosts}
    engines_out = {n: {k: round(after[n][k] - before[n][k], 2) for k in after[n] if k != "cpu_s"} for n in after}
    for n in engines_out:
        add_waited_loads(engines_out[n], f"{target} {n}")
        engines_out[n]["registered_at_end"] = registered[n]
    files = {p.name: json.loads(p.read_text()) for p in sorted(reports.rglob("*.json"))} if reports.exists() else {}
    tail = (run_dir / "inference-perf.log").read_text(errors="replace")[-1500:]
    log(f"{target}: inference-perf exited {rc} after {elapsed:.0f}s; {len(files)} report files")
    return {"exit_code": rc, "seconds": round(elapsed, 1), "front": FRONTS[target], "engines": engines_out,
            "summary": summarize(files),
            "machine_load_avg_1m": [round(load_avg, 1), round(os.getloadavg()[0], 1)],
            "tool_reports": files, "tool_log_tail": tail if rc else None}


def _ttft_ms(block: dict | None) -> dict | None:
    ttft = ((block or {}).get("latency") or {}).get("time_to_first_token")
    if not ttft:
        return None
    return {q: round(ttft[k] * 1000, 1) for q, k in (("p50", "median"), ("p90", "p90"), ("p99", "p99"))}


def summarize(tool_reports: dict) -> dict:
    """What the README quotes, read from the tool's own files: per adapter (its
    ``adapter_<name>_lifecycle_metrics.json``) and overall (``summary_lifecycle_metrics.json``),
    successes, failures and TTFT (ms)."""
    def one(report: dict) -> dict:
        ok = report.get("successes") or {}
        return {"successes": ok.get("count", 0), "failures": (report.get("failures") or {}).get("count", 0),
                "ttft_ms": _ttft_ms(ok)}
    summary = tool_reports.get("summary_lifecycle_metrics.json")
    per_adapter = {}
    for name, _ in adapters():
        report = tool_reports.get(f"adapter_{name}_lifecycle_metrics.json")
        per_adapter[name] = one(report) if report else {"successes": 0, "failures": 0, "ttft_ms": None}
    return {"overall": one(summary) if summary else None, "per_adapter": per_adapter}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    host_args(p, "inference_perf.json")
    p.add_argument("--targets", default=",".join(DEFAULT_TARGETS), help=f"any of {', '.join(TARGETS)}")
    p.add_argument("--rate", type=float, default=2.0, help="requests per second (constant load)")
    p.add_argument("--duration", type=int, default=120, help="seconds")
    p.add_argument("--tool", default=str(ROOT / ".venv-inference-perf" / "bin" / "inference-perf"))
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    if sorted(set(targets) - set(TARGETS)):
        p.error(f"targets are {', '.join(TARGETS)}")
    fake = [{"adapter": name, "rank": 8, "domain": "bench"} for name, _ in adapters()]
    catalog = trace_catalog(fake, args.fixtures, ROOT / "var" / "bench-fixtures", log).resolve()
    work = ROOT / "var" / "inference_perf" / time.strftime("%Y%m%d-%H%M%S")
    results = {t: run_target(args, t, catalog, work) for t in targets}
    report = {"tool": "inference-perf 0.7.0", "hosts": args.hosts, "rate": args.rate, "duration_s": args.duration,
              "lora_traffic_split": dict(adapters()), "vllm_flags": VLLMFlags(3, 3, 8).args(), "targets": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {args.out}")
    return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
