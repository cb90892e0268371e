"""The seeds' wire hints, injected where the upstream accepts them (body, headers, off).

Hints are sent only when the request is rewritten for an adapter (multi_lora prod).
In header mode each field ``f`` travels as ``x-ace-hint-<f with - for _>``: the decision
carries it as metadata ``hint_<f>`` and Envoy adds the header (extproc.envoy_config).

The hint fields are the gateway's: a client's copy (top level, or in a nested
``extra_body``) never reaches the engine, whatever the skill modes (``client_copies``).
The one exception is ``lora_name``, which a client sends to select the adapter: it is
kept where it names the adapter the gateway resolved, so its value is the gateway's.
"""
from __future__ import annotations

from typing import Any, Mapping

from extproc.domain.decision import Decision
from ace_common.engine_fields import EVICT_FIRST
from ace_common.tiers import Tier

__all__ = ["HINT_FIELDS", "wire_hints", "client_copies"]

HINT_FIELDS = ("lora_name", "lora_adapter", "lora_prefetch", "enable_lora_prefetch",
               "prefetch_adapter_id", "vram_allocated_mb", "prefetch_status")

_HINT_SET = frozenset(HINT_FIELDS)
# every field a client may not send the engine: the hints and the builtin engine's
# ``EVICT_FIRST`` (ace_common.engine_fields)
_GATEWAY_SET = _HINT_SET | {EVICT_FIRST}
_NONE: frozenset[str] = frozenset()
_SELECTOR = frozenset(("lora_name",))
_MIB = 1 << 20


def wire_hints(d: Decision) -> dict[str, Any]:
    if not d.applies_adapter:
        return {}
    adapter = d.adapter
    prefetch = d.signals_prefetch
    hints: dict[str, Any] = {"lora_name": adapter.name, "lora_adapter": adapter.name,
                             "lora_prefetch": prefetch, "enable_lora_prefetch": prefetch}
    if prefetch:
        hints["prefetch_adapter_id"] = adapter.sha256
    if d.residency.tier == Tier.DEVICE and d.residency.bytes is not None:
        hints["vram_allocated_mb"] = round(d.residency.bytes / _MIB, 3)
    hints["prefetch_status"] = d.residency.public_tier
    return hints


def client_copies(obj: Mapping[str, Any], d: Decision) -> frozenset[str]:
    """The gateway's fields in ``obj`` (a body or its ``extra_body``) the engine must not get
    from the client: all of them (the hints, ``EVICT_FIRST``) but a ``lora_name`` naming
    the adapter the gateway selected."""
    if _GATEWAY_SET.isdisjoint(obj):    # the usual body: one C-level pass, nothing built
        return _NONE
    found = _GATEWAY_SET.intersection(obj)
    if "lora_name" in found and d.adapter is not None:
        name = obj["lora_name"]
        if isinstance(name, str) and name == d.adapter.name:
            return found - _SELECTOR if len(found) > 1 else _NONE
    return found
