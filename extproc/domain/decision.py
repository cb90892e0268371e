"""The gateway's decision for one inference request: a pure function, no I/O.

``decide(snapshot, residency, sent, request, route=choose_upstream) -> Decision``

``residency`` and ``sent`` are what the residency board holds (``ResidencyBoard.current``
and ``.sent``): the routing policy reads the hosts' loads from both.

multi_lora actions (prod), by the adapter's tier on the chosen upstream:
- ``adapter_resident_applied``: the adapter is on the upstream's device (tier ``device``),
- ``adapter_prefetched_applied``: it is there because a prefetch put it there
  (the agent's ``loaded_by=prefetch``), or it sits in host memory (a fast copy away);
  only when ``dynamic_lora_prefetch`` is prod for this request (nothing else claims a
  prefetch),
- ``adapter_staged_applied``: in host memory, prefetch skill not prod (a host-to-device copy),
- ``adapter_cold_loaded``: on disk, remote or nowhere: the upstream loads it,
- ``adapter_applied``: residency unknown (no agent data): applied, honest about it,
- ``passthrough``: the skill is off, or no adapter is selected (base model).
In ``shadow`` the action is ``shadow`` and ``would`` names what prod would have done.

dynamic_lora_prefetch actions: ``prefetch_signalled`` (prod, adapter not known resident),
``not_needed`` (on the device or in host memory), ``not_applicable`` (no adapter), ``passthrough`` (off),
``shadow`` (would signal). Whether the signal was queued is added by the caller.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Mapping

from extproc.domain.auth import Principal
from extproc.state.catalog import Adapter, Upstream
from extproc.errors import NoUpstream
from extproc.frozen import fast_init
from extproc.domain.prefetch import REQUEST_COLD, REQUEST_UNKNOWN, PrefetchSignal
from extproc.policy.routing import RoutePolicy, choose_upstream
from extproc.state.residency import UNKNOWN, ResidencySnapshot, SentCounts, TierReport
from extproc.domain.selection import select_adapter
from extproc.state.skill_modes import DYNAMIC_LORA_PREFETCH, MULTI_LORA, OFF, PROD, SHADOW, validate_skills
from extproc.domain.skills import resolve
from extproc.state.store import Snapshot
from ace_common.tiers import Tier

__all__ = ["InferenceRequest", "Decision", "MultiLoraAction", "PrefetchAction", "decide"]

_NO_FIELDS: Mapping[str, str] = MappingProxyType({})
_WARM = frozenset((Tier.DEVICE, Tier.HOST))                    # no prefetch needed
_COLD = frozenset((Tier.DISK, Tier.REMOTE, Tier.ABSENT))       # the upstream loads it


class MultiLoraAction(StrEnum):
    """What ``multi_lora`` did (the module's docstring says when); its word is what the
    trace header, ``/v1/execute`` and the request metrics write."""
    RESIDENT_APPLIED = "adapter_resident_applied"
    PREFETCHED_APPLIED = "adapter_prefetched_applied"
    STAGED_APPLIED = "adapter_staged_applied"
    COLD_LOADED = "adapter_cold_loaded"
    APPLIED = "adapter_applied"
    PASSTHROUGH = "passthrough"
    SHADOW = "shadow"


class PrefetchAction(StrEnum):
    """What ``dynamic_lora_prefetch`` did."""
    SIGNALLED = "prefetch_signalled"
    NOT_NEEDED = "not_needed"
    NOT_APPLICABLE = "not_applicable"
    PASSTHROUGH = "passthrough"
    SHADOW = "shadow"


@fast_init
@dataclass(frozen=True, slots=True)
class InferenceRequest:
    principal: Principal
    body: Mapping[str, Any]                 # the parsed JSON body (chat/completions shape)
    header_skills: Mapping[str, str] = field(default_factory=lambda: _NO_FIELDS)


@fast_init
@dataclass(frozen=True, slots=True)
class Decision:
    upstream: Upstream
    adapter: Adapter | None
    selected_by: str
    skills: Mapping[str, str]
    residency: TierReport
    multi_lora_action: MultiLoraAction
    multi_lora_would: MultiLoraAction | None      # in shadow: what prod would have done
    prefetch_action: PrefetchAction
    prefetch_signal: PrefetchSignal | None
    #: the body's ``model`` names no model of this tenant (extproc.domain.selection): never sent on
    foreign_model: bool = False

    # What the decision means, defined once: read by the trace, the usage counts and the
    # wire hints.
    @property
    def applies_adapter(self) -> bool:
        """True when the request is rewritten for the adapter (multi_lora prod)."""
        return self.adapter is not None and self.skills[MULTI_LORA] == PROD

    @property
    def signals_prefetch(self) -> bool:
        """The request made the gateway signal the agent to prefetch its adapter."""
        return self.prefetch_action == PrefetchAction.SIGNALLED

    @property
    def prefetch_hit(self) -> bool | None:
        """True: the adapter was on the device because a prefetch put it there before the
        request, and the request's prefetch skill is prod (``decide`` claims no prefetch
        otherwise); in shadow, what prod would have found. None: residency unknown."""
        if self.adapter is None or self.multi_lora_action == MultiLoraAction.PASSTHROUGH:
            return False
        if not self.residency.known:
            return None
        action = self.multi_lora_would or self.multi_lora_action
        return action == MultiLoraAction.PREFETCHED_APPLIED and self.residency.tier == Tier.DEVICE

    @property
    def prefetch_used(self) -> bool:
        """A prefetch hit the request itself served (prod: not what shadow would have found)."""
        return self.multi_lora_would is None and self.prefetch_hit is True

    @property
    def swap_ms_saved(self) -> float | None:
        """The load the request did not wait for: the agent's measured cold load when the
        adapter was on the device. None: unknown (host tier, whose saving is not measured
        yet, or residency unknown)."""
        action = self.multi_lora_would or self.multi_lora_action
        if action == MultiLoraAction.RESIDENT_APPLIED or (action == MultiLoraAction.PREFETCHED_APPLIED
                                                          and self.residency.tier == Tier.DEVICE):
            return self.residency.cold_load_ms
        if action == MultiLoraAction.COLD_LOADED or action == MultiLoraAction.PASSTHROUGH:
            return 0.0
        return None


def _applied_action(res: TierReport, prefetching: bool = True) -> MultiLoraAction:
    """``prefetching``: this request's ``dynamic_lora_prefetch`` is prod. Only then may the
    action claim a prefetch: with the skill off or in shadow this gateway signalled none,
    so an adapter the agent reports as ``loaded_by=prefetch`` (another key's prefetch, or
    an earlier prod setting) or staged in host memory is reported for what it is."""
    if res.tier == Tier.DEVICE:
        return (MultiLoraAction.PREFETCHED_APPLIED if prefetching and res.prefetched
                else MultiLoraAction.RESIDENT_APPLIED)
    if res.tier == Tier.HOST:
        return MultiLoraAction.PREFETCHED_APPLIED if prefetching else MultiLoraAction.STAGED_APPLIED
    if res.tier in _COLD:
        return MultiLoraAction.COLD_LOADED
    return MultiLoraAction.APPLIED


def decide(snapshot: Snapshot, residency: ResidencySnapshot, sent: SentCounts,
           request: InferenceRequest, route: RoutePolicy = choose_upstream) -> Decision:
    body = request.body
    principal = request.principal
    body_skills = validate_skills(body.get("skill_overrides"), "skill_overrides")
    skills = resolve(request.header_skills, body_skills, principal.key.skills,
                     principal.tenant.skills, snapshot.default_skills)
    selection = select_adapter(snapshot, principal.tenant, body)
    adapter = selection.adapter
    ml_mode = skills[MULTI_LORA]
    if not snapshot.upstreams:   # discovery found no ready host (yet)
        raise NoUpstream("no engine host is available")
    # Only prod may move the request; off and shadow go where the request would go anyway.
    upstream = route(snapshot.upstreams, adapter if ml_mode == PROD else None, residency, sent)
    res = residency.of(upstream.name, adapter.name) if adapter is not None else UNKNOWN

    pf_mode = skills[DYNAMIC_LORA_PREFETCH]
    prefetching = pf_mode == PROD
    would = None
    if adapter is None or ml_mode == OFF:
        ml_action = MultiLoraAction.PASSTHROUGH
    elif ml_mode == SHADOW:
        ml_action, would = MultiLoraAction.SHADOW, _applied_action(res, prefetching)
    else:
        ml_action = _applied_action(res, prefetching)

    signal = None
    if pf_mode == OFF:
        pf_action = PrefetchAction.PASSTHROUGH
    elif adapter is None:
        pf_action = PrefetchAction.NOT_APPLICABLE
    elif res.tier in _WARM:
        pf_action = PrefetchAction.NOT_NEEDED
    elif pf_mode == SHADOW:
        pf_action = PrefetchAction.SHADOW
    else:
        pf_action = PrefetchAction.SIGNALLED
        # the victims the speculation's pool model chose (residency.victims): the load then
        # evicts by predicted use, not by the agent's LRU
        signal = PrefetchSignal(upstream=upstream.name, adapter=adapter.name, digest=adapter.sha256,
                                priority=1, reason=REQUEST_UNKNOWN if not res.known else REQUEST_COLD,
                                evict=residency.victims.get(upstream.name, ())[:upstream.victim_hints],
                                spare_s=upstream.victim_grace_s)
    return Decision(upstream=upstream, adapter=adapter, selected_by=selection.source, skills=skills,
                    residency=res, multi_lora_action=ml_action, multi_lora_would=would,
                    prefetch_action=pf_action, prefetch_signal=signal, foreign_model=selection.foreign_model)
