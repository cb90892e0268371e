"""``GET /v1/models`` and ``GET /v1/models/{id}``: answered by the gateway, never an engine.

An engine's own list names every adapter it holds, other tenants' too, with their
filesystem paths (vLLM's ``root``). The gateway's list is OpenAI's shape::

    {"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}, ...]}

with the base models the upstreams serve and the adapters visible to the key (public
ones and its tenant's own), an adapter with ``parent`` (its base model) as vLLM writes
it; ``created`` is 0 (unknown). ``owned_by``: ``ace`` for a base model, the adapter's owner (``public`` or the
caller's own tenant) for an adapter. ``/v1/models/{id}`` answers one entry, or 404
``model_not_found`` with the same message whether the id does not exist or belongs to
another tenant.

``public_model_list`` (state file, off by default): a request *without* an
Authorization header gets the list as no tenant sees it (base models and public
adapters). A wrong key is still 401.
"""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote

from extproc.domain.auth import authenticate
from extproc.state.catalog import PUBLIC
from extproc.errors import MethodNotAllowed, NotFound
from extproc.domain.headers import TENANT_HEADER
from extproc.app.handlers import HeadersOnly
from extproc.app.outcomes import Outcome, Reply, RequestHead
from extproc.state.paths import MODELS, MODELS_PREFIX
from extproc.state.store import Snapshot

__all__ = ["ModelList", "visible_models"]

BASE_OWNER = "ace"
#: ``created``: the gateway does not know when a model was made; 0 says so, and every
#: replica answers the same bytes
CREATED = 0


def visible_models(snap: Snapshot, tenant_id: str | None, created: int = CREATED) -> list[dict[str, Any]]:
    """The list entries ``tenant_id`` may see (None: no tenant, public adapters only):
    base models first, then adapters, each sorted by name."""
    adapters = [a for a in snap.adapters.values()
                if (a.owner == PUBLIC if tenant_id is None else a.visible_to(tenant_id))]
    bases = {u.base_model for u in snap.upstreams} | {a.base_model for a in adapters}
    out: list[dict[str, Any]] = [{"id": b, "object": "model", "created": created, "owned_by": BASE_OWNER}
                                 for b in sorted(bases)]
    out += [{"id": a.name, "object": "model", "created": created, "owned_by": a.owner, "parent": a.base_model}
            for a in sorted(adapters, key=lambda a: a.name)]
    return out


class ModelList(HeadersOnly):
    """``/v1/models`` and ``/v1/models/{id}`` (GET): one header message, answered here."""

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method != "GET":
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        snap = self.gw.store.snapshot
        h = head.headers
        if snap.public_model_list and "authorization" not in h and TENANT_HEADER not in h:
            tenant_id = None
        else:
            tenant_id = authenticate(snap, h.get("authorization"), h.get(TENANT_HEADER)).tenant.id
        models = visible_models(snap, tenant_id)
        if head.path == MODELS:
            return Reply(200, json.dumps({"object": "list", "data": models}).encode())
        wanted = unquote(head.path[len(MODELS_PREFIX):])
        for entry in models:
            if entry["id"] == wanted:
                return Reply(200, json.dumps(entry).encode())
        raise NotFound(f"model {wanted!r} does not exist or is not visible to this key", param="model",
                       code="model_not_found")
