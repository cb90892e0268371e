"""The gRPC calls the h2 server answers: ext_proc ``Process`` and ``grpc.health.v1`` ``Check``.

A call sees whole gRPC messages (``on_message``) and the client's half-close; it answers
with ``send_message`` and ``finish`` (the trailers' status). Framing and flow control are
the connection's (``extproc.h2server``).
"""
from __future__ import annotations

from grpc_health.v1 import health_pb2

from extproc.h2frames import (HEADERS, END_HEADERS, RESPONSE_HEADERS, TRAILERS_OK, RecvWindow, frame,
                              status_block)
from extproc.epp import EppStream
from extproc.processor import CONTINUE
from extproc.wire import NO_PHASE, head_from_attributes, pb, request_head, serialize_response

__all__ = ["Call", "ProcessCall", "EppProcessCall", "NullProcessCall", "HealthCheckCall", "UnknownCall"]

# gRPC status codes used here
OK, INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 3, 5, 8, 12, 13


class Call:
    """One gRPC stream. Subclasses answer messages; ``finish`` is the trailers' status."""

    __slots__ = ("conn", "sid", "buf", "window", "pending", "headers_sent", "closed_remote",
                 "done", "inflow")

    def __init__(self, conn, sid: int) -> None:
        self.conn, self.sid = conn, sid
        self.buf = bytearray()
        self.window = conn.peer_initial_window
        self.pending: list[tuple[int, int, bytes]] = []   # (frame kind, flags, payload) held by flow control
        self.headers_sent = self.closed_remote = self.done = False
        self.inflow = RecvWindow(conn.stream_window)   # what the client may still send us

    def on_message(self, data: bytes) -> None:
        raise NotImplementedError

    def on_half_close(self) -> None:
        self.finish(OK)

    # -- output
    def send_message(self, payload: bytes) -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self.conn.out += frame(HEADERS, END_HEADERS, self.sid, self.conn.outgoing_block(RESPONSE_HEADERS))
        self.conn.send_message(self, payload)

    def finish(self, code: int, message: str = "") -> None:
        if self.done:
            return
        self.done = True
        if self.buf:   # a partial message: its bytes go back to the connection's window
            self.conn.give_back(self, len(self.buf))
            self.buf.clear()
        block = TRAILERS_OK if code == OK and not message else status_block(code, message)
        if not self.headers_sent:   # trailers-only response
            block = RESPONSE_HEADERS + block
        self.conn.send_trailers(self, block)


class ProcessCall(Call):
    """``ExternalProcessor/Process``: the same Exchange loop as the grpcio flavours."""

    __slots__ = ("exchange",)

    def __init__(self, conn, sid: int) -> None:
        super().__init__(conn, sid)
        self.exchange = conn.gateway.exchange()

    def on_message(self, data: bytes) -> None:
        msg = pb.ProcessingRequest.FromString(data)
        exchange = self.exchange
        phase = msg.WhichOneof("request")
        if phase == "request_body":
            outcome = exchange.on_request_body(
                msg.request_body.body, head_from_attributes(msg) if exchange.handler is None else None)
        elif phase == "request_headers":
            outcome = exchange.on_request_headers(request_head(msg.request_headers))
        elif phase == "response_body":
            outcome = exchange.on_response_body(msg.response_body.body)
        elif phase is None:
            self.finish(INVALID_ARGUMENT, NO_PHASE)
            return
        else:
            outcome = CONTINUE
        self.send_message(serialize_response(phase, outcome))
        if exchange.done_after(phase):
            self.finish(OK)   # trailers in the same write: Envoy needs us no more for this request


class EppProcessCall(Call):
    """``ExternalProcessor/Process`` in the endpoint picker protocol (``extproc.epp``): zero,
    one or several answers per message; the stream ends when Envoy half-closes it."""

    __slots__ = ("stream",)

    def __init__(self, conn, sid: int) -> None:
        super().__init__(conn, sid)
        self.stream = EppStream(conn.gateway, conn.server.epp_stats)

    def on_message(self, data: bytes) -> None:
        for answer in self.stream.handle(pb.ProcessingRequest.FromString(data)):
            self.send_message(answer.SerializeToString())


class NullProcessCall(Call):
    """Answers every message with an empty response, parses nothing (bench.gateway_overhead)."""

    __slots__ = ()
    EMPTY = pb.ProcessingResponse(request_body={}).SerializeToString()

    def __init__(self, conn, sid: int) -> None:
        super().__init__(conn, sid)

    def on_message(self, data: bytes) -> None:
        self.send_message(self.EMPTY)


class HealthCheckCall(Call):
    """``grpc.health.v1.Health/Check`` (unary)."""

    __slots__ = ("service",)

    def __init__(self, conn, sid: int) -> None:
        super().__init__(conn, sid)
        self.service = ""

    def on_message(self, data: bytes) -> None:
        self.service = health_pb2.HealthCheckRequest.FromString(data).service

    def on_half_close(self) -> None:
        status = self.conn.server.health.get(self.service)
        if status is None:
            self.finish(NOT_FOUND, "unknown service")
            return
        self.send_message(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.finish(OK)


class UnknownCall(Call):
    """Any other method: answered ``UNIMPLEMENTED`` as soon as its headers arrive."""

    __slots__ = ()

    def on_message(self, data: bytes) -> None:
        pass
