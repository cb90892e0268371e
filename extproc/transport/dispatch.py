"""What every server flavour serves, written once: the ext_proc streams (phase dispatch, in
both protocols) and the gRPC health status.

The servers are transports (``extproc.transport.h2server`` + ``extproc.transport.h2calls``: ``--server h2``;
``extproc.transport.grpc_servers``: ``aio`` and ``threads`` on grpcio). For each ``Process`` call they
``open()`` a stream, hand it each ProcessingRequest (``answer``), write the answers it
returns in order, and end the gRPC stream (status OK) once ``ended`` is true; an
``InvalidMessage`` ends it with INVALID_ARGUMENT and the error's text. Nothing else. A
message whose bytes do not parse (``wire.parse_request``: a client's header that is not
UTF-8, copied into a proto string) is handed over as ``wire.UNREADABLE`` and answered with
a 400 (``UNREADABLE_ERROR``) that ends the stream, the same in every server flavour.

- protocol ``ace`` (``ExchangeStream``): one answer per message from the request's
  ``extproc.app.exchange.Exchange``; the stream ends with the exchange's last answer (``done_after``).
- protocol ``epp`` (``PickerStream``): ``extproc.protocols.epp.EppStream``'s zero or more answers;
  the stream ends when Envoy half-closes it.

Answers are ``ProcessingResponse`` messages (grpcio serializes them) or, ``as_bytes``, their
bytes (written by the h2 server; ``wire.serialize_response`` builds them without the
message).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from grpc_health.v1 import health, health_pb2

from extproc.protocols.epp import EppStats, EppStream
from extproc.errors import BadRequest, InvalidMessage
from extproc.app.exchange import error_reply
from extproc.app.outcomes import CONTINUE
from extproc.protocols.wire import (HEALTH_SERVICES, NO_PHASE, UNREADABLE, head_from_attributes, pb, request_head,
                          serialize_response, to_response)

if TYPE_CHECKING:
    from extproc.app.context import Gateway

__all__ = ["Dispatcher", "ExchangeStream", "PickerStream", "ServingHealth", "SERVING", "NOT_SERVING"]

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


#: the answer to a message that does not parse: the request cannot be read, so it is refused
UNREADABLE_ERROR = BadRequest("the request's headers could not be read: a header or the path is not "
                              "valid UTF-8", code="invalid_header_encoding")


def _unreadable(gateway: "Gateway", as_bytes: bool) -> Sequence[Any]:
    reply = error_reply(gateway, UNREADABLE_ERROR)
    # an immediate response answers any request phase alike
    return (serialize_response("request_headers", reply) if as_bytes
            else to_response("request_headers", reply),)


class ExchangeStream:
    """One ext_proc stream in ace's protocol: each phase to the request's ``Exchange``."""

    __slots__ = ("exchange", "as_bytes", "ended")

    def __init__(self, gateway: "Gateway", as_bytes: bool) -> None:
        self.exchange = gateway.exchange()
        self.as_bytes = as_bytes
        self.ended = False

    def answer(self, msg: pb.ProcessingRequest) -> Sequence[Any]:
        exchange = self.exchange
        if msg is UNREADABLE:
            self.ended = True
            return _unreadable(exchange.gw, self.as_bytes)
        phase = msg.WhichOneof("request")
        if phase == "request_body":
            outcome = exchange.on_request_body(
                msg.request_body.body, head_from_attributes(msg) if exchange.handler is None else None)
        elif phase == "request_headers":
            outcome = exchange.on_request_headers(request_head(msg.request_headers))
        elif phase == "response_body":
            outcome = exchange.on_response_body(msg.response_body.body)
        elif phase is None:
            raise InvalidMessage(NO_PHASE)
        else:
            outcome = CONTINUE
        # the last answer ends the stream: Envoy needs us no more for this request
        self.ended = exchange.done_after(phase)
        if self.as_bytes:
            return (serialize_response(phase, outcome),)
        return (to_response(phase, outcome),)


class PickerStream:
    """One ext_proc stream in the endpoint picker protocol (``extproc.protocols.epp``)."""

    __slots__ = ("stream", "as_bytes", "gateway", "ended")

    def __init__(self, gateway: "Gateway", stats: EppStats, as_bytes: bool) -> None:
        self.stream = EppStream(gateway, stats)
        self.as_bytes = as_bytes
        self.gateway = gateway
        self.ended = False   # Envoy half-closes it, but for an unreadable message

    def answer(self, msg: pb.ProcessingRequest) -> Sequence[Any]:
        if msg is UNREADABLE:
            self.ended = True
            return _unreadable(self.gateway, self.as_bytes)
        answers = self.stream.handle(msg)
        return [a.SerializeToString() for a in answers] if self.as_bytes else answers


class Dispatcher:
    """One per server: the streams its ``Process`` calls serve, in its protocol (``ace`` or
    ``epp``); ``as_bytes``: answers as serialized bytes (the h2 server) rather than
    messages (grpcio). ``epp_stats``: what the endpoint picker protocol counts."""

    __slots__ = ("gateway", "protocol", "as_bytes", "epp_stats")

    def __init__(self, gateway: "Gateway", protocol: str = "ace", *, as_bytes: bool = False) -> None:
        self.gateway = gateway
        self.protocol = "epp" if protocol == "epp" else "ace"
        self.as_bytes = as_bytes
        self.epp_stats = EppStats()

    def open(self) -> ExchangeStream | PickerStream:
        if self.protocol == "epp":
            return PickerStream(self.gateway, self.epp_stats, self.as_bytes)
        return ExchangeStream(self.gateway, self.as_bytes)


class ServingHealth:
    """The gRPC health every flavour answers: each of ``HEALTH_SERVICES`` (the server, ext_proc,
    and the endpoint picker protocol's ``liveness`` and ``readiness``) SERVING once listening,
    NOT_SERVING once draining; any other service is unknown. The h2 server answers ``Check``
    from ``check``; the grpcio flavours serve grpc's standard servicer, set from here."""

    __slots__ = ("status",)

    def __init__(self) -> None:
        self.status = dict.fromkeys(HEALTH_SERVICES, SERVING)

    def check(self, service: str) -> int | None:
        """The status of ``service``; None: not a service of ours."""
        return self.status.get(service)

    def drain(self) -> None:
        for name in self.status:
            self.status[name] = NOT_SERVING

    def grpcio_servicer(self) -> health.HealthServicer:
        servicer = health.HealthServicer()
        for name, status in self.status.items():
            servicer.set(name, status)
        return servicer

    async def grpcio_aio_servicer(self) -> health.aio.HealthServicer:
        servicer = health.aio.HealthServicer()
        for name, status in self.status.items():
            await servicer.set(name, status)
        return servicer
