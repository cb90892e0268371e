"""JSON for the request bodies: parsed as ``json.loads`` parses them, but strict about
numbers (RFC 8259: no ``NaN``, no ``Infinity``, no literal that overflows a double), re-sent
compact.

Python's ``json`` takes ``NaN``, ``Infinity`` and ``1e400`` (as ``inf``) from a client; an
engine that parses the same way then samples with a temperature of NaN and fails the
forward pass, and every other request in that batch with it. ``loads_strict`` refuses them
with a ``ValueError`` (a 400 at the gateway), as orjson already does.

orjson encodes a 2 KB chat body in ~0.3 µs against ~8.7 µs for ``json`` (docs/gateway.md,
"Speed"), but it is not a drop-in: it writes NaN and ±Infinity (which ``decode`` no longer
yields, but a value built in code may hold) as ``null`` and refuses integers beyond 64 bits and lone
surrogates. So its output is used only when it parses back to a value equal to the one
given; otherwise ``json`` encodes, as it always did. The refusals raise; the one silent
change is a non-finite float written as ``null``, so output without ``null`` in it is
taken at once, and only output with a ``null`` somewhere is parsed back and compared
(~1.4 µs of a 2 KB body's ~1.7).

``decode`` is ``loads_strict`` for a request body, with orjson (1.2 µs for 2 KB against
3.7, 8 against 20 on a cold cache) where orjson gives the same value: orjson refuses
NaN, ±Infinity, 1e400, lone surrogates, a BOM and UTF-16/32, and those go to ``loads_strict``;
it silently turns integers beyond 64 bits into floats and nests deeper than ``json``
can, so a body with a run of 19 digits or more than 255 ``[``/``{`` goes to
``loads_strict`` too (a one-pass ``translate`` that keeps only the digits and openers finds both). Errors
always come from ``loads_strict``, so their messages do not depend on the path taken.
tests/extproc/test_rewrite.py compares the two on a corpus and on random mutations.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

import orjson

__all__ = ["decode", "encode", "loads_strict"]


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:32]} is out of range")
    return value


loads_strict = functools.partial(json.loads, parse_constant=_refuse_constant, parse_float=_finite)
"""``json.loads`` less its extensions: ``NaN``, ``±Infinity`` and overflowing floats raise."""

# the body's digits (as "0") and openers ("[" and "{" as "["), in order, nothing else: one
# C pass, and for a chat body a few bytes to look at. A run of 19 digits in the body is a
# run of 19 "0" here (runs only merge), and the openers are all here, so the two checks on
# it refuse orjson for every body the same checks on the whole body would (and for a few
# more, which json then parses to the same value).
_SHAPE = bytes(0x30 if 0x30 <= i <= 0x39 else 0x5B if i in (0x5B, 0x7B) else 0x20 for i in range(256))
_OTHER = bytes(i for i in range(256) if not (0x30 <= i <= 0x39 or i in (0x5B, 0x7B)))
_BIG_INT = b"0" * 19          # may not fit 64 bits
_DEEP = 255                   # nesting both parse alike (json's limit is the stack's, orjson's 1024)


def decode(body: bytes) -> Any:
    """``loads_strict(body)``: the same value, or the same exception."""
    shape = body.translate(_SHAPE, _OTHER)
    if len(shape) < 19 or (_BIG_INT not in shape and shape.count(b"[") <= _DEEP):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return loads_strict(body)


_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_JSON_ASCII = json.JSONEncoder(separators=(",", ":")).encode


def encode(obj: Any) -> bytes:
    try:
        out = orjson.dumps(obj)
    except TypeError:   # orjson.JSONEncodeError: a big integer, a lone surrogate, deep nesting
        pass
    else:
        if b"null" not in out or orjson.loads(out) == obj:
            return out
    text = _JSON(obj)
    try:
        return text.encode()
    except UnicodeEncodeError:   # a lone surrogate (from a "\ud800" escape): keep it escaped
        return _JSON_ASCII(obj).encode()
