"""The inference handlers: ``/v1/chat/completions`` and ``/v1/completions`` (``Inference``),
``/v1/execute`` (``Execute``), the routes only some engine flavours serve (``Responses``,
``Embeddings``) and the engine routes an upstream allow-lists (``EngineRoute``): the key
checked, the body decided (``extproc.domain.decision.decide``), rewritten for the chosen
upstream (``extproc.rewrite``), counted and traced.
"""
from __future__ import annotations

import time
from typing import Any

from extproc.app.handlers import Authenticated, parse_object
from extproc.app.native import chat_body_from_execute, new_execution_id, wrap_output
from extproc.app.outcomes import Continue, Outcome, RequestHead
from extproc.app.trace import execute_trace, trace_metadata
from extproc.domain.decision import InferenceRequest, decide
from extproc.domain.headers import SESSION_HEADER, SKILL_OVERRIDE_HEADER, session_of
from extproc.domain.skills import parse_override_header
from extproc.errors import InvalidField, NoUpstream, NotFound
from extproc.policy.routing import RoutePolicy
from extproc.rewrite import SERVED_ROUTES, rewrite_request
from extproc.state.catalog import Upstream
from extproc.state.paths import EMBEDDINGS, RESPONSES, normalize
from extproc.state.skill_modes import MULTI_LORA
from extproc.state.store import Snapshot

__all__ = ["Inference", "Execute", "FlavourRoute", "Responses", "Embeddings", "EngineRoute"]


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
        # the request goes upstream: counted until that host's next load measurement, and
        # its adapter is nobody's hinted victim there for a while (Upstream.victim_grace_s)
        self.gw.residency.sent.record(d.upstream.name, d.adapter.name if d.adapter is not None else None)
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
