"""The Gateway API Inference Extension's endpoint picker protocol (``--protocol epp``).

Spec: ``docs/proposals/004-endpoint-picker-protocol`` of kubernetes-sigs/
gateway-api-inference-extension (see docs/epp.md). The same ``Exchange`` decides (auth,
adapter, skills, rewrite, routing, prefetch); admission (load shedding) is
``extproc.policy.admission``'s, the eligible hosts and the fallback order
``extproc.policy.routing``'s. This module is the protocol's state machine only:

- the pick goes out as header ``x-gateway-destination-endpoint`` and as dynamic metadata
  ``envoy.lb`` / ``x-gateway-destination-endpoint``, the same ``ip:port[,ip:port...]``
  (the routing policy's choice first, then up to ``Gateway.epp_fallbacks`` other eligible
  hosts in its order: Envoy's ORIGINAL_DST cluster reads one address, so none by default);
- the eligible hosts are ace's upstreams, narrowed by the subset hint (filter metadata
  ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``, a list or a comma
  string) when the gateway sends one; an empty or disjoint hint is a 503;
- ``FULL_DUPLEX_STREAMED``: the header answer is held until the body has been read, then
  the headers (pick, Content-Length when the body changed, ``clear_route_cache``) and
  the body as streamed chunks of ``CHUNK`` bytes, the last with ``end_of_stream``;
  ``BUFFERED``: the pick rides on the body answer. The mode is read from
  ``protocol_config`` (sent on the first message); without it, BUFFERED;
- the served endpoint (``envoy.lb`` / ``x-gateway-destination-endpoint-served``) is read
  on the response and counted (``EppStats``).
"""
from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc.app.outcomes import Continue, Reply
from extproc.domain.headers import SERVED_BY_HEADER, TENANT_HEADER, TRACE_METADATA_HEADERS, hint_header
from extproc.errors import GatewayError, InvalidMessage, NoUpstream, PayloadTooLarge
from extproc.policy.admission import admit
from extproc.policy.routing import eligible_upstreams, pick_order
from extproc.protocols.wire import METADATA_NAMESPACE, pb, request_head, set_headers, to_response
from extproc.rewrite.hints import HINT_FIELDS
from extproc.state.catalog import Upstream

if TYPE_CHECKING:
    from extproc.app.context import Gateway

__all__ = ["EppStream", "EppStats", "subset_hint", "ENDPOINT_HEADER", "LB_NAMESPACE", "SUBSET_NAMESPACE", "SUBSET_KEY", "SERVED_KEY", "CHUNK"]

log = logging.getLogger(__name__)

ENDPOINT_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
CHUNK = 62_000   # bytes per streamed body answer, as the reference picker splits them

#: ace's dynamic metadata keys that ace's own Envoy config turns into headers (envoy/
#: envoy.template.yaml); a gateway configured for the picker protocol does not, so they
#: are set here, and removed when ace sets none, so a client or an engine cannot supply them
_REQUEST_HEADERS = {"tenant": TENANT_HEADER, **{"hint_" + f: hint_header(f) for f in HINT_FIELDS}}
_RESPONSE_HEADERS = TRACE_METADATA_HEADERS
_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED


class EppStats:
    """What the protocol layer counts: responses per served endpoint, and how many were
    served by another endpoint than the primary pick (a fallback or a retry)."""

    def __init__(self) -> None:
        self.served: Counter[str] = Counter()
        self.served_by_fallback = 0


def subset_hint(metadata: pb.ProcessingRequest) -> tuple[str, ...] | None:
    """The gateway's subset hint from ``metadata_context``; None when it sent none."""
    ns = metadata.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        items = [value.string_value]
    elif kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    else:
        items = []
    return tuple(p.strip() for item in items for p in item.split(",") if p.strip())


def _body_chunks(phase: str, body: bytes, end: bool = True) -> list[pb.ProcessingResponse]:
    """``body`` as streamed answers of ``CHUNK`` bytes; the last ends the stream when ``end``
    (not when trailers follow)."""
    out = []
    for start in range(0, max(len(body), 1), CHUNK):
        resp = pb.ProcessingResponse()
        streamed = getattr(resp, phase).response.body_mutation.streamed_response
        streamed.body = body[start:start + CHUNK]
        streamed.end_of_stream = end and start + CHUNK >= len(body)
        out.append(resp)
    return out


def _echo(phase: str, body: bytes, end: bool) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    streamed = getattr(resp, phase).response.body_mutation.streamed_response
    streamed.body = body
    streamed.end_of_stream = end
    return resp


def _empty(phase: str) -> pb.ProcessingResponse:
    resp = pb.ProcessingResponse()
    getattr(resp, phase).SetInParent()
    return resp


def _reply(exc: GatewayError) -> list[pb.ProcessingResponse]:
    return [to_response("request_headers", Reply(exc.status, exc.to_json()))]


class EppStream:
    """One ext_proc stream (one HTTP request) in the endpoint picker protocol.
    ``handle(message) -> answers``: none while a phase is held, several when a held
    header answer and the body chunks go out together."""

    __slots__ = ("gw", "stats", "duplex_request", "duplex_response", "exchange", "eligible",
                 "held", "body", "echo_request", "echo_response", "picks", "metadata", "finished")

    def __init__(self, gw: Gateway, stats: EppStats | None = None) -> None:
        self.gw, self.stats = gw, stats or EppStats()
        self.duplex_request = self.duplex_response = False
        self.exchange = None
        self.eligible: list[Upstream] = []
        self.held: Continue | None = None
        self.body = bytearray()
        self.echo_request = self.echo_response = False
        self.picks: list[Upstream] = []
        self.metadata: tuple[tuple[str, str], ...] = ()   # ace's, from the request's decision
        self.finished = False   # an immediate response went out: Envoy is done with us

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            cfg = msg.protocol_config
            self.duplex_request = cfg.request_body_mode == _DUPLEX
            self.duplex_response = cfg.response_body_mode == _DUPLEX
        phase = msg.WhichOneof("request")
        if self.finished:
            return []
        try:
            if phase == "request_headers":
                return self._request_headers(msg)
            if phase == "request_body":
                return self._request_body(msg.request_body.body, msg.request_body.end_of_stream)
            if phase == "request_trailers":   # the body's end when the request has trailers
                return [*self._request_body(b"", True, trailers=True), _empty(phase)]
            if phase == "response_headers":
                return self._response_headers(msg)
            if phase == "response_body":
                return self._response_body(msg.response_body.body, msg.response_body.end_of_stream)
            if phase == "response_trailers":
                return [*self._response_body(b"", True, trailers=True), _empty(phase)]
        except GatewayError as exc:
            self.finished = True
            return _reply(exc)
        except InvalidMessage:   # a phase out of order: the servers end the stream INVALID_ARGUMENT
            raise
        except Exception:   # a bug: say so in the log, answer a clean JSON error, never hang
            log.exception("endpoint picker stream failed")
            self.finished = True
            return _reply(GatewayError("internal gateway error"))
        return []   # no phase: nothing to answer

    # -- request
    def _request_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        subset = subset_hint(msg)
        self.eligible = eligible_upstreams(self.gw.store.snapshot.upstreams, subset)
        if not self.eligible:
            raise NoUpstream("no eligible endpoint in the gateway's subset" if subset is not None
                             else "no endpoint is configured", code="no_endpoint")
        self.exchange = self.gw.exchange(self._route_in_subset)
        head = request_head(msg.request_headers)
        outcome = self.exchange.on_request_headers(head)
        if isinstance(outcome, Reply):
            return self._immediate(outcome)
        # authenticated, bound upstream: admitted before anything is decided or signalled
        admit(self.eligible, self.gw.residency.current, self.gw.residency.sent, self.gw.shed_load)
        if head.end_of_stream or self.exchange.headers_only:
            # nothing of the body is needed: pick now, let the body stream through
            self.echo_request = not head.end_of_stream
            return [self._headers_answer("request_headers", outcome, self._pick(None))]
        self.held = outcome   # its headers go out with the pick
        return [] if self.duplex_request else [_empty("request_headers")]

    def _request_body(self, chunk: bytes, end: bool, trailers: bool = False) -> list[pb.ProcessingResponse]:
        """``trailers``: called by the trailers, which end the body; nothing left to answer
        when the body was already answered (or streams through)."""
        if self.exchange is None:   # a body before any headers: Envoy's config is not the picker's
            raise GatewayError("gateway misconfigured: request body before its headers")
        if trailers and (self.echo_request or self.picks):
            return []
        if self.echo_request:
            return [_echo("request_body", chunk, end)] if self.duplex_request else [_empty("request_body")]
        self.body += chunk
        limit = self.gw.store.snapshot.max_body_bytes
        if len(self.body) > limit:
            raise PayloadTooLarge(f"body of {len(self.body)} bytes or more exceeds the limit of {limit} bytes")
        if not end and self.duplex_request:
            return []
        body, self.body = bytes(self.body), bytearray()
        outcome = self.exchange.on_request_body(body)
        if isinstance(outcome, Reply):
            return self._immediate(outcome)
        pick = self._pick(self.exchange.decision)
        held = self.held.headers if self.held is not None else ()
        merged = Continue(held + outcome.headers, outcome.body, outcome.metadata)
        if not self.duplex_request:
            return [self._headers_answer("request_body", merged, pick)]
        headers = self._headers_answer("request_headers", Continue(merged.headers, None, merged.metadata), pick)
        return [headers, *_body_chunks("request_body", body if outcome.body is None else outcome.body,
                                       not trailers)]

    def _route_in_subset(self, upstreams, adapter, residency, sent) -> Upstream:
        """The gateway's routing policy over the eligible hosts among ``upstreams`` (the
        request's route may narrow them: ``processor.Inference.serves``)."""
        allowed = [u for u in self.eligible if u in upstreams]
        if not allowed:
            raise NoUpstream("no eligible endpoint serves this route", code="no_endpoint")
        return self.gw.route(allowed, adapter, residency, sent)

    def _pick(self, decision) -> str:
        snap = self.gw.residency.current
        adapter = decision.adapter if decision is not None and decision.applies_adapter else None
        serves = getattr(self.exchange.handler, "serves", None)
        eligible = [u for u in self.eligible if serves(u)] if serves is not None else self.eligible
        if not eligible:
            raise NoUpstream("no eligible endpoint serves this route", code="no_endpoint")
        self.picks = pick_order(self.gw.route, eligible,
                                decision.upstream if decision is not None else None, adapter, snap,
                                self.gw.residency.sent, 1 + self.gw.epp_fallbacks)
        return ",".join(u.address for u in self.picks)

    def _headers_answer(self, phase: str, outcome: Continue, pick: str) -> pb.ProcessingResponse:
        resp = pb.ProcessingResponse()
        common = getattr(resp, phase).response
        common.clear_route_cache = True
        self.metadata = outcome.metadata
        set_headers(common.header_mutation, (*outcome.headers, (ENDPOINT_HEADER, pick)),
                     outcome.metadata, _REQUEST_HEADERS)
        if outcome.body is not None:
            common.body_mutation.body = outcome.body
        resp.dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields[ENDPOINT_HEADER].string_value = pick
        if outcome.metadata:
            fields = resp.dynamic_metadata.fields[METADATA_NAMESPACE].struct_value.fields
            for key, value in outcome.metadata:
                fields[key].string_value = value
        return resp

    def _immediate(self, reply: Reply) -> list[pb.ProcessingResponse]:
        self.finished = True
        return [to_response("request_headers", reply)]

    # -- response
    def _served(self, msg: pb.ProcessingRequest) -> str | None:
        ns = msg.metadata_context.filter_metadata.get(LB_NAMESPACE)
        if ns is None or SERVED_KEY not in ns.fields:
            return None
        served = ns.fields[SERVED_KEY].string_value
        self.stats.served[served] += 1
        self.gw.metrics.epp_served(served, self.picks[0].address if self.picks else None)   # /metrics
        if self.picks and served != self.picks[0].address:
            self.stats.served_by_fallback += 1
            log.info("served by %s, picked %s first", served, self.picks[0].address)
        return served

    def _served_headers(self, served: str | None) -> tuple[tuple[str, str], ...]:
        by = next((u.name for u in self.picks if u.address == served), None) if served else None
        if by is None and self.picks:
            by = self.picks[0].name
        return ((SERVED_BY_HEADER, by),) if by else ()

    def _response_headers(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        served = self._served_headers(self._served(msg))
        handler = self.exchange.handler if self.exchange is not None else None
        wants_body = handler is not None and handler.response_body_phase
        self.held = Continue(served)
        if wants_body and not msg.response_headers.end_of_stream and self.duplex_response:
            return []   # held: the body's rewrite may change its length
        self.echo_response = not wants_body
        resp = pb.ProcessingResponse()
        set_headers(resp.response_headers.response.header_mutation, served, self.metadata, _RESPONSE_HEADERS)
        return [resp]

    def _response_body(self, chunk: bytes, end: bool, trailers: bool = False) -> list[pb.ProcessingResponse]:
        if trailers and (self.echo_response or self.exchange is None or self.held is None):
            return []
        if self.echo_response or self.exchange is None:
            return [_echo("response_body", chunk, end)] if self.duplex_response else [_empty("response_body")]
        self.body += chunk
        if not end and self.duplex_response:
            return []
        body, self.body = bytes(self.body), bytearray()
        outcome = self.exchange.on_response_body(body)
        if isinstance(outcome, Reply):
            return self._immediate(outcome)
        headers = (self.held.headers if self.held is not None else ()) + outcome.headers
        self.held = None
        new_body = body if outcome.body is None else outcome.body
        if not self.duplex_response:
            resp = pb.ProcessingResponse()
            common = resp.response_body.response
            set_headers(common.header_mutation, headers, self.metadata, _RESPONSE_HEADERS)
            if outcome.body is not None:
                common.body_mutation.body = outcome.body
            return [resp]
        resp = pb.ProcessingResponse()
        set_headers(resp.response_headers.response.header_mutation, headers, self.metadata, _RESPONSE_HEADERS)
        return [resp, *_body_chunks("response_body", new_body, not trailers)]
