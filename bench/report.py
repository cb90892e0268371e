"""The multi-LoRA benchmark's report arithmetic: pure functions over measured rows.

A *row* is one replayed request as measured through the stack::

    {"domain": "coding", "adapter": "code-sql", "tier": "device", "wait_ms": 0.4, "ttft_ms": 12.3}

``tier`` and ``wait_ms`` come from the builtin engine's ``x-ace-adapter-tier`` and
``x-ace-adapter-wait-ms`` headers (where the adapter was when the request arrived, and
how long the request waited for it); ``ttft_ms`` is measured by the client. Nothing here
invents a number: every field is computed from rows and measured samples.

Definitions:

- ``resident_hits``: requests whose adapter was already on the device (tier ``device``;
  rows recorded before the tier rename say ``pool``, read the same).
- ``effective_hits``: requests that did not wait for their adapter (``wait_ms`` at most
  ``stall_eps_ms``): resident, or made resident by a prefetch before the engine needed it.
- ``cold_swap_ms`` / ``warm_swap_ms``: median load time of an adapter that was not on
  the host (remote -> disk -> host -> pool) / that was prefetched (host -> pool or
  already resident); ``swap_speedup`` = cold / warm.
- ``vram_savings_pct``: 1 - (base + pool bytes) / (adapters x (base + adapter bytes)),
  one shared base model with a pool versus one dedicated instance per adapter.
- ``by_step``: the hit counts of a session's first step (``step`` 0: no session model
  can predict it, only popularity, the warm set and the first-step model help) and of
  its later steps, per run; a row without ``step`` takes its position in its session.

The fleet benchmark (``fleets``: hosts -> arm -> ``fleet_entry``) runs three arms on the
same trace: ``round_robin`` (no affinity, no prefetch), ``affinity`` (ace's placement
and residency-aware routing, prefetch off) and ``ace`` (routing + prefetch).
``fleet_checks`` compares them: ``ace`` no worse than ``affinity`` at any stall or TTFT
percentile beyond noise (``<= NOISE_FACTOR x + NOISE_MS``), no errors in any arm, and the
4-host targets (``TARGETS``) against the seeds' figures.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

__all__ = [
    "NOISE_FACTOR",
    "NOISE_MS",
    "QUANTILES",
    "TARGETS",
    "build_report",
    "by_domain",
    "by_step",
    "fleet_checks",
    "fleet_entry",
    "first_replay_rows",
    "format_fleets",
    "format_report",
    "hit_counts",
    "median_ci",
    "paired_ttft",
    "percentiles",
    "swap_speedup",
    "ttft_breakdown",
    "vram_savings_pct",
]

# The engine's `x-ace-adapter-tier` for an adapter already on the device; "pool" is the
# name it had before the tier vocabulary was unified (rows in reports/ recorded then).
RESIDENT_TIERS = ("device", "pool")

QUANTILES = (50, 90, 95, 99)
BUSY_LIMIT = 0.7  # share of the replay an engine may spend in forward passes: above, it measures queueing
NOISE_FACTOR, NOISE_MS = 1.05, 1.0
# the seeds' figures for 4 hosts, 800 items: ace's effective / resident hit ratios, and
# affinity's stall p99 over ace's at least this
TARGETS = {"effective_hit_ratio": 0.9925, "resident_hit_ratio": 0.98, "stall_p99_reduction": 10.0}


def percentiles(values: Iterable[float], qs: Sequence[int] = QUANTILES) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` with linear interpolation between order statistics (numpy's
    default); ``None`` for an empty sample (unknown is a value, not zero)."""
    xs = sorted(float(v) for v in values)
    out: dict[str, float | None] = {}
    for q in qs:
        if not xs:
            out[f"p{q}"] = None
            continue
        pos = (len(xs) - 1) * q / 100.0
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{q}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    return out


def hit_counts(rows: Sequence[Mapping], stall_eps_ms: float = 1.0) -> dict[str, float]:
    total = len(rows)
    resident = sum(1 for r in rows if r["tier"] in RESIDENT_TIERS)
    effective = sum(1 for r in rows if r["wait_ms"] <= stall_eps_ms)
    return {
        "total": total,
        "resident_hits": resident,
        "effective_hits": effective,
        "resident_hit_ratio": resident / total if total else 0.0,
        "effective_hit_ratio": effective / total if total else 0.0,
    }


def swap_speedup(cold_ms: float | None, warm_ms: float | None) -> float | None:
    if cold_ms is None or warm_ms is None or warm_ms <= 0:
        return None
    return cold_ms / warm_ms


def vram_savings_pct(base_bytes: int, pool_bytes: int, adapter_bytes: Sequence[int]) -> float:
    """Shared base + pool versus one dedicated (base + adapter) instance per adapter."""
    dedicated = sum(base_bytes + a for a in adapter_bytes)
    if dedicated <= 0:
        return 0.0
    return 100.0 * (1.0 - (base_bytes + pool_bytes) / dedicated)


def by_domain(rows: Sequence[Mapping], stall_eps_ms: float = 1.0) -> dict[str, dict]:
    domains: dict[str, list[Mapping]] = {}
    for r in rows:
        domains.setdefault(r["domain"], []).append(r)
    out = {}
    for d in sorted(domains):
        rs = domains[d]
        out[d] = {
            **hit_counts(rs, stall_eps_ms),
            "ttft_ms": percentiles(r["ttft_ms"] for r in rs),
            "stall_ms": percentiles(r["wait_ms"] for r in rs),
        }
    return out


def by_step(rows: Sequence[Mapping], stall_eps_ms: float = 1.0) -> dict[str, dict]:
    """Hit counts of first steps and later steps of sessions.

    A row's step is its ``step`` field where the trace has one (it is optional in
    docs/trace-format.md); otherwise the row's position among the rows of its
    (``tenant``, ``session``), in row order (a closed-loop replay records a session's
    steps in order). Rows with neither are left out."""
    first, later = [], []
    seen: set = set()
    for r in rows:
        step = r.get("step")
        key = (r.get("tenant"), r.get("session"))
        if not isinstance(step, int) or isinstance(step, bool):
            if r.get("session") is None:
                continue
            step = 1 if key in seen else 0
        seen.add(key)
        (first if step == 0 else later).append(r)
    return {"first": hit_counts(first, stall_eps_ms), "later": hit_counts(later, stall_eps_ms)}


def build_report(
    baseline: Sequence[Mapping],
    prefetch: Sequence[Mapping],
    *,
    cold_swap_samples_ms: Sequence[float],
    warm_swap_samples_ms: Sequence[float],
    base_bytes: int,
    pool_bytes: int,
    adapter_bytes: Sequence[int],
    gateway_overhead_ms: float | None,
    stall_eps_ms: float = 1.0,
    extra: Mapping | None = None,
) -> dict:
    """The report of ``make bench``: headline numbers are from the prefetch run."""
    hits = hit_counts(prefetch, stall_eps_ms)
    cold = percentiles(cold_swap_samples_ms, (50,))["p50"]
    warm = percentiles(warm_swap_samples_ms, (50,))["p50"]
    stall_b = percentiles(r["wait_ms"] for r in baseline)
    stall_p = percentiles(r["wait_ms"] for r in prefetch)
    p99_b, p99_p = stall_b["p99"], stall_p["p99"]
    report = {
        "total": hits["total"],
        "resident_hits": hits["resident_hits"],
        "effective_hits": hits["effective_hits"],
        "resident_hit_ratio": hits["resident_hit_ratio"],
        "effective_hit_ratio": hits["effective_hit_ratio"],
        "baseline_hits": hit_counts(baseline, stall_eps_ms),
        "cold_swap_ms": cold,
        "warm_swap_ms": warm,
        "swap_speedup": swap_speedup(cold, warm),
        "vram_savings_pct": vram_savings_pct(base_bytes, pool_bytes, adapter_bytes),
        "gateway_overhead_ms": gateway_overhead_ms,
        "ttft_ms": {
            "baseline": percentiles(r["ttft_ms"] for r in baseline),
            "prefetch": percentiles(r["ttft_ms"] for r in prefetch),
        },
        "stall_ms": {"baseline": stall_b, "prefetch": stall_p},
        "stall_p99_reduction": (p99_b / p99_p) if p99_b is not None and p99_p else None,
        "by_domain": {
            "baseline": by_domain(baseline, stall_eps_ms),
            "prefetch": by_domain(prefetch, stall_eps_ms),
        },
        "by_step": {
            "baseline": by_step(baseline, stall_eps_ms),
            "prefetch": by_step(prefetch, stall_eps_ms),
        },
        "bytes": {"base": base_bytes, "pool": pool_bytes, "adapters": list(adapter_bytes)},
    }
    if extra:
        report.update(extra)
    return report


def _ms(v: float | None) -> str:
    return "unknown" if v is None else f"{v:.2f} ms"


def format_report(r: Mapping) -> str:
    """The printed report (what ``make bench`` shows)."""
    total = r["total"] or 1
    lines = [
        f"multi-LoRA eval: {r['total']} requests",
        f"  VRAM resident hits         {r['resident_hits']:>5} / {r['total']}  ({100 * r['resident_hits'] / total:.2f}%)",
        f"  effective prefetch hits    {r['effective_hits']:>5} / {r['total']}  ({100 * r['effective_hits'] / total:.2f}%)",
    ]
    base = r.get("baseline_hits")
    if base:
        lines.append(f"  effective hits, prefetch off {base['effective_hits']:>3} / {base['total']}  "
                     f"({100 * base['effective_hit_ratio']:.2f}%)")
    lines += [
        f"  cold swap latency (p50)    {_ms(r['cold_swap_ms'])}",
        f"  warm/prefetched latency    {_ms(r['warm_swap_ms'])}",
        "  swap speedup               " + ("unknown" if r["swap_speedup"] is None else f"{r['swap_speedup']:.1f}x"),
        f"  VRAM savings vs dedicated  {r['vram_savings_pct']:.1f}%",
        f"  gateway overhead (p50)     {_ms(r['gateway_overhead_ms'])}",
        "",
        f"  {'':<16}{'p50':>10}{'p90':>10}{'p95':>10}{'p99':>10}",
    ]
    for metric in ("ttft_ms", "stall_ms"):
        for run in ("baseline", "prefetch"):
            ps = r[metric][run]
            cells = "".join(f"{'-' if ps[k] is None else format(ps[k], '.2f'):>10}" for k in ("p50", "p90", "p95", "p99"))
            lines.append(f"  {metric[:-3] + ' ' + run:<16}{cells}")
    lines += ["", f"  {'domain':<14}{'total':>6}{'resident':>10}{'effective':>10}{'stall p99 off':>15}{'on':>8}"]
    base_d, pre_d = r["by_domain"]["baseline"], r["by_domain"]["prefetch"]
    for d, row in pre_d.items():
        off = base_d.get(d, {}).get("stall_ms", {}).get("p99")
        on = row["stall_ms"]["p99"]
        lines.append(
            f"  {d:<14}{row['total']:>6}{row['resident_hits']:>10}{row['effective_hits']:>10}"
            f"{'-' if off is None else format(off, '.1f'):>15}{'-' if on is None else format(on, '.1f'):>8}"
        )
    steps = r.get("by_step")
    if steps:
        lines += ["", f"  {'session step':<14}{'total':>6}{'effective off':>15}{'on':>8}"]
        for kind, label in (("first", "first"), ("later", "later")):
            b, p = steps["baseline"][kind], steps["prefetch"][kind]
            lines.append(f"  {label:<14}{p['total']:>6}{b['effective_hits']:>15}{p['effective_hits']:>8}")
    return "\n".join(lines)


def fleet_entry(rows: Sequence[Mapping], *, errors: int, requests_per_host: Mapping[str, int],
                loads_by_tier: Mapping[str, int], prefetch: Mapping[str, int | None],
                stall_eps_ms: float = 1.0, extra: Mapping | None = None) -> dict:
    """One arm on one fleet: hit counts, stall and TTFT percentiles, first steps."""
    hits = hit_counts(rows, stall_eps_ms)
    first = by_step(rows, stall_eps_ms)["first"]
    entry = {
        **hits,
        "errors": errors,
        "stall_ms": percentiles(r["wait_ms"] for r in rows),
        "ttft_ms": percentiles(r["ttft_ms"] for r in rows if r["ttft_ms"] is not None),
        "first_step": {"total": first["total"], "effective_hits": first["effective_hits"]},
        "requests_per_host": dict(sorted(requests_per_host.items())),
        "loads_by_tier": dict(sorted(loads_by_tier.items())),
        "prefetch": dict(prefetch),
    }
    if extra:
        entry.update(extra)
    return entry


# the engine's ``ace_timing`` fields a row carries, and the report's name for each part
BREAKDOWN_PARTS = {"queue_ms": "queue_ms", "stall_ms": "wait_ms", "compute_ms": "compute_ms",
                   "loads_ms": "loads_ms", "outside_engine_ms": "outside_engine_ms"}


def ttft_breakdown(rows: Sequence[Mapping]) -> dict:
    """Where each request's TTFT went, from the engine's ``ace_timing``: ``stall_ms``
    (waiting for the adapter), ``queue_ms`` (then waiting for the first forward pass),
    ``compute_ms`` (that pass), ``outside_engine_ms`` (TTFT minus the engine's time to
    the first token: gateway, Envoy, loopback, the engine's HTTP handling), and
    ``loads_ms``: the engine's load work that ended in the request's window, prefetch or
    demand (it overlaps the others: loads run beside the forward loop or block it).
    Percentiles of each part over all rows, and the median of each part over the worst
    1% of TTFTs (at least one row): what the tail is made of. ``source_loads``: the
    requests whose stall was a load from the source, that load split into the source's
    fetch, the tiers' read/parse/copy and a prefetch's pauses (the engine's
    ``ace_timing.load``; absent from rows of engines that do not report it).
    ``outside_engine_split``: ``outside_engine_ms`` split at the engine's arrival mark
    (``ace_timing.arrived_s``): ``to_engine_ms`` (client, Envoy, ext_proc, the engine's HTTP
    read and tokenizing) and ``from_engine_ms`` (the first token's way back: the engine's
    stream write, Envoy, the client's read); absent where the engine gives no mark.
    ``loop_lag_ms``: how late the engine's event loop ran between the request's arrival and
    its first token (``ace_timing.loop_lag_ms``: a late loop delays every request on it,
    whatever its adapter), with the worst 1%'s median; absent where the engine gives none.
    ``client_lag_ms``: the same for the load generator's own loop, from the send to the
    first token (it delays both, so it is in ``outside_engine_ms``); absent where the rows
    do not carry it."""
    timed = [r for r in rows if r.get("compute_ms") is not None and r.get("ttft_ms") is not None]
    if not timed:
        return {"rows": 0}
    out: dict = {"rows": len(timed), "ttft_ms": percentiles(r["ttft_ms"] for r in timed)}
    for name, field in BREAKDOWN_PARTS.items():
        out[name] = {**percentiles(r[field] for r in timed), "mean": sum(r[field] for r in timed) / len(timed)}
    worst = sorted(timed, key=lambda r: r["ttft_ms"])[-max(1, len(timed) // 100):]
    out["worst_1pct"] = {"rows": len(worst), "ttft_ms_p50": percentiles(r["ttft_ms"] for r in worst)["p50"],
                         **{f"{name}_p50": percentiles(r[field] for r in worst)["p50"]
                            for name, field in BREAKDOWN_PARTS.items()}}
    split = {"to_engine_ms": lambda r: r.get("to_engine_ms"),
             "from_engine_ms": lambda r: (None if r.get("to_engine_ms") is None
                                          else r["outside_engine_ms"] - r["to_engine_ms"])}
    lags = {name: (lambda r, name=name: r.get(name)) for name in ("loop_lag_ms", "client_lag_ms")}
    for name, value in (*split.items(), *lags.items()):
        have = [v for v in map(value, timed) if v is not None]
        if not have:
            continue
        if name in split:
            out.setdefault("outside_engine_split", {"rows": len(have)})[name] = percentiles(have)
        else:
            out[name] = {**percentiles(have), "rows": len(have), "mean": sum(have) / len(have)}
        in_worst = [value(r) for r in worst]
        if None not in in_worst:   # the worst rows' median only when each of them has the part
            out["worst_1pct"][f"{name}_p50"] = percentiles(in_worst)["p50"]
    loads = [r for r in timed if r.get("load_fetch_ms") is not None]
    if loads:
        out["source_loads"] = {"rows": len(loads), "stall": percentiles(r["wait_ms"] for r in loads),
                               **{part: percentiles(r[f"load_{part}_ms"] for r in loads)
                                  for part in ("fetch", "tiers", "paused")}}
    return out


def _no_worse(ace: float | None, affinity: float | None) -> bool | None:
    if ace is None or affinity is None:
        return None
    return ace <= NOISE_FACTOR * affinity + NOISE_MS


def hundreds_targets(ace: Mapping, aff: Mapping) -> dict:
    """Issue 21's targets for the hundreds scenario at 4 hosts: ace's effective hits >= 0.90,
    >= affinity + 0.12 and >= Belady's demand optimum of its own per-host sequences; stall
    p99 at least 3x lower than affinity's; TTFT no worse at any percentile; no errors."""
    b, p = aff["stall_ms"]["p99"], ace["stall_ms"]["p99"]
    belady = (ace.get("bounds") or {}).get("belady_hit_ratio")
    got = {"effective_hit_ratio": ace["effective_hit_ratio"],
           "over_affinity": ace["effective_hit_ratio"] - aff["effective_hit_ratio"],
           "over_own_belady": None if belady is None else ace["effective_hit_ratio"] - belady,
           "stall_p99_reduction": (b / p) if b is not None and p else (math.inf if b else None)}
    want = {"effective_hit_ratio": 0.90, "over_affinity": 0.12, "over_own_belady": 0.0, "stall_p99_reduction": 3.0}
    out = {k: {"want": v, "got": got[k], "met": got[k] is not None and got[k] >= v} for k, v in want.items()}
    ttft = {q: _no_worse(ace["ttft_ms"][q], aff["ttft_ms"][q]) for q in aff["ttft_ms"]}
    out["ttft_no_worse"] = {"want": "<= 1.05 x affinity + 1 ms at p50/p90/p95/p99", "got": ttft,
                            "met": all(v is True for v in ttft.values())}
    out["no_errors"] = {"want": 0, "got": ace["errors"], "met": ace["errors"] == 0}
    return out


def sixteen_targets(ace: Mapping, aff: Mapping) -> dict:
    """Issue 21's targets for the sixteen scenario at 4 hosts x 8 slots: ace's effective hits
    >= 0.985 and never worse than affinity at any stall or TTFT percentile (<= 1.05x + 1 ms);
    no errors. ``ceiling``: the fleet's on-demand cold-start ceiling (each adapter's first
    request misses): a bound on affinity, not on ace, whose start-up fill of free room may
    load an adapter before its first request."""
    ceiling = (ace.get("bounds") or {}).get("fleet_compulsory_hit_ratio")
    out = {"effective_hit_ratio": {"want": 0.985, "got": ace["effective_hit_ratio"], "ceiling": ceiling,
                                   "met": ace["effective_hit_ratio"] >= 0.985}}
    for metric in ("stall_ms", "ttft_ms"):
        got = {q: _no_worse(ace[metric][q], aff[metric][q]) for q in aff[metric]}
        out[f"{metric}_no_worse"] = {"want": "<= 1.05 x affinity + 1 ms at every percentile", "got": got,
                                     "met": all(v is not False for v in got.values())}
    out["no_errors"] = {"want": 0, "got": ace["errors"], "met": ace["errors"] == 0}
    return out


def first_replay_rows(report_path: Path) -> list[dict]:
    """The per-request rows written beside a ``bench.multi_lora_eval`` or ``bench.vllm_eval`` report
    (``<report>_rows.jsonl``) of each arm's first replay: the rows its entries' counts,
    bounds and miss causes come from (``--replays`` adds more, marked ``replay``)."""
    path = report_path.with_name(report_path.stem + "_rows.jsonl")
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return [r for r in rows if r.get("replay", 1) == 1]


def compared(entry: Mapping) -> Mapping:
    """What the checks compare of one arm: the entry, with its stall and TTFT percentiles
    over every replay's rows and its errors summed over them (``pooled``) in place of the
    first replay's when it was replayed more than once (``bench.multi_lora_eval
    --replays``, ``bench.vllm_eval --replays``: the machine's drift is what pooling
    cancels; an entry without stall figures, vLLM's, keeps none). Hit counts and bounds
    stay the first replay's: they do not depend on the machine's speed."""
    pooled = entry.get("pooled")
    if not pooled:
        return entry
    return {**entry, **{k: pooled[k] for k in ("errors", "stall_ms", "ttft_ms") if k in pooled}}


def median_ci(diffs: Sequence[float], draws: int = 2000, seed: int = 0) -> dict:
    """The median of ``diffs`` and a 95% bootstrap interval of it (resampled ``draws``
    times with a fixed seed: the same rows give the same figures)."""
    rnd = random.Random(seed)
    n = len(diffs)
    boots = sorted(statistics.median(rnd.choices(diffs, k=n)) for _ in range(draws))
    return {"requests": n, "median_ms": round(statistics.median(diffs), 2),
            "ci95_ms": [round(boots[int(0.025 * draws)], 2), round(boots[int(0.975 * draws) - 1], 2)]}


def paired_ttft(rows: Iterable[Mapping], arm: str, against: str,
                resident: Callable[[Mapping], bool] | None = None) -> dict | None:
    """TTFT of ``arm`` against ``against`` request by request: both replay the same trace,
    so each request id has a TTFT in each (the mean over an arm's replays); their
    difference's median, with a 95% bootstrap interval, says what one arm costs or saves
    a request with the trace's own variety (its prompts, its sessions' timing) taken out,
    which percentiles over two separate samples leave in. ``resident_both``: the same over
    the requests ``resident`` says were resident in every run of both arms (what an arm's
    other work costs a request that waits for no load). ``drift``: per arm replayed more
    than once, the median difference of its last run against its first, request by
    request: how far the machine moved between runs of one code, the resolution of any
    comparison between arms. None when the rows hold no request of both arms."""
    ttft: dict[tuple[str, str], list[float]] = {}
    by_run: dict[tuple[str, int], dict[str, float]] = {}
    reg: dict[tuple[str, str], bool] = {}
    for r in rows:
        if r.get("status") != 200 or r.get("ttft_ms") is None or r.get("arm") not in (arm, against):
            continue
        key = (r["arm"], r["id"])
        ttft.setdefault(key, []).append(r["ttft_ms"])
        by_run.setdefault((r["arm"], r.get("replay", 1)), {})[r["id"]] = r["ttft_ms"]
        if resident is not None:
            reg[key] = reg.get(key, True) and bool(resident(r))
    ids = sorted({i for a, i in ttft if a == arm} & {i for a, i in ttft if a == against})
    if not ids:
        return None

    def diff(i: str) -> float:
        return statistics.fmean(ttft[(arm, i)]) - statistics.fmean(ttft[(against, i)])

    out: dict = {"arm": arm, "against": against, "all": median_ci([diff(i) for i in ids])}
    if resident is not None:
        both = [i for i in ids if reg[(arm, i)] and reg[(against, i)]]
        out["resident_both"] = median_ci([diff(i) for i in both]) if both else None
    drift = {}
    for name in (arm, against):
        runs = sorted(k for a, k in by_run if a == name)
        if len(runs) > 1:
            first, last = by_run[(name, runs[0])], by_run[(name, runs[-1])]
            common = [i for i in first if i in last]
            if common:
                drift[name] = round(statistics.median(last[i] - first[i] for i in common), 2)
    out["drift_ms"] = drift
    return out


def pace_reading(entry: Mapping, field: str) -> float | None:
    """One run's reading of the machine's pace: ``pace_probe_ms`` (the median CPU time of
    ``bench.pace``'s fixed work) or ``client_cpu_s`` (the load generator's CPU seconds,
    ``process_cpu_s["client"]``); None where not measured."""
    if field == "pace_probe_ms":
        return (entry.get("pace_probe_ms") or {}).get("cpu_ms_p50")
    return (entry.get("process_cpu_s") or {}).get("client")


def pace_readings(entry: Mapping, field: str) -> list[float]:
    """One arm's ``pace_reading`` per run: each replay's (``pooled[field]``) where the arm
    was replayed; empty where not measured."""
    replays = (entry.get("pooled") or {}).get(field)
    if replays is None:
        replays = [pace_reading(entry, field)]
    return [v for v in replays if v is not None]


PACE_MEASURES = {
    "pace_probe_ms": "CPU time of bench.pace's fixed work on the hosts' cores, median per run, over the fleet's least",
    "client_cpu_s": "load generator CPU seconds per run over the fleet's least (not the same work in every arm: "
                    "a hint only)",
}


def machine_pace(entries: Mapping[str, Mapping]) -> dict | None:
    """How fast the machine ran during each arm's runs of one fleet: ``runs``, per arm,
    each run's reading over the fleet's least (1.10: that run's cores were 10% slower);
    ``ace_over_affinity``, the ratio of the two arms' means. From ``bench.pace``'s probe
    where every arm has it, else from the load generator's CPU seconds (older reports);
    None where neither was measured. A TTFT check that fails is read beside it: the same
    requests cost every process more when the box is slower, and the tail with them."""
    for field, measure in PACE_MEASURES.items():
        runs = {arm: pace_readings(e, field) for arm, e in entries.items()}
        if not all(runs.values()):
            continue
        least = min(v for vs in runs.values() for v in vs)
        if least <= 0:
            continue
        out: dict = {"measure": measure, "runs": {arm: [round(v / least, 3) for v in vs] for arm, vs in runs.items()}}
        ace, aff = runs.get("ace"), runs.get("affinity")
        if ace and aff:
            out["ace_over_affinity"] = round((sum(ace) / len(ace)) / (sum(aff) / len(aff)), 3)
        return out
    return None


def fleet_checks(fleets: Mapping[str, Mapping[str, Mapping]], scenario: str = "800") -> dict:
    """What the report can check about itself: per fleet, ``ace`` against ``affinity`` at
    every stall and TTFT percentile, errors per arm; for 4 hosts, the scenario's targets
    (``TARGETS`` for the 800 trace, ``hundreds_targets``). Each arm as ``compared`` gives
    it (pooled over replays where it has them; ``compared`` says which)."""
    out: dict = {}
    for n, entries in fleets.items():
        arms = {arm: compared(e) for arm, e in entries.items()}
        c: dict = {"errors": {arm: e["errors"] for arm, e in arms.items()},
                   "no_errors": all(e["errors"] == 0 for e in arms.values())}
        ace, aff = arms.get("ace"), arms.get("affinity")
        if ace and aff:
            pooled = entries["ace"].get("pooled") and entries["affinity"].get("pooled")
            c["compared"] = f"pooled over {pooled['replays']} replays each, palindromic order" if pooled \
                else "one replay each"
            c["ace_no_worse_than_affinity"] = {
                metric: {q: _no_worse(ace[metric][q], aff[metric][q]) for q in aff[metric]}
                for metric in ("stall_ms", "ttft_ms")}
            c["ace_no_worse_everywhere"] = all(
                v is not False for m in c["ace_no_worse_than_affinity"].values() for v in m.values())
        routers = {arm: e for arm, e in arms.items() if arm.startswith("vllm_router")}
        if ace and routers:
            # issue 20: on the builtin engine ace answers faster than vllm-router at every
            # TTFT percentile (strictly lower; ace's pooled replays where it has them)
            c["ace_below_vllm_router"] = {
                arm: {q: ace["ttft_ms"][q] is not None and e["ttft_ms"][q] is not None
                      and ace["ttft_ms"][q] < e["ttft_ms"][q] for q in e["ttft_ms"]}
                for arm, e in routers.items()}
            c["ace_below_every_vllm_router"] = all(
                v for m in c["ace_below_vllm_router"].values() for v in m.values())
        pace = machine_pace(entries)
        if pace is not None:
            c["machine_pace"] = pace
        if aff and aff.get("engine_busy"):
            busiest = max(aff["engine_busy"].values())
            c["affinity_busiest_engine_busy"] = busiest
            c["below_saturation"] = busiest < BUSY_LIMIT
        if n == "4" and ace and aff and scenario == "hundreds":
            c["targets"] = hundreds_targets(ace, aff)
        elif n == "4" and ace and aff and scenario == "sixteen":
            c["targets"] = sixteen_targets(ace, aff)
        elif n == "4" and ace and aff:
            b, p = aff["stall_ms"]["p99"], ace["stall_ms"]["p99"]
            got = {"effective_hit_ratio": ace["effective_hit_ratio"], "resident_hit_ratio": ace["resident_hit_ratio"],
                   "stall_p99_reduction": (b / p) if b is not None and p else (math.inf if b else None)}
            c["targets"] = {k: {"want": v, "got": got[k], "met": got[k] is not None and got[k] >= v}
                            for k, v in TARGETS.items()}
            ta, tb = ace["ttft_ms"]["p99"], aff["ttft_ms"]["p99"]
            c["targets"]["ttft_p99_lower"] = {"want": tb, "got": ta,
                                              "met": ta is not None and tb is not None and ta < tb}
        out[n] = c
    return out


def _cell(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def format_fleets(fleets: Mapping[str, Mapping[str, Mapping]], warm_from: str | None = None) -> str:
    """The fleet table: per hosts and arm, hits, stall and TTFT percentiles."""
    lines = [f"fleet benchmark (ace arm learned on: {warm_from or 'nothing, cold start, learns online'})",
             f"  {'hosts':>5} {'arm':<12}{'resident':>9}{'effective':>10}{'err':>4}"
             f"{'stall p50':>10}{'p99':>8}{'ttft p50':>9}{'p90':>8}{'p99':>8}  requests per host"]
    for n, arms in fleets.items():
        for arm, e in arms.items():
            t = e["total"] or 1
            lines.append(
                f"  {n:>5} {arm:<12}{100 * e['resident_hits'] / t:>8.2f}%{100 * e['effective_hits'] / t:>9.2f}%"
                f"{e['errors']:>4}{_cell(e['stall_ms']['p50']):>10}{_cell(e['stall_ms']['p99']):>8}"
                f"{_cell(e['ttft_ms']['p50']):>9}{_cell(e['ttft_ms']['p90']):>8}{_cell(e['ttft_ms']['p99']):>8}"
                f"  {'/'.join(str(v) for v in e['requests_per_host'].values())}")
    return "\n".join(lines)
