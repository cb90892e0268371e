"""One HTTP request's ext_proc phases as plain objects: one ``Exchange`` per request (= per
gRPC stream). It picks the request's handler from the route table (``extproc.app.routes``),
keeps the phase order, and is the one error boundary: errors raised anywhere below become
an OpenAI-shaped immediate response here, and only here.
"""
from __future__ import annotations

import logging
from enum import IntEnum
from typing import TYPE_CHECKING

from extproc.app.handlers import Handler
from extproc.app.outcomes import CONTINUE, Outcome, Reply, RequestHead
from extproc.app.routes import handler_for
from extproc.errors import GatewayError, InvalidMessage
from extproc.policy.routing import RoutePolicy

if TYPE_CHECKING:
    from extproc.app.context import Gateway
    from extproc.domain.decision import Decision

__all__ = ["Exchange", "Stage", "error_reply"]

log = logging.getLogger(__name__)


def error_reply(gw: Gateway, exc: GatewayError, handler: "Handler | None" = None) -> Reply:
    """An error answer, counted: by status and code; an inference request's also as a
    request whose action is the code (its tenant once the key was checked, never the
    client's header). The one place a ``GatewayError`` becomes a reply (``Exchange``, and
    the servers' refusal of a message that does not parse: extproc.transport.dispatch)."""
    gw.metrics.error(exc.status, exc.code)
    if getattr(handler, "uncounted", False):
        principal = getattr(handler, "principal", None)
        gw.metrics.request(principal.tenant.id if principal is not None else "", "", exc.code, "")
    return Reply(exc.status, exc.to_json())


class Stage(IntEnum):
    """Where an ``Exchange`` is in its request: each phase may come once, in this order."""
    NEW = 0            # nothing yet
    HEADERS = 1        # the headers were answered and the request goes on
    BODY = 2           # the request body was answered and the request goes on
    OVER = 3           # a final answer went out (a reply, or the response body's)


class Exchange:
    """One HTTP request's phases. The only place errors become responses. A phase out of
    order (a body after the gateway's reply, a response before the request's body: never
    from Envoy, only from a broken peer) is ``InvalidMessage``, not a handler's bug."""

    __slots__ = ("gw", "route", "handler", "stage")

    def __init__(self, gw: Gateway, route: RoutePolicy | None = None) -> None:
        self.gw = gw
        self.route = route or gw.route
        self.handler: Handler | None = None
        self.stage = Stage.NEW

    def _guard(self, phase, arg) -> Outcome:
        try:
            return phase(arg)
        except GatewayError as exc:
            return error_reply(self.gw, exc, self.handler)
        except Exception:  # a bug: say so in the log, answer a clean JSON error, never hang
            log.exception("ext_proc handler failed")
            exc = GatewayError("internal gateway error")
            return error_reply(self.gw, exc, self.handler)

    def _enter(self, expected: Stage, phase: str) -> None:
        if self.stage is not expected:
            raise InvalidMessage(f"{phase} out of order: after {self.stage.name.lower()}")

    def _after(self, outcome: Outcome, next_stage: Stage) -> Outcome:
        self.stage = Stage.OVER if isinstance(outcome, Reply) else next_stage
        return outcome

    def on_request_headers(self, head: RequestHead) -> Outcome:
        self._enter(Stage.NEW, "request_headers")
        self.handler = handler_for(head.path)(self.gw, self.route)
        return self._after(self._guard(self.handler.on_request_headers, head), Stage.HEADERS)

    def on_request_body(self, body: bytes, head: RequestHead | None = None) -> Outcome:
        """``head``: built from request_attributes when the headers were not sent to us."""
        if self.handler is None:
            if head is None:   # Envoy config lacks request_attributes: never pass unchecked
                log.error("request body without headers or request_attributes: check the Envoy config")
                exc = GatewayError("gateway misconfigured: no request headers")
                return error_reply(self.gw, exc)
            first = self.on_request_headers(head)
            if isinstance(first, Reply):
                return first
        self._enter(Stage.HEADERS, "request_body")
        return self._after(self._guard(self.handler.on_request_body, body), Stage.BODY)

    def on_response_body(self, body: bytes) -> Outcome:
        if self.handler is None:
            return CONTINUE
        self._enter(Stage.BODY, "response_body")
        return self._after(self._guard(self.handler.on_response_body, body), Stage.OVER)

    @property
    def decision(self) -> "Decision | None":
        """The request's decision once its body was decided (inference routes), else None."""
        return getattr(self.handler, "decision", None)

    @property
    def headers_only(self) -> bool:
        """Whether the route needs nothing of the body (it streams through untouched)."""
        return getattr(self.handler, "headers_only", False)

    def done_after(self, phase: str) -> bool:
        """Whether the answer to ``phase`` (an ext_proc phase name: ``request_body``,
        ``response_body``, ...) is this exchange's last. The servers then end the gRPC stream
        with it, so Envoy is done with this ext_proc for the request: a replica that dies
        while the request is upstream cannot fail it (fail-closed, that would be a 503)."""
        if phase == "response_body":
            return True
        if phase == "request_headers":
            return self.headers_only
        return phase == "request_body" and (self.handler is None or not self.handler.response_body_phase)
