"""The simulator against the stack: a bench trace replayed in ``bench.fleet`` as the bench ran it.

    python -m bench.sim_stack --trace FILE --hosts N [--slots S] [--stack-report FILE]
        [--out reports/sim_vs_stack.json]

(``make sim TRACE= HOSTS= SLOTS=``.) It reads the bench report of that trace
(``--stack-report``, default ``reports/hundreds_eval.json`` for the hundreds trace, else
``reports/multi_lora_eval.json``) and its per-request rows (``*_rows.jsonl``), and runs
the fleet simulator's three arms with what the bench measured on that fleet size:

- the **clock**: the trace's ``t`` divided by the bench's replay speed for that fleet
  size (``speed_by_hosts``, or ``speed``), so everything is in replay seconds;
- the **pool**: ``--slots`` per host (default: the report's ``pool_adapters``);
- the **load times**: per rank, the median measured stall of a demand load that came
  from the store or the disk (tier ``remote``/``disk``) in the on-demand arms' rows of
  that fleet size (a rank never loaded there: the median over all ranks);
- the **lead** (gateway to engine start): the median of the rows' time outside the
  engine, where the rows have it (the engine's ``ace_timing``), else 50 ms;
- the **service time** (how long a request holds its host, which load-aware routing
  sees): the median measured request duration.

Per arm it reports the stack's effective hit ratio, the simulator's, and the difference
(``agreement``: within ``TOLERANCE``); and a **calibration table**: each term of the model
with the stack's value and the simulator's, flagged where they differ (the closed-loop
replay against the simulator's open-loop nominal times, the warm start, the load link,
the placement's spread). Results go under a key ``<trace>@<hosts>x<slots>`` of ``--out``,
so the 800 trace at 1 host and the hundreds scenario at 4 hosts sit side by side.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from bench.report import first_replay_rows
from bench.trace import TraceError, load_trace
from gpu_agent.connectors.builtin import CPU_LOAD_COMPUTE_SHARE
from gpu_agent.residency.prefetch_budget import HintVerdict

__all__ = ["TOLERANCE", "agreement", "calibration", "measured_model"]

TOLERANCE = 0.03  # hit ratio: the simulator agrees with the stack within 3 points
DEFAULT_LEAD_MS = 50.0
ARMS = ("round_robin", "affinity", "ace")
# the agents' speculation budget refuses these bets, which the simulator's hosts take
REFUSED_BETS = tuple(v for v in HintVerdict if v not in (HintVerdict.ACCEPT, HintVerdict.INVALID))


def agreement(stack: dict, sim: dict, tolerance: float = TOLERANCE) -> dict:
    """Per arm in both: the stack's effective hit ratio, the simulator's hit ratio, their
    difference and whether it is within ``tolerance``; ``all_within`` over those arms."""
    rows = {}
    for arm in ARMS:
        if arm in stack and arm in sim:
            st, si = stack[arm]["effective_hit_ratio"], sim[arm]["hit_ratio"]
            rows[arm] = {"stack": round(st, 4), "sim": round(si, 4), "diff": round(si - st, 4),
                         "within": abs(si - st) <= tolerance}
    return {"tolerance": tolerance, "arms": rows, "all_within": bool(rows) and all(r["within"] for r in rows.values())}


def _spread(per_host: dict) -> float | None:
    counts = [v for v in per_host.values() if v]
    return round(max(counts) / min(counts), 3) if counts else None


def calibration(report: dict, hosts: int, model: dict, sim: dict) -> list[dict]:
    """Each term of the simulator's model beside what the stack did (``differs``)."""
    fleet = report["fleets"][str(hosts)]
    realized = bool(sim) and all(r.get("clock") == "realized" for r in sim.values())
    clock = ("each arm in the order and at the times the stack sent it (rows' sent_s)" if realized
             else "open-loop on nominal t (previous t + 0.3 s + think)")
    rows = [
        {"term": "replay speed", "stack": model["speed"], "sim": model["speed"], "differs": False},
        {"term": "pool slots per host", "stack": report.get("pool_adapters"), "sim": model["slots"],
         "differs": report.get("pool_adapters") != model["slots"]},
        {"term": "load time per rank (ms, median of measured demand loads)", "stack": model["load_ms_by_rank"],
         "sim": model["load_ms_by_rank"], "differs": False},
        {"term": "load time spread (ms, all ranks: median / p90)", "stack": [model["load_ms_median"], model["load_ms_p90"]],
         "sim": "each rank's median, every time", "differs": True},
        {"term": "lead: gateway to engine (ms)", "stack": model["lead_measured_ms"], "sim": model["lead_ms"],
         "differs": model["lead_measured_ms"] is None},
        {"term": "service time (s a request holds its host)", "stack": model["service_s"], "sim": model["service_s"],
         "differs": False},
        {"term": "replay loop", "stack": report.get("replay", "closed-loop"),
         "sim": clock, "differs": not realized},
        {"term": "a request's own adapter", "stack": "loaded when the request reaches its engine",
         "sim": "loaded when the request reaches its engine (ingress=False)", "differs": False},
        {"term": "ace arm's start", "stack": report.get("warm_from") or "cold", "sim": "cold",
         "differs": bool(report.get("warm_from"))},
        {"term": "load link", "stack": "loads in parallel (agent + engine), concurrent with compute",
         "sim": "1 FIFO link per host", "differs": True},
    ]
    for arm in ARMS:
        if arm in fleet and arm in sim:
            st, si = _spread(fleet[arm]["requests_per_host"]), _spread(sim[arm]["requests_per_host"])
            rows.append({"term": f"{arm}: busiest / idlest host requests", "stack": st, "sim": si,
                         "differs": st is not None and si is not None and abs(st - si) > 0.1 * st})
    if "ace" in fleet and "ace" in sim:
        pre = fleet["ace"].get("prefetch") or {}
        rows.append({"term": "ace: prefetches sent / used", "stack": [pre.get("sent"), pre.get("used")],
                     "sim": [sim["ace"].get("prefetches"), sim["ace"].get("prefetch_used")], "differs": True})
        outcomes = pre.get("agent_outcomes") or {}
        refused = {v.value: outcomes[f"rejected_{v.value}"] for v in REFUSED_BETS if outcomes.get(f"rejected_{v.value}")}
        sim_refused = sim["ace"].get("refused", {})
        fill = (fleet["ace"].get("speculation") or {}).get("fill_sent")
        if fill is not None:
            rows.append({"term": "ace: start-up fill of empty pools (signals; among the prefetches sent)",
                         "stack": fill, "sim": 0, "differs": bool(fill)})
        evictions = fleet["ace"].get("pool_evictions")
        if evictions is not None:
            # the engine evicts the gateway's named victims (hint) where they reached it in
            # time, else by its own LRU (budget); every eviction in the simulator is the model's
            rows.append({"term": "ace: what chose the pool's evictions", "stack": evictions,
                         "sim": "the pool model (lowest use probability), every time",
                         "differs": bool(evictions.get("budget"))})
        rows.append({"term": "ace: a wasted bet's load time charged (the agents' budget)",
                     "stack": model.get("agent_waste_share"), "sim": model.get("agent_waste_share"), "differs": False})
        rows.append({"term": "ace: bets the agents refused", "stack": refused, "sim": sim_refused,
                     "differs": abs(sum(refused.values()) - sum(sim_refused.values()))
                     > 0.25 * max(sum(refused.values()), 1)})
    return rows


def agent_waste_share(report: dict) -> float:
    """The share of a wasted load's time the bench's agents charged a bet: their
    ``--prefetch-waste-share`` where the bench set it, else the builtin engine's on the
    CPU (``CPU_LOAD_COMPUTE_SHARE``; the bench's engines run on the CPU)."""
    flag = argparse.ArgumentParser(add_help=False)
    flag.add_argument("--prefetch-waste-share", type=float, default=None)
    args = [*(report.get("agent_cold_args") or []), *(report.get("agent_extra_args") or [])]
    share = flag.parse_known_args(args)[0].prefetch_waste_share
    return CPU_LOAD_COMPUTE_SHARE if share is None else share


def measured_model(report: dict, rows: list[dict], requests: list[dict], hosts: int, slots: int | None) -> dict:
    """What the bench measured on this fleet size, as the simulator's parameters."""
    rank = {r["adapter"]: r["rank"] for r in requests}
    mine = [r for r in rows if r.get("hosts") == hosts and "error" not in r and r.get("wait_ms") is not None]
    demand = [r for r in mine if r["arm"] in ("round_robin", "affinity") and r.get("tier") in ("remote", "disk")]
    by_rank: dict[int, list[float]] = {}
    for r in demand:
        by_rank.setdefault(rank[r["adapter"]], []).append(r["wait_ms"])
    overall = statistics.median(r["wait_ms"] for r in demand) if demand else 100.0
    load_ms = {k: round(statistics.median(by_rank.get(k) or [overall]), 2) for k in sorted(set(rank.values()))}
    waits = sorted(r["wait_ms"] for r in demand)
    p90 = round(waits[int(0.9 * (len(waits) - 1))], 2) if waits else None
    outside = [r["outside_engine_ms"] for r in mine if r.get("outside_engine_ms") is not None]
    lead = round(statistics.median(outside), 2) if outside else None
    speed = (report.get("speed_by_hosts") or {}).get(str(hosts)) or report.get("speed")
    return {"speed": float(speed), "slots": slots or report["pool_adapters"], "load_ms_by_rank": load_ms,
            "agent_waste_share": agent_waste_share(report),
            "load_ms_median": round(overall, 2), "load_ms_p90": p90,
            "lead_measured_ms": lead, "lead_ms": lead if lead is not None else DEFAULT_LEAD_MS,
            "service_s": round(statistics.median(r["total_ms"] for r in mine) / 1000.0, 4) if mine else 0.1}


def realized_order(rows: list[dict], hosts: int, arm: str, ids: list[str]) -> tuple[list[int], list[float]] | None:
    """The order and send times (replay seconds from the first) in which the stack sent
    ``arm``'s requests on this fleet size (the rows' ``sent_s``): the trace's indices by
    send time. None when the rows lack a send time for any request of the trace."""
    sent = {r["id"]: r["sent_s"] for r in rows
            if r.get("hosts") == hosts and r.get("arm") == arm and r.get("sent_s") is not None}
    if any(i not in sent for i in ids):
        return None
    order = sorted(range(len(ids)), key=lambda j: (sent[ids[j]], j))
    t0 = sent[ids[order[0]]]
    return order, [sent[ids[j]] - t0 for j in order]


def simulate(requests: list[dict], hosts: int, model: dict, seed: int = 7,
             rows: list[dict] | None = None) -> dict:
    """The three arms in the fleet simulator. Each arm replays the requests in the order
    and at the times the stack sent them in that arm (``realized_order``, from ``rows``),
    else on the trace's nominal clock divided by the replay speed. A request reaches its
    engine ``lead`` after it is sent (exponential, the measured median as mean); every
    arm loads a request's own adapter when it reaches the engine, as the stack's engines
    do (``ingress=False``); the ace arm's prefetches start when the gateway offers them."""
    import numpy as np

    from bench.fleet import run_arm
    from bench.sim import first_steps
    from bench.workload import encode_trace
    from extproc.policy.speculator import SpeculationSettings

    w = encode_trace(requests)
    ids = [r["id"] for r in requests]
    nominal = (list(range(len(ids))), (w.t / model["speed"]).tolist())
    lead = np.random.default_rng(seed).exponential(model["lead_ms"] / 1000.0, len(w.t)).tolist()
    L = [model["load_ms_by_rank"][int(r)] / 1000.0 for r in w.rank_of.tolist()]
    ad, tn, ss = w.adapter.tolist(), w.tenant.tolist(), w.session.tolist()
    out = {}
    walks: dict = {}
    for arm in ARMS:
        realized = realized_order(rows, hosts, arm, ids) if rows else None
        order, t = realized or nominal
        s = [x + d for x, d in zip(t, lead)]
        session = [ss[j] for j in order]
        cols = (t, s, [ad[j] for j in order], [tn[j] for j in order], session, L,
                first_steps(np.asarray(session)))
        r, where = run_arm(arm, cols, hosts, model["slots"], 1, SpeculationSettings(), service_s=model["service_s"],
                           max_backlog_s=0.25, walks=walks, ingress=False,
                           agent_waste_share=model.get("agent_waste_share"))
        counts: dict[str, int] = {}
        for h in where:
            counts[f"host-{h:03d}"] = counts.get(f"host-{h:03d}", 0) + 1
        out[arm] = dict(r, requests_per_host=dict(sorted(counts.items())),
                        clock="realized" if realized else "nominal")
    return out


def default_report(trace: str) -> str:
    return "reports/hundreds_eval.json" if Path(trace).name.startswith("hundreds") else "reports/multi_lora_eval.json"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.sim_stack", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", required=True, help="the bench trace (docs/trace-format.md)")
    ap.add_argument("--hosts", type=int, required=True, help="fleet size: the report must hold it")
    ap.add_argument("--slots", type=int, default=None, help="slots per host (default: the report's pool_adapters)")
    ap.add_argument("--stack-report", default=None, help="the bench report of that trace (default by trace name)")
    ap.add_argument("--out", default="reports/sim_vs_stack.json", help="JSON file the result is merged into")
    args = ap.parse_args(argv)
    report_path = Path(args.stack_report or default_report(args.trace))
    try:
        requests = load_trace(args.trace)
        report = json.loads(report_path.read_text())
        rows = first_replay_rows(report_path)
    except (TraceError, OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if str(args.hosts) not in report.get("fleets", {}):
        print(f"error: {report_path} has no {args.hosts}-host fleet (it has {sorted(report.get('fleets', {}))})",
              file=sys.stderr)
        return 2
    model = measured_model(report, rows, requests, args.hosts, args.slots)
    sim = simulate(requests, args.hosts, model, rows=rows)
    stack = report["fleets"][str(args.hosts)]
    result = {"trace": args.trace, "stack_report": str(report_path), "hosts": args.hosts, "model": model,
              "sim": {a: {k: v for k, v in r.items() if not k.startswith("_")} for a, r in sim.items()},
              "agreement": agreement(stack, sim), "calibration": calibration(report, args.hosts, model, sim)}
    out = Path(args.out)
    merged = json.loads(out.read_text()) if out.exists() else {}
    merged[f"{Path(args.trace).stem}@{args.hosts}x{model['slots']}"] = result
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    for arm, r in result["agreement"]["arms"].items():
        print(f"{arm:<12} stack {r['stack']:.4f}  sim {r['sim']:.4f}  diff {r['diff']:+.4f}"
              f"  {'within' if r['within'] else 'OUTSIDE'} {TOLERANCE:.2f}")
    for c in result["calibration"]:
        if c["differs"]:
            print(f"  differs: {c['term']}: stack {c['stack']} / sim {c['sim']}")
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
