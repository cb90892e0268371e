"""The ``sixteen`` scenario: 16 adapters, 12 tenants (``generate.py --scenario sixteen``).

    python data/multi_lora_eval/generate.py --scenario sixteen [--seed 20261204] [--n 1200] [--out FILE]

Issue 21's middle case: a catalog a 4-host fleet of 8 slots per host holds twice over,
so what it measures is placement and the tails, not capacity. The same kind of world as
``hundreds.py`` (whose traffic model, ranks, prompts and timing it reuses), smaller:

- **Adapters**: 16 of ranks 8-128 (``hundreds.RANKS``): ``N_PUBLIC`` public ones
  ``pub-<domain>-NN`` over the 8 domains and one private ``<tenant>-<domain>-0`` for each
  of the first ``N_PRIVATE`` tenants.
- **Tenants**: 12, Zipf activity; each uses 2-4 public adapters of its two domains (by
  the public adapters' own Zipf popularity) and its private one, in 1-3 habitual
  workflows of 4-10 steps over a working set of 2-4 of them.
- **Traffic**: as ``hundreds``: Poisson session opens with bursts, strays, repeats,
  early ends and one-off requests (any adapter the tenant may use).

``HELD_OUT_SEEDS`` are never used to tune anything.
"""

from __future__ import annotations

import random

import hundreds
from generate import opened_sessions, session_steps

SEED = 20261204
HELD_OUT_SEEDS = (20261205, 20261206)
N_REQUESTS = 1200
N_TENANTS = 12
N_PUBLIC = 10
N_PRIVATE = 6
SESSION_RATE = 0.25  # sessions per second, outside bursts


def world(rng: random.Random, tenants: int = N_TENANTS) -> tuple[dict, dict]:
    """``(adapters, tenants)`` as ``hundreds.world``: 16 adapters in all."""
    ranks, rank_w = [r for r, _ in hundreds.RANKS], [w for _, w in hundreds.RANKS]
    domains = hundreds.DOMAINS
    adapters: dict[str, tuple[int, str, str]] = {}
    pub_by_domain: dict[str, list[str]] = {d: [] for d in domains}
    for j in range(N_PUBLIC):
        d = domains[j % len(domains)]
        name = f"pub-{d}-{len(pub_by_domain[d]):02d}"
        adapters[name] = (rng.choices(ranks, rank_w)[0], d, "public")
        pub_by_domain[d].append(name)
    order = list(adapters)
    rng.shuffle(order)
    pub_weight = {a: 1.0 / (k + 1) ** hundreds.ZIPF_PUBLIC for k, a in enumerate(order)}
    activity = [1.0 / (k + 1) ** hundreds.ZIPF_TENANTS for k in range(tenants)]
    rng.shuffle(activity)
    profiles: dict[str, dict] = {}
    for i in range(tenants):
        home, second = rng.sample(domains, 2)
        tenant = f"t{i:02d}-{home}"
        owned = []
        if i < N_PRIVATE:
            name = f"t{i:02d}-{home}-0"
            adapters[name] = (rng.choices(ranks, rank_w)[0], home, tenant)
            owned.append(name)
        # the tenant's public habits: its domains' adapters first, any public one if those are few
        candidates = pub_by_domain[home] + pub_by_domain[second]
        if len(candidates) < 4:
            candidates = candidates + [a for a in order if a not in candidates]
        used_public: list[str] = []
        while len(used_public) < rng.randint(2, 4):
            pick = rng.choices(candidates, [pub_weight[a] for a in candidates])[0]
            if pick not in used_public:
                used_public.append(pick)
        flows = hundreds.habitual_flows(rng, owned + used_public)
        profiles[tenant] = {"activity": activity[i], "visible": owned + list(pub_weight), "flows": flows}
    return adapters, profiles


def generate_sixteen(n: int = N_REQUESTS, seed: int = SEED) -> list[dict]:
    rng = random.Random(seed)
    adapters, profiles = world(rng)
    names = list(profiles)
    rates = [profiles[t]["activity"] for t in names]
    span = n / 6.0 / SESSION_RATE
    bursts = [(rng.uniform(0, span), rng.choice(names)) for _ in range(hundreds.BURSTS // 2)]
    bursts = [(s, s + rng.uniform(20, 60), t) for s, t in bursts]
    requests: list[dict] = []
    for clock, tenant, sid in opened_sessions(rng, names, rates, SESSION_RATE, bursts, 5.0,
                                              lambda: len(requests) >= n * 2):
        prof = profiles[tenant]
        session = f"{tenant}-s{sid:05d}"
        if rng.random() < hundreds.P_ONE_OFF:
            adapter = rng.choice(prof["visible"])
            requests.append(hundreds._request(rng, adapters, clock, None, tenant, session, 0, "one-off", adapter))
            continue
        flows = prof["flows"]
        chain = rng.choices([c for _, c in flows], [w for w, _ in flows])[0]
        for t, think, step, adapter in session_steps(rng, clock, chain, prof["visible"], hundreds.P_STRAY):
            requests.append(hundreds._request(rng, adapters, t, think, tenant, session, step, "->".join(chain),
                                              adapter))
    requests.sort(key=lambda r: (r["t"], r["session"], r["step"]))
    requests = requests[:n]
    width = max(4, len(str(n - 1)))
    return [{"id": f"req-{i:0{width}d}", **r} for i, r in enumerate(requests)]
