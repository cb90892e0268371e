"""Rewrite a request for the chosen upstream's flavour; touch the body only if it changes
(the adapter is applied, or the client sent fields that are the gateway's).

One module per flavour (``vllm``, ``sglang``, ``builtin``), each with ``model_for`` and
``ROUTES`` (the inference routes that flavour is sent: ``SERVED_ROUTES``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from extproc.state.catalog import Adapter, Upstream
from extproc.domain.decision import Decision
from extproc.frozen import fast_init
from extproc.rewrite import builtin, sglang, vllm
from extproc.rewrite.codec import encode
from extproc.rewrite.hints import client_copies, wire_hints
from ace_common.engine_fields import EVICT_FIRST

__all__ = ["Rewrite", "rewrite_request", "MODEL_FOR", "SERVED_ROUTES", "encode"]

_MISSING = object()

MODEL_FOR: Mapping[str, Callable[[Adapter, Upstream], str]] = {
    "vllm": vllm.model_for, "sglang": sglang.model_for, "builtin": builtin.model_for}
SERVED_ROUTES: Mapping[str, frozenset[str]] = {
    "vllm": vllm.ROUTES, "sglang": sglang.ROUTES, "builtin": builtin.ROUTES}


@fast_init
@dataclass(frozen=True, slots=True)
class Rewrite:
    body: bytes | None                            # None: forward the client's bytes untouched
    header_hints: tuple[tuple[str, str], ...] = ()   # (field, text) for ``hints: headers``


def _header_text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def rewrite_request(body: Mapping[str, Any], d: Decision, force: bool = False) -> Rewrite:
    """New body (or None) and header hints for ``d.upstream``; ``force`` re-encodes anyway.
    Without the adapter applied, a ``model`` the tenant may not use (``d.foreign_model``)
    becomes the upstream's base model.

    A client's copies of the gateway's fields (the hints, ``EVICT_FIRST``) are removed in
    every mode, from the top level and from a nested ``extra_body``
    (``hints.client_copies``): a body without any is forwarded as it came unless the
    adapter is applied. A builtin upstream's request whose adapter is not resident there
    carries the victims of the gateway's signal (``EVICT_FIRST``), which that engine's own
    load evicts first (ace_common.engine_fields). Header hints travel as
    ``x-ace-hint-<field>`` (Envoy adds them from the decision's metadata, see
    envoy/envoy.template.yaml)."""
    drop = client_copies(body, d)
    changes: dict[str, Any] = {}
    nested = body.get("extra_body")
    if isinstance(nested, dict):
        nested_drop = client_copies(nested, d)
        if nested_drop:
            changes["extra_body"] = {k: v for k, v in nested.items() if k not in nested_drop}
    headers: tuple[tuple[str, str], ...] = ()
    if d.applies_adapter:
        upstream = d.upstream
        model = MODEL_FOR[upstream.flavour](d.adapter, upstream)
        if body.get("model") != model:
            changes["model"] = model
        signal = d.prefetch_signal
        if signal is not None and signal.evict and upstream.flavour == "builtin":
            # the engine loads the adapter itself on arrival: the victims go with the request
            changes[EVICT_FIRST] = list(signal.evict)
            drop = drop - {EVICT_FIRST}
        if upstream.hints == "body":
            hints = wire_hints(d)
            if drop:
                drop = drop.difference(hints)     # the gateway's value replaces the client's
            for k, v in hints.items():
                old = body.get(k, _MISSING)
                if type(old) is not type(v) or old != v:   # 1 == True, but not to an engine
                    changes[k] = v
        elif upstream.hints == "headers":
            headers = tuple((k, _header_text(v)) for k, v in wire_hints(d).items())
    elif d.foreign_model:
        # a name the tenant may not use (another tenant's adapter, or unknown): an engine
        # could serve an adapter by it, so the base model goes instead
        changes["model"] = d.upstream.base_model
    if not changes and not drop:
        return Rewrite(encode(body) if force else None, headers)
    out = {k: v for k, v in body.items() if k not in drop} if drop else dict(body)
    out.update(changes)
    return Rewrite(encode(out), headers)
