"""ext_proc phases as plain objects: one ``Exchange`` per HTTP request (= per gRPC stream).

Handlers are registered per route path (``ROUTES``, ``PREFIX_ROUTES``); any other path is
default-deny (``extproc.state.paths``): ``GET /health`` open, an upstream's ``allow_paths``
key-checked and routed (``EngineRoute``), anything else 404 after the key check. Errors
raised anywhere below become an OpenAI-shaped immediate response here, and only here.
"""
from __future__ import annotations

import json
import logging
import time
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Callable, Mapping

from extproc.domain.auth import Principal
from extproc.state.catalog import Upstream
from extproc.domain.decision import Decision, InferenceRequest, decide
from extproc.app.console import CONSOLE_ROUTES
from extproc.errors import GatewayError, InvalidField, InvalidMessage, MethodNotAllowed, NoUpstream, NotFound
from extproc.app.handlers import Authenticated, Handler, HeadersOnly, parse_object
from extproc.domain.headers import SESSION_HEADER, SKILL_OVERRIDE_HEADER, session_of
from extproc.observe.metrics import GatewayMetrics
from extproc.app.model_list import ModelList
from extproc.app.native import chat_body_from_execute, new_execution_id, wrap_output
from extproc.app.outcomes import CONTINUE, Continue, Outcome, Reply, RequestHead
from extproc.state.paths import (CHAT, COMPLETIONS, EMBEDDINGS, EXECUTE, MODELS, MODELS_PREFIX, OPEN_PATHS,
                           RESPONSES, normalize)
from extproc.domain.prefetch import NullPrefetchSink, PrefetchSink
from extproc.policy.routing import RoutePolicy, choose_upstream
from extproc.state.residency import ResidencyBoard
from extproc.rewrite import SERVED_ROUTES, rewrite_request
from extproc.state.skill_modes import MULTI_LORA, SKILLS
from extproc.domain.skills import parse_override_header, resolve
from extproc.state.store import Snapshot, Store
from extproc.app.trace import execute_trace, trace_metadata
from extproc.observe.usage import UsageRing

if TYPE_CHECKING:
    from extproc.fleet.speculation import RequestObserver

__all__ = ["Gateway", "Exchange", "ROUTES", "PREFIX_ROUTES"]

log = logging.getLogger(__name__)


class Gateway:
    """What every exchange shares: state, residency, the prefetch sink, the routing policy,
    the request counts (``metrics``, read by /metrics)."""

    def __init__(self, store: Store, residency: ResidencyBoard | None = None,
                 prefetch: PrefetchSink | None = None, route: RoutePolicy = choose_upstream,
                 speculation: "RequestObserver | None" = None,
                 metrics: GatewayMetrics | None = None, shed_load: int = 0,
                 epp_fallbacks: int = 0) -> None:
        self.store = store
        self.residency = residency or ResidencyBoard()
        self.prefetch = prefetch or NullPrefetchSink()
        self.route = route
        self.speculation = speculation  # extproc.fleet.speculation.GatewaySpeculation: one append per request
        self.metrics = metrics or GatewayMetrics()
        self.shed_load = shed_load      # endpoint picker protocol: 429 when every host carries this many (0: never)
        self.epp_fallbacks = epp_fallbacks   # endpoint picker protocol: fallback hosts after the pick
        self.usage = UsageRing()        # the settings page's last hour per (tenant, adapter)

    def exchange(self, route: RoutePolicy | None = None) -> "Exchange":
        """``route``: this request's routing policy when not the gateway's (the endpoint
        picker protocol narrows the hosts to the gateway's subset hint, extproc.protocols.epp)."""
        return Exchange(self, route)


class OpenPath(HeadersOnly):
    """``GET /health``: liveness for load balancers, no key, forwarded to the default
    upstream; headers only."""

    def on_request_headers(self, head: RequestHead) -> Outcome:
        if head.method not in ("GET", "HEAD"):
            raise MethodNotAllowed(f"{head.method} is not allowed on {head.path}")
        return CONTINUE


class Inference(Authenticated):
    """``/v1/chat/completions`` and ``/v1/completions``: decide, rewrite, route."""

    uncounted = True           # not yet in ace_gateway_requests_total (a refusal counts there too)
    forces_body = False                                  # re-encode even if nothing changed
    extra_headers: tuple[tuple[str, str], ...] = ()      # set on the upstream request
    narrows = False            # only some upstreams serve the route (``serves``)

    def serves(self, upstream: Upstream) -> bool:
        """Whether ``upstream`` is sent this route (the endpoint picker asks it too)."""
        return True

    def routing(self, snap: Snapshot) -> RoutePolicy:
        """The routing policy over the upstreams that serve this route; 404
        ``route_not_served`` when none of the configured ones does."""
        if not self.narrows:
            return self.route
        if snap.upstreams and not any(self.serves(u) for u in snap.upstreams):
            raise NotFound(f"no engine host of this gateway serves {self.path_served}", code="route_not_served")
        base, serves = self.route, self.serves

        def narrowed(upstreams, adapter, residency, sent):
            serving = [u for u in upstreams if serves(u)]
            if not serving:
                raise NoUpstream(f"no engine host serving {self.path_served} is available")
            return base(serving, adapter, residency, sent)
        return narrowed

    @property
    def path_served(self) -> str:
        return ""

    def after_auth(self, head: RequestHead) -> Outcome:
        self.header_skills = parse_override_header(head.headers.get(SKILL_OVERRIDE_HEADER))
        self.session_header = head.headers.get(SESSION_HEADER)
        return super().after_auth(head)

    def to_chat(self, parsed: dict[str, Any]) -> dict[str, Any]:
        stream = parsed.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise InvalidField("stream must be a boolean", param="stream")
        return parsed

    def on_request_body(self, body: bytes) -> Outcome:
        self.check_size(body)
        chat = self.to_chat(parse_object(body))
        snap = self.gw.store.snapshot
        started = time.perf_counter()
        d = decide(snap, self.gw.residency.current, self.gw.residency.sent,
                   InferenceRequest(self.principal, chat, self.header_skills), self.routing(snap))
        decided = time.perf_counter() - started
        queued = self.gw.prefetch.submit(d.prefetch_signal) if d.prefetch_signal else None
        if self.gw.speculation is not None:
            self.gw.speculation.observe(d, self.principal.tenant.id, session_of(self.session_header, chat))
        self.decision, self.queued = d, queued
        rw = rewrite_request(chat, d, force=self.forces_body)
        metadata = (("destination", d.upstream.address), ("tenant", self.principal.tenant.id),
                    *trace_metadata(d, queued))
        if rw.header_hints:
            metadata += tuple(("hint_" + field, text) for field, text in rw.header_hints)
        # the request goes upstream: counted until that host's next load measurement
        self.gw.residency.sent.record(d.upstream.name)
        headers = self.extra_headers
        if rw.body is not None:  # Envoy checks it when the headers were sent to us
            headers += (("content-length", str(len(rw.body))),)
        # counted once it cannot fail any more (a refusal is counted as its error instead)
        self.gw.metrics.request(self.principal.tenant.id, d.adapter.name if d.adapter else "",
                                d.multi_lora_action, d.skills[MULTI_LORA], decided)
        self.gw.usage.record(self.principal.tenant.id, d, queued)
        self.uncounted = False
        return Continue(headers, rw.body, metadata)


class Execute(Inference):
    """``/v1/execute``: native request in, chat completion upstream, wrapped answer out."""

    forces_body = True
    extra_headers = ((":path", "/v1/chat/completions"),)
    response_body_phase = True

    def to_chat(self, parsed: dict[str, Any]) -> dict[str, Any]:
        return chat_body_from_execute(parsed)

    def on_response_body(self, body: bytes) -> Outcome:
        wrapped = wrap_output(body, execute_trace(self.decision, self.queued), new_execution_id())
        return Continue((("content-length", str(len(wrapped))),), wrapped)


class FlavourRoute(Inference):
    """An inference route only some engine flavours serve (``extproc.rewrite.SERVED_ROUTES``):
    ``/v1/responses`` (vLLM, builtin) and ``/v1/embeddings`` (vLLM, SGLang)."""

    narrows = True
    route_path = ""

    @property
    def path_served(self) -> str:
        return self.route_path

    def serves(self, upstream: Upstream) -> bool:
        return self.route_path in SERVED_ROUTES[upstream.flavour]


class Responses(FlavourRoute):
    """``/v1/responses``: chat's decision (adapter by ``model``, ``lora_name`` or
    ``extra_body``; skills, routing, prefetch, trace headers; ``stream`` passes through)."""

    route_path = RESPONSES


class Embeddings(FlavourRoute):
    route_path = EMBEDDINGS


class EngineRoute(Inference):
    """Any path without a handler of its own. One an upstream allow-lists (state file
    ``allow_paths``): a valid key, then with a JSON body the inference decision (adapter by
    ``model``: another tenant's is 404 as on chat) and without one the routing policy alone,
    to an upstream listing it. Any other: 404 ``unknown_route``, after the key check, so an
    unauthenticated caller learns nothing of the allow-lists."""

    methods = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")
    narrows = True
    headers_only = False        # becomes True for a request without a body

    @property
    def path_served(self) -> str:
        return self.path

    def serves(self, upstream: Upstream) -> bool:
        return self.path in upstream.allow_paths

    def after_auth(self, head: RequestHead) -> Outcome:
        self.path = normalize(head.path)
        snap = self.gw.store.snapshot
        if not any(self.serves(u) for u in snap.upstreams):
            raise NotFound(f"{head.method} {head.path} is not a route of this gateway", code="unknown_route")
        if not head.end_of_stream:
            return super().after_auth(head)
        self.headers_only = True
        if not snap.upstreams:
            raise NoUpstream("no engine host is available")
        upstream = self.routing(snap)(snap.upstreams, None, self.gw.residency.current, self.gw.residency.sent)
        self.gw.residency.sent.record(upstream.name)
        self.uncounted = False
        return Continue(metadata=(("destination", upstream.address), ("tenant", self.principal.tenant.id)))


class DevKeySkills(Authenticated):
    """``GET|POST /api/v1/dev_key/skills``: read or set the calling key's skills."""

    methods = ("GET", "POST")

    def after_auth(self, head: RequestHead) -> Outcome:
        if head.method == "GET":
            return self._answer(self.principal)
        return super().after_auth(head)

    def on_request_body(self, body: bytes) -> Outcome:
        snap = self.gw.store.set_key_skills(self.principal.key.sha256, self.skills_write(body))
        return self._answer(self.current(snap))

    def _answer(self, p: Principal) -> Reply:
        snap = self.gw.store.snapshot
        effective = resolve(p.key.skills, p.tenant.skills, snap.default_skills)
        out = {"key": p.key.name, "tenant": p.tenant.id,
               "skills": {s: p.key.skills[s] for s in SKILLS if s in p.key.skills},
               "effective": effective}
        return Reply(200, json.dumps(out).encode())


ROUTES: Mapping[str, type[Handler]] = {   # every other path: _default_deny
    CHAT: Inference,
    COMPLETIONS: Inference,
    RESPONSES: Responses,
    EMBEDDINGS: Embeddings,
    EXECUTE: Execute,
    MODELS: ModelList,
    "/api/v1/dev_key/skills": DevKeySkills,
    **CONSOLE_ROUTES,                       # the settings page and its read API
}
#: routes by path prefix (after ``ROUTES``): ``/v1/models/{id}``
PREFIX_ROUTES: Mapping[str, type[Handler]] = {MODELS_PREFIX: ModelList}


def _handler_for(path: str) -> Callable[[Gateway, RoutePolicy], Handler]:
    """The handler of ``path``: its own, else default deny (``extproc.state.paths``)."""
    handler = ROUTES.get(path)
    if handler is not None:
        return handler
    for prefix, handler in PREFIX_ROUTES.items():
        if path.startswith(prefix):
            return handler
    return OpenPath if normalize(path) in OPEN_PATHS else EngineRoute


def _error_reply(exc: GatewayError) -> Reply:
    return Reply(exc.status, exc.to_json())


def _count_error(gw: Gateway, handler: "Handler | None", exc: GatewayError) -> None:
    """An error answer: by status and code; an inference request's also as a request whose
    action is the code (its tenant once the key was checked, never the client's header)."""
    gw.metrics.error(exc.status, exc.code)
    if getattr(handler, "uncounted", False):
        principal = getattr(handler, "principal", None)
        gw.metrics.request(principal.tenant.id if principal is not None else "", "", exc.code, "")


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
            _count_error(self.gw, self.handler, exc)
            return _error_reply(exc)
        except Exception:  # a bug: say so in the log, answer a clean JSON error, never hang
            log.exception("ext_proc handler failed")
            exc = GatewayError("internal gateway error")
            _count_error(self.gw, self.handler, exc)
            return _error_reply(exc)

    def _enter(self, expected: Stage, phase: str) -> None:
        if self.stage is not expected:
            raise InvalidMessage(f"{phase} out of order: after {self.stage.name.lower()}")

    def _after(self, outcome: Outcome, next_stage: Stage) -> Outcome:
        self.stage = Stage.OVER if isinstance(outcome, Reply) else next_stage
        return outcome

    def on_request_headers(self, head: RequestHead) -> Outcome:
        self._enter(Stage.NEW, "request_headers")
        self.handler = _handler_for(head.path)(self.gw, self.route)
        return self._after(self._guard(self.handler.on_request_headers, head), Stage.HEADERS)

    def on_request_body(self, body: bytes, head: RequestHead | None = None) -> Outcome:
        """``head``: built from request_attributes when the headers were not sent to us."""
        if self.handler is None:
            if head is None:   # Envoy config lacks request_attributes: never pass unchecked
                log.error("request body without headers or request_attributes: check the Envoy config")
                exc = GatewayError("gateway misconfigured: no request headers")
                _count_error(self.gw, None, exc)
                return _error_reply(exc)
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

