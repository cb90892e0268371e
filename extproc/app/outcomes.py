"""What a request phase comes to, as plain objects: the application layer
(``extproc.app.exchange`` and the handlers) returns them, the protocol layer (``extproc.protocols.wire``,
``extproc.transport.dispatch``, ``extproc.protocols.epp``) writes them as ext_proc messages.

``Continue``: let the request go on, maybe changed; ``Reply``: answer the client now.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from extproc.frozen import fast_init

__all__ = ["RequestHead", "Continue", "Reply", "CONTINUE", "Outcome"]


@fast_init
@dataclass(frozen=True, slots=True)
class RequestHead:
    method: str
    path: str                      # without the query string
    headers: Mapping[str, str]     # lower-case names
    end_of_stream: bool


@fast_init
@dataclass(frozen=True, slots=True)
class Continue:
    headers: tuple[tuple[str, str], ...] = ()   # set with overwrite semantics (headers-first only)
    body: bytes | None = None                   # None: leave the body as it is
    metadata: tuple[tuple[str, str], ...] = ()  # dynamic metadata, namespace "ace" (see envoy/)


@fast_init
@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: bytes
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)


CONTINUE = Continue()
Outcome = Continue | Reply
