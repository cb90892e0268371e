"""The ext_proc's per-stream cost in-process: no Envoy, no sockets, one thread.

    python -m bench.gateway_profile [--streams 20000] [--sections] [--cprofile 30]   # from the repo root

Feeds an ``extproc.transport.h2server.H2Connection`` (with a transport that only counts writes) the
bytes Envoy 1.40 sends for one request on the shipped config, as recorded on its ext_proc
connection: one read with HEADERS + the one DATA frame holding the ``ProcessingRequest``
(``request_body`` with the body, ``end_of_stream``, an empty ``metadata_context``, the
three ``request_attributes`` and ``protocol_config``), and, once the answer is out, one
read with an empty DATA(END_STREAM) + RST_STREAM(CANCEL). So it times the same code the
server runs per stream: frame parsing, HPACK, the message, ``Exchange``, the answer, its
frames. Two servers: ``null`` (``bench.gateway_overhead``'s do-nothing ext_proc, the same
loop answering an empty response) and ``gateway`` (the state ``make bench-gateway`` uses,
2 KB body, key ``alice``: adapter applied, body rewritten, 5 metadata keys).

``warm``: streams back to back. ``cold``: 8 MiB of memory written between streams, which
evicts the caches the way Envoy, the upstream and the load generator do between two
requests at c=1 (the gateway's ext_proc CPU per request at c=1 in ``make bench-gateway``
sits near the cold figure, at c=8 between the two). ``--sections`` times each step of
the body message (wrapping the functions the processor calls; each wrapper adds
~0.1 µs), ``--cprofile N`` prints the N functions with the most own time.
``--instructions`` counts the instructions per stream of both servers under valgrind's
callgrind (only the streams, not the start-up: collected inside one ``functools.reduce``):
unlike the timings, the count does not move with what else runs on a shared CPU.
"""
from __future__ import annotations

import argparse
import cProfile
import functools
import json
import pstats
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from hpack import Encoder

import extproc.transport.dispatch as dispatch
import extproc.transport.h2calls as h2calls
import extproc.app.handlers as handlers
import extproc.app.exchange as exchange
import extproc.app.inference as inference
import extproc.rewrite as rewrite
from bench.gateway_overhead import _chat_body
from extproc.transport.h2frames import DATA, END_HEADERS, END_STREAM, HEADERS, PREFACE, RST, SETTINGS, WINDOW, frame
from extproc.transport.h2server import H2Connection, H2Server
from extproc.app.context import Gateway
from extproc.state.store import Store
from extproc.protocols.wire import SERVICE, pb
from tests.extproc.builders import KEYS, upstream, write_state

# what Envoy sends as the ext_proc stream's request headers (Envoy's blocks, like the
# hpack encoder's here, repeat from the second stream on, so the h2 loop's block cache hits)
_ENVOY_HEADERS = [(":method", "POST"), (":path", f"/{SERVICE}/Process"), (":authority", "ace_extproc"),
                  (":scheme", "http"), ("te", "trailers"), ("content-type", "application/grpc"),
                  ("x-envoy-internal", "true"), ("x-forwarded-for", "192.0.2.2")]
_CANCEL = (8).to_bytes(4, "big")


class CountingTransport:
    def __init__(self) -> None:
        self.writes = 0

    def write(self, data: bytes) -> None:
        self.writes += 1

    def set_write_buffer_limits(self, high: int) -> None:
        pass

    def get_extra_info(self, name: str):
        return ("127.0.0.1", 0)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    pause_reading = resume_reading = close


def envoy_message(body: bytes, key: str) -> bytes:
    """The ``ProcessingRequest`` of the one-message route, as Envoy lays it out."""
    m = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    m.metadata_context.SetInParent()
    attrs = m.attributes["envoy.filters.http.ext_proc"].fields
    attrs["request.url_path"].string_value = "/v1/chat/completions"
    attrs["request.method"].string_value = "POST"
    attrs["request.headers['authorization']"].string_value = f"Bearer {key}"
    m.protocol_config.request_body_mode = 2     # BUFFERED
    return m.SerializeToString()


class Feed:
    """One connection and the reads of successive streams on it."""

    def __init__(self, gateway: Gateway | None) -> None:
        self.conn = H2Connection(H2Server(gateway, null=gateway is None))
        self.transport = CountingTransport()
        self.conn.connection_made(self.transport)
        self.encoder = Encoder()
        self.sid = 1
        self.conn.data_received(PREFACE + frame(SETTINGS, 0, 0) + frame(WINDOW, 0, 0, (1 << 30).to_bytes(4, "big")))
        self.conn.data_received(frame(SETTINGS, 1, 0))

    def stream(self, message: bytes) -> tuple[bytes, bytes]:
        """(HEADERS + DATA, DATA(END_STREAM) + RST_STREAM) of the next stream."""
        sid, self.sid = self.sid, self.sid + 2
        block = self.encoder.encode(_ENVOY_HEADERS)
        grpc = b"\x00" + len(message).to_bytes(4, "big") + message
        return (frame(HEADERS, END_HEADERS, sid, block) + frame(DATA, 0, sid, grpc),
                frame(DATA, END_STREAM, sid) + frame(RST, 0, sid, _CANCEL))


_EVICT = bytearray(8 << 20)


def evict() -> None:
    _EVICT[::64] = bytes(len(_EVICT) // 64)


def run(feed: Feed, message: bytes, n: int, cold: bool) -> dict:
    streams = [feed.stream(message) for _ in range(n)]
    writes0 = feed.transport.writes
    clock = time.perf_counter_ns
    msg_ns, close_ns = [], []
    for first, close in streams:
        if cold:
            evict()
        feed.conn.conn_window = 1 << 30      # no peer here to send WINDOW_UPDATE
        t0 = clock()
        feed.conn.data_received(first)
        t1 = clock()
        feed.conn.data_received(close)
        msg_ns.append(t1 - t0)
        close_ns.append(clock() - t1)
    msg_ns.sort()
    close_ns.sort()
    return {"message_us_p50": round(msg_ns[n // 2] / 1e3, 2), "close_us_p50": round(close_ns[n // 2] / 1e3, 2),
            "message_us_p90": round(msg_ns[n * 9 // 10] / 1e3, 2),
            "writes_per_stream": round((feed.transport.writes - writes0) / n, 2)}


# (module, function, label): what --sections wraps, outermost last
_SECTIONS = [
    (dispatch, "head_from_attributes", "head from attributes"),
    (handlers, "authenticate", "authenticate (SHA-256)"),
    (inference, "parse_object", "JSON parse"),
    (inference, "decide", "decide"),
    (rewrite, "encode", "JSON encode"),
    (inference, "rewrite_request", "rewrite (with JSON encode)"),
    (inference, "trace_metadata", "trace metadata"),
    (exchange.Exchange, "on_request_body", "Exchange.on_request_body (from authenticate to trace)"),
    (dispatch, "serialize_response", "response bytes"),
    (h2calls.Call, "send_message", "send_message (frames)"),
    (h2calls.ProcessCall, "on_message", "ProcessCall.on_message (parse to frames)"),
]


def sections(feed: Feed, message: bytes, n: int, cold: bool) -> dict[str, float]:
    """p50 µs of each step, timed by wrappers around what the processor and h2 call."""
    spent: dict[str, list[int]] = defaultdict(list)
    clock = time.perf_counter_ns
    patched = []

    def wrap(module, name: str, label: str) -> None:
        fn = getattr(module, name)

        def timed(*args, **kw):
            t0 = clock()
            try:
                return fn(*args, **kw)
            finally:
                spent[label].append(clock() - t0)
        patched.append((module, name, fn))
        setattr(module, name, timed)

    for module, name, label in _SECTIONS:
        wrap(module, name, label)
    try:
        streams = [feed.stream(message) for _ in range(n)]
        for first, close in streams:
            if cold:
                evict()
            feed.conn.conn_window = 1 << 30
            t0 = clock()
            feed.conn.data_received(first)
            spent["whole read (HEADERS + DATA)"].append(clock() - t0)
            feed.conn.data_received(close)
    finally:
        for module, name, fn in reversed(patched):
            setattr(module, name, fn)
    order = [label for *_, label in _SECTIONS] + ["whole read (HEADERS + DATA)"]
    return {label: round(sorted(spent[label])[len(spent[label]) // 2] / 1e3, 2) for label in order if spent[label]}


def count_streams(server: str, n: int) -> int:
    """Feed ``n`` streams inside one ``functools.reduce`` call (what ``--instructions``
    tells callgrind to count: --toggle-collect=functools_reduce); returns the writes."""
    with tempfile.TemporaryDirectory(prefix="ace-profile-") as tmp_s:
        tmp = Path(tmp_s)
        state = write_state(tmp, [upstream("bench-upstream", "127.0.0.1:9", "vllm", "body")])
        store = Store(state, tmp / "gw.sqlite3")
        feed = Feed(Gateway(store) if server == "gateway" else None)
        message = envoy_message(_chat_body(), KEYS["alice"])
        run(feed, message, 50, cold=False)            # warm-up: caches, first-use paths
        streams = [feed.stream(message) for _ in range(n)]
        conn = feed.conn

        def one(_, stream: tuple[bytes, bytes]) -> None:
            conn.conn_window = 1 << 30
            conn.data_received(stream[0])
            conn.data_received(stream[1])
        writes = feed.transport.writes
        functools.reduce(one, streams, None)
        store.close()
        if conn.calls or conn.broken:
            raise RuntimeError("a stream did not complete")
        return feed.transport.writes - writes


def instructions(n: int) -> dict[str, int]:
    """Instructions per stream of each server, each in its own process under callgrind."""
    out = {}
    with tempfile.TemporaryDirectory(prefix="ace-callgrind-") as tmp:
        for server in ("null", "gateway"):
            proc = subprocess.run(
                ["valgrind", "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                 f"--callgrind-out-file={tmp}/{server}.out", sys.executable, "-m", "bench.gateway_profile",
                 "--count-streams", server, str(n)], capture_output=True, text=True, check=True)
            collected = re.search(r"Collected : (\d+)", proc.stderr)
            if collected is None:
                raise RuntimeError(f"callgrind printed no count: {proc.stderr[-500:]}")
            out[server] = round(int(collected.group(1)) / n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=20000, help="streams per warm run (cold: a fifth)")
    p.add_argument("--sections", action="store_true", help="time each step of the body message")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the N top functions by own time")
    p.add_argument("--instructions", action="store_true",
                   help="instructions per stream of both servers under valgrind's callgrind (minutes)")
    p.add_argument("--count-streams", nargs=2, metavar=("SERVER", "N"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.count_streams:
        count_streams(a.count_streams[0], int(a.count_streams[1]))
        return 0
    if a.instructions:
        counts = instructions(500)
        counts["gateway_minus_null"] = counts["gateway"] - counts["null"]
        print(json.dumps({"instructions_per_stream": counts}, indent=2))
        return 0
    with tempfile.TemporaryDirectory(prefix="ace-profile-") as tmp_s:
        tmp = Path(tmp_s)
        state = write_state(tmp, [upstream("bench-upstream", "127.0.0.1:9", "vllm", "body")])
        store = Store(state, tmp / "gw.sqlite3")
        message = envoy_message(_chat_body(), KEYS["alice"])
        report: dict = {"message_bytes": len(message)}
        for name, gateway in (("null", None), ("gateway", Gateway(store))):
            feed = Feed(gateway)
            run(feed, message, 2000, cold=False)          # warm-up
            report[name] = {"warm": run(feed, message, a.streams, cold=False),
                            "cold": run(feed, message, max(1000, a.streams // 5), cold=True)}
        feed = Feed(Gateway(store))
        run(feed, message, 2000, cold=False)
        if a.sections:
            report["sections_warm"] = sections(feed, message, a.streams, cold=False)
            report["sections_cold"] = sections(feed, message, max(1000, a.streams // 5), cold=True)
        print(json.dumps(report, indent=2))
        if a.cprofile:
            streams = [feed.stream(message) for _ in range(a.streams)]
            prof = cProfile.Profile()
            prof.enable()
            for first, close in streams:
                feed.conn.conn_window = 1 << 30
                feed.conn.data_received(first)
                feed.conn.data_received(close)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(a.cprofile)
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
