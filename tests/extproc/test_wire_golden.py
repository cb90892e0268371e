"""The h2 server's wire answers, byte for byte, for fixture ext_proc requests.

Each case is one ext_proc stream as Envoy sends it (``bench.gateway_profile.Feed``: HEADERS
+ the DATA frame holding the ``ProcessingRequest``, then DATA(END_STREAM) + RST_STREAM),
fed twice on one connection (the second stream answers from the caches: HPACK ``:path``,
metadata, trace, header names). What the connection writes for each is compared with
``fixtures/wire_golden.json``, recorded from the code before the request path was made
cheaper (docs/gateway.md, "Speed"): the frames, the HPACK blocks, the protobuf bytes of
the answer (body mutation, header mutation, dynamic metadata with the trace headers'
values, immediate responses with their JSON errors) must not change. The one freedom is
the order of map entries (the dynamic metadata's ``Struct``): protobuf leaves it unset and
upb's differs from one process to the next, so entries are compared sorted (``canonical``).

A deliberate change of an answer re-records the file:
``python -m tests.extproc.test_wire_golden --write`` (and says why in the commit).
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from bench.gateway_overhead import _chat_body
from bench.gateway_profile import Feed
from extproc.app.context import Gateway
from extproc.state.residency import ResidencyBoard, ResidencySnapshot, TierReport
from extproc.state.store import Store
from extproc.protocols.wire import pb
from tests.extproc.builders import KEYS, upstream, write_state

GOLDEN = Path(__file__).parent / "fixtures" / "wire_golden.json"
_ATTRS = "envoy.filters.http.ext_proc"


def _body_message(body: bytes, key: str | None, path: str = "/v1/chat/completions",
                  method: str = "POST", **headers: str) -> bytes:
    """A one-message route's ``ProcessingRequest``: the body and the request attributes."""
    m = pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))
    m.metadata_context.SetInParent()
    attrs = m.attributes[_ATTRS].fields
    attrs["request.url_path"].string_value = path
    attrs["request.method"].string_value = method
    if key is not None:
        attrs["request.headers['authorization']"].string_value = f"Bearer {key}"
    for name, value in headers.items():
        attrs[f"request.headers['{name.replace('_', '-')}']"].string_value = value
    m.protocol_config.request_body_mode = 2     # BUFFERED
    return m.SerializeToString()


def _headers_message(path: str, method: str, key: str | None, end_of_stream: bool, *more: tuple[str, str]) -> bytes:
    m = pb.ProcessingRequest()
    hs = m.request_headers.headers.headers
    for k, v in ((":path", path), (":method", method), ("host", "ace"), *more):
        hs.add(key=k, raw_value=v.encode())
    if key is not None:
        hs.add(key="authorization", raw_value=f"Bearer {key}".encode())
    m.request_headers.end_of_stream = end_of_stream
    return m.SerializeToString()


def _chat(**fields) -> bytes:
    body = {"model": "ace-tiny-llama", "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


# name -> (state flavour, message)
CASES = {
    "bench_body_alice": ("body", _body_message(_chat_body(), KEYS["alice"])),
    "adapter_by_model_bob": ("body", _body_message(_chat(model="code-python", max_tokens=8), KEYS["bob"])),
    "adapter_header_hints": ("headers", _body_message(_chat(lora_name="code-python"), KEYS["bob"])),
    "client_hint_fields_dropped": ("body", _body_message(
        _chat(lora_name="code-python", lora_prefetch=True, extra_body={"vram_allocated_mb": 3}), KEYS["bob"])),
    "base_model_untouched": ("body", _body_message(_chat(), KEYS["bob"])),
    "shadow_carol": ("body", _body_message(_chat(temperature=0.5), KEYS["carol"])),
    "skill_override_header": ("body", _body_message(
        _chat(), KEYS["alice"], x_ace_skill_override="multi_lora=off,dynamic_lora_prefetch=prod")),
    "resident_on_device": ("resident", _body_message(_chat(lora_name="code-python"), KEYS["alice"])),
    "execute_request": ("body", _body_message(
        json.dumps({"target": {"model": "code-python"}, "input": {"messages": [{"role": "user", "content": "x"}]},
                    "extra_body": {"max_tokens": 4}}).encode(), KEYS["alice"], path="/v1/execute")),
    "no_key_401": ("body", _body_message(_chat(), None)),
    "wrong_key_401": ("body", _body_message(_chat(), "sk-nope")),
    "unknown_adapter_404": ("body", _body_message(_chat(lora_name="nope"), KEYS["bob"])),
    "other_tenants_adapter_404": ("body", _body_message(_chat(lora_name="globex-secret"), KEYS["alice"])),
    "invalid_json_400": ("body", _body_message(b'{"model": ', KEYS["bob"])),
    "not_an_object_400": ("body", _body_message(b"[1, 2]", KEYS["bob"])),
    "big_integer_422": ("body", _body_message(b'{"model": "ace-tiny-llama", "adapter_rank": 123456789012345678901234}',
                                               KEYS["bob"])),
    "too_large_413": ("body", _headers_message("/v1/chat/completions", "POST", KEYS["bob"], False,
                                               ("content-length", "70000"))),
    "get_not_allowed_405": ("body", _body_message(_chat(), KEYS["bob"], method="GET")),
    "headers_phase_models": ("body", _headers_message("/v1/models", "GET", KEYS["bob"], True)),
    "headers_phase_engine_admin_404": ("body", _headers_message("/v1/load_lora_adapter", "POST", KEYS["bob"], False)),
    "headers_phase_chat": ("body", _headers_message("/v1/chat/completions", "POST", KEYS["bob"], False)),
}


def _gateway(flavour: str, tmp: Path) -> tuple[Gateway, Store]:
    hints = "headers" if flavour == "headers" else "body"
    state = write_state(tmp / flavour, [upstream("bench-upstream", "127.0.0.1:9", "vllm", hints)])
    store = Store(state, tmp / f"{flavour}.sqlite3")
    board = ResidencyBoard()
    if flavour == "resident":
        board.publish(ResidencySnapshot.build({"bench-upstream": {
            "code-python": TierReport("device", 12.5, bytes=3 << 20, prefetched=True, base_model_bytes=1 << 30)}}))
    return Gateway(store, residency=board), store


def _fields(buf: bytes) -> list[tuple[int, int, bytes, bytes]]:
    """Top-level protobuf fields: (number, wire type, tag + length bytes, payload)."""
    out, i = [], 0
    while i < len(buf):
        start = i
        tag, i = _varint(buf, i)
        number, kind = tag >> 3, tag & 7
        if kind == 2:
            size, i = _varint(buf, i)
        elif kind == 0:
            _, end = _varint(buf, i)
            size = end - i
        else:
            raise ValueError(f"wire type {kind} not expected in an answer")
        head = buf[start:i]
        out.append((number, kind, head, buf[i:i + size]))
        i += size
    return out


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _struct(buf: bytes) -> list:
    """A ``google.protobuf.Struct``'s entries sorted, nested Structs (Value.struct_value) too."""
    entries = []
    for number, _, head, entry in _fields(buf):
        parts = []
        for n, _, h, payload in _fields(entry):
            if n == 2:   # the entry's Value: a nested Struct is field 5
                value = [[h.hex()] + ([5, hh.hex(), _struct(p)] if nn == 5 else [hh.hex() + p.hex()])
                         for nn, _, hh, p in _fields(payload)]
                parts.append([n, value])
            else:
                parts.append([n, (h + payload).hex()])
        entries.append([number, head.hex(), parts])
    return sorted(entries, key=json.dumps)


def canonical(written: bytes) -> list:
    """The frames written, each DATA frame's gRPC message split into its top-level fields,
    ``dynamic_metadata`` (field 8) as its sorted entries; every other byte as it was."""
    frames, i = [], 0
    while i < len(written):
        size = int.from_bytes(written[i:i + 3], "big")
        head, payload = written[i:i + 9], written[i + 9:i + 9 + size]
        i += 9 + size
        if head[3] == 0 and len(payload) >= 5:   # DATA: one whole gRPC message here
            fields = [[n, h.hex(), _struct(p) if n == 8 else p.hex()] for n, _, h, p in _fields(payload[5:])]
            frames.append([head.hex(), payload[:5].hex(), fields])
        else:
            frames.append([head.hex(), payload.hex()])
    return frames


def answers() -> dict[str, list]:
    """Each case's writes (``canonical``) for its first and second stream on one connection."""
    out: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory(prefix="ace-golden-") as tmp_s:
        tmp = Path(tmp_s)
        gateways = {flavour: _gateway(flavour, tmp) for flavour in ("body", "headers", "resident")}
        try:
            for name, (flavour, message) in CASES.items():
                feed = Feed(gateways[flavour][0])
                written: list[bytes] = []
                feed.transport.write = written.append
                streams = []
                for _ in range(2):
                    first, close = feed.stream(message)
                    feed.conn.data_received(first)
                    feed.conn.data_received(close)
                    streams.append(canonical(b"".join(written)))
                    written.clear()
                out[name] = streams
        finally:
            for _, store in gateways.values():
                store.close()
    return out


@pytest.fixture(scope="module")
def recorded() -> tuple[dict, dict]:
    return answers(), json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("case", sorted(CASES))
def test_wire_answer_is_the_recorded_one(case, recorded):
    now, golden = recorded
    assert now[case] == golden[case]


def test_every_case_is_recorded(recorded):
    assert sorted(recorded[1]) == sorted(CASES)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python -m tests.extproc.test_wire_golden --write")
    GOLDEN.write_text(json.dumps(answers(), sort_keys=True).replace('], "', '],\n "') + "\n")
    print(f"wrote {GOLDEN}")
