"""Deterministic generator of the multi-LoRA evaluation trace (``multi_lora_eval_800.json``).

    python data/multi_lora_eval/generate.py [--n 800] [--seed 20261130] [--out FILE]

800 requests from 8 tenants over 5 domains and the fixtures' 10 adapters (ranks 8-128).
Traffic is sessions: a tenant opens a session (Poisson arrivals, with burst windows in
which one tenant opens sessions several times faster), and each session is a multi-step
workflow (e.g. acme's code -> review -> sql) whose steps follow each other after a
think time; a step sometimes repeats (a retry / follow-up) or strays to another adapter
the tenant may use, so the chains are habits, not rules. Each tenant sees only public
adapters and its own (owners as in ``gpu_agent.fixtures.ADAPTERS``). The format is
described in ``docs/trace-format.md``. Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
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

# tenant -> (relative session rate, workflows: (weight, chain)); owners: acme owns code-*,
# medco owns med-*, everything else is public.
TENANTS: dict[str, tuple[float, list[tuple[float, list[str]]]]] = {
    "acme": (1.6, [(0.6, ["code-python", "legal-review", "code-sql"]),
                   (0.4, ["code-python", "code-sql"])]),
    "medco": (1.3, [(0.7, ["med-triage", "med-notes", "tr-de-en"]),
                    (0.3, ["med-notes", "med-triage"])]),
    "lexfirm": (1.0, [(0.7, ["legal-contracts", "legal-review", "tr-fr-en"]),
                      (0.3, ["legal-review"])]),
    "bankco": (1.0, [(0.6, ["fin-reports", "fin-risk", "legal-review"]),
                     (0.4, ["fin-risk", "fin-reports"])]),
    "globetrans": (0.9, [(0.5, ["tr-de-en", "tr-fr-en"]), (0.5, ["tr-fr-en"])]),
    "insureco": (0.7, [(1.0, ["fin-risk", "legal-contracts", "fin-reports"])]),
    "newsdesk": (0.6, [(0.6, ["tr-fr-en", "fin-reports"]), (0.4, ["tr-de-en"])]),
    "govdocs": (0.5, [(1.0, ["legal-contracts", "tr-de-en", "legal-review"])]),
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


def generate(n: int = 800, seed: int = 20261130) -> list[dict]:
    rng = random.Random(seed)
    tenants = list(TENANTS)
    rates = [TENANTS[t][0] for t in tenants]
    session_rate = 0.5  # sessions per second, all tenants together, outside bursts
    # burst windows: (start, end, tenant) in which that tenant opens sessions 6x faster
    bursts = [(rng.uniform(0, 300), rng.choice(tenants)) for _ in range(4)]
    bursts = [(s, s + rng.uniform(15, 40), t) for s, t in bursts]
    requests: list[dict] = []
    clock = 0.0
    sid = 0
    while len(requests) < n * 2:  # overshoot, then keep the first n by time
        clock += rng.expovariate(session_rate)
        weights = list(rates)
        for start, end, t in bursts:
            if start <= clock < end:
                weights[tenants.index(t)] *= 6.0
        tenant = rng.choices(tenants, weights)[0]
        flows = TENANTS[tenant][1]
        chain = rng.choices([c for _, c in flows], [w for w, _ in flows])[0]
        sid += 1
        session = f"{tenant}-s{sid:04d}"
        t = clock
        step = 0
        for planned in chain:
            adapter = planned
            r = rng.random()
            if r < 0.08:  # strays from the habit
                adapter = rng.choice(visible(tenant))
            repeats = 2 if rng.random() < 0.15 else 1  # a follow-up on the same adapter
            for _ in range(repeats):
                requests.append(_request(rng, t, tenant, session, step, "->".join(chain), adapter))
                step += 1
                t += rng.uniform(1.0, 6.0)  # the answer plus the agent's/user's think time
    requests.sort(key=lambda r: (r["t"], r["session"], r["step"]))
    requests = requests[:n]
    for i, r in enumerate(requests):
        r["id"] = f"req-{i:04d}"
    return [{"id": r.pop("id"), **r} for r in requests]


def _request(rng: random.Random, t: float, tenant: str, session: str, step: int,
             workflow: str, adapter: str) -> dict:
    rank, domain = ADAPTERS[adapter]
    prompt = rng.choice(PROMPTS[domain]).format(task=rng.choice(TASKS[domain]))
    return {
        "t": round(t, 3),
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=800, help="number of requests")
    ap.add_argument("--seed", type=int, default=20261130, help="random seed")
    ap.add_argument("--out", default=str(Path(__file__).with_name("multi_lora_eval_800.json")),
                    help="output file (.json: one array; .jsonl: one object per line)")
    args = ap.parse_args(argv)
    reqs = generate(args.n, args.seed)
    out = Path(args.out)
    if out.suffix == ".jsonl":
        out.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    else:
        out.write_text("[\n" + ",\n".join(json.dumps(r) for r in reqs) + "\n]\n")
    print(f"wrote {len(reqs)} requests to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
