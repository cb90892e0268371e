"""Golden wire answers: the ext_proc answers (the bytes the h2 server writes) and the trace
headers in them, byte for byte, for a fixed set of requests in both protocols.

Canonical form: each answer parsed and serialized again with ``deterministic=True`` (the
``Struct`` of the dynamic metadata is a protobuf map, whose byte order the runtime does
not fix from one process to the next); every other byte is the server's. The file
``golden/wire.json`` was recorded from the code before the layout of issue 19
moved the modules (commit 14224b5's behaviour); a refactor must leave every byte alone.
Regenerate only for an intended behaviour change:
``.venv/bin/python -m tests.extproc.test_golden_wire --write``.
"""
from __future__ import annotations

import base64
import json
import re
import sys
from pathlib import Path

import pytest
from google.protobuf import text_format

from extproc.fleet.agent_link import to_residency
from extproc.transport.dispatch import Dispatcher
from extproc.app.context import Gateway
from extproc.state.residency import ResidencySnapshot, TierReport
from extproc.state.store import Store
from extproc.protocols.wire import pb
from ace_common.proto.ace.agent.v1 import agent_pb2 as agent_pb
from tests.extproc.builders import KEYS, upstream, write_state

GOLDEN = Path(__file__).parent / "golden" / "wire.json"
#: /v1/execute's id is random: the canonical form writes a fixed one of the same length
_EXEC_ID = re.compile(rb"exec-[0-9a-f]{24}")
_FIXED_ID = b"exec-" + b"0" * 24
UPSTREAM_BODY = json.dumps({"id": "chatcmpl-1", "object": "chat.completion", "model": "code-python",
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                                         "finish_reason": "stop"}]}).encode()


def _headers(**h: str) -> pb.ProcessingRequest:
    m = pb.ProcessingRequest()
    for k, v in h.items():
        m.request_headers.headers.headers.add(key=k.replace("_", "-") if not k.startswith(":") else k,
                                             raw_value=v.encode())
    return m


def _req(path: str, key: str | None, body: bytes | None, method: str = "POST", **extra: str):
    h = {":path": path, ":method": method, **extra}
    if key is not None:
        h["authorization"] = f"Bearer {KEYS[key]}"
    m = pb.ProcessingRequest()
    for k, v in h.items():
        m.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    m.request_headers.end_of_stream = body is None
    msgs = [m]
    if body is not None:
        msgs.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    return msgs


def _response(body: bytes = UPSTREAM_BODY, served: str | None = None) -> list[pb.ProcessingRequest]:
    m = pb.ProcessingRequest()
    m.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    if served is not None:
        m.metadata_context.filter_metadata["envoy.lb"].fields[
            "x-gateway-destination-endpoint-served"].string_value = served
    return [m, pb.ProcessingRequest(response_body=pb.HttpBody(body=body, end_of_stream=True))]


def _chat(model: str, **extra) -> bytes:
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}).encode()


#: name -> (protocol, messages)
CASES = {
    "chat-prefetch-hit": ("ace", _req("/v1/chat/completions", "bob", _chat("code-python"),
                                      **{"x-ace-skill-override": "dynamic_lora_prefetch=prod"})),
    "chat-tenant-default": ("ace", _req("/v1/chat/completions", "alice", _chat("ace-tiny-llama"))),
    "chat-shadow": ("ace", _req("/v1/chat/completions", "carol", _chat("code-python"))),
    "chat-lora-name": ("ace", _req("/v1/chat/completions", "alice", b'{"lora_name":"code-python","messages":[]}')),
    "completions": ("ace", _req("/v1/completions", "bob", json.dumps({"model": "code-python", "prompt": "x"}).encode())),
    "unknown-adapter": ("ace", _req("/v1/chat/completions", "bob", _chat("nope"))),
    "other-tenant-adapter": ("ace", _req("/v1/chat/completions", "bob", _chat("acme-legal"))),
    "bad-json": ("ace", _req("/v1/chat/completions", "bob", b"{not json")),
    "no-key": ("ace", _req("/v1/chat/completions", None, _chat("code-python"))),
    "engine-admin": ("ace", _req("/v1/load_lora_adapter", "alice", b"{}")),
    "health": ("ace", _req("/health", None, None, "GET")),
    "models": ("ace", _req("/v1/models", "bob", None, "GET")),
    "execute": ("ace", _req("/v1/execute", "bob", json.dumps({"input": {"messages": [{"role": "user", "content": "hi"}]},
                                                               "target": {"model": "code-python"}}).encode())
                + _response()),
    "epp-chat": ("epp", _req("/v1/chat/completions", "bob", _chat("code-python"),
                             **{"x-ace-skill-override": "dynamic_lora_prefetch=prod"})
                 + _response(served="127.0.0.2:8000")),
    "epp-tenant-default": ("epp", _req("/v1/chat/completions", "alice", _chat("acme-legal")) + _response()),
    "epp-no-key": ("epp", _req("/v1/chat/completions", None, _chat("code-python"))),
    # shed_load 3: other-vllm carries 2 (routed to), local-vllm 5; then both at 5 (shed)
    "epp-loaded": ("epp", _req("/v1/chat/completions", "bob", _chat("code-python")) + _response()),
    "epp-shed": ("epp", _req("/v1/chat/completions", "bob", _chat("code-python"))),
    # the agent reports code-python absent on local-vllm (the gateway writes it "none")
    "chat-absent": ("ace", _req("/v1/chat/completions", "bob", _chat("code-python"),
                                **{"x-ace-skill-override": "dynamic_lora_prefetch=prod"})),
    "execute-absent": ("ace", _req("/v1/execute", "bob", json.dumps({"input": {"messages": []},
                                                                   "target": {"model": "code-python"}}).encode())
                       + _response()),
    "console-adapters": ("ace", _req("/api/v1/adapters", "bob", None, "GET")),
    "epp-models": ("epp", _req("/v1/models", "bob", None, "GET") + _response(b"{}")),
}


LOADS = {"epp-loaded": {"local-vllm": 5, "other-vllm": 2}, "epp-shed": {"local-vllm": 5, "other-vllm": 5}}


def _gateway(tmp: Path, name: str) -> tuple[Gateway, Store]:
    state = write_state(tmp, [upstream("local-vllm", "127.0.0.1:8000", "vllm", "body"),
                              upstream("other-vllm", "127.0.0.2:8000", "sglang", "headers")])
    store = Store(state, tmp / "gw.sqlite3")
    gw = Gateway(store, epp_fallbacks=1, shed_load=3 if name in LOADS else 0)
    absent = name in ("chat-absent", "execute-absent", "console-adapters")
    local = (to_residency(agent_pb.AdapterStatus(adapter="code-python", tier=agent_pb.TIER_ABSENT)) if absent
             else TierReport(tier="device", cold_load_ms=4.5, bytes=1 << 20, prefetched=True))
    gw.residency.publish(ResidencySnapshot.build({
        "local-vllm": {"code-python": local},
        "other-vllm": {"acme-legal": TierReport(tier="host", cold_load_ms=12.0, bytes=1 << 21)},
    }, loads=LOADS.get(name)))
    return gw, store


def record(tmp: Path) -> dict:
    out = {}
    for name, (protocol, messages) in CASES.items():
        gw, store = _gateway(tmp / name, name)
        try:
            stream = Dispatcher(gw, protocol, as_bytes=True).open()
            answers = []
            for msg in messages:
                replies = stream.answer(msg)
                for raw in replies:
                    answer = pb.ProcessingResponse.FromString(_EXEC_ID.sub(_FIXED_ID, raw))
                    answers.append({"bytes": base64.b64encode(answer.SerializeToString(deterministic=True)).decode(),
                                    "text": text_format.MessageToString(answer)})
                # Envoy sends nothing more after an immediate response or the stream's end
                if stream.ended or any(pb.ProcessingResponse.FromString(r).HasField("immediate_response")
                                       for r in replies):
                    break
            out[name] = answers
        finally:
            store.close()
    return out


def test_wire_answers_match_the_golden_file_byte_for_byte(tmp_path):
    golden = json.loads(GOLDEN.read_text())
    now = record(tmp_path)
    assert sorted(now) == sorted(golden)
    for name in golden:
        # the text first: a readable diff when a byte moved
        assert [a["text"] for a in now[name]] == [a["text"] for a in golden[name]], name
        assert [a["bytes"] for a in now[name]] == [a["bytes"] for a in golden[name]], name


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        raise SystemExit("usage: python -m tests.extproc.test_golden_wire --write")
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        GOLDEN.write_text(json.dumps(record(Path(d)), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
