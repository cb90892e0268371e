"""The ext_proc phases without sockets: plain objects in, plain objects and protobuf out."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from extproc.domain.auth import hash_key
from extproc.app.outcomes import CONTINUE, Continue, Reply, RequestHead
from extproc.domain.prefetch import PrefetchQueue, PrefetchSignal
from extproc.app.context import Gateway
from extproc.transport.grpc_servers import ExternalProcessor
from extproc.protocols.wire import head_from_attributes, serialize_response, to_response
from tests.extproc.builders import KEYS


def _head(path, method="POST", eos=False, **headers):
    h = {":path": path, ":method": method, "authorization": f"Bearer {KEYS['bob']}", **headers}
    return RequestHead(method, path.split("?")[0], h, eos)


class Sink:
    def __init__(self):
        self.signals = []

    def submit(self, signal):
        self.signals.append(signal)
        return True


# the paths without a handler of their own (default deny): tests/extproc/test_edge_routes.py


def test_body_without_headers_or_attributes_fails_closed(store):
    out = Gateway(store).exchange().on_request_body(b'{"model": "code-python"}')
    assert isinstance(out, Reply) and out.status == 500


def test_inference_headers_then_body(store):
    sink = Sink()
    ex = Gateway(store, prefetch=sink).exchange()
    assert ex.on_request_headers(_head("/v1/chat/completions?x=1", **{
        "x-ace-skill-override": "dynamic_lora_prefetch=prod"})) is CONTINUE
    out = ex.on_request_body(json.dumps({"model": "code-python", "messages": []}).encode())
    assert isinstance(out, Continue)
    meta = dict(out.metadata)
    assert meta["destination"] == "127.0.0.1:8000"
    assert meta["tenant"] == "globex"
    assert dict(out.headers)["content-length"] == str(len(out.body))
    assert "queued=true" in meta["trace_dynamic_lora_prefetch"]
    assert sink.signals[0].adapter == "code-python"


def test_errors_become_replies_at_the_boundary(store):
    ex = Gateway(store).exchange()
    out = ex.on_request_headers(RequestHead("POST", "/v1/completions", {}, False))
    assert isinstance(out, Reply) and out.status == 401
    ex = Gateway(store).exchange()
    ex.on_request_headers(_head("/v1/completions"))
    out = ex.on_request_body(b"{")
    assert out.status == 400 and json.loads(out.body)["error"]["code"] == "invalid_json"


def test_a_key_revoked_while_its_skills_post_is_in_flight_gets_401_not_500(store):
    ex = Gateway(store).exchange()
    assert ex.on_request_headers(_head("/api/v1/dev_key/skills")) is CONTINUE
    store.revoke_key(hash_key(KEYS["bob"]))          # e.g. another replica's admin, via NOTIFY
    out = ex.on_request_body(json.dumps({"skills": {"multi_lora": "off"}}).encode())
    assert out.status == 401 and json.loads(out.body)["error"]["code"] == "invalid_api_key"


def test_wire_responses():
    r = to_response("request_headers", CONTINUE)
    assert r.WhichOneof("response") == "request_headers"
    r = to_response("request_body", Continue((("a", "b"),), b"{}"))
    common = r.request_body.response
    assert common.header_mutation.set_headers[0].header.raw_value == b"b"
    assert common.body_mutation.body == b"{}"
    r = to_response("request_body", Continue(metadata=(("served_by", "u"),)))
    assert r.WhichOneof("response") == "request_body"   # phase set even with metadata only
    assert r.dynamic_metadata.fields["ace"].struct_value.fields["served_by"].string_value == "u"
    r = to_response("request_body", Reply(422, b"{}"))
    assert r.immediate_response.status.code == 422
    assert r.immediate_response.details == "ace_gateway_reply"    # Envoy's 503 mapper skips it


def _chat_messages(body: bytes):
    """Envoy's headers-first exchange for one chat completion as alice."""
    m = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"),
                 ("authorization", f"Bearer {KEYS['alice']}")):
        m.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    yield m
    yield pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))


def test_grpc_servicer_loop(store):
    """The servicer's generator over real protobuf messages (no network)."""
    out = list(ExternalProcessor(Gateway(store)).Process(_chat_messages(b'{"lora_name":"code-python"}'), None))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body"]
    assert json.loads(out[1].request_body.response.body_mutation.body)["model"] == "code-python"
    ace = out[1].dynamic_metadata.fields["ace"].struct_value.fields
    assert ace["destination"].string_value == "127.0.0.1:8000"


@pytest.mark.parametrize("path, last", [("/v1/chat/completions", "request_body"),
                                        ("/v1/completions", "request_body"),
                                        ("/v1/execute", "response_body"),
                                        ("/v1/models", "request_headers")])
def test_exchange_is_done_after_its_last_phase(store, path, last):
    """The servers end the gRPC stream with the last answer (Envoy then needs this ext_proc no
    more for the request); /v1/execute alone has a response body to process."""
    ex = Gateway(store).exchange()
    ex.on_request_headers(_head(path))
    assert ex.done_after("request_headers") == (last == "request_headers")
    assert ex.done_after("request_body") == (last in ("request_headers", "request_body"))
    assert ex.done_after("response_body")


def test_grpc_servicer_ends_the_stream_after_the_last_answer(store):
    """The generator returns after the body's answer, whatever Envoy would send next."""
    def messages():
        yield from _chat_messages(b'{"model":"code-python"}')
        raise AssertionError("read past the last message")
    out = list(ExternalProcessor(Gateway(store)).Process(messages(), None))
    assert [o.WhichOneof("response") for o in out] == ["request_headers", "request_body"]


def test_one_message_body_with_attributes(store):
    """Headers skipped: the body message carries the request line and headers as attributes."""
    m = pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"model":"code-python"}', end_of_stream=True))
    attrs = m.attributes["envoy.filters.http.ext_proc"].fields
    attrs["request.url_path"].string_value = "/v1/chat/completions"
    attrs["request.method"].string_value = "POST"
    attrs["request.headers['authorization']"].string_value = f"Bearer {KEYS['alice']}"
    (out,) = ExternalProcessor(Gateway(store)).Process(iter([m]), None)
    ace = out.dynamic_metadata.fields["ace"].struct_value.fields
    assert ace["tenant"].string_value == "acme"
    assert ace["served_by"].string_value == "local-vllm"
    attrs["request.headers['authorization']"].string_value = "Bearer nope"
    (out,) = ExternalProcessor(Gateway(store)).Process(iter([m]), None)
    assert out.immediate_response.status.code == 401


def test_head_from_attributes_reads_every_attribute_by_key_or_by_pass():
    """The attributes ace's Envoy config asks for are looked up by key; a message with any
    other attribute (another config asking for more headers) is read by the pass over every
    key, and both give the same head."""
    m = pb.ProcessingRequest(request_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    attrs = m.attributes["envoy.filters.http.ext_proc"].fields
    attrs["request.url_path"].string_value = "/v1/chat/completions"
    attrs["request.method"].string_value = "POST"
    attrs["request.headers['authorization']"].string_value = "Bearer k"
    attrs["request.headers['x-ace-session-id']"].string_value = "s1"
    head = head_from_attributes(m)
    assert (head.method, head.path, head.end_of_stream) == ("POST", "/v1/chat/completions", False)
    assert head.headers == {"authorization": "Bearer k", "x-ace-session-id": "s1"}
    attrs["request.headers['x-other']"].string_value = "o"
    attrs["request.scheme"].string_value = "http"
    head = head_from_attributes(m)
    assert head.headers == {"authorization": "Bearer k", "x-ace-session-id": "s1", "x-other": "o"}
    assert (head.method, head.path) == ("POST", "/v1/chat/completions")
    assert head_from_attributes(pb.ProcessingRequest()) is None


def test_prefetch_queue_never_blocks_and_drops_when_full():
    import threading
    gate = threading.Event()
    sent = []
    def send(s):
        gate.wait(5)
        sent.append(s)

    q = PrefetchQueue(send, maxsize=1)
    sig = PrefetchSignal("u", "a", "d", 1, "request_cold")
    results = [q.submit(sig) for _ in range(5)]
    assert results.count(True) >= 1 and results[-1] is False
    gate.set()
    q.close()
    assert sent


def test_prefetch_queue_sends_a_signal_again_when_its_sender_asks_and_others_meanwhile():
    """``send`` may answer (signal, delay): that signal comes back after the delay, while
    signals submitted meanwhile go at once."""
    import threading
    calls, done = [], threading.Event()
    first = PrefetchSignal("u", "bet", "d", 0, "predicted")
    now = PrefetchSignal("u", "now", "d", 1, "request_cold")

    def send(s):
        calls.append(s.adapter)
        if s.adapter == "bet" and not s.deferred:
            q.submit(now)                             # arrives while the bet waits
            return replace(s, deferred=True), 0.05
        if s.deferred:
            done.set()
        return None

    q = PrefetchQueue(send, maxsize=4)
    assert q.submit(first)
    assert done.wait(30), calls
    assert calls == ["bet", "now", "bet"]
    q.close()


def _rewritten(store, raw: bytes) -> Continue | Reply:
    ex = Gateway(store).exchange()
    ex.on_request_headers(_head("/v1/chat/completions"))
    return ex.on_request_body(raw)


@pytest.mark.parametrize("raw, expected", [
    # orjson encodes these (it parses back equal)
    (b'{"model": "code-python", "temperature": 0.00001, "n": 1, "x": "\\u00e9\\n"}', None),
    # json encodes these: orjson refuses big integers
    (b'{"model": "code-python", "seed": 123456789012345678901234567890}',
     b'"seed":123456789012345678901234567890'),
    # a lone surrogate escape stays an escape (it was a UnicodeEncodeError, a 500)
    (b'{"model": "code-python", "s": "\\ud800"}', b'"s":"\\ud800"'),
])
def test_rewritten_body_keeps_every_value(store, raw, expected):
    out = _rewritten(store, raw)
    assert isinstance(out, Continue) and out.body is not None
    sent = json.loads(out.body)
    assert sent["model"] == "code-python" and sent["lora_name"] == "code-python"
    assert repr({k: v for k, v in sent.items() if k in json.loads(raw)}) == \
        repr({**json.loads(raw), "model": "code-python"})
    assert b" " not in out.body.replace(b"code-python", b"")   # compact
    if expected is not None:
        assert expected in out.body


@pytest.mark.parametrize("raw", [b'{"model": "code-python", "temperature": NaN}',
                                 b'{"model": "code-python", "top_p": -Infinity}',
                                 b'{"model": "code-python", "temperature": 1e400}'])
def test_a_number_json_does_not_have_is_a_400_not_sent_on(store, raw):
    """``json.loads`` takes NaN, Infinity and 1e400; an engine sampling with them fails
    the forward pass of every request in the batch (the builtin engine answered 500)."""
    out = _rewritten(store, raw)
    assert isinstance(out, Reply) and out.status == 400
    assert json.loads(out.body)["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("encoding, status", [("gzip", 415), ("br, gzip", 415), ("identity", None), ("", None)])
def test_a_compressed_body_is_refused_before_it_reaches_an_engine(store, encoding, status):
    """The gateway rewrites the body as JSON; a Content-Encoding header sent on beside it made
    the engine fail to decompress a plain body (a 500, and its connection closed)."""
    ex = Gateway(store).exchange()
    out = ex.on_request_headers(_head("/v1/chat/completions", **{"content-encoding": encoding}))
    if status is None:
        assert out is CONTINUE
        assert isinstance(ex.on_request_body(b'{"model": "code-python"}'), Continue)
    else:
        assert isinstance(out, Reply) and out.status == status
        assert json.loads(out.body)["error"]["code"] == "unsupported_content_encoding"


def test_deeply_nested_body_is_a_400_not_a_500(store):
    out = _rewritten(store, b'{"model": ' + b"[" * 30000 + b"]" * 30000 + b"}")
    assert isinstance(out, Reply) and out.status == 400
    assert json.loads(out.body)["error"]["code"] == "invalid_json"


def test_serialized_response_equals_to_response():
    outcomes = [CONTINUE, Reply(401, b"{}"), Continue(metadata=(("tenant", "acme"),)),
                Continue((("content-length", "2"),), b"{}", (("destination", "1.2.3.4:5"), ("tenant", "a"))),
                Continue((("content-length", "2"),), b"{}", (("destination", "1.2.3.4:5"), ("tenant", "b")))]
    for phase in ("request_headers", "request_body", "response_body"):
        for outcome in outcomes * 2:   # the second time from the metadata cache
            fast = pb.ProcessingResponse.FromString(serialize_response(phase, outcome))
            assert fast == to_response(phase, outcome)


def test_response_bytes_are_the_ones_upb_writes():
    """``serialize_response`` writes the phase by hand: byte for byte what upb writes for
    ``to_response`` (metadata aside, which is appended and parses as a merge)."""
    outcomes = [CONTINUE, Continue(body=b""), Continue(body=b"x" * 200), Continue(body=b"y" * 20000),
                Continue(body=b"z" * (3 << 20)), Continue((("a", ""),)), Continue((("", "v"),)),
                Continue((("content-length", "2"), (":path", "/v1/é" * 40)), b"{}" * 100),
                Continue((("x-" + "k" * 300, "v" * 20000),), b"{}"),
                Continue((("content-length", "2"),), b"{}", (("destination", "1.2.3.4:5"), ("tenant", "a"))),
                Continue(metadata=(("tenant", "acme"),)), Reply(413, b"{}")]
    for phase in ("request_headers", "response_headers", "request_body", "response_body"):
        for outcome in outcomes * 2:   # the second time from the caches
            wire = serialize_response(phase, outcome)
            assert pb.ProcessingResponse.FromString(wire) == to_response(phase, outcome)
            if isinstance(outcome, Continue) and not outcome.metadata:
                assert wire == to_response(phase, outcome).SerializeToString()
    for phase in ("request_trailers", "response_trailers"):
        assert serialize_response(phase, CONTINUE) == to_response(phase, CONTINUE).SerializeToString()


def test_a_burst_within_one_load_measurement_spreads_across_hosts(tmp_path):
    """Two hosts whose agents both last measured 0: the gateway adds what it routed since,
    so the burst leaves the resident host at the floor; the next measurement resets."""
    from extproc.fleet.agent_link import AgentLink
    from extproc.policy.routing import LOAD_FLOOR, route
    from extproc.state.residency import TierReport, host_load
    from extproc.state.store import Store
    from tests.extproc.builders import upstream, write_state

    state = write_state(tmp_path / "two", [upstream("u0", "127.0.0.1:8000"), upstream("u1", "127.0.0.1:8001")])
    store = Store(state, tmp_path / "gw.sqlite3")
    link = AgentLink({})  # no agents to dial: fed below as its streams would feed it
    try:
        link._publish("u0", {"code-python": TierReport("device", 12.0)}, 0)
        link._publish("u1", {}, 0)
        gw = Gateway(store, residency=link.board, route=route)

        def send():
            ex = gw.exchange()
            assert ex.on_request_headers(_head("/v1/chat/completions")) is CONTINUE
            out = ex.on_request_body(json.dumps({"model": "code-python", "messages": []}).encode())
            return dict(out.metadata)["destination"]

        burst = [send() for _ in range(LOAD_FLOOR + 4)]
        assert burst[:LOAD_FLOOR] == ["127.0.0.1:8000"] * LOAD_FLOOR
        assert set(burst[LOAD_FLOOR:]) == {"127.0.0.1:8001"}
        loads = lambda: [host_load(link.board.current, link.board.sent, u) for u in ("u0", "u1")]
        assert loads() == [LOAD_FLOOR, 4]
        # u0's agent measures again, the same 0 (the burst finished): a new snapshot, reset
        link._publish_load("u0", 0)
        assert loads() == [0, 4]
        assert send() == "127.0.0.1:8000"
        # an unchanged measurement with nothing sent since changes nothing
        link._publish_load("u1", 0)
        current = link.board.current
        link._publish_load("u1", 0)
        assert link.board.current is current
    finally:
        link.close()
        store.close()
