"""HTTP/2 frame and HPACK bits the h2 server writes (RFC 9113, RFC 7541), its receive windows,
and its one error.

We only ever encode without the dynamic table (static-table indices and literals "without
indexing"), so there is no encoder state to keep in step with the peer.
"""
from __future__ import annotations

from urllib.parse import quote

from extproc.errors import AceError

__all__ = ["ProtocolError", "RecvWindow", "frame", "hpack_int", "hpack_literal", "status_block",
           "PREFACE", "RESPONSE_HEADERS", "TRAILERS_OK", "MAX_FRAME"]

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST, SETTINGS, PUSH, PING, GOAWAY, WINDOW, CONT = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIO_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# error codes (RFC 9113 7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0, 1, 2, 3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 5, 6, 7, 9
MAX_FRAME = 16384               # SETTINGS_MAX_FRAME_SIZE we accept (the default; we never raise it)
MAX_WINDOW = (1 << 31) - 1


class ProtocolError(AceError):
    """A connection error (RFC 9113 5.4.1): the connection gets GOAWAY(``code``) and is closed."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code


class RecvWindow:
    """What a peer may still send us on a connection or a stream (RFC 9113 6.9.1).

    ``take(n)`` on every DATA frame (padding included): False means the peer sent more than we
    allowed. ``give_back(n)`` once ``n`` of those bytes have left our buffers (and with 0 after
    every frame); it returns the WINDOW_UPDATE increment now due, 0 for none. An update is due
    once less than half the window is left: a peer whose bytes we consume at once gets one per
    half window, one whose bytes we hold (a partial message) gets back all the rest, and what we
    hold (``size - left - unacked``) never exceeds ``size``.
    """

    __slots__ = ("size", "left", "unacked")

    def __init__(self, size: int) -> None:
        self.size = self.left = size
        self.unacked = 0            # given back but not yet announced

    def take(self, n: int) -> bool:
        self.left -= n
        return self.left >= 0

    def give_back(self, n: int) -> int:
        self.unacked += n
        if self.left >= self.size >> 1 or not self.unacked:
            return 0
        inc, self.unacked = self.unacked, 0
        self.left += inc
        return inc


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + sid.to_bytes(4, "big") + payload


def hpack_int(value: int, prefix_bits: int, first: int) -> bytes:
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


def hpack_literal(name: bytes, value: bytes) -> bytes:
    """Literal header field without indexing, new name, no Huffman (never touches the table)."""
    return b"\x00" + hpack_int(len(name), 7, 0) + name + hpack_int(len(value), 7, 0) + value


# ":status: 200" (static index 8) + "content-type: application/grpc" (name index 31)
RESPONSE_HEADERS = b"\x88" + hpack_int(31, 4, 0) + hpack_int(16, 7, 0) + b"application/grpc"
TRAILERS_OK = hpack_literal(b"grpc-status", b"0")


def status_block(code: int, message: str = "") -> bytes:
    """gRPC trailers: ``grpc-status`` and a percent-encoded ``grpc-message``, cut so the
    block always fits one frame (it may quote a client's ``:path``)."""
    block = hpack_literal(b"grpc-status", str(code).encode())
    if message:
        message = message if len(message) <= 1024 else message[:1021] + "..."
        block += hpack_literal(b"grpc-message", quote(message, safe=" ").encode())
    return block
