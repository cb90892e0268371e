"""The README's "Latest numbers" section, rendered from the committed reports.

    python -m tools.report_tables            # print the section
    python -m tools.report_tables --update   # rewrite it in README.md (between the markers)

Every figure comes from `reports/*.json` as the benchmarks wrote them; nothing here is
typed by hand. `tests/test_readme.py` checks that the README shows what the reports say
(``stale_section``): the committed reports, or the working tree's once the README has been
updated from them, so `make bench && make test` passes before anyone commits a new run.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
BEGIN = "<!-- numbers:begin (python -m tools.report_tables --update) -->"
END = "<!-- numbers:end -->"


REPORT_FILES = ("gateway_overhead.json", "agent.json", "agent_cuda.json", "load_interference_cuda.json",
                "hundreds_eval.json", "sixteen_eval.json", "multi_lora_eval.json", "sim.json", "sim_vs_stack.json",
                "vllm_eval.json", "vllm_paths.json", "inference_perf.json")
Loader = Callable[[str], "dict | None"]


def working_tree_reports(repo: Path) -> Loader:
    """Reports as they are on disk (what a benchmark has just written)."""
    def load(name: str) -> dict | None:
        path = repo / "reports" / name
        return json.loads(path.read_text()) if path.exists() else None
    return load


def committed_reports(repo: Path) -> Loader | None:
    """Reports as committed at ``HEAD`` (``git show``); None when ``repo`` is not a git
    checkout (a source tarball) or git is missing."""
    try:
        subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "HEAD"], check=True,
                       capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None

    def load(name: str) -> dict | None:
        shown = subprocess.run(["git", "-C", str(repo), "show", f"HEAD:reports/{name}"],
                               capture_output=True, timeout=30)
        return json.loads(shown.stdout) if shown.returncode == 0 else None   # not committed: absent
    return load


def _ok(flag: bool) -> str:
    return "met" if flag else "**missed**"


def gateway(r: dict) -> list[str]:
    e, g, n = r["envoy"], r["gateway"], r["null_extproc"]
    return [
        "### Gateway overhead — `make bench-gateway` → `reports/gateway_overhead.json`",
        "",
        "Envoy alone, Envoy + a do-nothing ext_proc, and Envoy + the ace gateway, against the same",
        f"upstream in one run; {r['body_bytes']} B bodies, {r['ext_proc_messages_per_request']} ext_proc "
        f"message per request, ext_proc server `{r['extproc_server']}`.",
        "",
        "| side | p50 ms (c=1) | p99 ms (c=1) | req/s (c=8) |",
        "|---|---|---|---|",
        *(f"| {name} | {s['c1']['p50_ms']:.3f} | {s['c1']['p99_ms']:.3f} | {s['c8']['rps']:,.0f} |"
          for name, s in (("Envoy alone", e), ("+ do-nothing ext_proc", n), ("+ ace gateway", g))),
        "",
        "| measure | value | target |",
        "|---|---|---|",
        f"| added p50 at c=1 | {r['added_p50_ms']:.2f} ms (do-nothing ext_proc: {r['null_extproc_added_p50_ms']:.2f}) "
        f"| ≤ 0.5 ms, {_ok(r['added_p50_ms'] <= 0.5)} |",
        f"| added p99 at c=1 | {r['added_p99_ms']:.2f} ms | |",
        f"| throughput ratio at c=8 | {r['throughput_ratio']:.2f} (do-nothing ext_proc: "
        f"{r['null_extproc_throughput_ratio']:.2f}; if ext_proc cost no CPU: "
        f"{r['throughput_ratio_if_ext_proc_were_free']:.2f}) | ≥ 0.5, {_ok(r['throughput_ratio'] >= 0.5)} |",
        f"| against the do-nothing ext_proc: throughput at c=8, added p50 at c=1 | "
        f"{r['ours_throughput_ratio']:.2f}×, +{r['ours_added_p50_ms']:.2f} ms | ≥ 0.95×, ≤ +0.05 ms, "
        f"{_ok(r['ours_throughput_ratio'] >= 0.95 and r['ours_added_p50_ms'] <= 0.05)} "
        "(a Python ext_proc doing only the irreducible work measured ~25 µs of CPU a request over "
        "the do-nothing one, the budget ~24 µs in all: docs/bench-history.md) |",
        f"| decision, 2 KB body | p50 {r['decision_us_p50']:.1f} µs, p99 {r['decision_us_p99']:.1f} µs "
        f"| p99 ≤ 20 µs, {_ok(r['decision_us_p99'] <= 20)} |",
    ]


def _cold_load_table(r: dict, target: str) -> list[str]:
    """bench.agent's cold loads per rank against their floor (CPU or CUDA report)."""
    return [f"| rank | adapter MB | cold load ms | floor ms | cold / floor{target} |", "|---|---|---|---|---|",
            *(f"| {k} | {r['adapter_bytes'][k] / 1e6:.1f} | {r['cold_load_ms'][k]:.2f} | {r['floor_ms'][k]:.2f} "
              f"| {r['cold_load_ms'][k] / r['floor_ms'][k]:.2f} |" for k in sorted(r["cold_load_ms"], key=int))]


def agent(r: dict) -> list[str]:
    return [
        "### Agent runtime — `make bench-agent` → `reports/agent.json`",
        "",
        f"Device `{r['device']}`, torch {r['torch']}, {r['threads']} threads. Cold load = PEFT dir on local "
        "disk → pool pages (hidden 4096, 32 layers, q/k/v/o); floor = bytes / measured memcpy bandwidth "
        f"({r['memcpy_gbps']} GB/s).",
        "",
        *_cold_load_table(r, " (target ≤ 2)"),
        "",
        f"- Resident lookup {r['resident_lookup_ms'] * 1000:.2f} µs "
        f"({100 * r['resident_lookup_ms'] / min(r['cold_load_ms'].values()):.3f}% of the fastest cold load; target ≤ 1%).",
        f"- Batched mixed-rank op, 64 rows over 32 adapters at hidden 4096: {r['batched_ms']:.2f} ms vs "
        f"per-adapter loop {r['loop_ms']:.2f} ms ({r['batched_vs_loop_speedup']:.2f}× faster), base dense matmul "
        f"{r['dense_ms']:.2f} ms (ratio {r['batched_vs_dense_ratio']:.3f}, target ≤ 0.35), floor "
        f"{r['batched_floor_ms']:.2f} ms (ratio {r['batched_ms'] / r['batched_floor_ms']:.2f}, target ≤ 1.3).",
        f"- Churn: {r['churn_cycles']:,} load/evict cycles of random ranks into a fixed budget: "
        f"{r['churn_failures']} failures in the paged pool (bytes constant: {r['churn_pool_bytes_constant']}) vs "
        f"{r['churn_failures_per_adapter_alloc']:,} with one torch allocation per adapter.",
        f"- Memory (fixtures): base + pool {r['memory']['shared_bytes'] / 1e6:.2f} MB vs "
        f"{r['memory']['adapters']} dedicated instances {r['memory']['dedicated_bytes'] / 1e6:.2f} MB "
        f"({r['memory']['saving_ratio']:.1f}×).",
    ]


def agent_cuda(r: dict) -> list[str]:
    return [
        "### Agent runtime on a GPU — `make gpu-check` → `reports/agent_cuda.json`",
        "",
        f"Device `{r.get('device_name', r['device'])}`, torch {r['torch']}, {r['threads']} threads (a session lent "
        "one; CI has none). Cold load = PEFT dir on local disk → pinned staging buffers → pool pages on the "
        f"device; floor = bytes / pinned host → device bandwidth ({r['memcpy_gbps']} GB/s).",
        "",
        *_cold_load_table(r, ""),
        "",
        f"- Batched mixed-rank op, 64 rows over 32 adapters at hidden 4096: {r['batched_ms']:.3f} ms"
        + (f" (two GEMMs per adapter segment: {r['segmented_ms']:.3f} ms)" if r.get("segmented_ms") else "")
        + f"; per-adapter loop {r['loop_ms']:.3f} ms, pad-to-max-rank bmm {r['pad_bmm_ms']:.3f} ms, "
        f"base dense matmul {r['dense_ms']:.3f} ms.",
        f"- Churn: {r['churn_cycles']:,} cycles, {r['churn_failures']} failures (bytes constant: "
        f"{r['churn_pool_bytes_constant']}).",
    ]


def interference_cuda(r: dict) -> list[str]:
    pool = r["pool"]

    def row(label: str, e: dict | None) -> str:
        if e is None:
            return f"| {label} | – | – | – |"
        st = e["step_ms"]
        slow = e.get("slow_steps", {}).get("steps", "–")
        return f"| {label} | {st['p50']:.2f} / {st['p99']:.2f} / {st['max']:.2f} | {e.get('loads_during', '–')} | {slow} |"
    return [
        "### Forward steps while loads stream in, on the GPU — `make gpu-check` → `reports/load_interference_cuda.json`",
        "",
        f"{pool['steps']} steps per phase over a resident adapter ({pool['layers']} layers) while another thread "
        f"loads {pool['adapter_mb_loaded']:.0f} MB adapters; a slow step takes over {pool['slow_step_ms']:.2f} ms "
        "(3× the idle median + 1 ms).",
        "",
        "| phase | step p50 / p99 / max ms | loads | slow steps |",
        "|---|---|---|---|",
        row("idle", pool["idle"]),
        row("disk reads through the staging buffers (default)", pool.get("loading")),
        row("host copies through the staging buffers", pool.get("loading_copy_only")),
        row("disk reads pinned per load (the old default)", pool.get("loading_pinned_reads")),
        *_engine_lines(r.get("engine")),
    ]


def _engine_lines(e: dict | None) -> list[str]:
    if e is None:
        return []
    idle, busy = e["idle"], e["loading"]
    return ["", f"The builtin engine on the same device (fixtures model and pool): TTFT p50 / p99 of {e['requests']} "
            f"requests {busy['ttft_ms']['p50']:.2f} / {busy['ttft_ms']['p99']:.2f} ms while prefetches cycle "
            f"({busy['loads_during']} completed), {idle['ttft_ms']['p50']:.2f} / {idle['ttft_ms']['p99']:.2f} ms "
            "without."]


def _pct(e: dict, key: str) -> str:
    return f"{100 * e[key] / (e['total'] or 1):.2f}%"


def _ms(v: float | None, fmt: str = ".1f") -> str:
    return "–" if v is None else format(v, fmt)


def fleet(r: dict) -> list[str]:
    """The fleet table: every hosts × arm run of the report."""
    learned = (f"the state learned on `{r['warm_from']}` (another day: never the scored trace)"
               if r.get("warm_from") else "nothing: it starts cold and learns online")
    rows = []
    for n, arms in r["fleets"].items():
        for arm, e in arms.items():
            pf = e["prefetch"]
            rows.append(
                f"| {n} | {arm} | {_pct(e, 'resident_hits')} | {_pct(e, 'effective_hits')} | {e['errors']} | "
                + " | ".join(_ms(e["stall_ms"][f"p{q}"]) for q in (50, 99)) + " | "
                + " | ".join(_ms(e["ttft_ms"][f"p{q}"]) for q in (50, 90, 99)) + " | "
                + f"{e['first_step']['effective_hits']}/{e['first_step']['total']} | "
                + "/".join(str(v) for v in e["requests_per_host"].values()) + " | "
                + f"{sum(e['loads_by_tier'].values())} | "
                + f"{_ms(pf['sent'], 'd')}/{_ms(pf['used'], 'd')}/{_ms(pf['wasted'], 'd')}/{_ms(pf['preempted'], 'd')} |")
    checks = []
    for n, c in r["checks"].items():
        worse = [f"{m[:-3]} {q}" for m, qs in c.get("ace_no_worse_than_affinity", {}).items()
                 for q, ok in qs.items() if ok is False]
        line = f"- {n} host{'s' if n != '1' else ''}: errors in every arm 0 — {_ok(c['no_errors'])}"
        if "ace_no_worse_everywhere" in c:
            line += (f"; ace never worse than affinity beyond noise (≤ 1.05× + 1 ms) at any stall/TTFT "
                     f"percentile — {_ok(c['ace_no_worse_everywhere'])}" + (f" ({', '.join(worse)})" if worse else ""))
        if "ace_below_every_vllm_router" in c:
            slower = [f"{arm} {q}" for arm, qs in c["ace_below_vllm_router"].items() for q, ok in qs.items() if not ok]
            line += (f"; ace's TTFT below vllm-router's at every percentile — "
                     f"{_ok(c['ace_below_every_vllm_router'])}" + (f" (not at {', '.join(slower)})" if slower else ""))
        checks.append(line + ".")
    t = r["checks"].get("4", {}).get("targets")
    if t and r.get("scenario") == "hundreds":
        checks.append(hundreds_targets(t))
    elif t and r.get("scenario") == "sixteen":
        checks.append(sixteen_targets(t))
    elif t:
        checks.append(
            f"- 4 hosts, targets (the seeds' figures): effective hits ≥ 99.25% — {_ok(t['effective_hit_ratio']['met'])} "
            f"({100 * t['effective_hit_ratio']['got']:.2f}%); resident ≥ 98% — {_ok(t['resident_hit_ratio']['met'])} "
            f"({100 * t['resident_hit_ratio']['got']:.2f}%); stall P99 ≥ 10× lower than affinity — "
            f"{_ok(t['stall_p99_reduction']['met'])} ({t['stall_p99_reduction']['got']:.1f}×); TTFT P99 lower — "
            f"{_ok(t['ttft_p99_lower']['met'])} ({t['ttft_p99_lower']['got']:.1f} vs {t['ttft_p99_lower']['want']:.1f} ms). "
            "What bounds a miss: docs/prediction.md.")
    names = list(dict.fromkeys(arm for arms in r["fleets"].values() for arm in arms))
    described = [ARM_TEXT.get(a, f"**{a}**") for a in names]
    return [
        f"Fleets of {' / '.join(r['fleets'])} engine hosts behind one Envoy + one ext_proc, each host with its own pool of "
        f"{r['pool_adapters']} slots; {len(names)} arms on the same trace: {', '.join(described)}. "
        f"The ace arm's gateway starts from {learned}. {_cores(r)}Wall time of the whole run: {r['wall_s'] / 60:.1f} min "
        f"({_speeds(r)}).",
        "",
        "| hosts | arm | resident | effective | errors | stall p50 ms | stall p99 ms | TTFT p50 ms | TTFT p90 ms "
        "| TTFT p99 ms | first steps effective | requests per host | loads | prefetch sent/used/wasted/preempted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        *pooled_table(r),
        *checks,
    ]


def pooled_table(r: dict) -> list[str]:
    """The arms replayed more than once (``--replays``): each replay's TTFT and the pooled
    percentiles the checks compare; nothing when no arm was."""
    rows = []
    for n, arms in r["fleets"].items():
        for arm, e in arms.items():
            p = e.get("pooled")
            if not p:
                continue
            rows.append(f"| {n} | {arm} | {' / '.join(str(x['order']) for x in e['replays'])} | {p['errors']} | "
                        + " | ".join(_ms(p["stall_ms"][f"p{q}"]) for q in (50, 99)) + " | "
                        + " | ".join(_ms(p["ttft_ms"][f"p{q}"]) for q in (50, 90, 95, 99)) + " | "
                        + " / ".join(f"{_ms(x['ttft_ms']['p50'])}, {_ms(x['ttft_ms']['p99'])}" for x in e["replays"])
                        + " |")
    if not rows:
        return []
    return [
        f"Replayed {r['replays']} times each on fresh cold stacks, in the order `{' '.join(r['replay_order'])}` "
        "(palindromic, so a drift of the machine's speed weighs on both alike); the checks below compare the "
        "pooled rows of every replay (the table above is each arm's first replay).",
        "",
        "| hosts | arm | run positions | errors | stall p50 ms | stall p99 ms | TTFT p50 ms | TTFT p90 ms "
        "| TTFT p95 ms | TTFT p99 ms | each replay: TTFT p50, p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


ARM_TEXT = {
    "round_robin": "**round_robin** (requests spread in turn, engines load on demand: a plain Service in front of "
                   "vLLM replicas)",
    "vllm_router": "**vllm_router** (vLLM's own router, `cache_aware`, in front of the same engines instead of "
                   "Envoy + ext_proc)",
    "vllm_router_session": "**vllm_router_session** (vLLM's router, `consistent_hash` on the session)",
    "affinity": "**affinity** (ace's placement and residency-aware routing, prefetch off: what a LoRA-affinity "
                "picker gives)",
    "ace": "**ace** (routing + prefetch)",
}


def sixteen_targets(t: dict) -> str:
    h = t["effective_hit_ratio"]
    worse = [f"{m[:-3]} {q}" for m in ("stall_ms", "ttft_ms") for q, ok in t[f"{m}_no_worse"]["got"].items()
             if ok is False]
    ceiling = (f", the on-demand cold-start ceiling {100 * h['ceiling']:.2f}%, which the start-up fill of free "
               "room may pass" if h.get("ceiling") is not None else "")
    return (f"- 4 hosts, targets (issue 21): ace effective hits ≥ 98.5% — {_ok(h['met'])} ({100 * h['got']:.2f}%"
            f"{ceiling}); never worse than affinity at any stall or TTFT percentile — "
            f"{_ok(t['stall_ms_no_worse']['met'] and t['ttft_ms_no_worse']['met'])}"
            + (f" (worse at {', '.join(worse)})" if worse else "") + f"; no errors — {_ok(t['no_errors']['met'])}.")


def miss_table(r: dict) -> list[str]:
    """Per hosts × arm: each miss under one cause (``bench.bounds.miss_causes``), and
    against Belady where the report has it."""
    entries = [(n, arm, e) for n, arms in r["fleets"].items() for arm, e in arms.items() if e.get("miss_causes")]
    causes = list(entries[0][2]["miss_causes"]["causes"]) if entries else []
    against = bool(entries) and all("belady_kept" in e["miss_causes"] for _, _, e in entries)
    rows = []
    for n, arm, e in entries:
        m = e["miss_causes"]
        rows.append(f"| {n} | {arm} | {m['misses']} | " + " | ".join(str(m["causes"][c]) for c in causes)
                    + f" | {m['unpredictable_hits']}/{m['unpredictable_requests']} | {100 * m['ceiling']:.2f}% | "
                    f"{_ms(m.get('compulsory_stall_p99_ms'))} / {_ms(e['stall_ms']['p99'])} |"
                    + (f" {_belady_kept(m)} |" if against else ""))
    if not rows:
        return []
    defs = next(e["miss_causes"]["definitions"] for arms in r["fleets"].values() for e in arms.values()
                if e.get("miss_causes"))
    return [
        "What each miss was (`bench.bounds.miss_causes`, first match wins): "
        + "; ".join(f"**{c}**: {defs[c]}" for c in causes)
        + ". Unpredictable hit: unpredictable requests (not the fleet's first) that hit anyway. Ceiling: the hit "
          "ratio if every miss but the compulsory and unpredictable ones had hit. Stall p99 floor: the arm's stall "
          "p99 if only its compulsory misses had stalled (each as long as it did), beside its stall p99."
        + (" Against Belady: of the arm's misses, those Belady on the same host sequences hits, by cause (it knows "
           "which stray or one-off comes next), and the arm's hits Belady misses (prefetched or filled ahead of "
           "their request); the arm's hits minus Belady's are the second minus the first." if against else ""),
        "",
        "| hosts | arm | misses | " + " | ".join(causes) + " | unpredictable hit | ceiling "
        "| stall p99 floor / stall p99 ms |" + (" against Belady: its misses Belady hits / its hits Belady misses |"
                                                 if against else ""),
        "|---|---|---|" + "---|" * len(causes) + "---|---|---|" + ("---|" if against else ""),
        *rows,
    ]


def _belady_kept(m: dict) -> str:
    kept = m["belady_kept"]
    parts = ", ".join(f"{c} {k}" for c, k in kept.items())
    return f"{sum(kept.values())} ({parts}) / {m['belady_missed_hits']}" if kept else f"0 / {m['belady_missed_hits']}"


def sixteen(r: dict) -> list[str]:
    return [
        "### Sixteen adapters, 8 slots per host — `make bench SCENARIO=sixteen` → `reports/sixteen_eval.json`",
        "",
        f"`{r['trace']}` (`generate.py --scenario sixteen`): {_requests(r)} requests, {r['sessions']} sessions, "
        f"{r['adapters']} adapters of ranks 8–128, 12 tenants, each host's pool {r['pool_adapters']} slots, so the "
        "fleet can hold the catalog twice; every arm starts cold.",
        "",
        *fleet(r),
        "",
        *miss_table(r),
        "",
        *where_time_goes(r),
        "",
        f"![TTFT distributions per arm, {r['fleet_hosts']} hosts, sixteen adapters](reports/sixteen_eval.png)",
    ]


def _speeds(r: dict) -> str:
    by = r.get("speed_by_hosts")
    if not by:
        return f"replay ×{float(r['speed']):g}"
    how = "chosen per fleet size by a pilot, busiest engine ≈ half busy" if r.get("speed") == "auto" else "fixed"
    return "replay " + ", ".join(f"×{v:g} at {n} host{'s' if n != '1' else ''}" for n, v in by.items()) + f" ({how})"


def hundreds_targets(t: dict) -> str:
    got = {k: v["got"] for k, v in t.items()}
    worse = [q for q, ok in got["ttft_no_worse"].items() if ok is False]
    return (f"- 4 hosts, targets (issue 21): ace effective hits ≥ 90% — {_ok(t['effective_hit_ratio']['met'])} "
            f"({100 * got['effective_hit_ratio']:.2f}%); ≥ affinity + 12 points — {_ok(t['over_affinity']['met'])} "
            f"({100 * got['over_affinity']:+.2f}); ≥ Belady's demand optimum of its own per-host sequences — "
            f"{_ok(t['over_own_belady']['met'])} ({_pts(got['over_own_belady'])}); stall P99 ≥ 3× lower than "
            f"affinity — {_ok(t['stall_p99_reduction']['met'])} ({_ms(got['stall_p99_reduction'])}×); TTFT no worse "
            f"at p50/p90/p95/p99 — {_ok(t['ttft_no_worse']['met'])}" + (f" (worse at {', '.join(worse)})" if worse else "")
            + f"; no errors — {_ok(t['no_errors']['met'])}.")


def _ttft_chunk(r: dict) -> str:
    """Reports with ``ttft_breakdown`` time the first chunk carrying a token; older ones
    the chat stream's opening role chunk, sent before any compute."""
    timed = any("ttft_breakdown" in e for arms in r["fleets"].values() for e in arms.values())
    return " that carries a token" if timed else " (the opening role chunk, sent before any compute)"


def _pts(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:+.2f} points"


def where_time_goes(r: dict) -> list[str]:
    """Per hosts × arm: busiest engine, the bounds of its own per-host sequences, and the
    TTFT split (p50 / p99 of each part, and what the worst 1% is made of); where the engines
    report it (``ace_timing.loop_lag_ms``), how late their event loops ran meanwhile."""
    rows = []
    lagged = any("loop_lag_ms" in (e.get("ttft_breakdown") or {}) for arms in r["fleets"].values()
                 for e in arms.values())
    for n, arms in r["fleets"].items():
        for arm, e in arms.items():
            b, t = e.get("bounds"), e.get("ttft_breakdown") or {}
            if not b or not t.get("rows"):
                continue
            busy = e.get("engine_busy") or {}
            w = t["worst_1pct"]
            rows.append(
                f"| {n} | {arm} | {_ms(max(busy.values()) * 100 if busy else None, '.0f')}% | "
                f"{_pct(e, 'effective_hits')} | {100 * b['belady_hit_ratio']:.2f}% | {100 * b['compulsory_hit_ratio']:.2f}% | "
                + " | ".join(f"{_ms(t[k]['p50'])} / {_ms(t[k]['p99'])}"
                             for k in ("queue_ms", "stall_ms", "compute_ms", "loads_ms", "outside_engine_ms"))
                + f" | {_ms(w['ttft_ms_p50'])}: " + " / ".join(_ms(w[f'{k}_p50']) for k in
                                                              ("queue_ms", "stall_ms", "compute_ms", "loads_ms",
                                                               "outside_engine_ms")) + " |"
                + (f" {_lag(e)} |" if lagged else ""))
    if not rows:
        return []
    return [
        "Where the time goes, and the bounds of each arm's own per-host request sequences (Belady: the "
        "demand-caching optimum at the pool's slots; compulsory: every request but each adapter's first on "
        "its host). TTFT parts, p50 / p99 ms, from the engine's `ace_timing`: queue (until the first forward "
        "pass), stall (the adapter), compute (the first pass), loads (the engine's load work that ended in "
        "the request's window, prefetch or demand: it overlaps the others), outside (TTFT minus the engine's "
        "time to the first token: Envoy, gateway, loopback); worst 1%: the median TTFT of the slowest 1% and "
        "the median of each part there."
        + (" Loop lag: how late the engine's event loop ran while it held a request (p99 ms, and the worst "
           "1%'s median), and how many of the agents' wake-ups (every 20 ms, all hosts), of the gateway's "
           "(its serving loop's, every 20 ms) and of the load generator's (every 5 ms) ran over 25 ms late during the replay: a late loop delays every "
           "request on it, whatever its adapter; on this 2-core machine the hosts' loops are late together "
           "(docs/bench-history.md, 2026-12-06)." if lagged else ""),
        "",
        "| hosts | arm | busiest engine busy | effective | Belady | compulsory | queue | stall | compute | loads "
        "| outside | worst 1%: TTFT: queue / stall / compute / loads / outside |"
        + (" loop lag: p99 / worst 1% / wake-ups > 25 ms: agents / gateway / load generator |" if lagged else ""),
        "|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if lagged else ""),
        *rows,
    ]


def _cores(r: dict) -> str:
    """Which cores the request path and the hosts ran on (``cpus``; bench.cores), as a sentence."""
    cpus = r.get("cpus")
    if not cpus:
        return "Every process ran on every core of the machine. "
    return (f"The load generator, the artifact store, Envoy and the ext_proc ran on core(s) "
            f"{', '.join(map(str, cpus['request_path']))} and the engine hosts on "
            f"{', '.join(map(str, cpus['hosts']))}, as separate machines would (`--cpu-split`). ")


def _lag(e: dict) -> str:
    t = (e.get("ttft_breakdown") or {})
    lag = t.get("loop_lag_ms")
    if lag is None:
        return "–"
    late = [(e.get(field) or {}).get("over_25ms") for field in ("loop_lag", "gateway_loop_lag", "client_loop_lag")]
    return (f"{_ms(lag['p99'])} / {_ms(t['worst_1pct'].get('loop_lag_ms_p50'))} / "
            + " / ".join("–" if n is None else str(n) for n in late))


def hundreds(r: dict) -> list[str]:
    return [
        "### Hundreds of adapters through the whole stack — `make bench SCENARIO=hundreds` → "
        "`reports/hundreds_eval.json`",
        "",
        f"The mission's scale (`{r['trace']}`, docs/trace-format.md): {_requests(r)}"
        f" requests, {r['sessions']} sessions, {r['adapters']} adapters of ranks 8–128, each host's pool "
        f"{r['pool_adapters']} slots ({r['pool_mb']} MiB), so the fleet holds about "
        f"{r['pool_adapters'] * max(int(n) for n in r['fleets']) / r['adapters']:.0%} of the catalog; every arm "
        "starts cold. Same stack, arms and cold loads as the 800 report below.",
        "",
        *fleet(r),
        "",
        *miss_table(r),
        *hundreds_reference(r),
        "",
        *where_time_goes(r),
        "",
        f"![TTFT distributions per arm, {r['fleet_hosts']} hosts, hundreds of adapters](reports/hundreds_eval.png)",
    ]


def hundreds_reference(r: dict) -> list[str]:
    """What prediction is worth on ace's routing at the fleet the targets name, against the
    hits each issue-21 target needs (reports from before ``prefetch_reference``: nothing)."""
    arms = r["fleets"].get(str(r["fleet_hosts"])) or {}
    ace, aff = arms.get("ace"), arms.get("affinity")
    if not ace or not aff or not ace.get("prefetch_reference"):
        return []
    n = ace["total"]
    needs = {"ace >= 90%": 0.9 * n, "+12 over affinity": aff["effective_hits"] + 0.12 * n,
             ">= its own per-host Belady": ace["bounds"]["belady_hits"]}
    return ["", _reference_line(ace["prefetch_reference"], needs, held="pool slots")
            + f" ace's own first run: {ace['effective_hits']} effective hits."]


def _requests(r: dict) -> int:
    e = next(iter(next(iter(r["fleets"].values())).values()))
    return e["total"] + e["errors"]


def sim_vs_stack(r: dict) -> list[str]:
    lines = ["### Simulator against the stack — `make sim TRACE= HOSTS= SLOTS=` → `reports/sim_vs_stack.json`",
             "",
             "The fleet simulator replays a bench trace with the bench's fleet size, pool, replay speed and "
             "measured load times (`bench.sim_stack`): each arm in the order and at the times the stack sent "
             "it, a request's own adapter loaded when it reaches its engine, every bet put to the agents' "
             "budget; per arm its hit ratio beside the stack's (agreement: within 3 points), and the model's "
             "terms that differ from what the stack did.",
             "",
             "| trace @ hosts × slots | arm | stack | sim | diff | within 3 points |",
             "|---|---|---|---|---|---|"]
    notes = []
    for key, res in sorted(r.items()):
        for arm, a in res["agreement"]["arms"].items():
            lines.append(f"| {key} | {arm} | {a['stack']:.3f} | {a['sim']:.3f} | {a['diff']:+.3f} | {_ok(a['within'])} |")
        differs = [c["term"] for c in res["calibration"] if c["differs"]]
        notes.append(f"- {key}: terms that differ — {'; '.join(differs) if differs else 'none'}.")
    return lines + [""] + notes


def eval800(r: dict) -> list[str]:
    b, p = r["baseline_hits"], r
    t, s = r["ttft_ms"], r["stall_ms"]
    return [
        "### 800-request trace through the whole stack — `make bench` → `reports/multi_lora_eval.json`",
        "",
        f"Envoy + ext_proc + agents + builtin engines, each engine's pool {r['pool_adapters']} adapter slots for "
        f"{r['adapters']} adapters ({r['pool_mb']} MiB: room for the {r['pool_adapters']} largest, vLLM's "
        f"`--max-loras` semantics); {r['replay']}, {r['sessions']} sessions; cold means cold: every load "
        "into the pool, first or after an eviction, goes artifact store over loopback HTTP → disk cache → "
        "host → pool, digest verified (the agent keeps no host or disk copy of an adapter that left the "
        "pool). Model: the fixtures' tiny Llama "
        f"(hidden {r['model_shape']['hidden_size']}, {r['model_shape']['num_hidden_layers']} layers), adapters "
        f"{min(r['bytes']['adapters']) / 1e3:.0f}–{max(r['bytes']['adapters']) / 1e3:.0f} KB.",
        "",
        *fleet(r),
        "",
        f"The {r['fleet_hosts']}-host fleet in detail (the report's top-level fields: prefetch off = `affinity`, "
        "prefetch on = `ace`):",
        "",
        "| | prefetch off (affinity) | prefetch on (ace) |",
        "|---|---|---|",
        f"| effective hits (adapter ready when the engine needed it) | {b['effective_hits']}/{b['total']} "
        f"({100 * b['effective_hit_ratio']:.2f}%) | {p['effective_hits']}/{p['total']} "
        f"({100 * p['effective_hit_ratio']:.2f}%) |",
        f"| resident (VRAM pool) hits | {b['resident_hits']} | {p['resident_hits']} |",
        *(f"| effective hits, {label} | {r['by_step']['baseline'][k]['effective_hits']}/"
          f"{r['by_step']['baseline'][k]['total']} | {r['by_step']['prefetch'][k]['effective_hits']}/"
          f"{r['by_step']['prefetch'][k]['total']} |"
          for k, label in (("first", "first steps of sessions"), ("later", "later steps"))
          if "by_step" in r),
        *(f"| TTFT p{q} ms | {t['baseline'][f'p{q}']:.1f} | {t['prefetch'][f'p{q}']:.1f} |" for q in (50, 90, 95, 99)),
        *(f"| adapter stall p{q} ms | {s['baseline'][f'p{q}']:.2f} | {s['prefetch'][f'p{q}']:.2f} |"
          for q in (50, 90, 95, 99)),
        "",
        f"- Cold swap {_ms(r['cold_swap_ms'])} ms vs warm ({r['warm_swap_source']}) {_ms(r['warm_swap_ms'], '.2f')} ms"
        + (f": {r['swap_speedup']:.1f}×" if r["swap_speedup"] else "")
        + f". VRAM savings vs one instance per adapter: {r['vram_savings_pct']:.1f}% "
        f"(real byte counts). Gateway overhead {_ms(r['gateway_overhead_ms'], '.2f')} ms.",
        "",
        "What the numbers mean: an **effective hit** is a request whose adapter was already in the "
        "engine's pool when the engine started it, whether it stayed there or a prefetch put it "
        "there (the engine's `x-ace-adapter-wait-ms` ≤ 1 ms); a **resident hit** is one whose adapter "
        "was in the pool when the request arrived; the **adapter stall** is the engine's measured "
        "wait for the adapter; **TTFT** is the client's time to the first streamed chunk through "
        f"Envoy{_ttft_chunk(r)}; **loads** are the engines' loads into their pools; **prefetch** counts the gateway's "
        "signals (warm set included), those whose adapter a request then used or that left unused, and "
        "the loads the agents preempted (– where the agents expose no such counter); "
        "**cold swap** is the engine's wait for a remote → pool load and **warm** the engine's wait "
        "for a host → pool copy or, when none happened (cold means cold), for an adapter a prefetch had "
        "made resident; "
        "**VRAM savings** compares base + pool bytes with one base model per adapter; **gateway "
        "overhead** is the added p50 of the same request through Envoy + ext_proc vs to an engine "
        "directly.",
        "",
        *(where_time_goes(r) + [""] if where_time_goes(r) else []),
        f"![TTFT distributions per arm, {r['fleet_hosts']} hosts](reports/multi_lora_eval.png)",
    ]


def _ratio(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def sim(r: dict) -> list[str]:
    budgets = r["budgets"]
    policies = list(r["results"])
    tg = r["targets"]
    lines = [
        "### Simulator — `make sim` → `reports/sim.json`",
        "",
        f"{r['requests']:,} requests, {r['adapters_seen']:,} adapters, {r['tenants_seen']} tenants, "
        f"{r['sessions']:,} sessions; the gateway's own policy code on a simulated clock "
        f"({r['elapsed_s']:.0f} s here). Hit ratio = {r['metric'].split('= ', 1)[-1]}.",
        "",
        "| budget (adapters) | " + " | ".join(policies) + " |",
        "|---|" + "---|" * len(policies),
        *(f"| {b} | " + " | ".join(f"{r['results'][p][str(b)]['hit_ratio']:.3f}" for p in policies) + " |"
          for b in budgets),
        "",
        f"- At budget {tg['budget']}: speculative closes {_ratio(tg['gap_closed'])} of the LRU → oracle gap "
        f"(target ≥ 0.5, {_ok(tg['gap_closed_met'])}); beats Belady's demand-caching optimum: "
        f"{_ok(tg['beats_belady'])} ({tg['hit_ratio']['speculative']:.3f} vs {tg['hit_ratio']['belady']:.3f}).",
    ]
    if "bounds_ok" in r:
        lines.append(f"- Bounds (oracle ≥ every policy, Belady ≥ LRU, per budget and per pool): "
                     f"{'hold' if r['bounds_ok'] else 'BROKEN: ' + '; '.join(r['bounds_broken'])}.")
    one = r.get("one_host")
    if one:
        h = one["hit_ratio"]
        lines.append(f"- 1 host, {one['budget']} slots, `{one['trace']}` replayed cold: ace (speculative) "
                     f"{h['speculative']:.3f} vs Belady's demand optimum {h['belady']:.3f} "
                     f"({_ok(one['ace_above_belady'])}); first steps hit {one['first_step_hits']['speculative']}"
                     f"/{one['first_steps']} (LRU {one['first_step_hits']['lru']}).")
    fleet = r.get("fleet")
    if fleet:
        w = fleet["workload"]
        arms = ("round_robin", "affinity", "ace")
        lines += [
            "",
            f"Fleet: {fleet['hosts']} hosts, {w['requests']:,} requests over {w['adapters']:,} adapters "
            f"({w['tenants']:,} tenants, {w['rate_per_s']:g} req/s); effective hit ratio per arm, "
            "resident in brackets, first-step hit ratio, and the per-pool bounds on ace's routing:",
            "",
            "| budget per host | " + " | ".join(arms) + " | first steps (rr / aff / ace) | Belady | oracle |",
            "|---|" + "---|" * (len(arms) + 3),
        ]
        for b in fleet["budgets"]:
            res = fleet["results"][str(b)]
            cells = " | ".join(f"{res[a]['hit_ratio']:.3f} ({res[a]['resident_hit_ratio']:.3f})" for a in arms)
            first = " / ".join(_ratio(res[a]["first_step_hit_ratio"]) for a in arms)
            bnd = res["ace"].get("bounds") or {}
            lines.append(f"| {b} | {cells} | {first} | {_ratio(bnd.get('belady', {}).get('hit_ratio'))} | "
                         f"{_ratio(bnd.get('oracle', {}).get('hit_ratio'))} |")
        ft = fleet.get("targets") or {}
        if ft:
            lines += ["", f"- At {ft['budget']} slots per host: ace − affinity = {ft['ace_minus_affinity']:+.3f} "
                          f"(target ≥ +0.10, {_ok(ft['ace_minus_affinity_met'])}); ace closes "
                          f"{_ratio(ft.get('gap_closed'))} of the affinity → oracle gap "
                          f"(target ≥ 0.5, {_ok(ft.get('gap_closed_met', False))})."]
        lines += ["", "![fleet: hit ratio per arm over the per-host budgets](reports/sim_fleet.png)"]
    return lines + ["", "![hit ratio per policy over the budget sweep](reports/sim.png)"]


def _ttft3(t: dict | None) -> str:
    return "–" if not t else " / ".join(_ms(t.get(q), ".0f") for q in ("p50", "p90", "p99"))


def _ranked(r: dict) -> str:
    """How many of vLLM's cache evictions took the agents' ranking, per gateway arm that has
    the count (``ranked_evictions``; reports before the ranking have none)."""
    counts = [f"{arm} {e['ranked_evictions']}" for n in r["fleets"].values() for arm, e in n.items()
              if e.get("ranked_evictions")]
    return f"; vLLM's evictions that took the ranking: {', '.join(counts)}" if counts else ""


def _compared_ttft(e: dict) -> dict:
    """An arm's TTFT percentiles as the checks compare them: pooled where it was replayed."""
    return (e.get("pooled") or {}).get("ttft_ms") or e["ttft_ms"]


def _and(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _vllm_runs(t: dict, arms: dict) -> str:
    """The line that says how the replayed arms were compared: each run, and the machine's
    pace in each."""
    pair = [arm for arm in ("vllm_router", "vllm_router_session", "affinity", "ace") if arms.get(arm, {}).get("replays")]
    each = "; ".join(f"{arm} " + ", ".join(f"{x['hits']}/{x['served']} hits, TTFT p50 "
                                          f"{_ms(x['ttft_ms']['p50'], '.0f')} p99 {_ms(x['ttft_ms']['p99'], '.0f')}"
                                          for x in arms[arm]["replays"]) for arm in pair)
    line = f"- The checks below compare {_and(pair)} {t['compared']} (each run: {each})"
    runs = (t.get("machine_pace") or {}).get("runs") or {}
    if runs:
        line += ("; the machine's pace in their runs (bench.pace's fixed work, over the fastest run): "
                 + "; ".join(f"{arm} {', '.join(f'{v:.2f}' for v in runs[arm])}" for arm in pair if arm in runs))
    return line + "."


def _vllm_causes(m: dict | None, need: float) -> str:
    """The sentence on the ace arm's misses by cause (its first run's ``miss_causes``)."""
    if not m:
        return ""
    causes = ", ".join(f"{k} {v}" for k, v in m["causes"].items() if v)
    kept = sum(m.get("belady_kept", {}).values())
    return (f" Its first run's misses by cause (a request whose adapter was not registered on its host when it "
            f"left, the agents' view: {m['misses']} of {m['requests']}): {causes}; Belady on the same host "
            f"sequences hits {kept} of them. Were every miss but the compulsory and unpredictable ones a hit, "
            f"ace would make {100 * m['ceiling']:.1f}% (the +10 target needs {100 * need:.1f}%): the target is "
            f"under that ceiling, so the evicted, capacity and opener misses are what it misses by.")


def _reference_line(ref: dict | None, needs: dict[str, float], held: str = "registrations") -> str:
    """The line on what prediction is worth on ace's routing (its first run's
    ``prefetch_reference``), against the hits each target ``needs``; ``held``: what a
    host's ``slots`` are (vLLM's registrations, the builtin pool's slots)."""
    if not ref:
        return ""
    p = ref["predictors"]

    def one(name: str, what: str) -> str:
        e = p[name]
        right = (f", {e['predictions_right']} of its {e['predictions']} guesses naming the session's next request"
                 if e["predictions"] and name != "next_step" else "")
        return f"{what} {e['hits']}{right}"

    reached = {name: [t for t, need in needs.items() if p[name]["hits"] >= need] for name in p}
    met = "; ".join(f"{name}: {', '.join(t) if t else 'none'}" for name, t in reached.items())
    return ("What prediction is worth on that routing (`prefetch_reference`, bench/prefetch_reference.py: ace's "
            f"first run replayed in the order sent through the same {ref['slots']} {held} a host, with loads "
            "that take no time and one rule: evict the adapter the fewest live predictions name, prefetch a "
            f"predicted one when its victim is named by fewer; references, not bounds): of {ref['requests']} "
            "requests, " + one("none", "no prediction (LRU)") + "; "
            + one("learned", "a second-order model learned online from the requests already sent") + "; "
            + one("seen_workflows", "the generator's plan of each session whose workflow an earlier session "
                                    "followed, else the learned model") + "; "
            + one("workflow", "the trace generator's own plan of every session (its habitual workflow; strays and "
                              "early ends unknown)") + "; "
            + one("next_step", "each session's actual next step") + ". The targets need "
            + ", ".join(f"{t} {need:.0f}" for t, need in needs.items())
            + f"; reached by {met}.")


def _vllm_paired(p: dict) -> str:
    """The line on ace's TTFT against affinity's request by request (``targets.ttft_paired``)."""
    def one(x: dict | None) -> str:
        if not x:
            return "–"
        return f"{x['median_ms']:+.2f} ms (95% interval {x['ci95_ms'][0]:+.2f} to {x['ci95_ms'][1]:+.2f}, {x['requests']} requests)"
    drift = "; ".join(f"{arm} {v:+.2f} ms" for arm, v in p.get("drift_ms", {}).items())
    return (f"- Request by request (each request's TTFT in ace, mean over its runs, minus in affinity; median): "
            f"{one(p['all'])}; over the requests registered on their host in every run of both arms "
            f"{one(p.get('resident_both'))}" + (f". The same measure between an arm's own last and first run "
                                                 f"(the machine's drift, the comparison's resolution): {drift}" if drift else "")
            + ".")


def vllm_eval(r: dict) -> list[str]:
    """``make bench ENGINE=vllm``: the arms on real vLLM hosts, the targets, what bounds them."""
    (hosts, arms), = r["fleets"].items()
    flags = " ".join(r["vllm_flags"])
    s_cache = r["vllm_flags"][r["vllm_flags"].index("--max-cpu-loras") + 1]
    rows, bound_rows = [], []
    for arm, e in arms.items():
        ag = e.get("agents") or {}
        pf = f"{ag.get('prefetch:accepted', 0)}/{sum(v for k, v in ag.items() if k.startswith('prefetch:rejected'))}"
        re_reads = f" ({e['re_reads']} re-reads)" if e.get("re_reads") else ""
        rows.append(f"| {arm} | {e['hits']}/{e['served']} | {e['on_demand_loads']}{re_reads} | {e['agent_loads']} | "
                    f"{e['unloads']} | {pf} | {_ttft3(e['ttft_ms'])} | {e['errors']} | "
                    + ", ".join(f"{v:.2f}" for v in e["engine_busy"].values())
                    + f" | {' → '.join(f'{v:g}' for v in e['machine_load_avg_1m'])} |")
        b = e.get("bounds")
        if b:
            by_reg = e.get("ttft_ms_by_registration") or {}
            bound_rows.append(
                f"| {arm} | {b['compulsory_fleet']} | {b.get('compulsory_this_routing', '–')} | "
                f"{b.get('belady_this_routing', '–')} | {b['belady_fleet_cache']} | "
                f"{e['on_demand_loads'] + e['agent_loads']} | {_ttft3(by_reg.get('registered'))} | "
                f"{_ttft3(by_reg.get('not_registered'))} |")
    t = r["targets"]
    def failure(arm: str, e: dict) -> str:
        why = ", ".join(f"{n} × {'HTTP ' if k.isdigit() else ''}{k}" for k, n in (e.get("error_statuses") or {}).items())
        return f"{arm} {e['errors']}" + (f" ({why})" if why else "")

    failed = [failure(arm, e) for arm, e in arms.items() if e["errors"]]
    checks = [f"- 0 errors in every arm — {_ok(t['no_errors'])}" + (f": {'; '.join(failed)}" if failed else "") + "."]
    if "hits_over_affinity" in t:
        worse = [q for q, ok in t["ttft_no_worse_than_affinity"].items() if not ok]
        checks += [
            f"- ace's hits ≥ affinity's + 10 points — {_ok(t['hits_over_affinity']['met'])} "
            f"({100 * t['hits_over_affinity']['got']:+.1f} points).",
            f"- vLLM's on-demand loads in the ace arm ≤ half of affinity's — "
            f"{_ok(t['on_demand_loads_half_of_affinity']['met'])} ({t['on_demand_loads_half_of_affinity']['got']:g} "
            f"against ≤ {t['on_demand_loads_half_of_affinity']['want']:g}).",
            f"- TTFT p50 / p90 / p99 ≤ 1.05× affinity's + 1 ms — {_ok(not worse)}"
            + (f" (worse at {', '.join(worse)})" if worse else "") + "."]
        if t.get("ttft_paired"):
            checks.append(_vllm_paired(t["ttft_paired"]))
    if t.get("compared", "one run each") != "one run each":
        checks.insert(1, _vllm_runs(t, arms))
    if "hits_over_best_vllm_router" in t:
        checks += [
            f"- ace's hits ≥ the best vllm-router arm's + 30 points — {_ok(t['hits_over_best_vllm_router']['met'])} "
            f"({100 * t['hits_over_best_vllm_router']['got']:+.1f} points).",
            f"- ace's TTFT p99 below every vllm-router arm's — {_ok(t['ttft_p99_below_every_vllm_router'])} ("
            + "; ".join(f"{arm} {_ms(_compared_ttft(arms[arm])['p99'])}" for arm in ("ace", "vllm_router",
                                                                                    "vllm_router_session")
                        if arm in arms) + " ms)."]
    out = [
        "### Real vLLM hosts — `make bench ENGINE=vllm` → `reports/vllm_eval.json`",
        "",
        f"{hosts} real vLLM hosts (CPU build, the fixtures' model, `{flags}`, filesystem resolver"
        + (", ace's evicting unload and victims' ranking: `VLLM_PLUGINS=" + ",".join(r["vllm_plugins"])
           + "`, tools/vllm_evict, with the agents' `--vllm-unload-evicts`"
           + _ranked(r) if "ace_evict" in (r.get("vllm_plugins") or ()) else "")
        + ") with their agents (in the vllm-router arms they only watch: they unload nothing); "
        f"the first {r['requests']} requests (whole sessions, {r['adapters']} adapters) of `{r['trace']}`, "
        f"closed-loop, arms in the order {', '.join(r['arm_order'])}. `vllm_router`: vllm-router's default policy "
        "(`cache_aware`); `vllm_router_session`: its `consistent_hash` on the session the client sends. Hits = "
        "requests vLLM served − its on-demand loads: the reads into its CPU cache that requests waited for (its "
        "resolver's registrations, and re-reads of registered adapters its CPU LRU had dropped, which vLLM does not "
        "log: ace's measuring plugin, tools/vllm_measure, counts every read); prefetch = the agents' accepted / "
        "refused hints; "
        "`engine_busy`: vLLM's CPU seconds per wall second per thread, per host; load = the machine's 1-minute load "
        "average at the arm's start → end.",
        "",
        f"| arm ({hosts} hosts, {r['requests']} requests, {r['adapters']} adapters) | hits | vLLM on-demand loads | "
        "agent loads | unloads | prefetch accepted/refused | TTFT p50 / p90 / p99 (ms) | errors | engine_busy | load |",
        "|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "![TTFT per arm on real vLLM](reports/vllm_eval_ttft.png)",
        "",
        *checks,
    ]
    ace, aff = arms.get("ace"), arms.get("affinity")
    if ace and aff and ace.get("bounds", {}).get("belady_this_routing") is not None:
        n, b = ace["served"], ace["bounds"]
        ceiling = n - b["belady_this_routing"]
        routers = [arms[a] for a in ("vllm_router", "vllm_router_session") if a in arms]

        def per_run(e: dict, field: str) -> float:
            """``field`` per run, as the targets count it: over every run of a replayed arm."""
            pooled = e.get("pooled")
            return pooled[field] / pooled["replays"] if pooled else e[field]

        need_hits = per_run(aff, "hits") + 0.10 * n
        aff_on_demand = per_run(aff, "on_demand_loads")
        sp = ace.get("speculation") or {}
        lines = [
            f"- What bounds ace's hits: with its routing the fewest loads any eviction could make (Belady) are "
            f"{b['belady_this_routing']}, so without prefetch at most {ceiling} of {n} requests can find their adapter "
            f"registered; one cache of all hosts' registrations (any routing) allows {n - b['belady_fleet_cache']}. "
            f"+10 points over affinity needs {need_hits:.0f} a run (the targets' count: over all of an arm's runs)"
            + (f", +30 over the best vllm-router arm {max(per_run(r, 'hits') for r in routers) + 0.30 * n:.0f}"
               if routers else "")
            + ". Above the ceiling only prefetches that displace nothing needed can go: of ace's "
            f"{sp.get('prefetches', '–')} speculative prefetches the gateway counted {sp.get('prefetch_used', '–')} used "
            f"and {sp.get('prefetch_wasted', '–')} wasted." + _vllm_causes(ace.get("miss_causes"), need_hits / n),
            f"- What bounds its on-demand loads: half of affinity's is {aff_on_demand / 2:g} a run; every load the "
            f"Belady count names ({b['belady_this_routing']}) is either vLLM's on demand or a prefetch ahead of need, "
            f"so the target needs at least {math.ceil(b['belady_this_routing'] - aff_on_demand / 2)} of them made "
            f"ahead of need by prefetches; ace made {ace['on_demand_loads']} on-demand and {ace['agent_loads']} agent "
            "loads.",
        ]
        needs = {"+10 over affinity": need_hits, "on-demand <= half of affinity's": n - aff_on_demand / 2}
        if routers:
            needs["+30 over the best vllm-router arm"] = max(per_run(r, "hits") for r in routers) + 0.30 * n
        if ace.get("prefetch_reference"):
            lines.append("- " + _reference_line(ace["prefetch_reference"], needs))
        by_reg = ace.get("ttft_ms_by_registration") or {}
        reg, unreg = by_reg.get("registered") or {}, by_reg.get("not_registered") or {}
        if reg.get("p50") is not None and unreg.get("p50") is not None:
            lines.append(
                f"- What bounds TTFT: in the ace arm a request whose adapter was registered had TTFT p50 {reg['p50']:.0f} "
                f"ms, one whose was not {unreg['p50']:.0f} ms (affinity: "
                + " / ".join(_ms(((aff.get("ttft_ms_by_registration") or {}).get(k) or {}).get("p50"), ".0f")
                             for k in ("registered", "not_registered"))
                + " ms); the agents' own loads run on vLLM's engine core between steps, where every running "
                "request waits for them, so a bet's load that is not used delays the requests that arrive "
                "meanwhile: the agents take a bet there only when it pays for that time too (docs/agent.md, "
                "speculation budget).")
        out += ["", *lines]
    if bound_rows:
        out += [
            "",
            "What bounds them, per arm on its own requests in the order sent (`bounds`): compulsory first loads "
            "(each adapter once in the fleet; each (host, adapter) pair once under this arm's routing), Belady's MIN "
            f"(the fewest loads any eviction could make, no prefetch) per host with its {s_cache} "
            "registrations under this arm's routing, and over one cache of all hosts' (any routing), against the "
            "loads the arm made (vLLM's on-demand + the agents'); TTFT of the requests whose adapter was registered "
            "on the chosen host when they left, and of those whose was not (the agents' view).",
            "",
            "| arm | compulsory (fleet) | compulsory (this routing) | Belady, this routing | Belady, one fleet cache "
            "| loads made | TTFT registered p50 / p90 / p99 | TTFT not registered p50 / p90 / p99 |",
            "|---|---|---|---|---|---|---|---|",
            *bound_rows,
        ]
    return out


def vllm_paths(r: dict) -> list[str]:
    """``make bench-vllm-paths``: what each path of a request costs on one vLLM host."""
    def d(x: dict) -> str:
        return f"{x['median_ms']:+.2f} ms ({x['ci95_ms'][0]:+.2f} to {x['ci95_ms'][1]:+.2f})"
    c, pm, fp = r["cases"], r["paired_ms"], r["front_paired_ms"]
    rows = [f"| {name} | {v['requests']} | {_ttft3(v)} |" for name, v in {**c, **r["front"]}.items()]
    fronts = "; ".join(f"{k.replace('_minus_', ' − ').replace('_', ' ')} {d(v)}" for k, v in fp.items())
    return [
        "### What a request's path costs on vLLM — `make bench-vllm-paths` → `reports/vllm_paths.json`",
        "",
        f"One vLLM host (`{' '.join(r['vllm_flags'])}`, the plugins above), one request at a time, streamed, "
        f"{r['rounds']} rounds with the cases interleaved request by request; TTFT at the client. `cpu_cache`: "
        "registered and in vLLM's CPU cache, moved into a slot; `re_read`: registered, its weights dropped by "
        "vLLM's CPU LRU (a miss in the vllm-router arms); `resolver`: unregistered, vLLM's filesystem resolver "
        "registers it (a miss in the gateway's arms, where the agents unload what they evict); then one "
        "registered adapter through each front and straight to vLLM. vLLM's log is checked: each case was the "
        "path it names.",
        "",
        "| case or front | requests | TTFT p50 / p90 / p99 (ms) |",
        "|---|---|---|",
        *rows,
        "",
        f"- Paired medians (95% interval): re-read − cached {d(pm['re_read_minus_cpu_cache'])}; resolver − cached "
        f"{d(pm['resolver_minus_cpu_cache'])}; resolver − re-read {d(pm['resolver_minus_re_read'])}.",
        f"- Fronts, paired medians: {fronts}.",
        "- So on these hosts the gateway's path and vllm-router's cost a request about the same, and a miss "
        "costs about what a front does; a miss in the gateway's arms (a registration through the resolver) costs "
        f"{pm['resolver_minus_re_read']['median_ms']:+.2f} ms more than one in vllm-router's (a re-read of a "
        "registered adapter): one reason vllm-router's arms serve about twice the misses at TTFT near affinity's.",
    ]


def inference_perf(r: dict) -> list[str]:
    """``make bench-inference-perf``: the tool's own per-adapter reports, per target."""
    targets = r["targets"]
    names = list(targets)
    head = " | ".join(f"{t}: ok / failed | {t}: TTFT p50 / p90 / p99 (ms)" for t in names)
    rows = []
    for adapter, split in r["lora_traffic_split"].items():
        cells = []
        for t in names:
            a = (targets[t].get("summary") or {}).get("per_adapter", {}).get(adapter) or {}
            cells.append(f"{a.get('successes', 0)} / {a.get('failures', 0)} | {_ttft3(a.get('ttft_ms'))}")
        rows.append(f"| {adapter} | {split:g} | " + " | ".join(cells) + " |")
    total = []
    for t in names:
        o = (targets[t].get("summary") or {}).get("overall") or {}
        total.append(f"**{o.get('successes', 0)} / {o.get('failures', 0)}** | **{_ttft3(o.get('ttft_ms'))}**")
    lines = []
    for t in names:
        e = targets[t]
        eng = e["engines"].values()
        lines.append(
            f"- **{t}**: {e['front']}. Tool exit code {e['exit_code']}, {e['seconds']:g} s; the engines served "
            f"{sum(h['served'] for h in eng)}, vLLM's on-demand loads {sum(h['on_demand_loads'] for h in eng)} "
            f"({sum(h['re_reads'] for h in eng)} re-reads of registered adapters its CPU LRU had dropped), the "
            f"agents' loads {sum(h['agent_loads'] for h in eng)}, unloads {sum(h['unloads'] for h in eng)}; load "
            f"average {' → '.join(f'{v:g}' for v in e['machine_load_avg_1m'])}.")
    return [
        "### inference-perf's LoRA split — `make bench-inference-perf` → `reports/inference_perf.json`",
        "",
        f"{r['tool']} (unpatched), its LoRA traffic split over {len(r['lora_traffic_split'])} adapters (5 share 60%, "
        f"5 share 30%, 5 share 10%), constant {r['rate']:g} requests/s for {r['duration_s']} s, streamed completions, "
        f"against {r['hosts']} real vLLM hosts per target (`{' '.join(r['vllm_flags'])}`: 3 slots per host). "
        "Per adapter, from the tool's own `adapter_<name>_lifecycle_metrics.json` files; the last row from its "
        "`summary_lifecycle_metrics.json`.",
        "",
        f"| adapter | split | {head} |",
        "|---|---|" + "---|---|" * len(names),
        *rows,
        "| all | 1 | " + " | ".join(total) + " |",
        "",
        *lines,
    ]


def render(load: Loader | None = None) -> str:
    """The section from ``load``'s reports (default: this checkout's working tree)."""
    load = load or working_tree_reports(REPO)
    parts: list[str] = []
    for name, fn in zip(REPORT_FILES, (gateway, agent, agent_cuda, interference_cuda, hundreds, sixteen, eval800,
                                       sim, sim_vs_stack, vllm_eval, vllm_paths, inference_perf), strict=True):
        report = load(name)
        if report is not None:
            parts += fn(report) + [""]
    return "\n".join(parts).rstrip() + "\n"


def readme_section(readme: str) -> str:
    """The README's numbers section, between the markers."""
    return readme.split(BEGIN, 1)[1].split(END, 1)[0]


def stale_section(repo: Path = REPO) -> str | None:
    """None when the README's numbers section is rendered from the committed reports or from
    the working tree's (updated after a new run, not yet committed); else what to run. A
    benchmark that has just rewritten a report leaves the committed README true: it shows
    the committed reports until someone runs ``--update``."""
    section = readme_section((repo / "README.md").read_text()).strip()
    if section == render(working_tree_reports(repo)).strip():
        return None
    committed = committed_reports(repo)
    if committed is not None and section == render(committed).strip():
        return None
    return ("README.md's numbers section matches neither the committed reports nor the "
            "working tree's: run python -m tools.report_tables --update")


def update(readme: Path) -> None:
    text = readme.read_text()
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"{readme}: markers {BEGIN!r} … {END!r} not found")
    readme.write_text(f"{head}{BEGIN}\n{render()}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--update", action="store_true", help="rewrite the section in README.md")
    a = p.parse_args(argv)
    if a.update:
        update(REPO / "README.md")
    else:
        sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
