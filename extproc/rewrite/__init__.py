"""Rewrite a request for the chosen upstream's flavour; touch the body only if it changes.

One module per flavour (``vllm``, ``sglang``, ``builtin``), each with ``model_for``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from extproc.catalog import Adapter, Upstream
from extproc.decision import Decision
from extproc.rewrite import builtin, sglang, vllm
from extproc.rewrite.codec import encode
from extproc.rewrite.hints import wire_hints

__all__ = ["Rewrite", "rewrite_request", "MODEL_FOR", "encode"]

_MISSING = object()

MODEL_FOR: Mapping[str, Callable[[Adapter, Upstream], str]] = {
    "vllm": vllm.model_for, "sglang": sglang.model_for, "builtin": builtin.model_for}


@dataclass(frozen=True, slots=True)
class Rewrite:
    body: bytes | None                            # None: forward the client's bytes untouched
    header_hints: tuple[tuple[str, str], ...] = ()   # (field, text) for ``hints: headers``


def _header_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def rewrite_request(body: Mapping[str, Any], d: Decision, force: bool = False) -> Rewrite:
    """New body (or None) and header hints for ``d.upstream``; ``force`` re-encodes anyway.

    Header hints travel as ``x-ace-hint-<field>`` (Envoy adds them from the decision's
    metadata, see envoy/envoy.template.yaml)."""
    if not d.applies_adapter:
        return Rewrite(encode(body) if force else None)
    upstream = d.upstream
    model = MODEL_FOR[upstream.flavour](d.adapter, upstream)
    hints = wire_hints(d) if upstream.hints != "off" else {}
    changes: dict[str, Any] = {}
    if body.get("model") != model:
        changes["model"] = model
    headers: tuple[tuple[str, str], ...] = ()
    if upstream.hints == "body":
        for k, v in hints.items():
            if body.get(k, _MISSING) != v:
                changes[k] = v
    elif upstream.hints == "headers":
        headers = tuple((k, _header_text(v)) for k, v in hints.items())
    if not changes and not force:
        return Rewrite(None, headers)
    return Rewrite(encode({**body, **changes}), headers)

