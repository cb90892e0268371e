"""``--server h2``: gRPC (ext_proc + health) on a bare asyncio HTTP/2 loop.

Why: on this kind of VM every syscall and thread wake-up is expensive. grpc.aio spends
~50 syscalls and several thread hand-offs (C-core poller thread <-> event loop) per
ext_proc stream; the loop below does one recv and one send per message on a single
asyncio protocol, and serves the same streams (extproc.transport.dispatch). It speaks just the HTTP/2 + gRPC that
Envoy's and grpc's clients use: h2c with prior knowledge, no compression, no server push.
A peer that breaks the protocol gets GOAWAY and loses its connection, nothing else.
What one connection may cost us is bounded: streams (SETTINGS_MAX_CONCURRENT_STREAMS),
buffered request bytes (the receive windows, enforced), header blocks, and our output (we
stop reading a peer that does not read). Numbers and limits: docs/gateway.md ("Speed").
"""
from __future__ import annotations

import asyncio
import collections
import logging
import os
import ssl
import struct
import tempfile

from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from hpack import Decoder, HPACKError

from extproc.transport.dispatch import Dispatcher, ServingHealth
from extproc.errors import ConfigError
from extproc.transport.h2calls import (INTERNAL, RESOURCE_EXHAUSTED, UNIMPLEMENTED, Call, HealthCheckCall,
                             NullProcessCall, ProcessCall, UnknownCall)
from extproc.transport.h2frames import (ACK, COMPRESSION_ERROR, CONT, DATA, END_HEADERS, END_STREAM,
                              FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, GOAWAY, HEADERS,
                              INTERNAL_ERROR, MAX_FRAME, MAX_WINDOW, PADDED, PING, PREFACE,
                              PRIO_FLAG, PROTOCOL_ERROR, PUSH, REFUSED_STREAM, RST, SETTINGS,
                              STREAM_CLOSED, WINDOW, ProtocolError, RecvWindow, frame, hpack_int)
from extproc.transport.handover import await_handover, serve_until_signal
from extproc.transport.health_port import ServerLifecycle
from extproc.transport.serving_cert import ServingCert
from extproc.protocols.wire import SERVICE

if TYPE_CHECKING:
    from extproc.app.context import Gateway

__all__ = ["H2Server", "serve_h2", "MAX_MESSAGE", "MAX_STREAMS", "STREAM_WINDOW", "CONNECTION_WINDOW"]

log = logging.getLogger(__name__)

# Defaults of the H2Server limits. Envoy counts its ext_proc streams against the cluster's
# max_requests circuit breaker (1024 unless raised) and opens another connection when ours is full.
MAX_STREAMS = 4096             # SETTINGS_MAX_CONCURRENT_STREAMS: open streams per connection
CONNECTION_WINDOW = 1 << 30    # request bytes a connection may have sent that we have not consumed
STREAM_WINDOW = 256 << 20      # the same per stream (SETTINGS_INITIAL_WINDOW_SIZE)
MAX_MESSAGE = 64 << 20         # one gRPC message (Envoy's buffer is max_body_bytes + 64 KiB)
MAX_HEADER_BLOCK = 256 << 10   # HEADERS + CONTINUATION bytes of one block
WRITE_HIGH = 1 << 20           # our output waiting for a peer beyond which we stop reading it
FLUSH_AT = 64 << 10            # write out mid-read once this much is queued (to see WRITE_HIGH)
CACHED_BLOCK = 4096            # header blocks longer than this are not kept in the :path cache
_HEALTH_PREFIX = "/grpc.health.v1.Health/"
_PROCESS_PATH = f"/{SERVICE}/Process"


_FRAME_HEAD = struct.Struct(">BHBBI")   # length (24 bits as 8 + 16), type, flags, stream id


def _data_head(sid: int, size: int) -> bytes:
    """The header of a DATA frame of ``size`` bytes that is one whole gRPC message, and the
    message's prefix (uncompressed, ``size - 5`` bytes)."""
    return _MESSAGE_HEAD.pack(size >> 16, size & 0xFFFF, DATA, 0, sid, 0, size - 5)


_MESSAGE_HEAD = struct.Struct(">BHBBIBI")


def _unpad(payload: bytes) -> bytes:
    if not payload or payload[0] >= len(payload):
        raise ProtocolError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[1:len(payload) - payload[0]]


def _setting(key: int, value: int) -> bytes:
    return key.to_bytes(2, "big") + value.to_bytes(4, "big")


class H2Connection(asyncio.Protocol):
    def __init__(self, server: "H2Server") -> None:
        self.server = server
        self.stream_window = server.stream_window
        self.max_message = min(MAX_MESSAGE, server.stream_window - 5)   # a bigger one could never arrive
        self.inflow = RecvWindow(server.connection_window)
        self.decoder = Decoder()
        self.path_cache: dict[bytes, str] = {}
        self.inbuf = bytearray()
        self.out = bytearray()
        self.calls: dict[int, Call] = {}
        self.reset_sids: collections.deque[int] = collections.deque(maxlen=128)   # we sent RST_STREAM
        self.preface = False
        self.peer_initial_window = 65535
        self.peer_max_frame = 16384
        self.conn_window = 65535       # what we may send (the peer's window)
        self.last_sid = 0
        self.header_block: tuple[int, int, bytearray] | None = None   # (sid, flags, block) awaiting CONTINUATION
        self.transport: asyncio.Transport | None = None
        self.going_away = False
        self.broken = False
        self.paused = False            # the peer does not read our output: we do not read its input
        self.refused = 0               # streams refused over the limit
        self.table_size = 4096         # our HPACK encoder's table limit (empty: we never index)
        self.table_update_due = False
        # the last trailers put in ``out`` and not yet written: (sid, start, end, carried the table update)
        self.unsent_trailers: tuple[int, int, int, bool] | None = None

    def outgoing_block(self, block: bytes) -> bytes:
        """After the peer lowers SETTINGS_HEADER_TABLE_SIZE, the first block we send carries
        the size update RFC 7541 4.2 asks for (our table is empty whatever its size)."""
        if self.table_update_due:
            self.table_update_due = False
            return hpack_int(self.table_size, 5, 0x20) + block
        return block

    # -- asyncio
    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.set_write_buffer_limits(high=WRITE_HIGH)
        self.server.connections.add(self)
        srv = self.server
        out = frame(SETTINGS, 0, 0, _setting(0x3, srv.max_streams)      # MAX_CONCURRENT_STREAMS
                    + _setting(0x4, srv.stream_window)                  # INITIAL_WINDOW_SIZE
                    + _setting(0x2, 0))                                 # ENABLE_PUSH
        if srv.connection_window > 65535:   # the connection's window starts at 65535 whatever SETTINGS say
            out += frame(WINDOW, 0, 0, (srv.connection_window - 65535).to_bytes(4, "big"))
        transport.write(out)

    def connection_lost(self, exc) -> None:
        self.server.connections.discard(self)
        self.calls.clear()
        self.server.idle_check()

    def pause_writing(self) -> None:
        """Over WRITE_HIGH of our output waits for a peer that does not read it: read no more
        from it (its PINGs, requests and their answers would pile up here) until it drains."""
        self.paused = True
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.broken or self.transport.is_closing():
            return
        self.transport.resume_reading()
        self._process(self.inbuf)      # the frames left in inbuf when we paused

    def data_received(self, data: bytes) -> None:
        if self.broken:
            return
        if self.inbuf or not self.preface:
            self.inbuf += data
            self._process(self.inbuf)
        else:                          # whole frames, nothing left from the last read: no copy
            self._process(data)

    def _process(self, buf: bytes | bytearray) -> None:
        """Handle the whole frames in ``buf`` (``inbuf``, or a read when ``inbuf`` is empty);
        what is left ends up in ``inbuf``."""
        try:
            if not self.preface:
                if len(buf) < 24:
                    if not PREFACE.startswith(bytes(buf)):
                        raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge client")
                    return
                if bytes(buf[:24]) != PREFACE:
                    raise ProtocolError(PROTOCOL_ERROR, "not an HTTP/2 prior-knowledge client")
                del buf[:24]
                self.preface = True
            pos, n = 0, len(buf)
            while n - pos >= 9 and not self.paused:
                high, low, kind, flags, sid = _FRAME_HEAD.unpack_from(buf, pos)
                length = high << 16 | low
                if length > MAX_FRAME:   # refuse at once rather than buffer up to 16 MiB
                    raise ProtocolError(FRAME_SIZE_ERROR, f"frame of {length} bytes")
                end = pos + 9 + length
                if end > n:
                    break
                self._frame(kind, flags, sid & 0x7FFFFFFF, bytes(buf[pos + 9:end]))
                pos = end
                if len(self.out) >= FLUSH_AT:
                    self.flush()       # may pause us (pause_writing)
            if buf is self.inbuf:
                del buf[:pos]
            elif pos < n:
                self.inbuf += buf[pos:]
        except ProtocolError as exc:
            self._abort(exc.code, str(exc))
            return
        except HPACKError as exc:
            self._abort(COMPRESSION_ERROR, f"HPACK: {exc}")
            return
        except Exception:
            log.exception("h2: internal error, closing the connection")
            self._abort(INTERNAL_ERROR, "internal error")
            return
        self.flush()

    def _abort(self, code: int, reason: str) -> None:
        log.warning("h2: closing the connection from %s: %s",
                    self.transport.get_extra_info("peername"), reason)
        self.broken = True
        self.unsent_trailers = None
        self.inbuf.clear()
        self.out += frame(GOAWAY, 0, 0, self.last_sid.to_bytes(4, "big") + code.to_bytes(4, "big"))
        self.transport.write(bytes(self.out))
        self.out.clear()
        self.calls.clear()
        self.transport.close()

    def _drop_trailers(self) -> None:
        """Envoy ends each ext_proc stream with END_STREAM and, in the same write, RST_STREAM:
        the trailers our half-close answer queued in between need not go out (RFC 9113 5.1:
        nothing more on a reset stream). That saves a write per request here and a read in
        Envoy."""
        _, start, end, carried_update = self.unsent_trailers
        self.unsent_trailers = None
        if end != len(self.out):   # more went out after them: leave it as it is
            return
        del self.out[start:]
        if carried_update:
            self.table_update_due = True

    def flush(self) -> None:
        self.unsent_trailers = None
        if self.out:
            self.transport.write(bytes(self.out))
            self.out.clear()
        if self.going_away and not self.calls:
            self.transport.close()

    # -- frames in
    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if self.header_block is not None and (kind != CONT or sid != self.header_block[0]):
            raise ProtocolError(PROTOCOL_ERROR, "header block interrupted")
        if kind == DATA:
            if sid == 0:
                raise ProtocolError(PROTOCOL_ERROR, "DATA on stream 0")
            size = len(payload)   # padding included (RFC 9113 6.9.1)
            if not self.inflow.take(size):
                raise ProtocolError(FLOW_CONTROL_ERROR, f"DATA beyond the connection window "
                                                        f"of {self.inflow.size} bytes")
            call = self.calls.get(sid)
            if call is None:    # a stream we reset or forgot: its bytes only count for the connection
                self.give_back(None, size)
                return
            if not call.inflow.take(size):
                self._reset(call, FLOW_CONTROL_ERROR,
                            f"DATA beyond the stream window of {self.stream_window} bytes")
                self.give_back(None, size)
                return
            if flags & PADDED:
                payload = _unpad(payload)
            if payload and not call.done:
                call.buf += payload
                self._messages(call)
                size -= len(payload)   # the padding is consumed now, the rest as messages complete
            if flags & END_STREAM:
                self._half_close(call)
            self.give_back(call, size)
        elif kind == HEADERS:
            if flags & PADDED:
                payload = _unpad(payload)
            if flags & PRIO_FLAG:
                if len(payload) < 5:
                    raise ProtocolError(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
                payload = payload[5:]
            if flags & END_HEADERS:
                self._headers(sid, flags, payload)
            else:
                self.header_block = (sid, flags, bytearray(payload))
        elif kind == CONT:
            if self.header_block is None:
                raise ProtocolError(PROTOCOL_ERROR, "unexpected CONTINUATION")
            block = self.header_block[2]
            block.extend(payload)
            if len(block) > MAX_HEADER_BLOCK:
                raise ProtocolError(PROTOCOL_ERROR, "header block too large")
            if flags & END_HEADERS:
                first_flags = self.header_block[1]
                self.header_block = None
                self._headers(sid, first_flags, bytes(block))
        elif kind == SETTINGS:
            self._settings(flags, sid, payload)
        elif kind == PING:
            if len(payload) != 8 or sid:
                raise ProtocolError(FRAME_SIZE_ERROR if len(payload) != 8 else PROTOCOL_ERROR, "bad PING")
            if not flags & ACK:
                self.out += frame(PING, ACK, 0, payload)
        elif kind == WINDOW:
            if len(payload) != 4:
                raise ProtocolError(FRAME_SIZE_ERROR, "bad WINDOW_UPDATE")
            inc = int.from_bytes(payload, "big") & 0x7FFFFFFF
            if sid == 0:
                if inc == 0:
                    raise ProtocolError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
                self.conn_window += inc
                if self.conn_window > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")
                self._pump_all()
            elif (call := self.calls.get(sid)) is not None:
                call.window += inc
                self._pump(call)
        elif kind == RST:
            if len(payload) != 4 or sid == 0:
                raise ProtocolError(PROTOCOL_ERROR, "bad RST_STREAM")
            call = self.calls.pop(sid, None)
            if call is not None and call.buf:   # a partial message: its bytes go back to the connection
                self.give_back(None, len(call.buf))
                call.buf.clear()
            elif self.unsent_trailers is not None and self.unsent_trailers[0] == sid:
                self._drop_trailers()
        elif kind == GOAWAY:
            self.going_away = True
        elif kind == PUSH:
            raise ProtocolError(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
        # PRIORITY and unknown frame types are ignored

    def _settings(self, flags: int, sid: int, payload: bytes) -> None:
        if sid:
            raise ProtocolError(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ProtocolError(FRAME_SIZE_ERROR, "SETTINGS length not a multiple of 6")
        for i in range(0, len(payload), 6):
            key = int.from_bytes(payload[i:i + 2], "big")
            value = int.from_bytes(payload[i + 2:i + 6], "big")
            if key == 0x4:
                if value > MAX_WINDOW:
                    raise ProtocolError(FLOW_CONTROL_ERROR, "INITIAL_WINDOW_SIZE over 2^31-1")
                delta = value - self.peer_initial_window
                self.peer_initial_window = value
                for call in self.calls.values():
                    call.window += delta
            elif key == 0x5:
                if not 16384 <= value <= 0xFFFFFF:
                    raise ProtocolError(PROTOCOL_ERROR, f"MAX_FRAME_SIZE {value}")
                self.peer_max_frame = value
            elif key == 0x1 and value < self.table_size:   # the peer shrank our HPACK table:
                self.table_size = value                      # the next block we send says so
                self.table_update_due = True
        self.out += frame(SETTINGS, ACK, 0)
        self._pump_all()

    def _headers(self, sid: int, flags: int, block: bytes) -> None:
        if sid == 0 or sid % 2 == 0:
            raise ProtocolError(PROTOCOL_ERROR, f"HEADERS on stream {sid}")
        path = self._path(block)
        call = self.calls.get(sid)
        if call is not None:                      # trailers from a client: the end of its side
            if not flags & END_STREAM:
                raise ProtocolError(PROTOCOL_ERROR, "second HEADERS without END_STREAM")
            self._half_close(call)
            return
        if sid <= self.last_sid:
            if sid in self.reset_sids:            # sent before our RST_STREAM reached the peer
                return
            raise ProtocolError(STREAM_CLOSED, f"HEADERS on closed stream {sid}")
        self.last_sid = sid
        if self.going_away or len(self.calls) >= self.server.max_streams:
            if not self.going_away:
                self.refused += 1
                if self.refused == 1:   # once per connection: a peer that ignores SETTINGS may do it a lot
                    log.warning("h2: %s opened more than %d streams; refusing the extra ones",
                                self.transport.get_extra_info("peername"), self.server.max_streams)
            self.out += frame(RST, 0, sid, REFUSED_STREAM.to_bytes(4, "big"))   # the client may retry it
            self.reset_sids.append(sid)
            return
        if path == _PROCESS_PATH:
            call = self.server.process_call(self, sid)
        elif path == _HEALTH_PREFIX + "Check":
            call = HealthCheckCall(self, sid)
        else:
            call = UnknownCall(self, sid)
            self.calls[sid] = call
            call.closed_remote = bool(flags & END_STREAM)
            call.finish(UNIMPLEMENTED, f"method {path} not implemented")
            return
        self.calls[sid] = call
        if flags & END_STREAM:
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
        # identity of the newest entry: hpack adds a new tuple per insertion, so an insertion
        # that evicts one and re-adds an equal header still shows as a change
        first = entries[0] if entries else None
        before = (len(entries), table.maxsize)
        headers = self.decoder.decode(block)
        path = next((v for k, v in headers if k == ":path"), "")
        if (entries[0] if entries else None) is first and before == (len(entries), table.maxsize):
            if len(self.path_cache) < 64 and len(block) <= CACHED_BLOCK:   # the table did not change:
                # the same bytes mean the same headers
                self.path_cache[block] = path
        else:
            self.path_cache.clear()           # the table changed: cached blocks may decode differently
        return path

    def _messages(self, call: Call) -> None:
        buf = call.buf
        while len(buf) >= 5 and not call.done:
            size = int.from_bytes(buf[1:5], "big")
            if size > self.max_message:
                call.finish(RESOURCE_EXHAUSTED, f"message of {size} bytes over the {self.max_message} limit")
                return
            if len(buf) < 5 + size:
                return
            if buf[0]:
                call.finish(UNIMPLEMENTED, "compressed messages are not supported")
                return
            data = bytes(buf[5:5 + size])
            del buf[:5 + size]
            self.give_back(call, 5 + size)
            try:
                call.on_message(data)
            except DecodeError:   # the peer's bytes, not our bug: no traceback
                log.warning("h2: stream %d: unparseable request message", call.sid)
                call.finish(INTERNAL, "could not parse the request message")
            except Exception as exc:
                log.exception("h2: call failed")
                call.finish(INTERNAL, f"internal error: {type(exc).__name__}")

    def give_back(self, call: Call | None, size: int) -> None:
        """``size`` received DATA bytes have left our buffers (0: see whether an update is due):
        WINDOW_UPDATE the connection and, while it may still send, the stream."""
        inc = self.inflow.give_back(size)
        if inc:
            self.out += frame(WINDOW, 0, 0, inc.to_bytes(4, "big"))
        if call is not None and not (call.done or call.closed_remote):
            inc = call.inflow.give_back(size)
            if inc:
                self.out += frame(WINDOW, 0, call.sid, inc.to_bytes(4, "big"))

    def _reset(self, call: Call, code: int, reason: str) -> None:
        """A stream error (RFC 9113 5.4.2): RST_STREAM(``code``) and the call is dropped; the
        connection and its other streams go on."""
        log.warning("h2: resetting stream %d from %s: %s", call.sid,
                    self.transport.get_extra_info("peername"), reason)
        call.done = True
        call.pending.clear()
        del self.calls[call.sid]
        self.out += frame(RST, 0, call.sid, code.to_bytes(4, "big"))
        self.reset_sids.append(call.sid)
        if call.buf:
            self.give_back(None, len(call.buf))
            call.buf.clear()

    def _half_close(self, call: Call) -> None:
        call.closed_remote = True
        if not call.done:
            call.on_half_close()
        self._maybe_forget(call)

    def _maybe_forget(self, call: Call) -> None:
        if call.done and not call.pending and self.calls.get(call.sid) is call:
            if not call.closed_remote:   # we ended first: tell the client to stop sending
                self.out += frame(RST, 0, call.sid, b"\x00\x00\x00\x00")
                self.reset_sids.append(call.sid)
            del self.calls[call.sid]

    # -- frames out (flow controlled)
    def send_message(self, call: Call, payload: bytes) -> None:
        """One gRPC message (the 5-byte prefix, then ``payload``) as DATA."""
        size = len(payload) + 5
        if (call.pending or call.done or size > self.peer_max_frame or size > call.window
                or size > self.conn_window):
            self.send_data(call, b"\x00" + (size - 5).to_bytes(4, "big") + payload)
            return
        # the common case, what _pump would do without the queue: one frame, both windows
        # allow it, nothing waiting before it; the payload is copied once
        call.window -= size
        self.conn_window -= size
        self.out += _data_head(call.sid, size)
        self.out += payload

    def send_data(self, call: Call, data: bytes) -> None:
        step = self.peer_max_frame
        for i in range(0, len(data), step):
            call.pending.append((DATA, 0, data[i:i + step]))
        self._pump(call)

    def send_trailers(self, call: Call, block: bytes) -> None:
        call.pending.append((HEADERS, END_HEADERS | END_STREAM, block))
        self._pump(call)

    def _pump(self, call: Call) -> None:
        pending = call.pending
        while pending:
            kind, flags, payload = pending[0]
            if kind == DATA:
                size = len(payload)
                if size > call.window or size > self.conn_window:
                    return
                call.window -= size
                self.conn_window -= size
            else:
                due = self.table_update_due
                payload = self.outgoing_block(payload)
            start = len(self.out)
            self.out += frame(kind, flags, call.sid, payload)
            pending.pop(0)
            if kind == HEADERS:   # trailers (END_STREAM): see _drop_trailers
                self.unsent_trailers = (call.sid, start, len(self.out), due)
        self._maybe_forget(call)

    def _pump_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending:
                self._pump(call)

    def go_away(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        self.going_away = True
        self.out += frame(GOAWAY, 0, 0, self.last_sid.to_bytes(4, "big") + b"\x00\x00\x00\x00")
        self.flush()


class H2Server:
    """ext_proc + health over the loop above; one asyncio event loop, no extra threads.

    Per connection: at most ``max_streams`` open streams (more are refused with
    REFUSED_STREAM), at most ``stream_window`` / ``connection_window`` bytes of requests held
    (a peer that sends more gets FLOW_CONTROL_ERROR)."""

    def __init__(self, gateway: Gateway | None, null: bool = False, *, max_streams: int = MAX_STREAMS,
                 stream_window: int = STREAM_WINDOW, connection_window: int = CONNECTION_WINDOW,
                 protocol: str = "ace", tls: ServingCert | None = None) -> None:
        if not 1 <= max_streams <= MAX_WINDOW:
            raise ConfigError(f"max_streams must be in 1..2^31-1, got {max_streams}")
        # below 65535 a peer that has not yet seen our SETTINGS could overrun the stream window
        if not 65535 <= stream_window <= connection_window <= MAX_WINDOW:
            raise ConfigError("windows must satisfy 65535 <= stream_window <= connection_window "
                              f"<= 2^31-1, got {stream_window} and {connection_window}")
        self.max_streams = max_streams
        self.stream_window, self.connection_window = stream_window, connection_window
        self.gateway = gateway
        self.process_call = NullProcessCall if null else ProcessCall
        self.dispatcher = Dispatcher(gateway, protocol, as_bytes=True)
        self.tls = tls
        self.health = ServingHealth()
        self.connections: set[H2Connection] = set()
        self._idle: asyncio.Event | None = None

    def idle_check(self) -> None:
        if self._idle is not None and not self.connections:
            self._idle.set()

    async def start(self, listen: str) -> asyncio.AbstractServer:
        host, _, port = listen.rpartition(":")
        host = host.strip("[]")     # "[::]:50051" as grpc spells it
        loop = asyncio.get_running_loop()
        # asyncio sets TCP_NODELAY on accepted sockets
        ssl_context = None
        if self.tls is not None:
            ssl_context = server_ssl_context(self.tls)
        # SO_REUSEPORT: a successor binds beside us while we hand over (extproc.transport.handover)
        return await loop.create_server(lambda: H2Connection(self), host or None, int(port), ssl=ssl_context,
                                        reuse_port=True)

    async def shutdown(self, server: asyncio.AbstractServer, grace_s: float) -> None:
        """NOT_SERVING, GOAWAY to every connection, wait up to ``grace_s`` for open streams."""
        self.health.drain()
        server.close()
        self._idle = asyncio.Event()
        for conn in list(self.connections):
            conn.go_away()
        self.idle_check()
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
        except asyncio.TimeoutError:
            log.warning("h2: %d connection(s) still open after %.1fs, cutting them",
                        len(self.connections), grace_s)
        for conn in list(self.connections):
            conn.transport.abort()   # close() would wait for a peer that does not read


def server_ssl_context(tls: ServingCert) -> ssl.SSLContext:
    """TLS 1.2+, ALPN h2 (gRPC), from PEM bytes (written to a private temporary directory:
    ``ssl`` loads certificates from files only)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    with tempfile.TemporaryDirectory(prefix="ace-tls-") as tmp:
        cert, key = os.path.join(tmp, "tls.crt"), os.path.join(tmp, "tls.key")
        with open(cert, "wb") as f:
            f.write(tls.cert_pem)
        with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
            f.write(tls.key_pem)
        ctx.load_cert_chain(cert, key)
    return ctx


async def serve_h2(gateway: Gateway | None, listen: str, grace_s: float = 5.0, null: bool = False,
                   max_streams: int = MAX_STREAMS, protocol: str = "ace", tls: ServingCert | None = None,
                   lifecycle: ServerLifecycle | None = None, handover_s: float = 0.0) -> None:
    """``null=True``: the benchmark's do-nothing ext_proc on the same loop. ``lifecycle``
    (extproc.transport.health_port): told once listening, and when the drain starts. SIGTERM:
    NOT_SERVING, serve on until a successor listens (``handover_s``, extproc.transport.handover),
    then GOAWAY and drain for ``grace_s``."""
    h2 = H2Server(gateway, null=null, max_streams=max_streams, protocol=protocol, tls=tls)
    server = await h2.start(listen)
    log.info("ext_proc (h2) listening on %s", listen)
    await serve_until_signal(lifecycle)
    h2.health.drain()
    await await_handover(listen, handover_s)
    await h2.shutdown(server, grace_s)
    log.info("ext_proc stopped")
