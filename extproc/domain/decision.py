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
from types import MappingProxyType
from typing import Any, Mapping

from extproc.domain.auth import Principal
from extproc.state.catalog import Adapter, Upstream
from extproc.errors import NoUpstream
from extproc.domain.prefetch import PrefetchSignal
from extproc.policy.routing import RoutePolicy, choose_upstream
from extproc.state.residency import NONE, UNKNOWN, ResidencySnapshot, SentCounts, TierReport
from extproc.domain.selection import select_adapter
from extproc.state.skill_modes import DYNAMIC_LORA_PREFETCH, MULTI_LORA, OFF, PROD, SHADOW, validate_skills
from extproc.domain.skills import resolve
from extproc.state.store import Snapshot
from ace_common.tiers import Tier

__all__ = ["InferenceRequest", "Decision", "decide"]

_NO_FIELDS: Mapping[str, str] = MappingProxyType({})
_WARM = frozenset((Tier.DEVICE.value, Tier.HOST.value))                  # no prefetch needed
_COLD = frozenset((Tier.DISK.value, Tier.REMOTE.value, NONE))           # the upstream loads it


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    principal: Principal
    body: Mapping[str, Any]                 # the parsed JSON body (chat/completions shape)
    header_skills: Mapping[str, str] = field(default_factory=lambda: _NO_FIELDS)


@dataclass(frozen=True, slots=True)
class Decision:
    upstream: Upstream
    adapter: Adapter | None
    selected_by: str
    skills: Mapping[str, str]
    residency: TierReport
    multi_lora_action: str
    multi_lora_would: str | None
    prefetch_action: str
    prefetch_signal: PrefetchSignal | None

    @property
    def applies_adapter(self) -> bool:
        """True when the request is rewritten for the adapter (multi_lora prod)."""
        return self.adapter is not None and self.skills[MULTI_LORA] == PROD


def _applied_action(res: TierReport, prefetching: bool = True) -> str:
    """``prefetching``: this request's ``dynamic_lora_prefetch`` is prod. Only then may the
    action claim a prefetch: with the skill off or in shadow this gateway signalled none,
    so an adapter the agent reports as ``loaded_by=prefetch`` (another key's prefetch, or
    an earlier prod setting) or staged in host memory is reported for what it is."""
    if res.tier == Tier.DEVICE:
        return "adapter_prefetched_applied" if prefetching and res.prefetched else "adapter_resident_applied"
    if res.tier == Tier.HOST:
        return "adapter_prefetched_applied" if prefetching else "adapter_staged_applied"
    if res.tier in _COLD:
        return "adapter_cold_loaded"
    return "adapter_applied"


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
        ml_action = "passthrough"
    elif ml_mode == SHADOW:
        ml_action, would = "shadow", _applied_action(res, prefetching)
    else:
        ml_action = _applied_action(res, prefetching)

    signal = None
    if pf_mode == OFF:
        pf_action = "passthrough"
    elif adapter is None:
        pf_action = "not_applicable"
    elif res.tier in _WARM:
        pf_action = "not_needed"
    elif pf_mode == SHADOW:
        pf_action = "shadow"
    else:
        pf_action = "prefetch_signalled"
        signal = PrefetchSignal(upstream=upstream.name, adapter=adapter.name, digest=adapter.sha256,
                                priority=1, reason="request_unknown" if not res.known else "request_cold")
    return Decision(upstream=upstream, adapter=adapter, selected_by=selection.source, skills=skills,
                    residency=res, multi_lora_action=ml_action, multi_lora_would=would,
                    prefetch_action=pf_action, prefetch_signal=signal)
