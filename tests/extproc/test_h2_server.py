"""``--server h2`` (extproc.transport.h2server) against grpcio's own client, and against broken peers.

The server runs in-process on an ephemeral loopback port (its own event loop in a thread),
except where the CLI matters (the grpc.aio reference, SIGTERM): there ``python -m extproc``
runs as a subprocess. Broken peers are raw sockets that speak just enough HTTP/2 to be wrong.
Every wait has a timeout: a hang is a failure, not a stuck suite.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import signal
import socket
import threading
import time

import grpc
import hpack
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.errors import ConfigError
from extproc.transport.h2calls import NullProcessCall
from extproc.transport.h2frames import (CONT, DATA, END_HEADERS, END_STREAM, FLOW_CONTROL_ERROR, GOAWAY, HEADERS,
                              PREFACE, REFUSED_STREAM, RST, SETTINGS, WINDOW, RecvWindow, frame)
from extproc.transport.h2server import (CONNECTION_WINDOW, FLUSH_AT, MAX_STREAMS, STREAM_WINDOW, WRITE_HIGH,
                              H2Server)
from extproc.app.context import Gateway
from extproc.state.store import Store
from extproc.protocols.wire import NO_PHASE, SERVICE
from tests.extproc.builders import KEYS, body_request, upstream, write_state
from tests.support.procs import extproc_process, free_port, python, running, wait_port
from tests.support.wait import scaled, wait_until

PROCESS = f"/{SERVICE}/Process"
ALICE = f"Bearer {KEYS['alice']}"
BOB = f"Bearer {KEYS['bob']}"
TIMEOUT = scaled(20)


# ---------------------------------------------------------------- fixtures

class ServerThread:
    """An ``H2Server`` on its own event loop in a daemon thread; ``stop`` drains and joins."""

    def __init__(self, gateway: Gateway | None, **limits) -> None:
        self.h2 = H2Server(gateway, **limits)
        self.loop = asyncio.new_event_loop()
        self.loop_errors: list[dict] = []
        self.loop.set_exception_handler(lambda loop, ctx: self.loop_errors.append(ctx))
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.server = self.loop.run_until_complete(self.h2.start("127.0.0.1:0"))
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, name="h2-server", daemon=True)
        self.thread.start()
        assert ready.wait(TIMEOUT), "h2 server did not start"
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def inspect(self, fn):
        """Run ``fn()`` on the server's loop (its state is only touched there)."""
        async def call():
            return fn()
        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(TIMEOUT)

    def open_streams(self) -> int:
        return self.inspect(lambda: sum(len(c.calls) for c in self.h2.connections))

    def assert_windows_account(self) -> None:
        """What each connection's window says we hold is what its calls hold: no bytes leak
        out of the connection window (that would stall it for good one day)."""
        def check():
            for conn in self.h2.connections:
                held = conn.inflow.size - conn.inflow.left - conn.inflow.unacked
                assert held == sum(len(c.buf) for c in conn.calls.values()), (held, conn.calls)
        self.inspect(check)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.h2.shutdown(self.server, 1.0), self.loop).result(TIMEOUT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("h2")
    return tmp, write_state(tmp, [upstream("local-vllm", "127.0.0.1:8000", "vllm", "body")],
                            max_body_bytes=4 << 20)


@pytest.fixture(scope="module")
def h2(state):
    tmp, path = state
    store = Store(path, tmp / "h2.sqlite3")
    srv = ServerThread(Gateway(store))
    yield srv
    srv.stop()
    store.close()
    assert not srv.loop_errors, srv.loop_errors


# small limits, so that tests can reach them: 8 streams, 64 KiB per stream, 192 KiB per connection
TIGHT = {"max_streams": 8, "stream_window": 65535, "connection_window": 3 << 16}


@pytest.fixture(scope="module")
def tight():
    """The do-nothing ext_proc (every message answered, whatever its bytes) under TIGHT limits."""
    srv = ServerThread(None, null=True, **TIGHT)
    yield srv
    srv.stop()
    assert not srv.loop_errors, srv.loop_errors


@pytest.fixture(scope="module")
def aio(state):
    """The grpc.aio flavour through the CLI: the reference behaviour."""
    tmp, path = state
    port = free_port()
    log = tmp / "aio.log"
    cmd = [python(), "-m", "extproc", "--server", "aio", "--config", str(path),
           "--db", str(tmp / "aio.sqlite3"), "--listen", f"127.0.0.1:{port}", "--metrics-listen", "off"]
    with running(cmd, log) as proc:
        wait_port(port, timeout=30, proc=proc, log=log)
        yield f"127.0.0.1:{port}"


@pytest.fixture
def no_errors_logged(caplog):
    """The server logs broken peers as warnings; an ERROR from it would be a bug of ours.
    (The processor's own ERROR for a body without attributes is by design.)"""
    caplog.set_level(logging.WARNING)
    yield caplog
    errors = [r for r in caplog.get_records("call") if r.levelno >= logging.ERROR
              and r.name in ("extproc.transport.h2server", "extproc.transport.h2calls", "extproc.transport.grpc_servers", "asyncio")]
    assert not errors, [r.getMessage() for r in errors]


def channel(address: str, **options) -> grpc.Channel:
    opts = [("grpc.use_local_subchannel_pool", 1), *options.items()]   # a connection of its own
    return grpc.insecure_channel(address, options=opts)


def health_check(address: str, service: str = "", timeout: float = TIMEOUT) -> int:
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status


def assert_still_serving(srv: ServerThread) -> None:
    assert srv.thread.is_alive()
    assert health_check(srv.address) == health_pb2.HealthCheckResponse.SERVING
    assert process(srv.address, [body_request(chat(), authorization=ALICE)])[0].HasField("request_body")


# ---------------------------------------------------------------- ext_proc messages

def chat(content: str = "hi", **extra) -> bytes:
    """A chat request body; without ``model`` the tenant's default adapter applies."""
    return json.dumps({"messages": [{"role": "user", "content": content}], **extra}).encode()


def headers_request(path: str, method: str = "POST", eos: bool = False, **headers: str) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    for name, value in {":path": path, ":method": method, **headers}.items():
        msg.request_headers.headers.headers.add(key=name.replace("_", "-"), raw_value=value.encode())
    msg.request_headers.end_of_stream = eos
    return msg


def plain_body(body: bytes) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    msg.request_body.body = body
    msg.request_body.end_of_stream = True
    return msg


def process(address: str, messages, timeout: float = TIMEOUT, **options) -> list[pb.ProcessingResponse]:
    with channel(address, **options) as ch:
        return list(pb_grpc.ExternalProcessorStub(ch).Process(iter(messages), timeout=timeout))


EXCHANGES = {
    "one-message chat, tenant default adapter": [body_request(chat(), authorization=ALICE)],
    "one-message chat, explicit adapter": [body_request(chat(lora_name="code-python"), authorization=BOB)],
    "headers then body": [headers_request("/v1/chat/completions", authorization=BOB,
                                          content_length="60"),
                          plain_body(chat(extra_body={"lora_name": "code-python"}))],
    "invalid JSON": [body_request(b'{"model": ', authorization=ALICE)],
    "missing key": [body_request(chat())],
    "unknown adapter": [body_request(chat(model="globex-secret"), authorization=ALICE)],
    "GET on chat": [headers_request("/v1/chat/completions", "GET", True, authorization=ALICE)],
    "dev key skills": [headers_request("/api/v1/dev_key/skills", "GET", True, authorization=ALICE)],
    "other path, with a key": [headers_request("/v1/models", "GET", True, authorization=ALICE)],
    "other path, no key": [headers_request("/v1/models", "GET", True)],
    "engine admin path": [headers_request("/v1/load_lora_adapter", "POST", authorization=ALICE)],
    "execute, response body": [headers_request("/v1/execute", authorization=ALICE),
                               plain_body(json.dumps({"input": {"messages": [{"role": "user", "content": "x"}]},
                                                      "target": {"model": "code-python"}}).encode()),
                               pb.ProcessingRequest(response_body={"body": b'{"choices": []}'})],
}


# ---------------------------------------------------------------- behaviour = grpc.aio's

@pytest.mark.parametrize("name", list(EXCHANGES))
def test_same_responses_as_grpc_aio(h2, aio, name):
    ours, reference = process(h2.address, EXCHANGES[name]), process(aio, EXCHANGES[name])
    assert len(ours) == len(EXCHANGES[name])
    assert _same_but_execution_ids(ours) == _same_but_execution_ids(reference)


def _same_but_execution_ids(responses) -> list[bytes]:
    """/v1/execute answers carry a fresh random ``exec-<hex>`` id each time."""
    return [re.sub(rb"exec-[0-9a-f]{24}", b"exec-" + b"0" * 24, r.SerializeToString(deterministic=True))
            for r in responses]


def test_a_message_without_a_phase_is_invalid_argument(h2, aio, no_errors_logged):
    """(Was a KeyError in wire.to_response on every flavour: a traceback and UNKNOWN/INTERNAL.)"""
    codes = []
    for address in (h2.address, aio):
        with pytest.raises(grpc.RpcError) as err:
            process(address, [pb.ProcessingRequest()])
        codes.append((err.value.code(), err.value.details()))
    assert codes[0] == codes[1] == (grpc.StatusCode.INVALID_ARGUMENT, NO_PHASE)


def test_a_real_request_is_decided(h2):
    (resp,) = process(h2.address, [body_request(chat(), authorization=ALICE)])
    meta = resp.dynamic_metadata.fields["ace"].struct_value.fields
    assert meta["destination"].string_value == "127.0.0.1:8000"
    assert meta["tenant"].string_value == "acme"
    body = json.loads(resp.request_body.response.body_mutation.body)
    assert body["model"] == "acme-legal" and body["lora_name"] == "acme-legal"
    (err,) = process(h2.address, [body_request(b"[]", authorization=ALICE)])
    assert err.immediate_response.status.code == 400
    assert json.loads(err.immediate_response.body)["error"]["code"] == "invalid_json"


# ---------------------------------------------------------------- size and concurrency

def test_large_messages_both_ways(h2, aio):
    """~1.5 MiB in, ~1.5 MiB out: split DATA frames, and grpcio's 64 KiB windows hold our
    answer back until it sends WINDOW_UPDATEs."""
    big = [body_request(chat("x" * (3 << 19)), authorization=ALICE)]
    (resp,) = process(h2.address, big)
    out = resp.request_body.response.body_mutation.body
    assert len(out) > 3 << 19 and json.loads(out)["lora_name"] == "acme-legal"
    assert [resp] == process(aio, big)
    # a small window on our side of grpcio's connection, too
    (resp,) = process(h2.address, big, **{"grpc.http2.lookahead_bytes": 16384,
                                          "grpc.http2.bdp_probe": 0})
    assert resp.request_body.response.body_mutation.body == out


def test_large_metadata_arrives_in_continuation_frames(h2):
    with channel(h2.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(), metadata=[("x-big", "a" * 40000)],
                          timeout=TIMEOUT)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_many_streams_on_one_connection_and_several_connections(h2):
    async def run(connections: int, streams: int) -> list[list[pb.ProcessingResponse]]:
        chans = [grpc.aio.insecure_channel(h2.address, options=[("grpc.use_local_subchannel_pool", 1)])
                 for _ in range(connections)]
        try:
            async def one(ch, i):
                call = pb_grpc.ExternalProcessorStub(ch).Process(
                    iter([body_request(chat(f"req {i}"), authorization=ALICE)]), timeout=TIMEOUT)
                return [r async for r in call]
            return await asyncio.gather(*(one(chans[i % connections], i)
                                          for i in range(connections * streams)))
        finally:
            for ch in chans:
                await ch.close()

    for connections, streams in ((1, 200), (4, 50)):
        results = asyncio.run(run(connections, streams))
        assert len(results) == connections * streams
        for i, (resp,) in enumerate(results):
            assert json.loads(resp.request_body.response.body_mutation.body)["messages"][0]["content"] == f"req {i}"
    assert h2.open_streams() == 0


# ---------------------------------------------------------------- gRPC semantics

def test_health_check(h2):
    assert health_check(h2.address) == health_pb2.HealthCheckResponse.SERVING
    assert health_check(h2.address, SERVICE) == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.RpcError) as err:
        health_check(h2.address, "no.such.Service")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_unknown_method_is_unimplemented(h2):
    with channel(h2.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.unary_unary("/no.such.Service/Method")(b"", timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as err:
            list(ch.stream_stream(f"/{SERVICE}/Nope")(iter([b"a", b"b"]), timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as err:   # its name is quoted in the trailers, cut to fit a frame
            ch.unary_unary("/no.such.Service/" + "m" * 30000)(b"", timeout=TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as err:   # Watch is not served
            list(ch.unary_stream("/grpc.health.v1.Health/Watch")(b"", timeout=TIMEOUT))
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert_still_serving(h2)


def test_compressed_message_is_refused(h2):
    msg = body_request(chat("y" * 4096), authorization=ALICE)
    with pytest.raises(grpc.RpcError) as err:
        process(h2.address, [msg], **{"grpc.default_compression_algorithm": 2})   # gzip
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "compress" in err.value.details()
    assert_still_serving(h2)


def test_client_cancels_a_stream_midway(h2):
    release = threading.Event()

    def messages():
        yield headers_request("/v1/chat/completions", authorization=ALICE)
        release.wait(TIMEOUT)   # the body never comes: the client cancels first

    with channel(h2.address) as ch:
        call = pb_grpc.ExternalProcessorStub(ch).Process(messages(), timeout=TIMEOUT)
        first = next(call)
        assert first.HasField("request_headers")
        assert h2.open_streams() == 1
        call.cancel()
        release.set()
        wait_until(lambda: h2.open_streams() == 0, what="the cancelled stream closed")
        # the same connection goes on
        (resp,) = pb_grpc.ExternalProcessorStub(ch).Process(
            iter([body_request(chat(), authorization=ALICE)]), timeout=TIMEOUT)
        assert resp.HasField("request_body")


# ---------------------------------------------------------------- broken peers

class RawPeer:
    """A TCP client writing whatever bytes a test gives it and reading frames back."""

    def __init__(self, address: str, preface: bool = True, rcvbuf: int | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf is not None:   # before connecting: it sets the window TCP offers
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(5)
        self.sock.connect((host, int(port)))
        self.encoder = hpack.Encoder()
        self.data = bytearray()
        if preface:
            self.send(PREFACE + frame(SETTINGS, 0, 0))

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def request_block(self, path: str = "/grpc.health.v1.Health/Check") -> bytes:
        return self.encoder.encode([(":method", "POST"), (":scheme", "http"), (":path", path),
                                    (":authority", "test"), ("content-type", "application/grpc"),
                                    ("te", "trailers")])

    def frames(self) -> list[tuple[int, int, int, bytes]]:
        out, pos, buf = [], 0, self.data
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            out.append((buf[pos + 3], buf[pos + 4], int.from_bytes(buf[pos + 5:pos + 9], "big"),
                        bytes(buf[pos + 9:pos + 9 + length])))
            pos += 9 + length
        return out

    def read_until(self, done, timeout: float = 5.0) -> bool:
        """Read until ``done(frames)`` or EOF; True on EOF. A timeout fails the test."""
        timeout = scaled(timeout)
        deadline = time.monotonic() + timeout
        while not done(self.frames()):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except socket.timeout:
                pytest.fail(f"the server neither answered nor closed in {timeout}s: {self.frames()}")
            except ConnectionResetError:
                return True
            if not chunk:
                return True
            self.data += chunk
        return False

    def expect_closed(self, code: int | None) -> None:
        """The server closes the connection, after GOAWAY(code) when ``code`` is given."""
        assert self.read_until(lambda frames: False), "connection still open"
        goaways = [int.from_bytes(p[4:8], "big") for kind, _, _, p in self.frames() if kind == GOAWAY]
        if code is not None:
            assert goaways and goaways[-1] == code, self.frames()

    def close(self) -> None:
        self.sock.close()


def _health_request(peer: RawPeer, sid: int) -> None:
    block = peer.request_block()
    msg = health_pb2.HealthCheckRequest().SerializeToString()
    peer.send(frame(HEADERS, END_HEADERS, sid, block)
              + frame(DATA, END_STREAM, sid, b"\x00" + len(msg).to_bytes(4, "big") + msg))


def _stream_ended(sid: int):
    return lambda frames: any(k == HEADERS and f & END_STREAM and s == sid for k, f, s, _ in frames)


def test_raw_peer_valid_exchange_with_continuation(h2):
    """The raw client is right when it is right: a header block in three frames."""
    peer = RawPeer(h2.address)
    block = peer.request_block()
    msg = health_pb2.HealthCheckRequest().SerializeToString()
    peer.send(frame(HEADERS, 0, 1, block[:3]) + frame(CONT, 0, 1, block[3:7])
              + frame(CONT, END_HEADERS, 1, block[7:])
              + frame(DATA, END_STREAM, 1, b"\x00" + len(msg).to_bytes(4, "big") + msg))
    assert not peer.read_until(_stream_ended(1))
    data = [p for k, _, s, p in peer.frames() if k == DATA and s == 1]
    assert health_pb2.HealthCheckResponse.FromString(b"".join(data)[5:]).status == \
        health_pb2.HealthCheckResponse.SERVING
    peer.close()


def test_stream_reset_with_its_end_gets_no_trailers(h2, no_errors_logged):
    """Envoy ends each ext_proc stream with DATA(END_STREAM) and RST_STREAM(CANCEL) in one
    write: the trailers our half-close queued are dropped, not sent on a reset stream. A
    plain END_STREAM still gets them, and the connection goes on either way. (A headers
    message: after it the exchange is not done, so the stream waits for Envoy's end.)"""
    peer = RawPeer(h2.address)
    msg = headers_request("/v1/chat/completions", authorization=ALICE, content_length="60").SerializeToString()
    request = b"\x00" + len(msg).to_bytes(4, "big") + msg
    for sid in (1, 3):
        peer.send(frame(HEADERS, END_HEADERS, sid, peer.request_block(f"/{SERVICE}/Process"))
                  + frame(DATA, 0, sid, request))
        assert not peer.read_until(lambda frames: any(k == DATA and s == sid for k, _, s, _ in frames))
        answer = b"".join(p for k, _, s, p in peer.frames() if k == DATA and s == sid)
        assert pb.ProcessingResponse.FromString(answer[5:]).HasField("request_headers")
        assert not _stream_ended(sid)(peer.frames())
    peer.send(frame(DATA, END_STREAM, 1) + frame(RST, 0, 1, (8).to_bytes(4, "big")))
    peer.send(frame(DATA, END_STREAM, 3))
    assert not peer.read_until(_stream_ended(3))
    _health_request(peer, 5)
    assert not peer.read_until(_stream_ended(5))
    assert not _stream_ended(1)(peer.frames()), peer.frames()
    assert h2.open_streams() == 0
    h2.assert_windows_account()
    peer.close()


def test_the_last_answer_ends_the_stream(h2, no_errors_logged):
    """Once an exchange has nothing more to process, its answer comes with the trailers
    (grpc-status 0) in the same write, before Envoy half-closes: Envoy is then done with
    this ext_proc for the request, and a replica that dies while the request is upstream
    cannot fail it. The one-message body, the headers-first body and /v1/execute's response
    body are last; a headers message and /v1/execute's request body are not."""
    peer = RawPeer(h2.address)
    execute = json.dumps({"input": {"messages": [{"role": "user", "content": "x"}]},
                          "target": {"model": "code-python"}}).encode()
    cases = [(1, [body_request(chat(), authorization=ALICE)], True),
             (3, [headers_request("/v1/chat/completions", authorization=ALICE, content_length="60")], False),
             (3, [plain_body(chat())], True),
             (5, [headers_request("/v1/execute", authorization=ALICE)], False),
             (5, [plain_body(execute)], False),
             (5, [pb.ProcessingRequest(response_body={"body": b'{"choices": []}'})], True)]
    opened = set()
    for sid, (msg,), last in cases:
        data = msg.SerializeToString()
        head = b"" if sid in opened else frame(HEADERS, END_HEADERS, sid, peer.request_block(f"/{SERVICE}/Process"))
        opened.add(sid)
        answers = sum(1 for k, _, s, _ in peer.frames() if k == DATA and s == sid)
        peer.send(head + frame(DATA, 0, sid, b"\x00" + len(data).to_bytes(4, "big") + data))
        assert not peer.read_until(lambda frames: sum(1 for k, _, s, _ in frames if k == DATA and s == sid) > answers)
        if last:
            assert not peer.read_until(_stream_ended(sid)), (sid, msg)
            (trailers,) = [p for k, f, s, p in peer.frames() if k == HEADERS and f & END_STREAM and s == sid]
            assert hpack.Decoder().decode(trailers) == [("grpc-status", "0")]
        else:
            assert not _stream_ended(sid)(peer.frames()), (sid, msg)
    peer.send(frame(DATA, END_STREAM, 1) + frame(DATA, END_STREAM, 3) + frame(DATA, END_STREAM, 5))
    _health_request(peer, 7)
    assert not peer.read_until(_stream_ended(7))
    assert h2.open_streams() == 0
    peer.close()


BROKEN = {
    # name: (bytes after connecting, GOAWAY code expected or None for a plain close)
    "HTTP/1.1 request": (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", 1),
    "garbage": (bytes(range(256)) * 4, 1),
    "bad preface": (b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n" + frame(SETTINGS, 0, 0), 1),
    "oversize frame header": (PREFACE + frame(SETTINGS, 0, 0) + b"\xff\xff\xff\x00\x00\x00\x00\x00\x01", 6),
    "HEADERS on stream 0": (PREFACE + frame(HEADERS, END_HEADERS, 0, b"\x82"), 1),
    "HEADERS on an even stream": (PREFACE + frame(HEADERS, END_HEADERS, 2, b"\x82"), 1),
    "HPACK garbage": (PREFACE + frame(HEADERS, END_HEADERS, 1, b"\xff\xff\xff\xff\xff\xff"), 9),
    "interrupted header block": (PREFACE + frame(HEADERS, 0, 1, b"\x82") + frame(DATA, 0, 1, b"x"), 1),
    "CONTINUATION out of the blue": (PREFACE + frame(CONT, END_HEADERS, 1, b"\x82"), 1),
    "bad padding": (PREFACE + frame(HEADERS, END_HEADERS | 0x8, 1, b"\x09\x82"), 1),
    "SETTINGS of odd length": (PREFACE + frame(SETTINGS, 0, 0, b"\x00\x04\x00"), 6),
    "tiny MAX_FRAME_SIZE": (PREFACE + frame(SETTINGS, 0, 0, b"\x00\x05\x00\x00\x00\x01"), 1),
    "PING of 3 bytes": (PREFACE + frame(6, 0, 0, b"abc"), 6),
    "WINDOW_UPDATE overflow": (PREFACE + frame(8, 0, 0, b"\x7f\xff\xff\xff"), 3),
    "PUSH_PROMISE": (PREFACE + frame(5, END_HEADERS, 1, b"\x00\x00\x00\x02\x82"), 1),
    # one header block of 17 x 16 KiB: over the 256 KiB we buffer for one, at its last frame
    "endless CONTINUATION": (PREFACE + frame(HEADERS, 0, 1, b"\x82" * 16384)
                             + frame(CONT, 0, 1, b"\x82" * 16384) * 16, 1),
    # a 4 KB header indexed 1,000 times: 5 KB on the wire, 4 MB decoded (we stop at 64 KiB)
    "HPACK bomb": (PREFACE + frame(HEADERS, END_HEADERS | END_STREAM, 1, b"\x40\x06x-bomb\x7f\xa1\x1e"
                                   + b"v" * 4000 + b"\xbe" * 1000), 9),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_peer_loses_its_connection_only(h2, no_errors_logged, name):
    data, code = BROKEN[name]
    with channel(h2.address) as bystander:   # another connection, open across the breakage
        stub = health_pb2_grpc.HealthStub(bystander)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == 1
        peer = RawPeer(h2.address, preface=False)
        peer.send(data)
        peer.expect_closed(code)
        peer.close()
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == 1
    assert_still_serving(h2)


def test_headers_on_a_closed_stream(h2, no_errors_logged):
    peer = RawPeer(h2.address)
    _health_request(peer, 1)
    assert not peer.read_until(_stream_ended(1))
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block()))
    peer.expect_closed(5)   # STREAM_CLOSED
    peer.close()
    assert_still_serving(h2)


def test_truncated_frame_then_eof(h2, no_errors_logged):
    peer = RawPeer(h2.address)
    block = peer.request_block(PROCESS)
    peer.send(frame(HEADERS, END_HEADERS, 1, block)[:-3])   # the frame's last bytes never come
    peer.sock.shutdown(socket.SHUT_WR)
    peer.expect_closed(None)
    peer.close()
    assert_still_serving(h2)


def test_connection_closed_mid_message(h2, no_errors_logged):
    before = h2.inspect(lambda: set(h2.h2.connections))
    peer = RawPeer(h2.address)
    msg = body_request(chat("z" * 50000), authorization=ALICE).SerializeToString()
    prefixed = b"\x00" + len(msg).to_bytes(4, "big") + msg
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block(PROCESS))
              + frame(DATA, 0, 1, prefixed[:16000]) + frame(DATA, 0, 1, prefixed[16000:30000]))
    ours = wait_until(lambda: h2.inspect(lambda: [c for c in h2.h2.connections
                                                  if c not in before and c.calls]), what="the call open")
    assert len(ours) == 1
    peer.close()
    wait_until(lambda: h2.inspect(lambda: ours[0] not in h2.h2.connections), what="the connection gone")
    assert_still_serving(h2)


def test_random_corruption_never_breaks_the_server(h2, no_errors_logged):
    """A valid ext_proc exchange with bytes flipped, cut or repeated: every run ends with an
    answer or a closed connection, never an internal error or a hang."""
    rng = random.Random(1234)
    msg = body_request(chat(), authorization=ALICE).SerializeToString()
    for i in range(150):
        peer = RawPeer(h2.address, preface=False)
        good = bytearray(PREFACE + frame(SETTINGS, 0, 0)
                         + frame(HEADERS, END_HEADERS, 1, peer.request_block(PROCESS))
                         + frame(DATA, END_STREAM, 1, b"\x00" + len(msg).to_bytes(4, "big") + msg))
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(good))
            op = rng.random()
            if op < 0.6:
                good[at] = rng.randrange(256)
            elif op < 0.8:
                del good[at:at + rng.randint(1, 20)]
            else:
                good[at:at] = good[at:at + rng.randint(1, 30)]
        peer.send(bytes(good))
        peer.sock.shutdown(socket.SHUT_WR)
        peer.read_until(lambda frames: False)   # EOF: the server closed its side
        peer.close()
    assert_still_serving(h2)


def test_oversize_message_is_refused_without_buffering(h2, no_errors_logged):
    peer = RawPeer(h2.address)
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block(PROCESS))
              + frame(DATA, 0, 1, b"\x00\x7f\xff\xff\xff" + b"x" * 100))
    assert not peer.read_until(_stream_ended(1))
    trailers = [p for k, f, s, p in peer.frames() if k == HEADERS and s == 1]
    assert dict(hpack.Decoder().decode(trailers[-1]))["grpc-status"] == "8"   # RESOURCE_EXHAUSTED
    peer.close()
    assert_still_serving(h2)


# ---------------------------------------------------------------- limits: streams, windows, output

def _settings_of(peer: RawPeer) -> tuple[dict[int, int], int]:
    """The server's first SETTINGS and the connection WINDOW_UPDATE sent with it."""
    peer.read_until(lambda frames: any(k == SETTINGS and not f for k, f, _, _ in frames)
                    and any(k == WINDOW and not s for k, _, s, _ in frames))
    payload = next(p for k, f, _, p in peer.frames() if k == SETTINGS and not f)
    settings = {int.from_bytes(payload[i:i + 2], "big"): int.from_bytes(payload[i + 2:i + 6], "big")
                for i in range(0, len(payload), 6)}
    updates = [int.from_bytes(p, "big") for k, _, s, p in peer.frames() if k == WINDOW and s == 0]
    return settings, sum(updates)


def _partial(sid: int, sent: int, claimed: int = 65530) -> bytes:
    """DATA frames with the first ``sent`` bytes of a ``claimed``-byte gRPC message."""
    data = (b"\x00" + claimed.to_bytes(4, "big") + b"x" * claimed)[:sent]
    return b"".join(frame(DATA, 0, sid, data[i:i + 16384]) for i in range(0, len(data), 16384))


def _resets(peer: RawPeer) -> dict[int, int]:
    return {s: int.from_bytes(p, "big") for k, _, s, p in peer.frames() if k == RST}


@pytest.mark.parametrize("limits", [{}, TIGHT], ids=["defaults", "tight"])
def test_settings_advertise_the_limits(limits):
    srv = ServerThread(None, null=True, **limits)
    try:
        peer = RawPeer(srv.address)
        settings, window = _settings_of(peer)
        peer.close()
    finally:
        srv.stop()
    assert settings[0x3] == limits.get("max_streams", MAX_STREAMS)        # MAX_CONCURRENT_STREAMS
    assert settings[0x4] == limits.get("stream_window", STREAM_WINDOW)    # INITIAL_WINDOW_SIZE
    assert settings[0x2] == 0                                              # ENABLE_PUSH
    assert 65535 + window == limits.get("connection_window", CONNECTION_WINDOW)


@pytest.mark.parametrize("limits", [{"max_streams": 0}, {"stream_window": 1024},
                                    {"stream_window": 1 << 20, "connection_window": 1 << 19},
                                    {"connection_window": 1 << 31}])
def test_limits_out_of_range_are_config_errors(limits):
    with pytest.raises(ConfigError):
        H2Server(None, **limits)


def test_streams_over_the_limit_are_refused_the_others_answered(tight, no_errors_logged):
    peer = RawPeer(tight.address)
    sids = [1 + 2 * i for i in range(TIGHT["max_streams"])]
    msg = b"\x00\x00\x00\x00\x03abc"
    for sid in sids:   # open, one message each, not half-closed: all 8 stay open
        peer.send(frame(HEADERS, END_HEADERS, sid, peer.request_block(PROCESS)) + frame(DATA, 0, sid, msg))
    assert not peer.read_until(lambda frames: {s for k, _, s, _ in frames if k == DATA} == set(sids))
    assert tight.open_streams() == len(sids)
    over = sids[-1] + 2
    peer.send(frame(HEADERS, END_HEADERS, over, peer.request_block(PROCESS))
              + frame(DATA, END_STREAM, over, msg))
    assert not peer.read_until(lambda frames: over in _resets(peer))
    assert _resets(peer) == {over: REFUSED_STREAM}
    for sid in sids:   # the 8 go on: another message each, then the end of the client's side
        peer.send(frame(DATA, 0, sid, msg) + frame(DATA, END_STREAM, sid, b""))
    for sid in sids:
        assert not peer.read_until(_stream_ended(sid))
        trailers = [p for k, f, s, p in peer.frames() if k == HEADERS and s == sid and f & END_STREAM]
        assert dict(hpack.Decoder().decode(trailers[0]))["grpc-status"] == "0"
        assert len([k for k, _, s, _ in peer.frames() if k == DATA and s == sid]) == 2
    _health_request(peer, over + 2)   # with the 8 closed there is room again
    assert not peer.read_until(_stream_ended(over + 2))
    assert not [k for k, _, _, _ in peer.frames() if k == GOAWAY]
    assert _resets(peer) == {over: REFUSED_STREAM}
    peer.close()
    assert tight.open_streams() == 0


def test_grpcio_keeps_to_our_limits(tight):
    """40 calls at once on one connection limited to 8 streams, each sending 90 KB in 3
    messages through a 64 KiB stream / 192 KiB connection window: grpcio queues the streams
    our SETTINGS do not allow, and the windows come back as messages are consumed (no stall)."""
    async def run() -> list[list[bytes]]:
        async with grpc.aio.insecure_channel(tight.address,
                                             options=[("grpc.use_local_subchannel_pool", 1)]) as ch:
            method = ch.stream_stream(PROCESS)
            assert [r async for r in method(iter([b"warm"]), timeout=TIMEOUT)] == [NullProcessCall.EMPTY]

            async def one(i: int) -> list[bytes]:
                return [r async for r in method(iter([bytes([i]) * 30000] * 3), timeout=TIMEOUT)]
            return await asyncio.gather(*(one(i) for i in range(40)))

    results = asyncio.run(run())
    assert len(results) == 40 and all(len(r) == 3 for r in results)
    tight.assert_windows_account()


def test_data_beyond_a_stream_window_resets_that_stream_only(tight, no_errors_logged):
    peer = RawPeer(tight.address)
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block(PROCESS))
              + _partial(1, 65435)                 # a message not yet whole: the stream window is 100 short
              + frame(DATA, 0, 1, b"y" * 200))     # 100 more than it allows
    assert not peer.read_until(lambda frames: 1 in _resets(peer))
    assert _resets(peer) == {1: FLOW_CONTROL_ERROR}
    _health_request(peer, 3)                       # the connection goes on
    assert not peer.read_until(_stream_ended(3))
    assert not [k for k, _, _, _ in peer.frames() if k == GOAWAY]
    tight.assert_windows_account()
    peer.close()


def test_data_beyond_the_connection_window_is_a_connection_error(tight, no_errors_logged):
    peer = RawPeer(tight.address)
    for sid in (1, 3, 5):   # 3 x 65,000 partial bytes, each within its stream's window: 195,000 held
        peer.send(frame(HEADERS, END_HEADERS, sid, peer.request_block(PROCESS)) + _partial(sid, 65000))
    peer.send(frame(HEADERS, END_HEADERS, 7, peer.request_block(PROCESS))
              + _partial(7, 2000))   # 197,000 > 196,608
    peer.expect_closed(FLOW_CONTROL_ERROR)
    peer.close()
    assert_still_serving_null(tight)


def test_partial_messages_of_reset_streams_give_their_window_back(tight, no_errors_logged):
    """Envoy resets an ext_proc stream whose client went away, maybe mid-message: those bytes
    must go back to the connection window, or after a few such resets it would stall. The
    same for a client that ends its side mid-message."""
    peer = RawPeer(tight.address)
    for sid in range(1, 40, 2):   # 20 x 60,000 bytes, six times the connection window
        end = (frame(RST, 0, sid, (8).to_bytes(4, "big")) if sid % 4 == 1     # CANCEL
               else frame(DATA, END_STREAM, sid, b""))
        peer.send(frame(HEADERS, END_HEADERS, sid, peer.request_block(PROCESS)) + _partial(sid, 60000) + end)
    _health_request(peer, 41)
    assert not peer.read_until(_stream_ended(41))
    assert not [k for k, _, _, _ in peer.frames() if k in (GOAWAY, RST)]
    assert all(_stream_ended(sid)(peer.frames()) for sid in range(3, 40, 4))
    assert sum(int.from_bytes(p, "big") for k, _, s, p in peer.frames() if k == WINDOW and s == 0) \
        >= 20 * 60000 - TIGHT["connection_window"]
    tight.assert_windows_account()
    peer.close()


def test_a_stream_that_used_its_window_on_a_partial_message_gets_it_back(tight, no_errors_logged):
    """A whole message (consumed, but under half the window: no update yet), then the start of
    a big one that uses the rest: the peer may send no more until we give back the first's
    bytes, so they must come back then, not only after another message completes."""
    peer = RawPeer(tight.address)
    first = b"\x00" + (29995).to_bytes(4, "big") + b"a" * 29995             # 30,000 bytes
    peer.send(frame(HEADERS, END_HEADERS, 1, peer.request_block(PROCESS))
              + frame(DATA, 0, 1, first[:16384]) + frame(DATA, 0, 1, first[16384:])
              + _partial(1, 65535 - 30000))                                 # the window used up
    assert not peer.read_until(lambda frames: any(k == WINDOW and s == 1 for k, _, s, _ in frames))
    given = sum(int.from_bytes(p, "big") for k, _, s, p in peer.frames() if k == WINDOW and s == 1)
    assert given == 30000
    rest = (b"\x00" + (65530).to_bytes(4, "big") + b"x" * 65530)[65535 - 30000:]
    peer.send(b"".join(frame(DATA, 0, 1, rest[i:i + 16384]) for i in range(0, len(rest), 16384))
              + frame(DATA, END_STREAM, 1, b""))
    assert not peer.read_until(_stream_ended(1))
    assert len([k for k, _, s, _ in peer.frames() if k == DATA and s == 1]) == 2
    assert not [k for k, _, _, _ in peer.frames() if k in (GOAWAY, RST)]
    peer.close()


def assert_still_serving_null(srv: ServerThread) -> None:
    assert health_check(srv.address) == health_pb2.HealthCheckResponse.SERVING
    with channel(srv.address) as ch:
        assert list(ch.stream_stream(PROCESS)(iter([b"x"]), timeout=TIMEOUT)) == [NullProcessCall.EMPTY]


def test_recv_window_gives_back_once_half_is_used():
    w = RecvWindow(100)
    assert w.take(40) and w.give_back(40) == 0        # 60 left: no update yet
    assert w.take(20) and w.give_back(0) == 40        # 40 left: the 40 consumed go back, 20 held
    assert w.left == 80 and w.give_back(20) == 0      # 80 left: no update yet
    assert w.take(70) and w.give_back(0) == 20        # 70 held (a partial message): the rest back
    assert w.left == 30 and w.give_back(70) == 70 and w.left == 100
    assert w.take(100) and not w.take(1)              # one byte more than allowed


def test_a_peer_that_does_not_read_is_not_read_either(h2, no_errors_logged):
    """10,000 requests for an unknown method (16 bytes each once its name is indexed, a
    1 KB UNIMPLEMENTED answer each) from a peer that reads nothing: once WRITE_HIGH of
    answers wait, the server stops reading it instead of queueing 10 MB for it."""
    n = 10000
    peer = RawPeer(h2.address, preface=False, rcvbuf=4096)
    peer.sock.settimeout(TIMEOUT)
    path = "/no.such.Service/" + "m" * 1000
    blob = bytearray(PREFACE + frame(SETTINGS, 0, 0))
    for i in range(n):
        blob += frame(HEADERS, END_HEADERS | END_STREAM, 1 + 2 * i, peer.request_block(path))
    sender = threading.Thread(target=peer.sock.sendall, args=(bytes(blob),), daemon=True)
    sender.start()
    paused = wait_until(lambda: h2.inspect(lambda: [(c.transport.get_write_buffer_size(), len(c.inbuf),
                                                    c.last_sid) for c in h2.h2.connections if c.paused]),
                        what="the server stopped reading")
    assert len(paused) == 1
    queued, inbuf, last_sid = paused[0]
    assert queued <= WRITE_HIGH + FLUSH_AT + 2048
    assert inbuf <= 1 << 20
    assert last_sid < 2 * n - 1, "it read every request anyway"
    ended, pos, buf = 0, 0, bytearray()   # now read: every request gets its answer
    deadline = time.monotonic() + TIMEOUT
    while ended < n and time.monotonic() < deadline:
        chunk = peer.sock.recv(1 << 20)
        assert chunk, f"closed after {ended} answers"
        buf += chunk
        while len(buf) - pos >= 9:
            end = pos + 9 + int.from_bytes(buf[pos:pos + 3], "big")
            if end > len(buf):
                break
            ended += buf[pos + 3] == HEADERS and bool(buf[pos + 4] & END_STREAM)
            pos = end
        del buf[:pos]
        pos = 0
    assert ended == n
    sender.join(TIMEOUT)
    assert not sender.is_alive()
    peer.close()
    assert_still_serving(h2)


# ---------------------------------------------------------------- SIGTERM through the CLI

def _refused(address: str) -> bool:
    """True once nothing accepts connections on ``address`` any more: refused, or reset
    (a connect that reached the backlog of the listener as it closed). A connect that
    times out is not yet either: the draining server no longer accepts, so these probes
    fill the listener's backlog until it closes, and the kernel drops the next SYN."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except (ConnectionRefusedError, ConnectionResetError):
        return True
    except TimeoutError:
        pass   # the backlog is full: not closed yet
    return False


NO_HANDOVER = ["--drain-handover-s", "0"]   # the drain itself (the handover: test_handover.py)


def test_sigterm_drains_an_open_stream_and_exits_0(state, tmp_path):
    _, path = state
    log = tmp_path / "extproc.log"
    with extproc_process(tmp_path, path, extproc_args=NO_HANDOVER) as (address, proc):
        release = threading.Event()

        def messages():
            yield headers_request("/v1/chat/completions", authorization=ALICE)
            assert release.wait(TIMEOUT)
            yield plain_body(chat())

        with channel(address) as ch:
            call = pb_grpc.ExternalProcessorStub(ch).Process(messages(), timeout=TIMEOUT)
            assert next(call).HasField("request_headers")
            proc.send_signal(signal.SIGTERM)
            wait_until(lambda: _refused(address), what="the listener closed by SIGTERM")
            assert proc.poll() is None, "exited with a stream open"
            release.set()
            rest = list(call)
            assert len(rest) == 1 and rest[0].request_body.response.body_mutation.body
        assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()


def test_sigterm_drain_is_bounded(state, tmp_path):
    _, path = state
    log = tmp_path / "extproc.log"
    with extproc_process(tmp_path, path, extproc_args=NO_HANDOVER) as (address, proc):
        release = threading.Event()

        def messages():
            yield headers_request("/v1/chat/completions", authorization=ALICE)
            release.wait(TIMEOUT)

        with channel(address) as ch:
            call = pb_grpc.ExternalProcessorStub(ch).Process(messages(), timeout=TIMEOUT)
            assert next(call).HasField("request_headers")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=TIMEOUT) == 0, log.read_text()
            # the 5 s grace ran out and the stream was cut (not a hang until the client gave up)
            assert "still open after 5.0s, cutting them" in log.read_text()
            with pytest.raises(grpc.RpcError):
                list(call)
            release.set()


def _not_utf8_key() -> bytes:
    """The one-message request of a client that sent ``Authorization: Bearer \xc3\xff``:
    Envoy copies the header's bytes into the attribute, a proto string, as they are."""
    raw = body_request(chat(), authorization="Bearer @@").SerializeToString()
    assert raw.count(b"Bearer @@") == 1
    return raw.replace(b"Bearer @@", b"Bearer \xc3\xff")


def _refused_400(answers: list[bytes]) -> dict:
    assert len(answers) == 1
    reply = pb.ProcessingResponse.FromString(answers[0]).immediate_response
    assert reply.status.code == 400
    return json.loads(reply.body)["error"]


@pytest.mark.parametrize("raw", [_not_utf8_key(), b"\xff\xff\xff"], ids=["key not utf-8", "garbage"])
def test_a_message_that_does_not_parse_is_refused_with_a_400(h2, aio, no_errors_logged, raw):
    """Not the call's INTERNAL, which a fail-closed Envoy turns into a 503 (a client's odd
    header is not the gateway being down); the same on the h2 and grpc.aio servers."""
    for address in (h2.address, aio):
        with channel(address) as ch:
            answers = list(ch.stream_stream(PROCESS)(iter([raw]), timeout=TIMEOUT))
        assert _refused_400(answers)["code"] == "invalid_header_encoding"
    assert_still_serving(h2)


# ---------------------------------------------------------------- endpoint picker protocol

@pytest.fixture(scope="module")
def epp_servers(state):
    """``--protocol epp --secure-serving false`` on each flavour, through the CLI."""
    tmp, path = state
    with contextlib.ExitStack() as stack:
        addresses = {}
        for flavour in ("h2", "aio", "threads"):
            port = free_port()
            log = tmp / f"epp-{flavour}.log"
            cmd = [python(), "-m", "extproc", "--server", flavour, "--protocol", "epp",
                   "--secure-serving", "false", "--config", str(path),
                   "--db", str(tmp / f"epp-{flavour}.sqlite3"), "--listen", f"127.0.0.1:{port}",
                   "--metrics-listen", "off", "--health-listen", "off"]
            addresses[flavour] = (port, stack.enter_context(running(cmd, log)), log)
        for port, proc, log in addresses.values():
            wait_port(port, timeout=30, proc=proc, log=log)
        yield {flavour: f"127.0.0.1:{port}" for flavour, (port, _, _) in addresses.items()}


def _duplex(msg: pb.ProcessingRequest) -> pb.ProcessingRequest:
    msg.protocol_config.request_body_mode = msg.protocol_config.response_body_mode = 4  # FULL_DUPLEX_STREAMED
    return msg


def _part(body: bytes, end: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body={"body": body, "end_of_stream": end})


_BIG = chat("z" * 130_000, lora_name="code-python")
EPP_EXCHANGES = {
    "chat in three parts": [_duplex(headers_request("/v1/chat/completions", authorization=ALICE)),
                            _part(_BIG[:1000], False), _part(_BIG[1000:70_000], False), _part(_BIG[70_000:], True),
                            pb.ProcessingRequest(response_headers={}),
                            pb.ProcessingRequest(response_body={"body": b"data: x\n\n", "end_of_stream": True})],
    "bad key": [_duplex(headers_request("/v1/chat/completions", authorization="Bearer sk-no"))],
    "GET other path": [_duplex(headers_request("/v1/models", "GET", True, authorization=ALICE))],
    "buffered": [headers_request("/v1/chat/completions", authorization=BOB), plain_body(chat(lora_name="code-python"))],
}


@pytest.mark.parametrize("name", list(EPP_EXCHANGES))
def test_epp_same_answers_on_every_flavour(epp_servers, name):
    answers = {flavour: _same_but_execution_ids(process(address, EPP_EXCHANGES[name]))
               for flavour, address in epp_servers.items()}
    assert answers["h2"] == answers["aio"] == answers["threads"]
    assert answers["h2"]


@pytest.mark.parametrize("service", ["", "liveness", "readiness", SERVICE])
def test_epp_health_services_on_every_flavour(epp_servers, service):
    for address in epp_servers.values():
        assert health_check(address, service) == health_pb2.HealthCheckResponse.SERVING


def test_epp_refuses_a_message_that_does_not_parse_on_every_flavour(epp_servers):
    for address in epp_servers.values():
        with channel(address) as ch:
            answers = list(ch.stream_stream(PROCESS)(iter([_not_utf8_key()]), timeout=TIMEOUT))
        assert _refused_400(answers)["code"] == "invalid_header_encoding"
