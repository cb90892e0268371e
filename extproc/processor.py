"""ext_proc phases as plain objects: one ``Exchange`` per HTTP request (= per gRPC stream).

Handlers are registered per route path; any other path gets ``KeyRequired`` (a valid
key, then forwarded untouched; the engines' administration API refused). Errors raised
anywhere below become an OpenAI-shaped immediate response here, and only here.
"""
from __future__ import annotations

import json
import logging
import re
import time
from enum import IntEnum
from urllib.parse import unquote
from typing import TYPE_CHECKING, Any, Mapping

from extproc.auth import Principal, authenticate
from extproc.decision import InferenceRequest, decide
from extproc.console import CONSOLE_ROUTES
from extproc.errors import Forbidden, GatewayError, InvalidField, InvalidMessage
from extproc.handlers import Authenticated, Handler, parse_object
from extproc.headers import SESSION_HEADER, SKILL_OVERRIDE_HEADER, TENANT_HEADER, session_of
from extproc.metrics import GatewayMetrics
from extproc.native import chat_body_from_execute, new_execution_id, wrap_output
from extproc.outcomes import CONTINUE, Continue, Outcome, Reply, RequestHead
from extproc.prefetch import NullPrefetchSink, PrefetchSink
from extproc.policy.routing import RoutePolicy, choose_upstream
from extproc.residency_view import ResidencyBoard
from extproc.rewrite import rewrite_request
from extproc.skills import MULTI_LORA, SKILLS, parse_override_header, resolve
from extproc.store import Store
from extproc.trace import execute_trace, trace_metadata
from extproc.usage import UsageRing

if TYPE_CHECKING:
    from extproc.prefetch_planner import RequestObserver

__all__ = ["Gateway", "Exchange", "ENGINE_ADMIN_PATHS", "OPEN_PATHS", "ROUTES"]

log = logging.getLogger(__name__)

#: The engines' own administration (vLLM's and SGLang's runtime adapter, weight, cache and
#: profiler endpoints). The gateway and the agents own what an engine loads: a client never
#: reaches these through the gateway, whatever its key.
ENGINE_ADMIN_PATHS = frozenset({
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",                       # vLLM
    "/load_lora_adapter", "/unload_lora_adapter",                             # SGLang
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/flush_cache", "/reset_prefix_cache", "/start_profile",
    "/stop_profile", "/sleep", "/wake_up", "/collective_rpc", "/pause", "/resume", "/abort_request",
})
#: Open without a key, GET/HEAD only: liveness for load balancers; carries no tenant data.
#: (The settings page's static files, /settings and its files, are open too: extproc.console answers them.)
OPEN_PATHS = frozenset({"/health"})
_SLASHES = re.compile(r"/{2,}")


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
        self.speculation = speculation  # extproc.prefetch_planner.GatewaySpeculation: one append per request
        self.metrics = metrics or GatewayMetrics()
        self.shed_load = shed_load      # endpoint picker protocol: 429 when every host carries this many (0: never)
        self.epp_fallbacks = epp_fallbacks   # endpoint picker protocol: fallback hosts after the pick
        self.usage = UsageRing()        # the settings page's last hour per (tenant, adapter)

    def exchange(self, route: RoutePolicy | None = None) -> "Exchange":
        """``route``: this request's routing policy when not the gateway's (the endpoint
        picker protocol narrows the hosts to the gateway's subset hint, extproc.epp)."""
        return Exchange(self, route)


def _engine_path(path: str) -> str:
    """The path as an engine's router reads it: percent-decoded, slashes merged, no trailing
    slash (Envoy normalizes too; this check must not depend on it)."""
    return _SLASHES.sub("/", unquote(path)).rstrip("/") or "/"


class KeyRequired:
    """Any other path on ace's host: a valid key (authentication is never bypassed: an
    engine's other endpoints list adapters, tokenize, embed...), then forwarded untouched;
    headers only, the body streams. Engine administration is refused even with a key."""

    response_body_phase = False
    headers_only = True

    def __init__(self, gw: Gateway, route: RoutePolicy) -> None:
        self.gw = gw

    def on_request_headers(self, head: RequestHead) -> Outcome:
        path = _engine_path(head.path)
        if path in OPEN_PATHS and head.method in ("GET", "HEAD"):
            return CONTINUE
        h = head.headers
        authenticate(self.gw.store.snapshot, h.get("authorization"), h.get(TENANT_HEADER))
        if path in ENGINE_ADMIN_PATHS:
            raise Forbidden(f"{head.path} is the engine's administration API; ace manages the "
                            "engines' adapters", code="engine_admin_forbidden")
        return CONTINUE

    def on_request_body(self, body: bytes) -> Outcome:
        return CONTINUE

    def on_response_body(self, body: bytes) -> Outcome:
        return CONTINUE


class Inference(Authenticated):
    """``/v1/chat/completions`` and ``/v1/completions``: decide, rewrite, route."""

    uncounted = True           # not yet in ace_gateway_requests_total (a refusal counts there too)
    forces_body = False                                  # re-encode even if nothing changed
    extra_headers: tuple[tuple[str, str], ...] = ()      # set on the upstream request

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
                   InferenceRequest(self.principal, chat, self.header_skills), self.route)
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


ROUTES: Mapping[str, type[Handler]] = {   # every other path: KeyRequired
    "/v1/chat/completions": Inference,
    "/v1/completions": Inference,
    "/v1/execute": Execute,
    "/api/v1/dev_key/skills": DevKeySkills,
    **CONSOLE_ROUTES,                       # the settings page and its read API
}


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
        self.handler = ROUTES.get(head.path, KeyRequired)(self.gw, self.route)
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

    def done_after(self, phase: str) -> bool:
        """Whether the answer to ``phase`` (an ext_proc phase name: ``request_body``,
        ``response_body``, ...) is this exchange's last. The servers then end the gRPC stream
        with it, so Envoy is done with this ext_proc for the request: a replica that dies
        while the request is upstream cannot fail it (fail-closed, that would be a 503)."""
        if phase == "response_body":
            return True
        if phase == "request_headers":
            return getattr(self.handler, "headers_only", False)
        return phase == "request_body" and (self.handler is None or not self.handler.response_body_phase)

