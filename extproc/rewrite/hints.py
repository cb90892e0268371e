"""The seeds' wire hints, injected where the upstream accepts them (body, headers, off).

Hints are sent only when the request is rewritten for an adapter (multi_lora prod).
In header mode each field ``f`` travels as ``x-ace-hint-<f with - for _>``: the decision
carries it as metadata ``hint_<f>`` and Envoy adds the header (extproc.envoy_config).
"""
from __future__ import annotations

from typing import Any

from extproc.decision import Decision

__all__ = ["wire_hints"]

_MIB = 1 << 20


def wire_hints(d: Decision) -> dict[str, Any]:
    if not d.applies_adapter:
        return {}
    adapter = d.adapter
    prefetch = d.prefetch_action == "prefetch_signalled"
    hints: dict[str, Any] = {"lora_name": adapter.name, "lora_adapter": adapter.name,
                             "lora_prefetch": prefetch, "enable_lora_prefetch": prefetch}
    if prefetch:
        hints["prefetch_adapter_id"] = adapter.sha256
    if d.residency.tier == "pool" and d.residency.bytes is not None:
        hints["vram_allocated_mb"] = round(d.residency.bytes / _MIB, 3)
    hints["prefetch_status"] = d.residency.tier
    return hints

