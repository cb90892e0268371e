"""What every HTTP route handler of the gateway is, and the pieces they share.

A handler answers one request's ext_proc phases (``Handler``); ``extproc.app.exchange.Exchange``
picks it by path from ``extproc.app.routes.ROUTES`` (inference routes in ``extproc.app.inference``,
the dev-key route in ``extproc.app.dev_key_skills``, the settings page and its read API in
``extproc.app.console``) and is the only place its errors become responses. ``Authenticated``: POST (or ``methods``), a
valid key, a body within the limit, before the handler's own work.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol

from extproc.domain.auth import Principal, authenticate
from extproc.errors import (BadRequest, InvalidField, MethodNotAllowed, PayloadTooLarge, Unauthorized,
                            UnsupportedMediaType)
from extproc.domain.headers import TENANT_HEADER
from extproc.app.outcomes import CONTINUE, Outcome, RequestHead
from extproc.rewrite.codec import decode
from extproc.state.skill_modes import validate_skills

if TYPE_CHECKING:
    from extproc.policy.routing import RoutePolicy
    from extproc.app.context import Gateway
    from extproc.state.store import Snapshot

__all__ = ["Handler", "Authenticated", "HeadersOnly", "parse_object"]


class Handler(Protocol):
    response_body_phase: bool     # Envoy sends this route's response body too (ExtProcPerRoute)

    def on_request_headers(self, head: RequestHead) -> Outcome: ...
    def on_request_body(self, body: bytes) -> Outcome: ...
    def on_response_body(self, body: bytes) -> Outcome: ...



class HeadersOnly:
    """A route answered (or let through) from the request headers alone: one ext_proc
    message; the handler's own ``on_request_headers`` decides."""

    response_body_phase = False
    headers_only = True

    def __init__(self, gw: Gateway, route: RoutePolicy) -> None:
        self.gw = gw

    def on_request_body(self, body: bytes) -> Outcome:   # answered at the headers already
        return CONTINUE

    def on_response_body(self, body: bytes) -> Outcome:
        return CONTINUE


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = decode(body)
    except (ValueError, RecursionError) as exc:   # RecursionError: nesting deeper than json's stack
        raise BadRequest(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(parsed, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_json")
    return parsed


class Authenticated:
    """Common header phase: POST only, a valid key, a body within the limit, not compressed."""

    methods = ("POST",)
    response_body_phase = False
    principal: Principal

    def __init__(self, gw: Gateway, route: RoutePolicy) -> None:
        self.gw = gw
        self.route = route

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in self.methods:
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        snap = self.gw.store.snapshot
        h = head.headers
        self.principal = authenticate(snap, h.get("authorization"), h.get(TENANT_HEADER))
        length = h.get("content-length")
        if length is not None and length.isdigit() and int(length) > snap.max_body_bytes:
            raise PayloadTooLarge(f"body of {length} bytes exceeds the limit of "
                                  f"{snap.max_body_bytes} bytes")
        encoding = h.get("content-encoding")
        if encoding is not None and encoding.strip().lower() not in ("", "identity"):
            # the gateway reads and rewrites the body as JSON; a header that claims otherwise
            # would reach the engine beside a plain body, which it then fails to decompress
            raise UnsupportedMediaType(f"Content-Encoding {encoding[:40]!r} is not supported: "
                                       "send the JSON body uncompressed", param="content-encoding",
                                       code="unsupported_content_encoding")
        return self.after_auth(head)

    def after_auth(self, head: RequestHead) -> Outcome:
        if head.end_of_stream:
            raise BadRequest("a JSON request body is required", code="missing_body")
        return CONTINUE

    def check_size(self, body: bytes) -> None:
        limit = self.gw.store.snapshot.max_body_bytes
        if len(body) > limit:
            raise PayloadTooLarge(f"body of {len(body)} bytes exceeds the limit of {limit} bytes")

    def skills_write(self, body: bytes) -> Mapping[str, str | None]:
        """The body of a skills write (``{"skills": {skill: mode or null}}``; null: remove
        that skill's runtime setting), checked: the skills APIs' one parser."""
        self.check_size(body)
        parsed = parse_object(body)
        if "skills" not in parsed:
            raise InvalidField("body must be {\"skills\": {skill: mode}}", param="skills")
        return validate_skills(parsed["skills"], "skills", unset=True)

    def current(self, snap: Snapshot) -> Principal:
        """The caller after a write: revoked in the meantime is 401."""
        key = snap.keys.get(self.principal.key.sha256)
        if key is None:
            raise Unauthorized("invalid API key")
        return Principal(key=key, tenant=snap.tenants[key.tenant])

    def on_response_body(self, body: bytes) -> Outcome:
        return CONTINUE
