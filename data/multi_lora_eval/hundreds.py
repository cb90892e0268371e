"""The ``hundreds`` scenario: the mission's scale (``generate.py --scenario hundreds``).

    python data/multi_lora_eval/generate.py --scenario hundreds [--seed 20261201] [--n 2400]
        [--tenants 48] [--public 112] [--session-rate R] [--out FILE]

A world of tenants and adapters, then a day of their traffic, both drawn from the seed:

- **Adapters** (ranks 8-128, drawn per adapter: 8 30%, 16 25%, 32 20%, 64 15%, 128 10%):
  ``--public`` shared ones named ``pub-<domain>-NN`` over 8 domains, and 2-5 private ones
  per tenant, ``<tenant>-<domain>-N`` (its home domain, sometimes its second one).
- **Tenants** (``--tenants``, named ``tNN-<home domain>``): activity is Zipf (weight
  1/k^1.1 over a shuffled order), so a few tenants send most sessions. Each uses a few
  public adapters of its two domains, picked by the public adapters' own Zipf
  popularity (a hot public adapter sits in many tenants' workflows), and has 1-3
  habitual workflows: chains of 4-10 steps over a working set of 2-4 of its visible
  adapters (no step repeats the previous one; repeats come from ``P_REPEAT``).
- **Traffic**: sessions open as a Poisson process (``SESSION_RATE`` per second), with
  ``BURSTS`` windows in which one tenant opens sessions 5x faster. A session runs one of
  its tenant's workflows; steps stray (``P_STRAY``) to any adapter the tenant may use
  (its own or a public one), repeat (``P_REPEAT``) or end early (``P_END``, never before
  ``MIN_STEPS``). ``P_ONE_OFF`` of the sessions are one-off requests: one step, to any
  adapter the tenant may use, uniformly (the long tail no history predicts).

Timing is the 800 trace's (``generate.py``): ``think_s`` on later steps, ``t`` the
session's first-step time then the nominal open-loop time. The format is
docs/trace-format.md; same arguments, same bytes.

``HELD_OUT_SEEDS`` are never used to tune anything (the scored seed is ``SEED``): they
are the unseen traces of the same shape whose results are reported beside the scored
one.
"""

from __future__ import annotations

import random

from generate import PROMPTS, TASKS, opened_sessions, session_steps

SEED = 20261201
HELD_OUT_SEEDS = (20261202, 20261203)
N_REQUESTS = 2400
N_TENANTS = 48
N_PUBLIC = 112

RANKS = ((8, 0.30), (16, 0.25), (32, 0.20), (64, 0.15), (128, 0.10))
PROMPTS = {
    **PROMPTS,
    "support": ["Answer this customer ticket: {task}.", "Classify the intent of: {task}."],
    "retail": ["Write a product description for {task}.", "Suggest cross-sells for {task}."],
    "science": ["Summarise the findings on {task}.", "Propose an experiment about {task}."],
}
TASKS = {
    **TASKS,
    "support": ["a refund for a late delivery", "a password reset loop", "a double charge on a card"],
    "retail": ["a waterproof hiking boot", "a cast-iron pan", "a kids' bicycle helmet"],
    "science": ["protein folding kinetics", "soil carbon in drylands", "battery cathode fatigue"],
}
DOMAINS = tuple(PROMPTS)

SESSION_RATE = 0.5   # sessions per second of N_TENANTS tenants, outside bursts (scales with --tenants)
BURSTS = 6           # windows of 20-60 s in which one tenant opens sessions 5x faster
P_STRAY = 0.06
# answers shorter than the 800 trace's (16-32): the measure is the adapters, and on a shared CPU
# every decoded token is compute that slows the replay the bench must keep below saturation
MAX_TOKENS = (8, 12, 16)
P_ONE_OFF = 0.15
ZIPF_TENANTS = 0.8
ZIPF_PUBLIC = 0.9


def habitual_flows(rng: random.Random, habits: list[str]) -> list[tuple[float, list[str]]]:
    """A tenant's 1-3 habitual workflows: each a weight and a chain of 4-10 steps over a
    working set of 2-4 of its habits, no step repeating the one before."""
    flows = []
    for _ in range(rng.randint(1, 3)):
        working = rng.sample(habits, min(len(habits), rng.randint(2, 4)))
        chain = [rng.choice(working)]
        while len(chain) < rng.randint(4, 10):
            chain.append(rng.choice([a for a in working if a != chain[-1]]))
        flows.append((round(rng.uniform(0.2, 1.0), 3), chain))
    return flows


def world(rng: random.Random, tenants: int, public: int) -> tuple[dict, dict]:
    """``(adapters, tenants)``: adapter -> (rank, domain, owner); tenant -> its profile
    (activity weight, visible adapters, workflows as (weight, chain))."""
    ranks, rank_w = [r for r, _ in RANKS], [w for _, w in RANKS]
    adapters: dict[str, tuple[int, str, str]] = {}
    pub_by_domain: dict[str, list[str]] = {d: [] for d in DOMAINS}
    for j in range(public):
        d = DOMAINS[j % len(DOMAINS)]
        name = f"pub-{d}-{len(pub_by_domain[d]):02d}"
        adapters[name] = (rng.choices(ranks, rank_w)[0], d, "public")
        pub_by_domain[d].append(name)
    # the public adapters' own popularity: Zipf over a shuffled order
    order = [a for a in adapters]
    rng.shuffle(order)
    pub_weight = {a: 1.0 / (k + 1) ** ZIPF_PUBLIC for k, a in enumerate(order)}
    activity = [1.0 / (k + 1) ** ZIPF_TENANTS for k in range(tenants)]
    rng.shuffle(activity)
    profiles: dict[str, dict] = {}
    for i in range(tenants):
        home, second = rng.sample(DOMAINS, 2)
        tenant = f"t{i:02d}-{home}"
        owned = []
        for k in range(rng.randint(3, 6)):
            d = second if k and rng.random() < 0.3 else home
            name = f"t{i:02d}-{d}-{k}"
            adapters[name] = (rng.choices(ranks, rank_w)[0], d, tenant)
            owned.append(name)
        candidates = pub_by_domain[home] + pub_by_domain[second]
        used_public: list[str] = []
        while len(used_public) < min(len(candidates), rng.randint(2, 5)):
            pick = rng.choices(candidates, [pub_weight[a] for a in candidates])[0]
            if pick not in used_public:
                used_public.append(pick)
        flows = habitual_flows(rng, owned + used_public)
        profiles[tenant] = {"activity": activity[i], "visible": owned + list(pub_weight), "flows": flows}
    return adapters, profiles


def generate_hundreds(n: int = N_REQUESTS, seed: int = SEED, tenants: int = N_TENANTS,
                      public: int = N_PUBLIC, session_rate: float | None = None) -> list[dict]:
    rng = random.Random(seed)
    adapters, profiles = world(rng, tenants, public)
    names = list(profiles)
    rates = [profiles[t]["activity"] for t in names]
    rate = SESSION_RATE * tenants / N_TENANTS if session_rate is None else session_rate
    span = n / 6.0 / rate  # about the trace's duration: ~6 requests a session
    bursts = [(rng.uniform(0, span), rng.choice(names)) for _ in range(BURSTS)]
    bursts = [(s, s + rng.uniform(20, 60), t) for s, t in bursts]
    requests: list[dict] = []
    for clock, tenant, sid in opened_sessions(rng, names, rates, rate, bursts, 5.0, lambda: len(requests) >= n * 2):
        prof = profiles[tenant]
        session = f"{tenant}-s{sid:05d}"
        if rng.random() < P_ONE_OFF:
            adapter = rng.choice(prof["visible"])
            requests.append(_request(rng, adapters, clock, None, tenant, session, 0, "one-off", adapter))
            continue
        flows = prof["flows"]
        chain = rng.choices([c for _, c in flows], [w for w, _ in flows])[0]
        for t, think, step, adapter in session_steps(rng, clock, chain, prof["visible"], P_STRAY):
            requests.append(_request(rng, adapters, t, think, tenant, session, step, "->".join(chain), adapter))
    requests.sort(key=lambda r: (r["t"], r["session"], r["step"]))
    requests = requests[:n]
    width = max(4, len(str(n - 1)))
    return [{"id": f"req-{i:0{width}d}", **r} for i, r in enumerate(requests)]


def _request(rng: random.Random, adapters: dict, t: float, think: float | None, tenant: str, session: str,
             step: int, workflow: str, adapter: str) -> dict:
    rank, domain, _ = adapters[adapter]
    prompt = rng.choice(PROMPTS[domain]).format(task=rng.choice(TASKS[domain]))
    timing = {"t": round(t, 3)} if think is None else {"t": round(t, 3), "think_s": think}
    return {**timing, "tenant": tenant, "session": session, "step": step, "workflow": workflow,
            "adapter": adapter, "rank": rank, "domain": domain,
            "messages": [{"role": "user", "content": prompt}], "max_tokens": rng.choice(MAX_TOKENS)}
