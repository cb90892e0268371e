"""The one phase dispatcher (extproc.transport.dispatch) every server flavour serves, without sockets."""
from __future__ import annotations

import json

import pytest
from grpc_health.v1 import health_pb2

from extproc.transport.dispatch import NOT_SERVING, SERVING, Dispatcher, ServingHealth
from extproc.errors import InvalidMessage
from extproc.app.context import Gateway
from extproc.protocols.wire import HEALTH_SERVICES, NO_PHASE, pb
from tests.extproc.builders import KEYS


def _chat(body: bytes = b'{"lora_name":"code-python"}') -> list[pb.ProcessingRequest]:
    m = pb.ProcessingRequest()
    for k, v in ((":path", "/v1/chat/completions"), (":method", "POST"),
                 ("authorization", f"Bearer {KEYS['alice']}")):
        m.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    return [m, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]


def _run(stream, messages) -> tuple[list, list[bool]]:
    answers, ended = [], []
    for msg in messages:
        answers += stream.answer(msg)
        ended.append(stream.ended)
    return answers, ended


@pytest.mark.parametrize("protocol", ["ace", "epp"])
def test_both_encodings_answer_the_same_messages(store, protocol):
    """h2 writes bytes, grpcio the messages: the same answers either way."""
    as_messages, ended = _run(Dispatcher(Gateway(store), protocol).open(), _chat())
    as_bytes, _ = _run(Dispatcher(Gateway(store), protocol, as_bytes=True).open(), _chat())
    assert all(isinstance(a, bytes) for a in as_bytes)
    assert [pb.ProcessingResponse.FromString(b) for b in as_bytes] == as_messages
    assert as_messages
    # ace: the body's answer is the exchange's last (the stream ends); epp: Envoy half-closes
    assert ended == ([False, True] if protocol == "ace" else [False, False])


def test_ace_stream_answers_each_phase_once(store):
    answers, _ = _run(Dispatcher(Gateway(store)).open(), _chat())
    assert [a.WhichOneof("response") for a in answers] == ["request_headers", "request_body"]
    assert json.loads(answers[1].request_body.response.body_mutation.body)["model"] == "code-python"


def test_a_message_without_a_phase_is_invalid_in_ace_and_ignored_in_epp(store):
    with pytest.raises(InvalidMessage, match=NO_PHASE):
        Dispatcher(Gateway(store)).open().answer(pb.ProcessingRequest())
    assert list(Dispatcher(Gateway(store), "epp").open().answer(pb.ProcessingRequest())) == []


def test_epp_streams_of_one_server_share_its_counts(store):
    d = Dispatcher(Gateway(store), "epp")
    assert d.open().stream.stats is d.open().stream.stats is d.epp_stats


def test_health_serves_every_service_until_draining():
    h = ServingHealth()
    assert all(h.check(name) == SERVING for name in HEALTH_SERVICES)
    assert h.check("liveness") == h.check("readiness") == SERVING
    assert h.check("no.such.Service") is None
    servicer = h.grpcio_servicer()   # grpc's own, for the grpcio flavours: the same answers
    for name in HEALTH_SERVICES:
        assert servicer.Check(health_pb2.HealthCheckRequest(service=name), None).status == SERVING
    h.drain()
    assert all(h.check(name) == NOT_SERVING for name in HEALTH_SERVICES)
