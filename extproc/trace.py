"""What the gateway tells the client about its decision.

Response header values are ``k=v`` lists (``x-ace-trace-multi-lora: mode=prod,action=...``),
handed to Envoy as dynamic metadata (``trace_metadata``) which the virtual host turns
into headers; ``/v1/execute`` returns the same facts as a list of objects. Numbers come from the
residency snapshot; without agent data they read ``unknown``.
"""
from __future__ import annotations

from extproc.decision import Decision
from extproc.skills import DYNAMIC_LORA_PREFETCH, MULTI_LORA

__all__ = ["trace_entries", "trace_metadata"]


def _num(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"


def _swap_ms_saved(d: Decision) -> str:
    action = d.multi_lora_would or d.multi_lora_action
    if action == "adapter_resident_applied" or (action == "adapter_prefetched_applied"
                                                and d.residency.tier == "pool"):
        return _num(d.residency.cold_load_ms)  # the agent's measured cold load of this adapter
    if action == "adapter_cold_loaded":
        return "0"
    if action == "passthrough":
        return "0"
    return "unknown"   # host tier (saving not measured yet) or residency unknown


def _is_prefetch_hit(d: Decision) -> str:
    """true: the adapter was in the pool because a prefetch put it there before the request,
    and the request's prefetch skill is prod (``decide`` claims no prefetch otherwise)."""
    if d.adapter is None or d.multi_lora_action == "passthrough":
        return "false"
    if not d.residency.known:
        return "unknown"
    action = d.multi_lora_would or d.multi_lora_action
    return "true" if action == "adapter_prefetched_applied" and d.residency.tier == "pool" else "false"


def _vram_mb_saved(d: Decision) -> str:
    """Serving the adapter on the shared base instead of a dedicated instance saves the base
    model's weights (as the upstream's agent measured them)."""
    if d.adapter is None or d.multi_lora_action == "passthrough":
        return "0"
    base = d.residency.base_model_bytes
    return "unknown" if not base else f"{base / (1 << 20):.3g}"


def trace_entries(d: Decision, prefetch_queued: bool | None) -> list[dict[str, str]]:
    adapter = d.adapter.name if d.adapter is not None else "none"
    ml = {"skill": MULTI_LORA, "mode": d.skills[MULTI_LORA], "action": d.multi_lora_action}
    if d.multi_lora_would:
        ml["would"] = d.multi_lora_would
    ml.update(adapter=adapter, residency=d.residency.tier, swap_ms_saved=_swap_ms_saved(d),
              is_prefetch_hit=_is_prefetch_hit(d), vram_mb_saved=_vram_mb_saved(d),
              upstream=d.upstream.name)
    pf = {"skill": DYNAMIC_LORA_PREFETCH, "mode": d.skills[DYNAMIC_LORA_PREFETCH],
          "action": d.prefetch_action, "adapter": adapter, "residency": d.residency.tier}
    if prefetch_queued is not None:
        pf["queued"] = "true" if prefetch_queued else "dropped"
    return [ml, pf]


def _header_value(entry: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in entry.items() if k != "skill")


_METADATA: dict[tuple, tuple] = {}
_METADATA_SIZE = 512


def trace_metadata(d: Decision, prefetch_queued: bool | None) -> tuple[tuple[str, str], ...]:
    """Metadata keys Envoy turns into the response headers ``x-ace-trace-multi-lora``,
    ``x-ace-trace-dynamic-lora-prefetch`` and ``x-ace-served-by``.

    Memoised on what the values are made of: requests to the same adapter and upstream
    in the same state share them, and building them was ~5% of a request's ext_proc time.
    The residency is matched by identity (the snapshot's object, held by the cache so its
    id cannot be reused), so no two residencies that compare equal but print differently
    (``-0.0`` and ``0.0`` ms) can share an entry."""
    res = d.residency
    key = (id(res), d.upstream.name, d.adapter.name if d.adapter is not None else None,
           d.skills[MULTI_LORA], d.skills[DYNAMIC_LORA_PREFETCH], d.multi_lora_action,
           d.multi_lora_would, d.prefetch_action, prefetch_queued)
    hit = _METADATA.get(key)
    if hit is not None and hit[0] is res:
        return hit[1]
    ml, pf = trace_entries(d, prefetch_queued)
    out = (("trace_multi_lora", _header_value(ml)),
           ("trace_dynamic_lora_prefetch", _header_value(pf)), ("served_by", d.upstream.name))
    if len(_METADATA) >= _METADATA_SIZE:
        _METADATA.clear()
    _METADATA[key] = (res, out)
    return out
