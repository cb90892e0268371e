"""The gRPC loop: ext_proc stream <-> ``Exchange``, plus the standard health service.

Knows nothing about OpenAI. ``serve(settings)`` blocks until SIGTERM/SIGINT, then marks
the service NOT_SERVING and drains in-flight streams for a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent import futures

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.processor import CONTINUE, Gateway
from extproc.wire import head_from_attributes, pb, request_head, to_response

__all__ = ["ExternalProcessor", "H2Server", "build_server", "serve", "serve_aio", "serve_h2"]

log = logging.getLogger(__name__)
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def Process(self, request_iterator, context):
        exchange = self.gateway.exchange()
        for msg in request_iterator:
            phase = msg.WhichOneof("request")
            if phase == "request_headers":
                outcome = exchange.on_request_headers(request_head(msg.request_headers))
            elif phase == "request_body":
                outcome = exchange.on_request_body(
                    msg.request_body.body,
                    head_from_attributes(msg) if exchange.handler is None else None)
            elif phase == "response_body":
                outcome = exchange.on_response_body(msg.response_body.body)
            else:
                outcome = CONTINUE
            yield to_response(phase, outcome)


class AioExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The same loop on grpc.aio with the read/write API: one thread, no hand-offs."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def Process(self, request_iterator, context):
        exchange = self.gateway.exchange()
        read, write, eof = context.read, context.write, grpc.aio.EOF
        while True:
            msg = await read()
            if msg is eof:
                return
            phase = msg.WhichOneof("request")
            if phase == "request_body":
                outcome = exchange.on_request_body(
                    msg.request_body.body,
                    head_from_attributes(msg) if exchange.handler is None else None)
            elif phase == "request_headers":
                outcome = exchange.on_request_headers(request_head(msg.request_headers))
            elif phase == "response_body":
                outcome = exchange.on_response_body(msg.response_body.body)
            else:
                outcome = CONTINUE
            await write(to_response(phase, outcome))


async def serve_aio(gateway: Gateway, listen: str, grace_s: float = 5.0) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(AioExternalProcessor(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    for name in ("", SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    log.info("ext_proc (aio) listening on %s (port %d)", listen, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    log.info("ext_proc stopped")


def build_server(gateway: Gateway, listen: str, workers: int) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(gateway), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(listen)
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def serve(gateway: Gateway, listen: str, workers: int, grace_s: float = 5.0) -> None:
    server, health_servicer, port = build_server(gateway, listen, workers)
    server.start()
    log.info("ext_proc listening on %s (port %d)", listen, port)
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait()
    log.info("ext_proc stopped")


# ---------------------------------------------------------------- h2: gRPC on a bare HTTP/2 loop
# Why: on this kind of VM every syscall and thread wake-up is expensive. grpc.aio spends
# ~50 syscalls and several thread hand-offs (C-core poller thread <-> event loop) per
# ext_proc stream; the loop below does one recv and one send per message on a single
# asyncio protocol, and calls the same Exchange. It speaks just the HTTP/2 + gRPC that
# Envoy's and grpc's clients use: h2c with prior knowledge, no compression, no server push.
# Numbers and limits: docs/gateway.md ("Speed").

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _PRIORITY, _RST, _SETTINGS, _PUSH, _PING, _GOAWAY, _WINDOW, _CONT = range(10)
_END_STREAM, _ACK, _END_HEADERS, _PADDED, _PRIO_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
_RECV_WINDOW = 1 << 30          # what we let a peer send before a WINDOW_UPDATE
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_PROCESS_PATH = f"/{SERVICE}/Process"


def _frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def _hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 127) | 128)
        value >>= 7
    out.append(value)
    return bytes(out)


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name, no Huffman (never touches the table)."""
    return b"\x00" + _hpack_int(len(name), 7, 0) + name + _hpack_int(len(value), 7, 0) + value


# ":status: 200" (static index 8) + "content-type: application/grpc" (name index 31)
_RESPONSE_HEADERS = b"\x88" + _hpack_int(31, 4, 0) + _hpack_int(16, 7, 0) + b"application/grpc"
_TRAILERS_OK = _hpack_literal(b"grpc-status", b"0")


def _status_block(code: int, message: str = "") -> bytes:
    block = _hpack_literal(b"grpc-status", str(code).encode())
    if message:
        from urllib.parse import quote
        block += _hpack_literal(b"grpc-message", quote(message, safe=" ").encode())
    return block


class _Call:
    """One gRPC stream. Subclasses answer messages; ``finish`` is the trailers' status."""

    __slots__ = ("conn", "sid", "buf", "window", "pending", "headers_sent", "closed_remote", "done")

    def __init__(self, conn: "_H2Connection", sid: int) -> None:
        self.conn, self.sid = conn, sid
        self.buf = bytearray()
        self.window = conn.peer_initial_window
        self.pending: list[tuple[int, int, bytes]] = []   # (frame kind, flags, payload) held by flow control
        self.headers_sent = self.closed_remote = self.done = False

    def on_message(self, data: bytes) -> None:
        raise NotImplementedError

    def on_half_close(self) -> None:
        self.finish(0)

    # -- output
    def send_message(self, payload: bytes) -> None:
        if not self.headers_sent:
            self.headers_sent = True
            self.conn.out += _frame(_HEADERS, _END_HEADERS, self.sid, self.conn.outgoing_block(_RESPONSE_HEADERS))
        self.conn.send_data(self, b"\x00" + len(payload).to_bytes(4, "big") + payload)

    def finish(self, code: int, message: str = "") -> None:
        if self.done:
            return
        self.done = True
        block = _TRAILERS_OK if code == 0 and not message else _status_block(code, message)
        if not self.headers_sent:   # trailers-only response
            block = _RESPONSE_HEADERS + block
        self.conn.send_trailers(self, block)


class _ProcessCall(_Call):
    """``ExternalProcessor/Process``: the same Exchange loop as the grpcio flavours."""

    __slots__ = ("exchange",)

    def __init__(self, conn: "_H2Connection", sid: int) -> None:
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
        else:
            outcome = CONTINUE
        self.send_message(to_response(phase, outcome).SerializeToString())


class _NullProcessCall(_Call):
    """Answers every message with an empty response, parses nothing (bench.gateway_overhead)."""

    __slots__ = ()
    EMPTY = pb.ProcessingResponse(request_body={}).SerializeToString()

    def on_message(self, data: bytes) -> None:
        self.send_message(self.EMPTY)


class _HealthCheckCall(_Call):
    """``grpc.health.v1.Health/Check`` (unary)."""

    __slots__ = ("service",)

    def on_message(self, data: bytes) -> None:
        self.service = health_pb2.HealthCheckRequest.FromString(data).service

    def on_half_close(self) -> None:
        status = self.conn.server.health.get(getattr(self, "service", ""))
        if status is None:
            self.finish(5, "unknown service")   # NOT_FOUND
            return
        self.send_message(health_pb2.HealthCheckResponse(status=status).SerializeToString())
        self.finish(0)


class _UnknownCall(_Call):
    def on_message(self, data: bytes) -> None:
        pass


class _H2Connection(asyncio.Protocol):
    def __init__(self, server: "H2Server") -> None:
        from hpack import Decoder
        self.server, self.gateway = server, server.gateway
        self.decoder = Decoder()
        self.path_cache: dict[bytes, str] = {}
        self.inbuf = bytearray()
        self.out = bytearray()
        self.calls: dict[int, _Call] = {}
        self.preface = False
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.conn_window = 65535
        self.received = 0              # DATA bytes since our last connection WINDOW_UPDATE
        self.last_sid = 0
        self.header_block: tuple[int, int, bytearray] | None = None   # (sid, flags, block) awaiting CONTINUATION
        self.transport: asyncio.Transport | None = None
        self.going_away = False
        self.table_size = 4096         # our HPACK encoder's table limit (empty: we never index)
        self.table_update_due = False

    def outgoing_block(self, block: bytes) -> bytes:
        """After the peer lowers SETTINGS_HEADER_TABLE_SIZE, the first block we send carries
        the size update RFC 7541 4.2 asks for (our table is empty whatever its size)."""
        if self.table_update_due:
            self.table_update_due = False
            return _hpack_int(self.table_size, 5, 0x20) + block
        return block

    # -- asyncio
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.server.connections.add(self)
        settings = ((0x4).to_bytes(2, "big") + _RECV_WINDOW.to_bytes(4, "big")      # INITIAL_WINDOW_SIZE
                    + (0x2).to_bytes(2, "big") + (0).to_bytes(4, "big"))            # ENABLE_PUSH = 0
        transport.write(_frame(_SETTINGS, 0, 0, settings)
                        + _frame(_WINDOW, 0, 0, (_RECV_WINDOW - 65535).to_bytes(4, "big")))

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.calls.clear()
        self.server.idle_check()

    def data_received(self, data: bytes) -> None:
        buf = self.inbuf
        buf += data
        try:
            if not self.preface:
                if len(buf) < 24:
                    return
                if bytes(buf[:24]) != _PREFACE:
                    raise ConnectionError("not an HTTP/2 prior-knowledge client")
                del buf[:24]
                self.preface = True
            pos, n = 0, len(buf)
            while n - pos >= 9:
                length = int.from_bytes(buf[pos:pos + 3], "big")
                end = pos + 9 + length
                if end > n:
                    break
                kind, flags = buf[pos + 3], buf[pos + 4]
                sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
                self._frame(kind, flags, sid, bytes(buf[pos + 9:end]))
                pos = end
            del buf[:pos]
        except Exception:
            log.exception("h2: protocol error, closing the connection")
            self.out += _frame(_GOAWAY, 0, 0, self.last_sid.to_bytes(4, "big") + (1).to_bytes(4, "big"))
            self.flush()
            self.transport.close()
            return
        self.flush()

    def flush(self) -> None:
        if self.out:
            self.transport.write(bytes(self.out))
            self.out.clear()
        if self.going_away and not self.calls:
            self.transport.close()

    # -- frames in
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == _DATA:
            self.received += len(payload)
            if self.received > _RECV_WINDOW // 2:
                self.out += _frame(_WINDOW, 0, 0, self.received.to_bytes(4, "big"))
                self.received = 0
            call = self.calls.get(sid)
            if call is None:
                return
            if flags & _PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if payload:
                call.buf += payload
                self._messages(call)
            if flags & _END_STREAM:
                self._half_close(call)
        elif kind == _HEADERS:
            if flags & _PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & _PRIO_FLAG:
                payload = payload[5:]
            if flags & _END_HEADERS:
                self._headers(sid, flags, payload)
            else:
                self.header_block = (sid, flags, bytearray(payload))
        elif kind == _CONT:
            if self.header_block is None or self.header_block[0] != sid:
                raise ConnectionError("unexpected CONTINUATION")
            self.header_block[2].extend(payload)
            if flags & _END_HEADERS:
                sid, first_flags, block = self.header_block
                self.header_block = None
                self._headers(sid, first_flags, bytes(block))
        elif kind == _SETTINGS:
            if flags & _ACK:
                return
            for i in range(0, len(payload) - 5, 6):
                key = int.from_bytes(payload[i:i + 2], "big")
                value = int.from_bytes(payload[i + 2:i + 6], "big")
                if key == 0x4:
                    delta = value - self.peer_initial_window
                    self.peer_initial_window = value
                    for call in self.calls.values():
                        call.window += delta
                elif key == 0x5:
                    self.peer_max_frame = value
                elif key == 0x1 and value < self.table_size:   # the peer shrank our HPACK table:
                    self.table_size = value                      # the next block we send says so
                    self.table_update_due = True
            self.out += _frame(_SETTINGS, _ACK, 0)
            self._pump_all()
        elif kind == _PING:
            if not flags & _ACK:
                self.out += _frame(_PING, _ACK, 0, payload)
        elif kind == _WINDOW:
            inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if sid == 0:
                self.conn_window += inc
                self._pump_all()
            elif (call := self.calls.get(sid)) is not None:
                call.window += inc
                self._pump(call)
        elif kind == _RST:
            self.calls.pop(sid, None)
        elif kind == _GOAWAY:
            self.going_away = True
        elif kind == _PUSH:
            raise ConnectionError("PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored

    def _headers(self, sid: int, flags: int, block: bytes) -> None:
        path = self._path(block)
        call = self.calls.get(sid)
        if call is not None:                      # trailers from a client: the end of its side
            if flags & _END_STREAM:
                self._half_close(call)
            return
        if sid <= self.last_sid or sid % 2 == 0:
            return
        self.last_sid = sid
        if self.going_away:
            self.out += _frame(_RST, 0, sid, (7).to_bytes(4, "big"))   # REFUSED_STREAM
            return
        if path == _PROCESS_PATH:
            call = self.server.process_call(self, sid)
        elif path == _HEALTH_PREFIX + "Check":
            call = _HealthCheckCall(self, sid)
        else:
            call = _UnknownCall(self, sid)
            self.calls[sid] = call
            call.finish(12, f"method {path} not implemented")   # UNIMPLEMENTED
            return
        self.calls[sid] = call
        if flags & _END_STREAM:
            self._half_close(call)

    def _path(self, block: bytes) -> str:
        """``:path`` of a header block. Every block is decoded (that keeps the HPACK table in
        step), except one seen before that left the table unchanged: Envoy sends the same
        bytes for every ext_proc stream (``:path`` as a Huffman literal, the rest indexed),
        and Huffman-decoding it in Python was ~30% of a request's ext_proc time."""
        path = self.path_cache.get(block)
        if path is not None:
            return path
        table = self.decoder.header_table
        entries = table.dynamic_entries
        before = (entries[0] if entries else None, len(entries), table.maxsize)
        headers = self.decoder.decode(block)
        path = next((v for k, v in headers if k == ":path"), "")
        if before == (entries[0] if entries else None, len(entries), table.maxsize):
            if len(self.path_cache) < 64:     # the table did not change: the same bytes mean the same headers
                self.path_cache[block] = path
        else:
            self.path_cache.clear()           # the table changed: cached blocks may decode differently
        return path

    def _messages(self, call: _Call) -> None:
        buf = call.buf
        while len(buf) >= 5 and not call.done:
            size = int.from_bytes(buf[1:5], "big")
            if len(buf) < 5 + size:
                return
            if buf[0]:
                call.finish(12, "compressed messages are not supported")
                return
            data = bytes(buf[5:5 + size])
            del buf[:5 + size]
            try:
                call.on_message(data)
            except Exception as exc:
                log.exception("h2: call failed")
                call.finish(13, f"internal error: {type(exc).__name__}")   # INTERNAL

    def _half_close(self, call: _Call) -> None:
        call.closed_remote = True
        if not call.done:
            call.on_half_close()
        self._maybe_forget(call)

    def _maybe_forget(self, call: _Call) -> None:
        if call.done and not call.pending:
            if not call.closed_remote:   # we ended first: tell the client to stop sending
                self.out += _frame(_RST, 0, call.sid, b"\x00\x00\x00\x00")
            self.calls.pop(call.sid, None)

    # -- frames out (flow controlled)
    def send_data(self, call: _Call, data: bytes) -> None:
        step = self.peer_max_frame
        for i in range(0, len(data), step):
            call.pending.append((_DATA, 0, data[i:i + step]))
        self._pump(call)

    def send_trailers(self, call: _Call, block: bytes) -> None:
        call.pending.append((_HEADERS, _END_HEADERS | _END_STREAM, block))
        self._pump(call)

    def _pump(self, call: _Call) -> None:
        pending = call.pending
        while pending:
            kind, flags, payload = pending[0]
            if kind == _DATA:
                size = len(payload)
                if size > call.window or size > self.conn_window:
                    return
                call.window -= size
                self.conn_window -= size
            else:
                payload = self.outgoing_block(payload)
            self.out += _frame(kind, flags, call.sid, payload)
            pending.pop(0)
        self._maybe_forget(call)

    def _pump_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending:
                self._pump(call)

    def go_away(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self.out += _frame(_GOAWAY, 0, 0, self.last_sid.to_bytes(4, "big") + b"\x00\x00\x00\x00")
        self.flush()


class H2Server:
    """ext_proc + health over the loop above; one asyncio event loop, no extra threads."""

    def __init__(self, gateway: Gateway | None, null: bool = False) -> None:
        self.gateway = gateway
        self.process_call = _NullProcessCall if null else _ProcessCall
        self.health = {name: health_pb2.HealthCheckResponse.SERVING for name in ("", SERVICE)}
        self.connections: set[_H2Connection] = set()
        self._idle: asyncio.Event | None = None

    def idle_check(self) -> None:
        if self._idle is not None and not self.connections:
            self._idle.set()

    async def start(self, listen: str) -> asyncio.AbstractServer:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")     # "[::]:50051" as grpc spells it
        loop = asyncio.get_running_loop()
        # asyncio sets TCP_NODELAY on accepted sockets
        return await loop.create_server(lambda: _H2Connection(self), host or None, int(port))

    async def shutdown(self, server: asyncio.AbstractServer, grace_s: float) -> None:
        for name in self.health:
            self.health[name] = health_pb2.HealthCheckResponse.NOT_SERVING
        server.close()
        self._idle = asyncio.Event()
        for conn in list(self.connections):
            conn.go_away()
        self.idle_check()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            pass
        for conn in list(self.connections):
            conn.transport.close()


async def serve_h2(gateway: Gateway | None, listen: str, grace_s: float = 5.0, null: bool = False) -> None:
    """``null=True``: the benchmark's do-nothing ext_proc on the same loop."""
    h2 = H2Server(gateway, null=null)
    server = await h2.start(listen)
    log.info("ext_proc (h2) listening on %s", listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await h2.shutdown(server, grace_s)
    log.info("ext_proc stopped")
