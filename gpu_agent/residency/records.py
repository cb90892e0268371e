"""The residency manager's records: what an operation did (``ResidencyResult``), what
observers see of one adapter (``AdapterView``), the budgets it is given
(``ResidencyBudgets``), and its own mutable note per adapter (``AdapterState``).

Plain values; no behaviour beyond their own fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ace_common.tiers import Tier
from ace_common.catalog import Adapter
from gpu_agent.residency.prefetch_budget import DEFAULT_LINK_BUDGET_MS

__all__ = ["AdapterState", "AdapterView", "DONE", "ResidencyBudgets", "ResidencyOutcome", "ResidencyResult",
           "rejected"]


class ResidencyOutcome(str, Enum):
    """What a prefetch, evict, pin or unpin did. Refusals are outcomes (REJECTED with a
    reason), never exceptions: exceptions are errors (the engine failed, a bug)."""

    ACCEPTED = "accepted"                  # prefetch: queued, or joined a queued/running load
    ALREADY_RESIDENT = "already_resident"  # prefetch: on the device already
    DONE = "done"                          # evict / pin / unpin: done as asked
    REJECTED = "rejected"                  # nothing done; ``reason`` says why


@dataclass(frozen=True)
class ResidencyResult:
    """The one way the manager reports an operation's outcome."""

    outcome: ResidencyOutcome
    reason: str = ""   # REJECTED: unknown_adapter, digest_mismatch, queue_full, pinned, busy,
                       # loading, not_resident; ACCEPTED: coalesced when it joined a load

    @property
    def ok(self) -> bool:
        return self.outcome is not ResidencyOutcome.REJECTED


def rejected(reason: str) -> ResidencyResult:
    return ResidencyResult(ResidencyOutcome.REJECTED, reason)


DONE = ResidencyResult(ResidencyOutcome.DONE)


@dataclass(frozen=True)
class AdapterView:
    """One adapter's residency as observers see it (immutable)."""

    name: str
    tier: Tier
    cold_load_ms: float | None = None
    bytes: int = 0
    pinned: bool = False
    digest: str = ""
    loading: bool = False
    # Why the adapter is on the device: "prefetch" (a Prefetch signal loaded it and no
    # operator/restart load happened since), "pin", "engine_restart", "request" (an
    # awaited ensure_resident), "engine" (the engine loaded it itself, found by reconcile).
    loaded_by: str = ""


@dataclass(frozen=True)
class ResidencyBudgets:
    # The device tier's budgets, for an engine the agent drives; a self-managed engine
    # (builtin) takes neither: its pool enforces its own (gpu_agent.residency.holdings).
    device_count: int | None = None     # None: the connector's capacity (vLLM --max-cpu-loras)
    device_bytes: int | None = None     # None: no byte budget on the device tier
    host_bytes: int = 0                 # 0: no host tier (the engine reads files itself)
    queue_size: int = 64                # pending prefetches; beyond this they are rejected
    workers: int = 1                    # concurrent background loads
    reconcile_interval_s: float = 2.0
    load_interval_s: float = 0.5        # engine load measurements; 0: none (always unknown)
    link_budget_ms: float = DEFAULT_LINK_BUDGET_MS  # load work queued ahead of a hint with a probability
    # the share of a bet's load time charged against it if unused (HintBet.waste_ms);
    # None: the engine's (EngineConnector.load_compute_share)
    waste_share: float | None = None
    # An adapter the engine loaded itself (found by reconcile) is nobody's victim for this
    # long: it was loaded for a request that may still be queued (the engine's busy gauge
    # lags), and unloading it then fails that request (docs/engine.md, "Unloading an adapter
    # a queued request uses kills vLLM 0.32's engine"). The tier may exceed its count budget
    # meanwhile; the next reconcile after it shrinks it back.
    adopt_grace_s: float = 2.0


@dataclass
class AdapterState:
    """The manager's own note on one catalog adapter (mutable; the manager's modules only)."""

    spec: Adapter
    pinned: bool = False
    cold_load_ms: float | None = None
    loaded_by: str = ""
    pending_reason: str = ""   # reason of the queued prefetch that will load it
    pending_evict: tuple[str, ...] = ()  # adapters to evict first if its load needs room
    engine_loaded_at: float | None = None  # when reconcile found the engine had loaded it itself
    priced: bool = False  # the queued prefetch is a bet (it came with a probability) against its hinted victims
    room_only: bool = False  # the queued prefetch loads only into free device room (PrefetchRequest.room_only)
