"""The native ``/v1/execute`` API, translated to and from a chat completion.

Request ``{"input": {"messages": [...]}, "target": {"model": ...}, "skill_overrides": {...},
"extra_body": {...}}`` becomes ``{"model", "messages", **extra_body}`` (the keys of
``extra_body`` go to the top level, as the OpenAI SDK does; ``extra_body`` itself is
kept so ``extra_body.lora_name`` still selects the adapter). The response is
``{"output": <upstream JSON>, "trace": [...]}``.
"""
from __future__ import annotations

import json
from typing import Any, Mapping

from extproc.errors import InvalidField

__all__ = ["chat_body_from_execute", "wrap_output"]


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


def wrap_output(upstream_body: bytes, trace: list[dict[str, str]]) -> bytes:
    try:
        output: Any = json.loads(upstream_body) if upstream_body else None
    except ValueError:
        output = upstream_body.decode("utf-8", "replace")
    return json.dumps({"output": output, "trace": trace}, ensure_ascii=False).encode()
