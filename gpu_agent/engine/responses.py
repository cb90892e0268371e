"""The Responses API (``POST /v1/responses``) on the builtin engine's chat path, as plain
values: the request's ``instructions`` and ``input`` as chat messages, its sampling fields
as chat's, and the answer as a ``response`` object or as its stream of SSE events.

Served: ``input`` as a string or a list of messages (``{"role", "content"}``, content a
string or ``input_text``/``output_text`` parts), ``instructions``, ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``. Refused with 400 (never ignored silently): tools,
``previous_response_id`` and ``background`` (this engine stores no responses), input items
that are not messages.

Stream (OpenAI's event order for one text message): ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` per text piece, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, ``response.completed``
(``response.incomplete`` when ``max_output_tokens`` cut it); each with its
``sequence_number``.
"""
from __future__ import annotations

import json
import uuid
from typing import Any

from gpu_agent.engine.errors import InvalidRequest

__all__ = ["ResponseStream", "chat_messages", "response_object", "responses_param", "sampling_body"]

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSUPPORTED = ("previous_response_id", "background", "conversation", "prompt")


def _content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        text = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}: only text content parts ({', '.join(_TEXT_PARTS)}) are supported",
                                     param="input")
            text.append(part["text"])
        return "".join(text)
    raise InvalidRequest(f"{where}: content must be a string or a list of text parts", param="input")


def chat_messages(body: dict) -> list[dict[str, str]]:
    """The chat messages a Responses request stands for; ``InvalidRequest`` for what this
    engine does not serve."""
    for field in _UNSUPPORTED:
        if body.get(field):
            raise InvalidRequest(f"`{field}` is not supported by this engine (it stores no responses)", param=field)
    if body.get("tools"):
        raise InvalidRequest("`tools` are not supported by this engine", param="tools")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest("`instructions` must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str) and given:
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list) and given:
        for i, item in enumerate(given):
            where = f"input[{i}]"
            if not isinstance(item, dict) or item.get("type", "message") != "message":
                raise InvalidRequest(f"{where}: only message items are supported by this engine", param="input")
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise InvalidRequest(f"{where}: role must be one of {', '.join(_ROLES)}", param="input")
            messages.append({"role": role, "content": _content(item.get("content"), where)})
    else:
        raise InvalidRequest("`input` must be a non-empty string or a non-empty list of messages", param="input")
    return messages


def sampling_body(body: dict) -> dict[str, Any]:
    """The request's sampling fields under chat's names (``parse_sampling`` checks them;
    ``responses_param`` names a refused one as the request did)."""
    out = {k: body[k] for k in ("temperature", "top_p", "stream") if k in body}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    return out


def responses_param(exc: InvalidRequest) -> InvalidRequest:
    """``exc`` from ``parse_sampling`` with the Responses API's name for ``max_tokens``."""
    if exc.param != "max_tokens":
        return exc
    return InvalidRequest(exc.message.replace("max_tokens", "max_output_tokens"), param="max_output_tokens")


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def _message(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def response_object(response_id: str, item_id: str, model: str, created: int, body: dict, *,
                    text: str | None, finish: str | None, usage: tuple[int, int] | None) -> dict[str, Any]:
    """A ``response`` object: in progress while ``finish`` is None, else completed (or
    incomplete when ``finish`` is ``length``)."""
    status = "in_progress" if finish is None else "incomplete" if finish == "length" else "completed"
    done = finish is not None
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model,
        "output": [_message(item_id, text, "completed" if done else "in_progress")] if done else [],
        "parallel_tool_calls": False, "previous_response_id": None, "store": False,
        "temperature": body.get("temperature", 0.0), "top_p": body.get("top_p", 1.0),
        "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [], "truncation": "disabled",
        "usage": _usage(*usage) if usage is not None else None, "metadata": body.get("metadata") or {},
    }


class ResponseStream:
    """The SSE events of one streamed response, in order, each ``bytes`` ready to write."""

    def __init__(self, model: str, created: int, body: dict) -> None:
        self.model, self.created, self.body = model, created, body
        self.response_id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0
        self.text = ""

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload)}\n\n".encode()

    def _response(self, finish: str | None = None, usage: tuple[int, int] | None = None) -> dict[str, Any]:
        return response_object(self.response_id, self.item_id, self.model, self.created, self.body,
                               text=self.text, finish=finish, usage=usage)

    def opening(self) -> list[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self._event("response.created", response=self._response()),
                self._event("response.in_progress", response=self._response()),
                self._event("response.output_item.added", output_index=0,
                            item=_message(self.item_id, None, "in_progress")),
                self._event("response.content_part.added", **where,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def delta(self, text: str) -> bytes:
        self.text += text
        return self._event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=text, logprobs=[])

    def closing(self, finish: str, usage: tuple[int, int]) -> list[bytes]:
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        final = self._response(finish, usage)
        return [self._event("response.output_text.done", **where, text=self.text, logprobs=[]),
                self._event("response.content_part.done", **where,
                            part={"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}),
                self._event("response.output_item.done", output_index=0, item=final["output"][0]),
                self._event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                            response=final)]

    def failure(self, error: dict[str, Any]) -> bytes:
        """An ``error`` event (the headers are sent: an error after them is reported in-band)."""
        err = error.get("error", {})
        return self._event("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param"))
