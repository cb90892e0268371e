"""Load and validate request traces (the format of ``docs/trace-format.md``).

A trace is a JSON array of request objects, or the same objects as JSON Lines (one per
line; blank lines allowed). ``load_trace(path)`` returns the list of dicts sorted by
``t`` (stable), or raises ``TraceError`` naming the file, the request (line number for
JSONL, index for JSON) and the field at fault.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterable

__all__ = ["REQUIRED", "TraceError", "load_trace", "validate_request", "validate_trace"]

REQUIRED = ("t", "tenant", "adapter", "rank", "domain", "session", "messages")


class TraceError(ValueError):
    """A trace that cannot be used; the message says where and why."""


def _fail(where: str, msg: str) -> None:
    raise TraceError(f"{where}: {msg}")


def validate_request(obj: Any, where: str) -> dict:
    if not isinstance(obj, dict):
        _fail(where, f"a request must be a JSON object, got {type(obj).__name__}")
    missing = [f for f in REQUIRED if f not in obj]
    if missing:
        _fail(where, f"missing field(s) {', '.join(repr(m) for m in missing)}")
    t = obj["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        _fail(where, f"'t' must be a non-negative number of seconds, got {t!r}")
    for f in ("tenant", "adapter", "domain"):
        if not isinstance(obj[f], str) or not obj[f]:
            _fail(where, f"{f!r} must be a non-empty string, got {obj[f]!r}")
    if not isinstance(obj["session"], (str, int)) or isinstance(obj["session"], bool):
        _fail(where, f"'session' must be a string or an integer, got {obj['session']!r}")
    think = obj.get("think_s")
    if think is not None and (isinstance(think, bool) or not isinstance(think, (int, float))
                              or not math.isfinite(think) or think < 0):
        _fail(where, f"'think_s' must be a non-negative number of seconds, got {think!r}")
    rank = obj["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        _fail(where, f"'rank' must be a positive integer, got {rank!r}")
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        _fail(where, "'messages' must be a non-empty list")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            _fail(where, f"messages[{j}] must be an object with string 'role' and 'content'")
    return obj


def validate_trace(requests: Iterable[tuple[str, Any]]) -> list[dict]:
    """Validate (where, object) pairs; one rank per adapter; returns the dicts sorted by t."""
    out: list[dict] = []
    ranks: dict[str, tuple[int, str]] = {}
    for where, obj in requests:
        req = validate_request(obj, where)
        seen = ranks.setdefault(req["adapter"], (req["rank"], where))
        if seen[0] != req["rank"]:
            _fail(where, f"adapter {req['adapter']!r} has rank {req['rank']} here but {seen[0]} at {seen[1]}")
        out.append(req)
    if not out:
        raise TraceError("the trace holds no requests")
    out.sort(key=lambda r: r["t"])
    return out


def load_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}: invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}") from exc
        return validate_trace((f"{path}: request [{i}]", obj) for i, obj in enumerate(data))
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{lineno}: invalid JSON Lines record: {exc.msg}") from exc
        pairs.append((f"{path}:{lineno}", obj))
    return validate_trace(pairs)
