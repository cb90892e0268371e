"""Which adapter a request asks for; first match wins.

1. ``extra_body.lora_name`` (a nested object, what curl users send),
2. top-level ``lora_name`` (what the OpenAI SDK's ``extra_body=`` puts on the wire),
3. ``model`` naming an adapter visible to the tenant (an explicit base model name means no
   adapter),
4. the tenant's ``default_adapter``.

An adapter owned by another tenant is treated exactly like an unknown name, so a caller
cannot learn which adapters other tenants have: named by ``lora_name`` both are 404; named
by ``model`` both fall through to 4, as any name the gateway does not know does (an SDK's
default ``"gpt-4o"``), and the selection says ``foreign_model``: the rewrite then never
sends that name to an engine (which could serve another tenant's adapter by it). ``adapter_rank`` (top level or in
``extra_body``), when sent, must equal the catalog's rank (422).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from extproc.state.catalog import Adapter, Tenant
from extproc.errors import InvalidField, NotFound
from extproc.frozen import fast_init
from extproc.state.store import Snapshot

__all__ = ["Selection", "select_adapter"]


@fast_init
@dataclass(frozen=True, slots=True)
class Selection:
    adapter: Adapter | None
    source: str    # extra_body.lora_name | lora_name | model | tenant_default | base_model | none
    foreign_model: bool = False   # ``model`` names neither a base model nor an adapter of this tenant


def _lookup(snapshot: Snapshot, tenant: Tenant, name: Any, param: str) -> Adapter:
    if not isinstance(name, str) or not name:
        raise InvalidField(f"{param} must be a non-empty string", param=param)
    adapter = snapshot.adapters.get(name)
    if adapter is None or not adapter.visible_to(tenant.id):
        raise NotFound(f"adapter {name!r} does not exist or is not visible to this key", param=param)
    return adapter


def select_adapter(snapshot: Snapshot, tenant: Tenant, body: Mapping[str, Any]) -> Selection:
    extra = body.get("extra_body")
    if extra is not None and not isinstance(extra, dict):
        raise InvalidField("extra_body must be an object", param="extra_body")
    if extra and "lora_name" in extra:
        sel = Selection(_lookup(snapshot, tenant, extra["lora_name"], "extra_body.lora_name"),
                        "extra_body.lora_name")
    elif "lora_name" in body:
        sel = Selection(_lookup(snapshot, tenant, body["lora_name"], "lora_name"), "lora_name")
    else:
        sel = None
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidField("model must be a string", param="model")
    named = snapshot.adapters.get(model) if model is not None else None
    visible = named is not None and named.visible_to(tenant.id)
    foreign = model is not None and not visible and model not in snapshot.base_models
    if sel is not None:
        sel = Selection(sel.adapter, sel.source, foreign)
    elif visible:
        sel = Selection(named, "model")
    elif model in snapshot.base_models:
        sel = Selection(None, "base_model")
    elif tenant.default_adapter:
        sel = Selection(snapshot.adapters[tenant.default_adapter], "tenant_default", foreign)
    else:
        sel = Selection(None, "none", foreign)
    rank = extra.get("adapter_rank") if extra and "adapter_rank" in extra else body.get("adapter_rank")
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise InvalidField("adapter_rank must be an integer", param="adapter_rank")
        if sel.adapter is None:
            raise InvalidField("adapter_rank given but no adapter selected", param="adapter_rank")
        if rank != sel.adapter.rank:
            raise InvalidField(f"adapter_rank {rank} does not match adapter {sel.adapter.name} "
                               f"(rank {sel.adapter.rank})", param="adapter_rank",
                               code="adapter_rank_mismatch")
    return sel
