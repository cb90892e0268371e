"""The header names the gateway owns, and the one rule that reads a header's value here.

Request headers a client may send: ``TENANT_HEADER`` (checked against the key's tenant),
``SKILL_OVERRIDE_HEADER``, ``SESSION_HEADER``. Headers the gateway sets (overwrite
semantics, so a client or an engine cannot supply them): the seeds' hints on the upstream
request (``hint_header``), the trace and ``SERVED_BY_HEADER`` on the response. ace's Envoy
config turns the decision's dynamic metadata into them (envoy/envoy.template.yaml);
the endpoint picker protocol sets them itself (``extproc.protocols.epp``).

Nothing of the gateway is imported here: every layer may read these names.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["TENANT_HEADER", "SKILL_OVERRIDE_HEADER", "SESSION_HEADER", "SERVED_BY_HEADER",
           "TRACE_MULTI_LORA_HEADER", "TRACE_PREFETCH_HEADER", "HINT_HEADER_PREFIX",
           "TRACE_METADATA_HEADERS", "hint_header", "session_of"]

TENANT_HEADER = "x-ace-tenant-id"
SKILL_OVERRIDE_HEADER = "x-ace-skill-override"
SESSION_HEADER = "x-ace-session-id"
SERVED_BY_HEADER = "x-ace-served-by"
TRACE_MULTI_LORA_HEADER = "x-ace-trace-multi-lora"
TRACE_PREFETCH_HEADER = "x-ace-trace-dynamic-lora-prefetch"
HINT_HEADER_PREFIX = "x-ace-hint-"

#: dynamic metadata key (``extproc.app.trace.trace_metadata``) -> the response header it becomes
TRACE_METADATA_HEADERS = {"trace_multi_lora": TRACE_MULTI_LORA_HEADER,
                          "trace_dynamic_lora_prefetch": TRACE_PREFETCH_HEADER}

_MAX_SESSION = 256


def hint_header(field: str) -> str:
    """The header a seed's hint ``field`` travels in (``lora_name`` -> ``x-ace-hint-lora-name``)."""
    return HINT_HEADER_PREFIX + field.replace("_", "-")


def session_of(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The session a request belongs to: the header, else the body's ``user``, else None."""
    if header:
        return header[:_MAX_SESSION]
    user = body.get("user")
    if isinstance(user, str) and user:
        return user[:_MAX_SESSION]
    return None
