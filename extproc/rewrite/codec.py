"""JSON for the request bodies: parsed as ``json.loads`` parses them, re-sent compact.

orjson encodes a 2 KB chat body in ~0.3 µs against ~8.7 µs for ``json`` (docs/gateway.md,
"Speed"), but it is not a drop-in: it writes NaN and ±Infinity (which ``json.loads``
accepts from a client) as ``null`` and refuses integers beyond 64 bits and lone
surrogates. So its output is used only when it parses back to a value equal to the one
given; otherwise ``json`` encodes, as it always did. The refusals raise; the one silent
change is a non-finite float written as ``null``, so output without ``null`` in it is
taken at once, and only output with a ``null`` somewhere is parsed back and compared
(~1.4 µs of a 2 KB body's ~1.7).

``decode`` is ``json.loads`` for a request body, with orjson (1.2 µs for 2 KB against
3.7, 8 against 20 on a cold cache) where orjson gives the same value: orjson refuses
NaN, ±Infinity, 1e400, lone surrogates, a BOM and UTF-16/32, and those go to ``json``;
it silently turns integers beyond 64 bits into floats and nests deeper than ``json``
can, so a body with a run of 19 digits or more than 255 ``[``/``{`` goes to ``json``
too (a one-pass ``translate`` that keeps only the digits and openers finds both). Errors
always come from ``json.loads``, so their messages do not change.
tests/extproc/test_rewrite.py compares the two on a corpus and on random mutations.
"""
from __future__ import annotations

import json
from typing import Any

import orjson

__all__ = ["decode", "encode"]

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
    """``json.loads(body)``: the same value, or the same exception."""
    shape = body.translate(_SHAPE, _OTHER)
    if len(shape) < 19 or (_BIG_INT not in shape and shape.count(b"[") <= _DEEP):
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            pass
    return json.loads(body)


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
