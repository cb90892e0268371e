"""The endpoint picker protocol layer (extproc.protocols.epp) with real ext_proc protobuf messages."""
from __future__ import annotations

import json

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode

from extproc.protocols.epp import CHUNK, ENDPOINT_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY, SUBSET_NAMESPACE, EppStats, EppStream
from extproc.policy.routing import route
from extproc.app.context import Gateway
from extproc.state.residency import ResidencySnapshot
from extproc.state.store import Store
from extproc.protocols.wire import pb
from tests.extproc.builders import KEYS, upstream, write_state

A, B, C = "127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8003"


@pytest.fixture
def gateway(tmp_path):
    state = write_state(tmp_path, [upstream("a", A), upstream("b", B), upstream("c", C)],
                        max_body_bytes=400_000)
    store = Store(state, tmp_path / "gw.sqlite3")
    yield Gateway(store, route=route, epp_fallbacks=2)
    store.close()


def headers_msg(path="/v1/chat/completions", key=KEYS["alice"], eos=False, subset=None, duplex=True,
                method="POST"):
    msg = pb.ProcessingRequest()
    hs = msg.request_headers.headers.headers
    for k, v in ((":method", method), (":path", path), ("authorization", f"Bearer {key}"),
                 (ENDPOINT_HEADER, "6.6.6.6:1")):   # a client's own pick is overwritten
        hs.add(key=k, raw_value=v.encode())
    msg.request_headers.end_of_stream = eos
    mode = ProcessingMode.FULL_DUPLEX_STREAMED if duplex else ProcessingMode.BUFFERED
    msg.protocol_config.request_body_mode = mode
    msg.protocol_config.response_body_mode = mode
    if subset is not None:
        ns = msg.metadata_context.filter_metadata[SUBSET_NAMESPACE]
        if isinstance(subset, str):
            ns.fields[SUBSET_KEY].string_value = subset
        else:
            ns.fields[SUBSET_KEY].list_value.values.add().string_value = "placeholder"
            del ns.fields[SUBSET_KEY].list_value.values[:]
            for item in subset:
                ns.fields[SUBSET_KEY].list_value.values.add().string_value = item
    return msg


def body_msgs(body: bytes, parts: int = 1):
    step = max(1, -(-len(body) // parts))
    out = []
    for i in range(0, len(body), step):
        m = pb.ProcessingRequest()
        m.request_body.body = body[i:i + step]
        m.request_body.end_of_stream = i + step >= len(body)
        out.append(m)
    return out


def chat(model="code-python", extra=""):
    return json.dumps({"model": model, "messages": [{"role": "user", "content": "hi" + extra}]}).encode()


def header_map(common):
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


def run(stream, msgs):
    out = []
    for m in msgs:
        out += stream.handle(m)
    return out


def test_full_duplex_holds_headers_then_answers_headers_and_chunked_body(gateway):
    s = EppStream(gateway)
    assert s.handle(headers_msg()) == []              # held until the body is read
    body = chat()
    msgs = body_msgs(body, parts=3)
    assert run(s, msgs[:-1]) == []
    out = s.handle(msgs[-1])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    common = out[0].request_headers.response
    assert common.clear_route_cache
    hs = header_map(common)
    pick = hs[ENDPOINT_HEADER]
    assert pick.split(",")[0] in (A, B, C) and sorted(pick.split(",")) == sorted([A, B, C])
    lb = out[0].dynamic_metadata.fields[LB_NAMESPACE].struct_value.fields
    assert lb[ENDPOINT_HEADER].string_value == pick       # header and metadata agree
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.end_of_stream
    sent = json.loads(streamed.body)
    assert sent["model"] == "code-python"                # the adapter, as the rewrite sets it
    assert hs["content-length"] == str(len(streamed.body))


def test_large_rewritten_body_goes_back_in_62000_byte_chunks(gateway):
    s = EppStream(gateway)
    s.handle(headers_msg())
    out = run(s, body_msgs(chat(extra="x" * 150_000), parts=10))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert [len(c.body) for c in chunks[:-1]] == [CHUNK] * (len(chunks) - 1)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    whole = b"".join(c.body for c in chunks)
    assert header_map(out[0].request_headers.response)["content-length"] == str(len(whole))
    assert json.loads(whole)["messages"][0]["content"].endswith("x" * 150_000)


def test_buffered_mode_sets_the_pick_on_the_body_answer(gateway):
    s = EppStream(gateway)
    first = s.handle(headers_msg(duplex=False))
    assert [r.WhichOneof("response") for r in first] == ["request_headers"]
    out = run(s, body_msgs(chat()))
    assert len(out) == 1
    common = out[0].request_body.response
    assert common.clear_route_cache and ENDPOINT_HEADER in header_map(common)
    assert json.loads(common.body_mutation.body)["model"] == "code-python"


@pytest.mark.parametrize("subset", [f"{B}, {C}", [B, C], [f"{B},{C}"]])
def test_subset_hint_list_or_comma_string_narrows_the_pick(gateway, subset):
    s = EppStream(gateway)
    s.handle(headers_msg(subset=subset))
    out = run(s, body_msgs(chat()))
    assert sorted(header_map(out[0].request_headers.response)[ENDPOINT_HEADER].split(",")) == [B, C]


@pytest.mark.parametrize("subset", ["", [], ["10.9.9.9:80"]])
def test_empty_or_disjoint_subset_is_503(gateway, subset):
    s = EppStream(gateway)
    out = s.handle(headers_msg(subset=subset))
    assert out[0].immediate_response.status.code == 503
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "no_endpoint"
    assert run(s, body_msgs(chat())) == []                # nothing more after an immediate answer


def test_bad_key_is_401_json(gateway):
    out = EppStream(gateway).handle(headers_msg(key="sk-nope"))
    assert out[0].immediate_response.status.code == 401
    assert json.loads(out[0].immediate_response.body)["error"]["type"]


def test_shedding_when_every_eligible_host_is_at_the_bound(gateway):
    gateway.shed_load = 4
    gateway.residency.publish(ResidencySnapshot.build({}, loads={"a": 4, "b": 9, "c": 4}))
    s = EppStream(gateway)
    out = s.handle(headers_msg())                   # after auth, before any decision
    assert out[0].immediate_response.status.code == 429
    assert json.loads(out[0].immediate_response.body)["error"]["code"] == "overloaded"
    assert EppStream(gateway).handle(headers_msg(key="sk-nope"))[0].immediate_response.status.code == 401
    gateway.residency.publish(ResidencySnapshot.build({}, loads={"a": 4, "b": 3, "c": 4}))
    s = EppStream(gateway)
    s.handle(headers_msg())
    assert run(s, body_msgs(chat()))[0].HasField("request_headers")


def test_shedding_counts_the_requests_routed_since_each_measurement(gateway):
    """The shedding bound reads a host's load as routing does: its agent's measurement plus
    what this gateway routed there since that measurement arrived (extproc.state.residency.host_load)."""
    gateway.shed_load = 4
    for u in ("a", "b", "c"):
        gateway.residency.sent.record(u)           # before the measurement: not counted
    marks = {u: gateway.residency.sent.value(u) for u in ("a", "b", "c")}
    gateway.residency.publish(ResidencySnapshot.build({}, {"a": 3, "b": 3, "c": 3}, marks))
    assert not any(r.HasField("immediate_response") for r in EppStream(gateway).handle(headers_msg()))
    for u in ("a", "b", "c"):
        gateway.residency.sent.record(u)           # one more each since: 3 + 1 = the bound
    out = EppStream(gateway).handle(headers_msg())
    assert out[0].immediate_response.status.code == 429


def test_no_fallbacks_by_default_one_address_as_envoy_reads_it(gateway):
    gateway.epp_fallbacks = 0
    s = EppStream(gateway)
    s.handle(headers_msg())
    out = run(s, body_msgs(chat()))
    assert header_map(out[0].request_headers.response)[ENDPOINT_HEADER] in (A, B, C)


def test_headers_only_request_is_picked_at_once_and_its_body_streams(gateway):
    s = EppStream(gateway)
    out = s.handle(headers_msg(path="/health", method="GET", eos=True))
    assert ENDPOINT_HEADER in header_map(out[0].request_headers.response)


def test_served_endpoint_is_read_on_the_response_and_response_streams(gateway):
    stats = EppStats()
    s = EppStream(gateway, stats)
    s.handle(headers_msg())
    out = run(s, body_msgs(chat()))
    first = header_map(out[0].request_headers.response)[ENDPOINT_HEADER].split(",")
    resp = pb.ProcessingRequest()
    resp.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    resp.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY].string_value = first[1]
    answer = s.handle(resp)
    assert header_map(answer[0].response_headers.response)["x-ace-served-by"]
    assert stats.served[first[1]] == 1 and stats.served_by_fallback == 1
    assert gateway.metrics.served_totals() == {(first[1], "fallback"): 1}   # /metrics
    chunk = pb.ProcessingRequest()
    chunk.response_body.body = b"data: {}\n\n"
    echoed = s.handle(chunk)[0].response_body.response.body_mutation.streamed_response
    assert echoed.body == b"data: {}\n\n" and not echoed.end_of_stream


def test_body_over_the_limit_is_413(gateway):
    s = EppStream(gateway)
    s.handle(headers_msg())
    out = run(s, body_msgs(b"x" * 500_000, parts=10))
    assert out[-1].immediate_response.status.code == 413


def test_trailers_end_the_body_in_full_duplex(gateway):
    s = EppStream(gateway)
    s.handle(headers_msg())
    part = pb.ProcessingRequest()
    part.request_body.body = chat()
    assert s.handle(part) == []                     # no end_of_stream: trailers will end it
    trailers = pb.ProcessingRequest()
    trailers.request_trailers.SetInParent()
    out = s.handle(trailers)
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert json.loads(streamed.body)["model"] == "code-python" and not streamed.end_of_stream


def test_body_before_headers_is_a_clean_json_error(gateway):
    out = EppStream(gateway).handle(body_msgs(chat())[0])
    assert out[0].immediate_response.status.code == 500
    assert json.loads(out[0].immediate_response.body)["error"]["message"]


def test_a_failing_routing_policy_answers_json_not_a_hang(gateway):
    def broken(upstreams, adapter, residency, sent):
        raise RuntimeError("policy bug")
    gateway.route = broken
    s = EppStream(gateway)
    s.handle(headers_msg())
    out = run(s, body_msgs(chat()))
    assert out[0].immediate_response.status.code == 500


def _mixed(tmp_path, **upstream_kw):
    """Three hosts of which only ``b`` serves what the test asks (its flavour or allow_paths)."""
    state = write_state(tmp_path, [upstream("a", A, "builtin"), upstream("b", B, **upstream_kw),
                                   upstream("c", C, "builtin")], max_body_bytes=400_000)
    return Store(state, tmp_path / "gw.sqlite3", watch=False)


@pytest.mark.parametrize("path, kw", [("/v1/embeddings", {"flavour": "vllm"}),
                                      ("/tokenize", {"flavour": "builtin", "allow_paths": ["/tokenize"]})])
def test_a_route_some_hosts_serve_is_picked_among_them_fallbacks_too(tmp_path, path, kw):
    store = _mixed(tmp_path, **kw)
    try:
        s = EppStream(Gateway(store, route=route, epp_fallbacks=2))
        s.handle(headers_msg(path=path))
        out = run(s, body_msgs(json.dumps({"model": "code-python", "input": "hi"}).encode()))
        assert header_map(out[0].request_headers.response)[ENDPOINT_HEADER] == B   # no fallback serves it
        s = EppStream(Gateway(store, route=route, epp_fallbacks=2))
        s.handle(headers_msg(path=path, subset=A))                                   # b outside the subset
        out = run(s, body_msgs(json.dumps({"model": "code-python", "input": "hi"}).encode()))
        reply = out[0].immediate_response
        assert reply.status.code == 503 and json.loads(reply.body)["error"]["code"] == "no_endpoint"
    finally:
        store.close()
