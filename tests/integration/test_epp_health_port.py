"""``python -m extproc --protocol epp`` with TLS on its ext_proc port and the plaintext
gRPC health port beside it (extproc.transport.health_port), each server flavour, real grpcio
clients: what the kubelet's ``grpc:`` probes see while it serves and while SIGTERM drains
an open stream, and the served-endpoint counts on /metrics."""
from __future__ import annotations

import contextlib
import queue
import signal
import ssl
import threading

import grpc
import httpx
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from extproc.protocols.epp import ENDPOINT_HEADER, LB_NAMESPACE, SERVED_KEY
from extproc.protocols.wire import SERVICE, pb
from tests.extproc.builders import KEYS, upstream, write_state
from tests.support.wait import scaled, wait_until
from tools.localstack import extproc_process, free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
ONE, TWO = "127.0.0.1:18001", "127.0.0.1:18002"     # never dialled: the picker only names them
FLAVOURS = ["h2", "aio", "threads"]


def start(tmp, flavour: str, metrics_port: int | None = None):
    """The picker as the InferencePool overlays run it: epp, TLS (self-signed), health port."""
    state = write_state(tmp, [upstream("one", ONE), upstream("two", TWO)])
    health = free_port()
    args = ["--protocol", "epp", "--server", flavour, "--health-listen", f"127.0.0.1:{health}"]
    return extproc_process(tmp, state, extproc_args=args, metrics_port=metrics_port), health


@contextlib.contextmanager
def ready(tmp, flavour: str):
    """The picker started, its health port reporting readiness: (ext_proc address, process,
    plaintext health address)."""
    process, health = start(tmp, flavour)
    with process as (address, proc):
        plain = f"127.0.0.1:{health}"
        wait_until(lambda: check(plain, "readiness") == SERVING, what="readiness SERVING")
        yield address, proc, plain


def check(address: str, service: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                    timeout=scaled(10)).status


def tls_channel(address: str) -> grpc.Channel:
    host, _, port = address.rpartition(":")
    cert = ssl.get_server_certificate((host, int(port))).encode()
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=cert),
                               options=[("grpc.ssl_target_name_override", "localhost")])


def headers(path: str, method: str, eos: bool) -> pb.ProcessingRequest:
    msg = pb.ProcessingRequest()
    for name, value in ((":path", path), (":method", method), ("authorization", f"Bearer {KEYS['alice']}")):
        msg.request_headers.headers.headers.add(key=name, raw_value=value.encode())
    msg.request_headers.end_of_stream = eos
    return msg


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_plaintext_health_port_serves_beside_the_tls_ext_proc_port(tmp_path, flavour):
    with ready(tmp_path, flavour) as (address, _, plain):
        for service in ("liveness", "readiness", SERVICE, ""):
            assert check(plain, service) == SERVING, service
        # the reason for the second port: the ext_proc port speaks TLS only
        with pytest.raises(grpc.RpcError) as err:
            check(address, "readiness")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with tls_channel(address) as ch:
            assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="readiness"),
                                                        timeout=scaled(10)).status == SERVING


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_sigterm_turns_readiness_off_while_an_open_stream_drains(tmp_path, flavour):
    with ready(tmp_path, flavour) as (address, proc, plain):
        release = threading.Event()

        def messages():
            yield headers("/v1/chat/completions", "POST", eos=False)   # the body never comes...
            release.wait(scaled(60))                                  # ...until the test says

        with tls_channel(address) as ch, grpc.insecure_channel(plain) as hch:
            stream = pb_grpc.ExternalProcessorStub(ch).Process(messages(), timeout=scaled(60))
            next(stream)                                   # the stream is open on the server
            watch = health_pb2_grpc.HealthStub(hch).Watch(health_pb2.HealthCheckRequest(service="readiness"),
                                                          timeout=scaled(60))
            assert next(watch).status == SERVING
            proc.send_signal(signal.SIGTERM)
            assert next(watch).status == NOT_SERVING       # sent by the live process, while draining
            assert check(plain, "liveness") == SERVING     # the kubelet must not restart it now
            assert check(plain, SERVICE) == NOT_SERVING
            assert proc.poll() is None                     # held by the open stream
            release.set()                                  # the client half-closes: the drain ends
            assert list(stream) == []
        assert proc.wait(timeout=scaled(30)) == 0


def metric_samples(port: int) -> dict[tuple, float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=scaled(10)).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_served_endpoints_are_exported_on_metrics(tmp_path, flavour):
    metrics = free_port()
    process, _ = start(tmp_path, flavour, metrics_port=metrics)
    with process as (address, _), tls_channel(address) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        served = []
        for by_pick in (True, False):                      # served by ace's pick, then by the other
            response = queue.Queue()

            def messages():
                yield headers("/health", "GET", eos=True)      # headers only: picked at once
                yield response.get(timeout=scaled(30))

            answers = stub.Process(messages(), timeout=scaled(30))
            pick = next(answers).request_headers.response.header_mutation.set_headers
            first = next(h.header.raw_value.decode() for h in pick if h.header.key == ENDPOINT_HEADER)
            served.append(first if by_pick else {ONE: TWO, TWO: ONE}[first])
            msg = pb.ProcessingRequest(response_headers={})
            msg.metadata_context.filter_metadata[LB_NAMESPACE].fields[SERVED_KEY].string_value = served[-1]
            response.put(msg)
            assert len(list(answers)) == 1                 # the response headers' answer
        got = metric_samples(metrics)
        assert got[("ace_gateway_epp_served_total", (("endpoint", served[0]), ("pick", "primary")))] == 1
        assert got[("ace_gateway_epp_served_total", (("endpoint", served[1]), ("pick", "fallback")))] == 1
