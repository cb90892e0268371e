"""The gRPC calls the h2 server answers: ext_proc ``Process`` and ``grpc.health.v1`` ``Check``.

A call sees whole gRPC messages (``on_message``) and the client's half-close; it answers
with ``send_message`` and ``finish`` (the trailers' status). Framing and flow control are
the connection's (``extproc.transport.h2server``).
"""
from __future__ import annotations

from grpc_health.v1 import health_pb2

from extproc.errors import InvalidMessage
from extproc.transport.h2frames import (HEADERS, END_HEADERS, RESPONSE_HEADERS, TRAILERS_OK, RecvWindow, frame,
                              status_block)
from extproc.protocols.wire import parse_request, pb

__all__ = ["Call", "ProcessCall", "NullProcessCall", "HealthCheckCall", "UnknownCall"]

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
    """``ExternalProcessor/Process``: a stream of ``extproc.transport.dispatch`` (either protocol), the
    same as the grpcio flavours serve."""

    __slots__ = ("stream",)

    def __init__(self, conn, sid: int) -> None:
        super().__init__(conn, sid)
        self.stream = conn.server.dispatcher.open()

    def on_message(self, data: bytes) -> None:
        stream = self.stream
        try:
            answers = stream.answer(parse_request(data))
        except InvalidMessage as exc:
            self.finish(INVALID_ARGUMENT, str(exc))
            return
        for answer in answers:
            self.send_message(answer)
        if stream.ended:
            self.finish(OK)   # trailers in the same write: Envoy needs us no more for this request


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
        status = self.conn.server.health.check(self.service)
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
