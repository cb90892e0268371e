"""Parsers that take anything (hypothesis): the h2 frame reader (extproc.transport.h2server, without a
socket: bytes into ``H2Connection.data_received``), its HPACK use (our encoder, the ``:path``
cache) and the ext_proc protobuf decoding (``extproc.protocols.wire`` through ``extproc.transport.dispatch``).

Arbitrary bytes, arbitrary frames and mutations of valid exchanges must give a clean
error (GOAWAY, RST_STREAM, a gRPC status, an OpenAI JSON error) or a correct parse; never
an exception that escapes, an internal error logged, a 500 or unbounded buffering. Each
property runs a bounded number of cases (``MAX_EXAMPLES``; ``ACE_FUZZ_EXAMPLES`` raises it
for a longer hunt); the bugs they found are regular tests at the end of this file.
"""
from __future__ import annotations

import json
import logging
import os
from urllib.parse import unquote

import hpack
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.transport.dispatch import Dispatcher
from extproc.errors import InvalidMessage
from extproc.transport.h2frames import (CONT, DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS, MAX_FRAME, PADDED, PING,
                              PREFACE, RESPONSE_HEADERS, RST, SETTINGS, WINDOW, frame, hpack_literal,
                              status_block)
from extproc.transport.h2server import H2Connection, H2Server
from extproc.app.context import Gateway
from extproc.state.store import Store
from extproc.protocols.wire import SERVICE
from tests.extproc.builders import KEYS, body_request, upstream, write_state

MAX_EXAMPLES = int(os.environ.get("ACE_FUZZ_EXAMPLES", "100"))
FUZZ = settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROCESS = f"/{SERVICE}/Process"
ALICE = f"Bearer {KEYS['alice']}"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    state = write_state(tmp, [upstream("local-vllm", "127.0.0.1:8000", "vllm", "body")])
    store = Store(state, tmp / "fuzz.sqlite3")
    yield Gateway(store)
    store.close()


class ErrorLog(logging.Handler):
    """ERROR records of the server modules: an internal error, i.e. a bug of ours."""

    NAMES = ("extproc.transport.h2server", "extproc.transport.h2calls", "extproc.transport.grpc_servers", "extproc.app.exchange", "asyncio")

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        # the processor's one by-design ERROR: a body with neither headers nor attributes
        # (an Envoy misconfiguration, never a client's doing)
        if record.name in self.NAMES and "request_attributes" not in record.getMessage():
            self.records.append(record)

    def __enter__(self) -> "ErrorLog":
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)
        assert not self.records, [r.getMessage() + str(r.exc_info) for r in self.records]


# ---------------------------------------------------------------- the h2 frame reader

class Transport:
    """What ``H2Connection`` uses of an asyncio transport, recording our output."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        assert not self.closed, "wrote after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default=None):
        return ("fuzz", 0) if name == "peername" else default

    def set_write_buffer_limits(self, high=None, low=None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def parse_frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """Our output must be whole, well-formed frames."""
    out, pos = [], 0
    while pos < len(data):
        assert len(data) - pos >= 9, "a truncated frame header in our output"
        length = int.from_bytes(data[pos:pos + 3], "big")
        assert length <= MAX_FRAME and pos + 9 + length <= len(data), "a truncated frame in our output"
        out.append((data[pos + 3], data[pos + 4], int.from_bytes(data[pos + 5:pos + 9], "big") & 0x7FFFFFFF,
                    bytes(data[pos + 9:pos + 9 + length])))
        pos += 9 + length
    return out


def feed(server: H2Server, chunks: list[bytes]) -> tuple[H2Connection, Transport, list]:
    """One connection fed ``chunks`` (as reads), then closed by the peer."""
    transport = Transport()
    conn = H2Connection(server)
    conn.connection_made(transport)
    for chunk in chunks:
        conn.data_received(chunk)
        # bounded: at most one partial frame (or the preface) is ever held
        assert len(conn.inbuf) < 9 + MAX_FRAME, len(conn.inbuf)
        assert len(conn.calls) <= server.max_streams
    frames = parse_frames(bytes(transport.out))
    if transport.closed:   # a broken peer: GOAWAY, then nothing
        assert frames and frames[-1][0] == GOAWAY, frames[-3:]
    decoder = hpack.Decoder()   # what we send decodes in order (table size updates included)
    for kind, _, _, payload in frames:
        if kind == HEADERS:
            assert dict(decoder.decode(payload))
    conn.connection_lost(None)
    return conn, transport, frames


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in zip([0, *points], [*points, len(data)]) if b > a]


def _request_block(path: str = PROCESS) -> bytes:
    return hpack.Encoder().encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                   (":authority", "fuzz"), ("content-type", "application/grpc"),
                                   ("te", "trailers")])


def _grpc(msg: bytes) -> bytes:
    return b"\x00" + len(msg).to_bytes(4, "big") + msg


def _valid_exchange() -> bytes:
    """A client's whole connection: two ext_proc streams (one in CONTINUATION, one padded),
    a health check, a PING and a WINDOW_UPDATE."""
    body = body_request(json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                        authorization=ALICE).SerializeToString()
    block = _request_block()
    return (PREFACE + frame(SETTINGS, 0, 0, (4).to_bytes(2, "big") + (1 << 20).to_bytes(4, "big"))
            + frame(HEADERS, 0, 1, block[:5]) + frame(CONT, END_HEADERS, 1, block[5:])
            + frame(DATA, END_STREAM, 1, _grpc(body))
            + frame(HEADERS, END_HEADERS | PADDED, 3, b"\x02" + block + b"\x00\x00")
            + frame(DATA, PADDED, 3, b"\x03" + _grpc(body) + b"\x00\x00\x00") + frame(DATA, END_STREAM, 3, b"")
            + frame(HEADERS, END_HEADERS | END_STREAM, 5, _request_block("/grpc.health.v1.Health/Check"))
            + frame(PING, 0, 0, b"12345678") + frame(WINDOW, 0, 0, (1000).to_bytes(4, "big")))




@st.composite
def mutated(draw, data: bytes) -> bytes:
    """``data`` with a few bytes changed, cut out, repeated or inserted."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 6))):
        if not out:
            break
        at = draw(st.integers(0, len(out) - 1))
        op = draw(st.sampled_from(["set", "delete", "repeat", "insert"]))
        if op == "set":
            out[at] = draw(st.integers(0, 255))
        elif op == "delete":
            del out[at:at + draw(st.integers(1, 16))]
        elif op == "repeat":
            out[at:at] = out[at:at + draw(st.integers(1, 32))]
        else:
            out[at:at] = draw(st.binary(min_size=1, max_size=16))
    return bytes(out)


FRAME = st.builds(lambda kind, flags, sid, payload: frame(kind, flags, sid, payload),
                  st.integers(0, 10), st.integers(0, 255), st.sampled_from([0, 1, 2, 3, 5, 7, 0x7FFFFFFF]),
                  st.binary(max_size=64))


@FUZZ
@given(data=st.binary(max_size=4096), cuts=st.lists(st.integers(0, 4096), max_size=8), preface=st.booleans())
def test_arbitrary_bytes(gateway, data, cuts, preface):
    with ErrorLog():
        feed(H2Server(gateway), _split((PREFACE if preface else b"") + data, cuts))


@FUZZ
@given(frames=st.lists(FRAME, max_size=24), cuts=st.lists(st.integers(0, 2048), max_size=4))
def test_arbitrary_frames(gateway, frames, cuts):
    """Frames of any type, flags and stream, with random payloads, after a valid start."""
    start = PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, _request_block())
    with ErrorLog():
        feed(H2Server(gateway), _split(start + b"".join(frames), cuts))


@FUZZ
@given(data=st.data(), cuts=st.lists(st.integers(0, 4096), max_size=6))
def test_mutated_valid_exchanges(gateway, data, cuts):
    exchange = data.draw(mutated(_valid_exchange()))
    with ErrorLog():
        feed(H2Server(gateway), _split(exchange, cuts))


@FUZZ
@given(cuts=st.lists(st.integers(0, 4096), max_size=12))
def test_a_valid_exchange_in_any_split_is_answered(gateway, cuts):
    """However the reads split it, the valid exchange gets its three answers: two ext_proc
    responses that parse, a SERVING health answer, and the PING's ACK; nothing is closed."""
    with ErrorLog():
        _, transport, frames = feed(H2Server(gateway), _split(_valid_exchange(), cuts))
    assert not transport.closed
    messages: dict[int, bytes] = {}
    for kind, flags, sid, payload in frames:
        if kind == DATA:
            messages[sid] = messages.get(sid, b"") + payload
    for sid in (1, 3):
        answer = pb.ProcessingResponse.FromString(messages[sid][5:])
        assert answer.HasField("request_body"), answer
    assert messages[5][5:] == b"\x08\x01"   # HealthCheckResponse(status=SERVING)
    assert (PING, 1, 0, b"12345678") in frames


# ---------------------------------------------------------------- HPACK

HEADER_TEXT = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)


@FUZZ
@given(name=st.binary(max_size=300), value=st.binary(max_size=3000))
def test_our_literals_decode_to_what_we_wrote(name, value):
    assert hpack.Decoder().decode(hpack_literal(name, value), raw=True) == [(name, value)]


@FUZZ
@given(code=st.integers(0, 16), message=st.text(max_size=3000))
def test_status_trailers_decode_and_fit_one_frame(code, message):
    block = status_block(code, message)
    assert len(RESPONSE_HEADERS + block) <= MAX_FRAME
    got = dict(hpack.Decoder().decode(block))
    assert got["grpc-status"] == str(code)
    if message:
        expected = message if len(message) <= 1024 else message[:1021] + "..."
        assert unquote(got["grpc-message"]) == expected
    else:
        assert "grpc-message" not in got


@FUZZ
@given(requests=st.lists(st.tuples(HEADER_TEXT, st.lists(st.tuples(HEADER_TEXT.map(str.lower), HEADER_TEXT),
                                                            max_size=4),
                                   st.sampled_from([None, 0, 64, 256, 4096])), min_size=1, max_size=30))
def test_the_path_cache_gives_what_a_fresh_decoder_gives(gateway, requests):
    """Header blocks from a real encoder (dynamic table, Huffman, table size updates), many
    of them repeated byte for byte: ``:path`` read through the cache is always what decoding
    every block gives."""
    encoder, reference = hpack.Encoder(), hpack.Decoder()
    conn = H2Connection(H2Server(gateway))
    for path, extra, table_size in requests:
        if table_size is not None:
            encoder.header_table_size = table_size
        block = encoder.encode([(":method", "POST"), (":path", "/" + path), *extra])
        want = dict(reference.decode(block))[":path"]
        assert conn._path(block) == want


OPS = st.lists(st.one_of(st.tuples(st.just("table"), st.integers(0, 4096)), st.just(("health",)),
                         st.just(("reset",))), max_size=16)


@FUZZ
@given(ops=OPS)
def test_header_table_size_changes_keep_our_blocks_decodable(gateway, ops):
    """The peer lowers (or raises) SETTINGS_HEADER_TABLE_SIZE between health checks and
    resets streams as they end (their trailers dropped, the size update they carried
    moved to the next block): every block we send decodes, in order, and each check is
    answered."""
    data, sid, checks = PREFACE + frame(SETTINGS, 0, 0), 1, 0
    for op in ops:
        if op[0] == "table":
            data += frame(SETTINGS, 0, 0, (1).to_bytes(2, "big") + op[1].to_bytes(4, "big"))
        elif op[0] == "health":
            data += frame(HEADERS, END_HEADERS | END_STREAM, sid, _request_block("/grpc.health.v1.Health/Check"))
            sid, checks = sid + 2, checks + 1
        elif sid > 1:
            data += frame(RST, 0, sid - 2, (8).to_bytes(4, "big"))
    with ErrorLog():
        _, transport, frames = feed(H2Server(gateway), [data])
    assert not transport.closed
    assert len({s for kind, _, s, _ in frames if kind == DATA}) == checks


# ---------------------------------------------------------------- ext_proc protobuf decoding

def headers_request(headers: dict[str, bytes], eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    for name, value in headers.items():
        msg.request_headers.headers.headers.add(key=name, raw_value=value)
    msg.request_headers.end_of_stream = eos
    return msg


def answer_all(gateway: Gateway, protocol: str, messages: list[bytes]) -> None:
    """Each message parsed (or refused as the servers refuse it) and answered by one stream,
    as the h2 server does: an answer parses, a gateway reply is never a 500."""
    stream = Dispatcher(gateway, protocol, as_bytes=True).open()
    for data in messages:
        try:
            msg = pb.ProcessingRequest.FromString(data)
        except DecodeError:
            return                          # the call ends INTERNAL "could not parse"
        try:
            answers = stream.answer(msg)
        except InvalidMessage:
            return                          # the call ends INVALID_ARGUMENT
        for answer in answers:
            resp = pb.ProcessingResponse.FromString(answer)
            if resp.HasField("immediate_response"):
                status = resp.immediate_response.status.code
                body = resp.immediate_response.body
                # a body with neither headers nor attributes: Envoy's config, never a client's doing
                misconfigured = b"gateway misconfigured" in body
                assert status not in (0, 500) or misconfigured, body
                if status >= 400:
                    error = json.loads(body)["error"]
                    assert {"message", "type", "code"} <= set(error), body
        if getattr(stream, "ended", False):
            return


PATHS = st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/execute", "/api/v1/dev_key/skills",
                         "/v1/models", "/settings", "/api/v1/usage", "/", "", "/v1/chat/completions?x=1"])
def _json_containers(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
                    _json_containers, max_leaves=20)
CHAT_KEYS = st.sampled_from(["model", "messages", "lora_name", "extra_body", "adapter_rank", "stream",
                             "input", "target", "skills", "prompt", "max_tokens"])
BODY = st.one_of(
    st.binary(max_size=300),
    JSON.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(CHAT_KEYS, JSON, max_size=6).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"messages": st.just([{"role": "user", "content": "hi"}])},
                          optional={"model": JSON, "lora_name": JSON, "extra_body": JSON, "adapter_rank": JSON,
                                    "stream": JSON}).map(lambda v: json.dumps(v).encode()),
)
AUTH = st.sampled_from([ALICE, f"Bearer {KEYS['bob']}", "Bearer sk-wrong", "", "Basic x", "Bearer "])
HEADER_VALUE = st.one_of(st.binary(max_size=40), AUTH.map(str.encode))


@st.composite
def exchanges(draw) -> list[bytes]:
    """A stream of ext_proc messages: the one-message route, or headers first then body and
    response body, with arbitrary headers, attributes and bodies."""
    if draw(st.booleans()):
        headers = {"authorization": draw(AUTH)}
        for name in draw(st.lists(st.sampled_from(["x-ace-tenant-id", "x-ace-skill-override",
                                                   "x-ace-session-id"]), max_size=3)):
            headers[name] = draw(st.text(max_size=30))
        msgs = [body_request(draw(BODY), draw(PATHS), draw(st.sampled_from(["POST", "GET", ""])), **headers)]
    else:
        headers = {":path": draw(PATHS).encode(), ":method": draw(st.sampled_from([b"POST", b"GET", b"PUT"]))}
        headers.update(draw(st.dictionaries(st.sampled_from(["authorization", "content-length",
                                                             "x-ace-skill-override", "x-ace-tenant-id",
                                                             "content-type", "cookie"]),
                                            HEADER_VALUE, max_size=4)))
        msgs = [headers_request(headers, draw(st.booleans())),
                pb.ProcessingRequest(request_body=pb.HttpBody(body=draw(BODY), end_of_stream=True)),
                pb.ProcessingRequest(response_body=pb.HttpBody(body=draw(BODY), end_of_stream=True))]
    return [m.SerializeToString() for m in msgs]


@FUZZ
@given(messages=st.lists(st.binary(max_size=512), min_size=1, max_size=3),
       protocol=st.sampled_from(["ace", "epp"]))
def test_arbitrary_message_bytes(gateway, messages, protocol):
    with ErrorLog():
        answer_all(gateway, protocol, messages)


@FUZZ
@given(messages=exchanges(), protocol=st.sampled_from(["ace", "epp"]))
def test_arbitrary_requests_are_answered_cleanly(gateway, messages, protocol):
    with ErrorLog():
        answer_all(gateway, protocol, messages)


@FUZZ
@given(data=st.data(), protocol=st.sampled_from(["ace", "epp"]))
def test_mutated_valid_messages(gateway, data, protocol):
    valid = data.draw(exchanges())
    at = data.draw(st.integers(0, len(valid) - 1))
    valid[at] = data.draw(mutated(valid[at]))
    with ErrorLog():
        answer_all(gateway, protocol, valid)


# ---------------------------------------------------------------- what the properties found

def _stream(gateway: Gateway):
    return Dispatcher(gateway, "ace", as_bytes=True).open()


def test_a_body_after_the_gateways_reply_is_invalid_not_a_500(gateway):
    """Found by test_arbitrary_requests_are_answered_cleanly: the headers of a dev-key API
    call without a key are answered 401; a request body after that reached the handler,
    which had no caller (AttributeError: 500 internal_error)."""
    stream = _stream(gateway)
    first = pb.ProcessingResponse.FromString(stream.answer(headers_request(
        {":path": b"/api/v1/dev_key/skills", ":method": b"POST"}, False))[0])
    assert first.immediate_response.status.code == 401
    with ErrorLog(), pytest.raises(InvalidMessage, match="request_body out of order"):
        stream.answer(pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)))


def test_a_response_body_before_the_request_body_is_invalid_not_a_500(gateway):
    """Found by the same property: ``/v1/execute``'s response body before its request body
    reached a handler that had decided nothing (AttributeError: 500 internal_error)."""
    stream = _stream(gateway)
    first = pb.ProcessingResponse.FromString(stream.answer(headers_request(
        {":path": b"/v1/execute", ":method": b"POST", "authorization": ALICE.encode()}, False))[0])
    assert first.HasField("request_headers")
    with ErrorLog(), pytest.raises(InvalidMessage, match="response_body out of order"):
        stream.answer(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))


def test_phases_out_of_order_end_the_h2_stream_with_invalid_argument(gateway):
    """Through the h2 server: the call ends INVALID_ARGUMENT (3), the connection serves on."""
    headers = headers_request({":path": b"/api/v1/dev_key/skills", ":method": b"POST"}, False).SerializeToString()
    body = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True)).SerializeToString()
    with ErrorLog():
        _, transport, frames = feed(H2Server(gateway), [
            PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, _request_block())
            + frame(DATA, 0, 1, _grpc(headers)) + frame(DATA, END_STREAM, 1, _grpc(body))])
    trailers = [dict(hpack.Decoder().decode(p)) for kind, flags, sid, p in frames
                if kind == HEADERS and flags & END_STREAM and sid == 1]
    assert trailers and trailers[-1]["grpc-status"] == "3", trailers
    assert not transport.closed
