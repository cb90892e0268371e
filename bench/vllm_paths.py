"""What each path of a request costs on a real vLLM host, one request at a time.

    python -m bench.vllm_paths [--n 200] [--fronts envoy,vllm_router] [--out reports/vllm_paths.json]

One vLLM host (``tools.vllm_fleet``, the flags and plugins of ``make bench ENGINE=vllm``:
``--max-loras 2 --max-cpu-loras 4``, the filesystem resolver, ace's evicting unload and
measuring plugins), requests sent one at a time, streamed, each timed to its first token
(TTFT at the client), with the trace's first prompt. The machine's speed drifts by more
than the paths differ (5 ms between two blocks of one case, minutes apart, in a first
version that ran the cases in blocks), so the cases are interleaved request by request,
``--n`` rounds of three, and compared by the median of their paired differences:

- ``cpu_cache``: one adapter asked for every third request: registered and in vLLM's CPU
  cache all along, moved into one of the 2 slots again (the two others take them);
- ``re_read``: six registered adapters in turn, over the 2 cache entries the others
  leave: vLLM's CPU LRU has dropped each before its turn, so vLLM reads it again in its
  step. What a miss costs in vllm-router's arms, where nothing unregisters;
- ``resolver``: one adapter unloaded (untimed) before each of its requests: vLLM's
  filesystem resolver registers and reads it first. What a miss costs in the gateway's
  arms, where the agents unload what they evict.

vLLM's log is counted (the measuring plugin's reads, the resolver's registrations): a
run where they are not one read per ``re_read`` and ``resolver`` request and one
registration per ``resolver`` request fails, since its cases measured something else.

Then the host's agent and the gateway (Envoy + ext_proc) start in front of it, beside
Envoy alone with the same configuration but no ext_proc and ``vllm-router`` (its default
policy), and ``front`` sends one registered adapter's requests in turn through each and
straight to vLLM: the paired differences are what each front adds to a request, and how
much of the gateway's is Envoy's hop.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.report import median_ci, percentiles
from bench.scenario_fixtures import trace_catalog
from bench.trace import load_trace
from bench.vllm_eval import TOKEN, first_requests, log, state_yaml
from bench.vllm_router import ROUTER_ARMS, vllm_router
from tools.localstack import run_envoy, run_until_stopped
from tools.vllm_fleet import RESOLVED_MARK, VLLMFlags, vllm_fleet, vllm_hosts
from tools.vllm_measure.ace_vllm_measure import MARK as CPU_CACHE_READ_MARK

ROOT = Path(__file__).resolve().parents[1]
CASES = ("cpu_cache", "re_read", "resolver")
CYCLE = 6  # re_read's adapters: more than the cache entries left to them
FRONTS = ("envoy", "vllm_router")  # besides the gateway and the direct request


class PathError(RuntimeError):
    """A case did not measure what it names (its adapters were not read as it expects)."""


def ttft_ms(client: httpx.Client, url: str, adapter: str, messages: list, headers: dict | None = None) -> float:
    body = {"model": adapter, "messages": messages, "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers or {}) as resp:
        if resp.status_code != 200:
            raise PathError(f"{adapter} via {url}: HTTP {resp.status_code}: {resp.read()[:200]!r}")
        ttft = None
        for chunk in resp.iter_bytes():
            if ttft is None and chunk.strip():
                ttft = (time.perf_counter() - t0) * 1000
    if ttft is None:
        raise PathError(f"{adapter} via {url}: no token streamed")
    return ttft


def marks(log_path: Path) -> tuple[int, int]:
    """(CPU-cache reads, resolver registrations) in vLLM's log so far."""
    text = log_path.read_text(errors="replace")
    return text.count(CPU_CACHE_READ_MARK), text.count(RESOLVED_MARK)


def interleaved(client: httpx.Client, host, adapters: list[str], messages: list, n: int) -> dict[str, list[float]]:
    """``n`` rounds of one request per case (``CASES``); checks from vLLM's log that each
    was the path it names."""
    kept, moved, cycle = adapters[0], adapters[1], adapters[2:2 + CYCLE]
    for a in [*cycle, moved, kept]:  # all registered; kept and moved last, so cached
        ttft_ms(client, host.url, a, messages)
    reads0, resolved0 = marks(host.log)
    out: dict[str, list[float]] = {c: [] for c in CASES}
    for i in range(n):
        for case in CASES:  # one order: reversed, the kept adapter would find itself in a slot every other round
            if case == "resolver":
                client.post(host.url + "/v1/unload_lora_adapter", json={"lora_name": moved}).raise_for_status()
            a = {"cpu_cache": kept, "re_read": cycle[i % CYCLE], "resolver": moved}[case]
            out[case].append(ttft_ms(client, host.url, a, messages))
    reads, resolved = marks(host.log)
    if (reads - reads0, resolved - resolved0) != (2 * n, n):
        raise PathError(f"vLLM read {reads - reads0} adapters into its CPU cache and resolved {resolved - resolved0} "
                        f"over {n} rounds; the cases need {2 * n} reads and {n} registrations")
    return out


def paired(a: list[float], b: list[float]) -> dict:
    """The median of the paired differences ``a - b``, with its 95% bootstrap interval."""
    return median_ci([x - y for x, y in zip(a, b)])


def summary(values: list[float]) -> dict:
    return {"requests": len(values), "mean_ms": round(statistics.fmean(values), 2),
            **{k: round(v, 2) for k, v in percentiles(values).items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.vllm_paths", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", type=Path, default=ROOT / "data" / "multi_lora_eval" / "vllm_hosts.json",
                   help="the adapters and prompts (default: make bench ENGINE=vllm's trace)")
    p.add_argument("--n", type=int, default=200, help="rounds (one request per case each), and front's pairs")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--fixtures", type=Path, default=ROOT / ".fixtures")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "vllm_paths.json")
    p.add_argument("--work", type=Path, default=None,
                   help="where the processes' logs go (default var/vllm_paths/<time>)")
    p.add_argument("--router-bin", default=str(ROOT / ".venv-router" / "bin" / "vllm-router"))
    p.add_argument("--fronts", default=",".join(FRONTS),
                   help=f"fronts compared with the gateway and a direct request, of {', '.join(FRONTS)}")
    args = p.parse_args(argv)
    if args.n < 6:
        p.error("--n must be at least 6")
    fronts = [f for f in args.fronts.split(",") if f]
    if set(fronts) - set(FRONTS):
        p.error(f"unknown front(s) {', '.join(sorted(set(fronts) - set(FRONTS)))}; choose from {', '.join(FRONTS)}")
    requests = first_requests(load_trace(args.trace), 240)
    catalog = trace_catalog(requests, args.fixtures, ROOT / "var" / "bench-fixtures", log).resolve()
    fixtures = catalog.parent
    by_adapter: dict[str, dict] = {}
    for r in requests:
        by_adapter.setdefault(r["adapter"], r)
    adapters = sorted(by_adapter)
    if len(adapters) < CYCLE + 2:
        p.error(f"{args.trace} names {len(adapters)} adapters; the cases need {CYCLE + 2}")
    messages = requests[0]["messages"]
    rank = max(int(r["rank"]) for r in requests)
    flags = VLLMFlags(2, 4, rank)
    work = args.work or ROOT / "var" / "vllm_paths" / time.strftime("%Y%m%d-%H%M%S")
    with vllm_hosts(args.vllm_python, fixtures / "model", fixtures / "adapters", work, 1, flags) as engines:
        host = engines[0]
        log(f"vLLM ready after {host.startup_s:.0f}s")
        with httpx.Client(timeout=120) as client:
            got = interleaved(client, host, adapters, messages, args.n)
            host.unload_all()
        tenants = sorted({r["tenant"] for r in requests})
        owner = by_adapter[adapters[0]]["tenant"]

        def write_state(path: Path, fleet: list[dict]) -> dict:
            return state_yaml(path, catalog, tenants, fleet, False)

        with contextlib.ExitStack() as stack:
            st = stack.enter_context(vllm_fleet(work / "front", catalog, fixtures / "model", fixtures / "adapters",
                                                args.vllm_python, 1, flags, write_state, token=TOKEN, engines=engines))
            headers = {"authorization": f"Bearer {st['state'][owner]}"}
            legs = [("gateway", st["gateway"], headers)]
            if "envoy" in fronts:
                plain = stack.enter_context(run_envoy(work / "front", extproc="127.0.0.1:9", name="plain",
                                                      default_upstream=f"127.0.0.1:{host.port}", with_extproc=False))
                legs.append(("envoy", f"http://127.0.0.1:{plain}", None))
            if "vllm_router" in fronts:
                legs.append(("vllm_router", stack.enter_context(
                    vllm_router([host.url], ROUTER_ARMS["vllm_router"], work / "front", Path(args.router_bin))), None))
            legs.append(("direct", host.url, None))
            client = stack.enter_context(httpx.Client(timeout=120))
            ttft_ms(client, st["gateway"], adapters[0], messages, headers)   # registered, in a slot
            front: dict[str, list[float]] = {name: [] for name, _, _ in legs}
            for i in range(args.n):
                k = i % len(legs)
                for name, url, h in legs[k:] + legs[:k]:  # each leg first in as many rounds
                    front[name].append(ttft_ms(client, url, adapters[0], messages, h))
    report = {
        "trace": str(args.trace.relative_to(ROOT) if args.trace.is_relative_to(ROOT) else args.trace),
        "vllm_flags": flags.args(), "rounds": args.n,
        "cases": {c: summary(v) for c, v in got.items()},
        "paired_ms": {"re_read_minus_cpu_cache": paired(got["re_read"], got["cpu_cache"]),
                      "resolver_minus_cpu_cache": paired(got["resolver"], got["cpu_cache"]),
                      "resolver_minus_re_read": paired(got["resolver"], got["re_read"])},
        "front": {name: summary(v) for name, v in front.items()},
        "front_paired_ms": {f"{a}_minus_{b}": paired(front[a], front[b])
                            for a, b in (("gateway", "direct"), ("gateway", "envoy"), ("envoy", "direct"),
                                         ("vllm_router", "direct"), ("gateway", "vllm_router"))
                            if a in front and b in front},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    log(f"wrote {args.out}\n{json.dumps(report['paired_ms'])}\n{json.dumps(report['front_paired_ms'])}")
    return 0


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
