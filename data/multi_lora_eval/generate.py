"""Deterministic generator of the multi-LoRA evaluation trace (``multi_lora_eval_800.json``).

    python data/multi_lora_eval/generate.py [--n 800] [--seed 20261130] [--out FILE]
    python data/multi_lora_eval/generate.py --scenario hundreds [--seed N] [--out FILE]
    python data/multi_lora_eval/generate.py --scenario sixteen [--seed N] [--out FILE]
    python data/multi_lora_eval/generate.py --scenario vllm [--seed N] [--out FILE]

``--scenario hundreds`` is the mission's scale: 200+ adapters, 48 tenants (``hundreds.py``);
``--scenario sixteen``: 16 adapters, 12 tenants, 1,200 requests (``sixteen.py``);
``--scenario vllm``: about 24 adapters, 5 tenants, 240 requests for two real vLLM hosts
(``vllm_hosts.py``).
The rest of this docstring is the default scenario, ``800``:

800 requests from 8 tenants over 5 domains and the fixtures' 10 adapters (ranks 8-128).
Traffic is agentic sessions: a tenant opens a session (Poisson arrivals, with burst
windows in which one tenant opens sessions several times faster) and runs one of its
habitual workflows, 4-12 steps (e.g. acme's code -> review -> sql loop). An agent sends
each step after the previous answer arrived plus a think time (tool execution, a human
glance): ``think_s`` on every step after the first, so the benchmark replays sessions
closed-loop. ``t`` is the session's first-step time; for later steps it is the nominal
open-loop time (previous ``t`` + ``NOMINAL_SERVICE_S`` + ``think_s``), which the
simulator uses. Steps sometimes repeat (an agent iterating), stray to another adapter
the tenant may use, or the session ends early (never before 4 steps), so the chains are
habits, not rules. Each tenant sees only public adapters and its own (owners as in
``gpu_agent.fixtures.ADAPTERS``). The format is ``docs/trace-format.md``. Same seed,
same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

# name -> (rank, domain): exactly gpu_agent.fixtures.ADAPTERS
ADAPTERS: dict[str, tuple[int, str]] = {
    "code-python": (8, "coding"),
    "code-sql": (32, "coding"),
    "med-triage": (16, "medical"),
    "med-notes": (64, "medical"),
    "legal-contracts": (32, "legal"),
    "legal-review": (128, "legal"),
    "fin-reports": (8, "finance"),
    "fin-risk": (64, "finance"),
    "tr-de-en": (16, "translation"),
    "tr-fr-en": (128, "translation"),
}

# tenant -> (relative session rate, workflows: (weight, steps)); owners: acme owns code-*,
# medco owns med-*, everything else is public. Workflows are 4-12 steps: what an agent
# framework runs for one task (plan/code/test/review/query loops, triage/notes/translate).
TENANTS: dict[str, tuple[float, list[tuple[float, list[str]]]]] = {
    "acme": (1.5, [(0.6, ["code-python", "legal-review", "code-sql", "code-python", "legal-review",
                          "code-sql", "code-python"]),
                   (0.4, ["code-sql", "code-python", "code-sql", "legal-review", "code-python"])]),
    "medco": (1.3, [(0.7, ["med-triage", "med-notes", "med-triage", "med-notes", "tr-de-en"]),
                    (0.3, ["med-notes", "med-triage", "med-notes", "tr-de-en", "med-notes", "med-triage",
                           "med-notes", "tr-de-en"])]),
    "lexfirm": (1.0, [(0.7, ["legal-contracts", "legal-review", "legal-contracts", "legal-review", "tr-fr-en"]),
                      (0.3, ["legal-review", "legal-contracts", "legal-review", "legal-contracts",
                             "legal-review", "tr-fr-en", "legal-review"])]),
    "bankco": (1.0, [(0.6, ["fin-reports", "fin-risk", "fin-reports", "fin-risk", "legal-review", "fin-reports"]),
                     (0.4, ["fin-risk", "legal-contracts", "fin-risk", "fin-reports", "fin-risk"])]),
    "globetrans": (0.9, [(0.5, ["tr-de-en", "tr-fr-en", "tr-de-en", "tr-fr-en"]),
                         (0.5, ["tr-fr-en", "tr-de-en", "tr-fr-en", "legal-review", "tr-fr-en", "tr-de-en"])]),
    "insureco": (0.7, [(1.0, ["fin-risk", "legal-contracts", "fin-reports", "fin-risk", "legal-contracts",
                              "legal-review", "fin-reports", "fin-risk", "legal-contracts", "fin-reports"])]),
    "newsdesk": (0.6, [(0.6, ["tr-fr-en", "fin-reports", "tr-de-en", "fin-reports", "tr-fr-en", "fin-reports"]),
                       (0.4, ["tr-de-en", "tr-fr-en", "tr-de-en", "fin-reports"])]),
    "govdocs": (0.5, [(1.0, ["legal-contracts", "tr-de-en", "legal-review", "legal-contracts", "tr-de-en",
                             "legal-review", "legal-contracts", "tr-de-en", "legal-review", "tr-fr-en",
                             "legal-review", "legal-contracts"])]),
}
OWNED = {"acme": ("code-python", "code-sql"), "medco": ("med-triage", "med-notes")}

PROMPTS: dict[str, list[str]] = {
    "coding": ["Write a Python function that {task}.", "Fix the bug in this snippet: {task}.",
               "Write a SQL query that {task}.", "Explain what this code does: {task}."],
    "medical": ["Triage this patient: {task}.", "Summarise these clinical notes: {task}.",
                "List red flags for: {task}."],
    "legal": ["Review this clause: {task}.", "Draft a contract section about {task}.",
              "Flag risks in this agreement: {task}."],
    "finance": ["Summarise the quarterly report: {task}.", "Assess the credit risk of {task}.",
                "Explain the variance in {task}."],
    "translation": ["Translate into English: {task}.", "Translate and keep the formatting: {task}."],
}
TASKS: dict[str, list[str]] = {
    "coding": ["parses ISO dates", "dedupes a list of orders", "joins users to invoices by month",
               "retries an HTTP call with backoff", "computes a rolling median"],
    "medical": ["58-year-old with chest pain and dyspnoea", "child with fever for three days",
                "post-op day two, low urine output", "chronic cough and weight loss"],
    "legal": ["limitation of liability", "termination for convenience", "data processing terms",
              "non-compete for twelve months"],
    "finance": ["ACME Corp Q3 revenue", "a mid-size logistics borrower", "opex vs budget in EMEA",
                "a portfolio of municipal bonds"],
    "translation": ["Der Vertrag tritt am ersten Januar in Kraft", "Le patient se plaint de douleurs",
                    "Die Quartalszahlen liegen über den Erwartungen", "Merci de confirmer la livraison"],
}


def visible(tenant: str) -> list[str]:
    owned_by_others = {a for t, names in OWNED.items() if t != tenant for a in names}
    return [a for a in ADAPTERS if a not in owned_by_others]


NOMINAL_SERVICE_S = 0.3  # open-loop stand-in for an answer's duration (simulator only)
P_STRAY = 0.05   # a step goes to another adapter the tenant may use
P_REPEAT = 0.12  # a step is sent twice (the agent iterates on the same adapter)
P_END = 0.04     # the session ends after this step (never before MIN_STEPS)
MIN_STEPS = 4


def opened_sessions(rng: random.Random, tenants: list[str], rates: list[float], session_rate: float,
                    bursts: list[tuple[float, float, str]], burst_factor: float, enough):
    """Session openings, ``(time, tenant, number from 1)`` until ``enough()``: a Poisson
    process of ``session_rate`` per second, tenants drawn by ``rates``, a burst window's
    tenant ``burst_factor``x likelier."""
    clock = 0.0
    sid = 0
    while not enough():
        clock += rng.expovariate(session_rate)
        weights = list(rates)
        for start, end, t in bursts:
            if start <= clock < end:
                weights[tenants.index(t)] *= burst_factor
        sid += 1
        yield clock, rng.choices(tenants, weights)[0], sid


def session_steps(rng: random.Random, start: float, chain: list[str], visible: list[str], p_stray: float):
    """One session running its workflow ``chain`` from ``start``: ``(t, think_s or None,
    step, adapter)`` per request; a step strays to a ``visible`` adapter (``p_stray``), is
    sent twice (``P_REPEAT``), or the session ends early (``P_END``, from ``MIN_STEPS``)."""
    t, think, step = start, 0.0, 0
    for planned in chain:
        adapter = rng.choice(visible) if rng.random() < p_stray else planned
        for _ in range(2 if rng.random() < P_REPEAT else 1):
            yield t, think if step else None, step, adapter
            step += 1
            # the agent's think time before the next step: tool runs, a human glance
            think = round(min(8.0, max(0.2, rng.lognormvariate(0.3, 0.7))), 3)
            t += NOMINAL_SERVICE_S + think
        if step >= MIN_STEPS and rng.random() < P_END:
            break


def generate(n: int = 800, seed: int = 20261130) -> list[dict]:
    rng = random.Random(seed)
    tenants = list(TENANTS)
    rates = [TENANTS[t][0] for t in tenants]
    session_rate = 0.28  # sessions per second, all tenants together, outside bursts
    # burst windows: (start, end, tenant) in which that tenant opens sessions 4x faster
    bursts = [(rng.uniform(0, 300), rng.choice(tenants)) for _ in range(3)]
    bursts = [(s, s + rng.uniform(20, 45), t) for s, t in bursts]
    requests: list[dict] = []
    # overshoot, then keep the first n by time
    for clock, tenant, sid in opened_sessions(rng, tenants, rates, session_rate, bursts, 4.0,
                                              lambda: len(requests) >= n * 2):
        flows = TENANTS[tenant][1]
        chain = rng.choices([c for _, c in flows], [w for w, _ in flows])[0]
        session = f"{tenant}-s{sid:04d}"
        for t, think, step, adapter in session_steps(rng, clock, chain, visible(tenant), P_STRAY):
            requests.append(_request(rng, t, think, tenant, session, step, "->".join(chain), adapter))
    requests.sort(key=lambda r: (r["t"], r["session"], r["step"]))
    requests = requests[:n]
    # keep whole prefixes of sessions only: a cut session keeps its first steps
    for i, r in enumerate(requests):
        r["id"] = f"req-{i:04d}"
    return [{"id": r.pop("id"), **r} for r in requests]


def _request(rng: random.Random, t: float, think: float | None, tenant: str, session: str, step: int,
             workflow: str, adapter: str) -> dict:
    rank, domain = ADAPTERS[adapter]
    prompt = rng.choice(PROMPTS[domain]).format(task=rng.choice(TASKS[domain]))
    timing = {"t": round(t, 3)} if think is None else {"t": round(t, 3), "think_s": think}
    return {
        **timing,
        "tenant": tenant,
        "session": session,
        "step": step,
        "workflow": workflow,
        "adapter": adapter,
        "rank": rank,
        "domain": domain,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": rng.choice([16, 24, 32]),
    }


SCENARIOS = ("800", "hundreds", "sixteen", "vllm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", choices=SCENARIOS, default="800",
                    help="800: the 10-adapter trace; hundreds: 200+ adapters, 48 tenants (hundreds.py); "
                         "sixteen: 16 adapters, 12 tenants (sixteen.py); "
                         "vllm: about 24 adapters, 5 tenants, for make bench ENGINE=vllm (vllm_hosts.py)")
    ap.add_argument("--n", type=int, default=None, help="number of requests (800; hundreds: 2400; sixteen: 1200; vllm: 240)")
    ap.add_argument("--seed", type=int, default=None, help="random seed (800: 20261130; hundreds: 20261201; sixteen: 20261204; vllm: 20261210)")
    ap.add_argument("--tenants", type=int, default=None, help="hundreds only: tenants (48)")
    ap.add_argument("--public", type=int, default=None, help="hundreds only: public adapters (112)")
    ap.add_argument("--session-rate", type=float, default=None,
                    help="hundreds only: sessions opened per second (0.5 per 48 tenants)")
    ap.add_argument("--out", default=None, help="output file (.json: one array; .jsonl: one object per line; "
                    "default: the scenario's .json beside this script)")
    args = ap.parse_args(argv)
    here = Path(__file__).resolve().parent
    if args.scenario == "hundreds":
        sys.path.insert(0, str(here))  # hundreds.py imports this module as `generate`
        import hundreds

        reqs = hundreds.generate_hundreds(
            args.n or hundreds.N_REQUESTS, hundreds.SEED if args.seed is None else args.seed,
            args.tenants or hundreds.N_TENANTS, hundreds.N_PUBLIC if args.public is None else args.public,
            args.session_rate)
        out = Path(args.out or here / "hundreds.json")
    elif args.scenario == "sixteen":
        if args.tenants is not None or args.public is not None or args.session_rate is not None:
            ap.error("--tenants, --public and --session-rate are for --scenario hundreds")
        sys.path.insert(0, str(here))
        import sixteen

        reqs = sixteen.generate_sixteen(args.n or sixteen.N_REQUESTS, sixteen.SEED if args.seed is None else args.seed)
        out = Path(args.out or here / "sixteen.json")
    elif args.scenario == "vllm":
        if args.tenants is not None or args.public is not None or args.session_rate is not None:
            ap.error("--tenants, --public and --session-rate are for --scenario hundreds")
        sys.path.insert(0, str(here))
        import vllm_hosts

        reqs = vllm_hosts.generate_vllm(args.n or vllm_hosts.N_REQUESTS,
                                        vllm_hosts.SEED if args.seed is None else args.seed)
        out = Path(args.out or here / "vllm_hosts.json")
    else:
        if args.tenants is not None or args.public is not None or args.session_rate is not None:
            ap.error("--tenants, --public and --session-rate are for --scenario hundreds")
        reqs = generate(args.n or 800, 20261130 if args.seed is None else args.seed)
        out = Path(args.out or here / "multi_lora_eval_800.json")
    if out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    else:
        out.write_text("[\n" + ",\n".join(json.dumps(r) for r in reqs) + "\n]\n")
    print(f"wrote {len(reqs)} requests to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
