"""The native ``/v1/execute`` API, translated to and from a chat completion.

Request ``{"input": {"messages": [...]}, "target": {"model": ...}, "skill_overrides": {...},
"extra_body": {...}}`` becomes ``{"model", "messages", **extra_body}`` (the keys of
``extra_body`` go to the top level, as the OpenAI SDK does; ``extra_body`` itself is
kept so ``extra_body.lora_name`` still selects the adapter; the gateway's hint fields are
removed from both places by the rewrite, extproc.rewrite). The response is
``{"id": "exec-<hex>", "output": <upstream JSON, its id the execution id>, "trace": [...],
"upstream_id": <the upstream's id>}``; ``skill_overrides`` take ``"prod"`` or
``{"mode": "prod"}`` per skill (extproc.domain.skills).
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Mapping

from extproc.errors import InvalidField

__all__ = ["chat_body_from_execute", "new_execution_id", "wrap_output"]


def chat_body_from_execute(body: Mapping[str, Any]) -> dict[str, Any]:
    inp = body.get("input")
    if not isinstance(inp, dict) or not isinstance(inp.get("messages"), list):
        raise InvalidField("input.messages must be a list of messages", param="input.messages")
    target = body.get("target") or {}
    if not isinstance(target, dict):
        raise InvalidField("target must be an object", param="target")
    model = target.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidField("target.model must be a string", param="target.model")
    extra = body.get("extra_body") or {}
    if not isinstance(extra, dict):
        raise InvalidField("extra_body must be an object", param="extra_body")
    if extra.get("stream") not in (None, False):
        raise InvalidField("/v1/execute does not stream; use /v1/chat/completions", param="stream")
    chat: dict[str, Any] = {}
    if model is not None:
        chat["model"] = model
    chat["messages"] = inp["messages"]
    chat.update((k, v) for k, v in extra.items() if k not in ("model", "messages"))
    if extra:
        chat["extra_body"] = extra
    if "skill_overrides" in body:
        chat["skill_overrides"] = body["skill_overrides"]
    return chat


def new_execution_id() -> str:
    return "exec-" + secrets.token_hex(12)


def wrap_output(upstream_body: bytes, trace: list[dict[str, Any]], execution_id: str) -> bytes:
    """``{"id": execution_id, "output": ..., "trace": ..., "upstream_id": ...}``.

    When the upstream answered a JSON object, ``output.id`` is the execution id too (the
    seeds read it there) and the upstream's own id moves to the top-level ``upstream_id``
    (null when it sent none)."""
    try:
        output: Any = json.loads(upstream_body) if upstream_body else None
    except ValueError:
        output = upstream_body.decode("utf-8", "replace")
    upstream_id = None
    if isinstance(output, dict):
        upstream_id = output.get("id")
        output = {**output, "id": execution_id}
    return json.dumps({"id": execution_id, "output": output, "trace": trace,
                       "upstream_id": upstream_id}, ensure_ascii=False).encode()
