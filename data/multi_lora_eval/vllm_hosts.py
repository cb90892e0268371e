"""The ``vllm`` scenario: issue 20's real-vLLM fleet (``generate.py --scenario vllm``).

    python data/multi_lora_eval/generate.py --scenario vllm [--seed 20261210] [--n 240] [--out FILE]

``hundreds.py``'s world (habitual per-tenant workflows over own and shared public
adapters, Zipf activity, bursts, strays, one-off requests, ranks 8-128) at the size that
``make bench ENGINE=vllm`` replays through two real vLLM hosts on shared CPUs in minutes:
5 tenants and 8 public adapters, about 24 adapters in all (24 at the default seed),
240 requests, sessions opened at 0.3 per second. With ``--max-cpu-loras 4`` per host
(``VLLM_S``), two hosts hold a third of the catalog, as a 4-host fleet of 16 slots holds
a third of ``hundreds``.

``HELD_OUT_SEEDS`` are never used to tune anything.
"""

from __future__ import annotations

import hundreds

SEED = 20261210
HELD_OUT_SEEDS = (20261211, 20261212)
N_REQUESTS = 240
N_TENANTS = 5
N_PUBLIC = 8
SESSION_RATE = 0.3  # sessions per second, outside bursts


def generate_vllm(n: int = N_REQUESTS, seed: int = SEED) -> list[dict]:
    return hundreds.generate_hundreds(n, seed, N_TENANTS, N_PUBLIC, SESSION_RATE)
