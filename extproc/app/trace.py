"""What the gateway tells the client about its decision.

Response header values are ``k=v`` lists (``x-ace-trace-multi-lora: mode=prod,action=...``),
handed to Envoy as dynamic metadata (``trace_metadata``) which the virtual host turns
into headers; ``/v1/execute`` returns the same facts as a list of objects with JSON numbers
and booleans (``execute_trace``). Numbers come from the residency snapshot; without agent
data a header reads ``unknown``, and the JSON writes 0 / false and names the field in
``unknown``.
"""
from __future__ import annotations

from typing import Any

from extproc.domain.decision import Decision, MultiLoraAction
from extproc.state.skill_modes import DYNAMIC_LORA_PREFETCH, MULTI_LORA

__all__ = ["trace_entries", "execute_trace", "trace_metadata"]

_MIB = 1 << 20


def _vram_mb_saved(d: Decision) -> float | None:
    """Serving the adapter on the shared base instead of a dedicated instance saves the base
    model's weights (as the upstream's agent measured them)."""
    if d.adapter is None or d.multi_lora_action == MultiLoraAction.PASSTHROUGH:
        return 0.0
    base = d.residency.base_model_bytes
    return base / _MIB if base else None


def _num(value: float | None) -> str:
    return "unknown" if value is None else f"{value:g}"


def _flag(value: bool | None) -> str:
    return "unknown" if value is None else ("true" if value else "false")


def trace_entries(d: Decision, prefetch_queued: bool | None) -> list[dict[str, str]]:
    """The header form: every value a string, ``unknown`` where not known."""
    adapter = d.adapter.name if d.adapter is not None else "none"
    vram = _vram_mb_saved(d)
    ml = {"skill": MULTI_LORA, "mode": d.skills[MULTI_LORA], "action": d.multi_lora_action}
    if d.multi_lora_would:
        ml["would"] = d.multi_lora_would
    ml.update(adapter=adapter, residency=d.residency.public_tier, swap_ms_saved=_num(d.swap_ms_saved),
              is_prefetch_hit=_flag(d.prefetch_hit),
              vram_mb_saved="unknown" if vram is None else f"{vram:.3g}",
              upstream=d.upstream.name)
    pf = {"skill": DYNAMIC_LORA_PREFETCH, "mode": d.skills[DYNAMIC_LORA_PREFETCH],
          "action": d.prefetch_action, "adapter": adapter, "residency": d.residency.public_tier}
    if prefetch_queued is not None:
        pf["queued"] = "true" if prefetch_queued else "dropped"
    return [ml, pf]


def _savings(hit: bool | None, swap_ms: float | None, vram_mb: float | None) -> dict[str, Any]:
    """JSON numbers and a boolean; an unknown one is written 0 / false and named in ``unknown``."""
    return {"is_prefetch_hit": bool(hit),
            "swap_ms_saved": 0 if swap_ms is None else round(swap_ms, 3),
            "vram_mb_saved": 0 if vram_mb is None else round(vram_mb, 3),
            "unknown": [name for name, v in (("is_prefetch_hit", hit), ("swap_ms_saved", swap_ms),
                                             ("vram_mb_saved", vram_mb)) if v is None]}


def execute_trace(d: Decision, prefetch_queued: bool | None) -> list[dict[str, Any]]:
    """The ``/v1/execute`` form: the same facts as the headers, typed (docs/gateway.md).

    The two entries are two views of one request, not parts to add up: ``multi_lora``
    saves the swap when the adapter was already on the device (whoever put it there) and the
    base weights a dedicated instance would repeat; ``dynamic_lora_prefetch`` saves the
    swap only on a prefetch hit, and no memory."""
    adapter = d.adapter.name if d.adapter is not None else None
    hit = d.prefetch_hit
    ml: dict[str, Any] = {"skill": MULTI_LORA, "mode": d.skills[MULTI_LORA],
                          "action": d.multi_lora_action}
    if d.multi_lora_would:
        ml["would"] = d.multi_lora_would
    ml.update(adapter_name=adapter, residency=d.residency.public_tier,
              **_savings(hit, d.swap_ms_saved, _vram_mb_saved(d)), upstream=d.upstream.name)
    pf_swap = None if hit is None else (d.swap_ms_saved if hit else 0.0)
    pf: dict[str, Any] = {"skill": DYNAMIC_LORA_PREFETCH, "mode": d.skills[DYNAMIC_LORA_PREFETCH],
                          "action": d.prefetch_action, "adapter_name": adapter,
                          "residency": d.residency.public_tier, **_savings(hit, pf_swap, 0.0)}
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
