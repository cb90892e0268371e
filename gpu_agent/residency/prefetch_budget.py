"""Whether the agent takes a prefetch hint: the speculation budget (pure).

A hint is a bet: the load may save a request its stall, and it costs the load link's time
and, when the pool is full, a victim that may be wanted again. The agent takes a hint
whose sender said how likely it is (``PrefetchRequest.probability``) only when

    probability x stall avoided  >  victim's reuse probability x victim's reload
                                    + (1 - probability) x the engine time a wasted load takes

and only while the load link has room: no request's load queued or running (a request
waits for that one), and no more than ``link_budget_ms`` of load work queued ahead. A hint
without a probability (an older sender) is taken as before: its priority orders it.

:func:`decide_hint` is the one place this is decided; ``ResidencyManager.prefetch`` builds
its inputs from what it knows (measured load times, the queue, the engine's own loads)
and counts every refusal (``ace_agent_prefetch_total{outcome="rejected_<verdict>"}``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

__all__ = ["HintVerdict", "HintBet", "LinkState", "decide_hint", "DEFAULT_LINK_BUDGET_MS",
           "DEFAULT_LINK_BYTES_PER_MS"]

#: Load work (ms) that may be queued ahead of a speculative prefetch.
DEFAULT_LINK_BUDGET_MS = 200.0
#: An adapter's load time before any load was measured: bytes / this (100 MB/s).
DEFAULT_LINK_BYTES_PER_MS = 100_000.0


class HintVerdict(str, Enum):
    """What the budget says about one hint; every refusal names its reason."""

    ACCEPT = "accept"
    INVALID = "invalid_probability"    # not a number in [0, 1]
    DEMAND_QUEUED = "demand_queued"    # a request's load is queued or running: it goes first
    LINK_BUSY = "link_busy"            # more load work queued ahead than the budget
    NOT_WORTH = "not_worth"            # expected saving <= expected cost


@dataclass(frozen=True)
class HintBet:
    """One hint as a bet. ``probability`` None: the sender gave none (take it as before)."""

    probability: float | None
    stall_ms: float                        # what a request would wait for this adapter's load
    victim_reuse_probability: float = 0.0  # of the adapter this load would displace
    victim_reload_ms: float = 0.0          # 0 when the load needs no room
    # the engine time a load takes from requests, which a wasted bet costs whoever arrives
    # meanwhile: the load's time x the engine's ``load_compute_share`` (vLLM, SGLang: all
    # of it; the builtin engine on the CPU: the share its forward passes lose; on CUDA: 0)
    waste_ms: float = 0.0


@dataclass(frozen=True)
class LinkState:
    """The load link as the agent sees it when the hint arrives."""

    demand_loads: int       # requests' loads queued or running (the agent's and the engine's)
    busy_ms: float          # expected load work queued or running ahead of this hint
    budget_ms: float = DEFAULT_LINK_BUDGET_MS


def decide_hint(bet: HintBet, link: LinkState) -> HintVerdict:
    p = bet.probability
    if p is None:
        return HintVerdict.ACCEPT   # an older sender: priority semantics, as before
    q = bet.victim_reuse_probability
    if not (_unit(p) and _unit(q)):
        return HintVerdict.INVALID
    if link.demand_loads > 0:
        return HintVerdict.DEMAND_QUEUED
    if link.busy_ms > link.budget_ms:
        return HintVerdict.LINK_BUSY
    if p * bet.stall_ms <= q * bet.victim_reload_ms + (1.0 - p) * bet.waste_ms:
        return HintVerdict.NOT_WORTH
    return HintVerdict.ACCEPT


def _unit(x: float) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x) and 0.0 <= x <= 1.0
