"""The plaintext gRPC health port (extproc.transport.health_port) and its setting, with a real
grpcio client: what each service answers in each phase of the ext_proc server."""
from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.errors import ConfigError
from extproc.transport.health_port import HealthPort
from extproc.settings import Settings
from extproc.protocols.wire import SERVICE

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
READY_SERVICES = ("readiness", SERVICE, "")


@pytest.fixture
def port():
    hp = HealthPort("127.0.0.1:0").start()
    with grpc.insecure_channel(f"127.0.0.1:{hp.port}") as ch:
        yield hp, health_pb2_grpc.HealthStub(ch)
    hp.stop()


def statuses(stub) -> dict[str, int]:
    return {s: stub.Check(health_pb2.HealthCheckRequest(service=s), timeout=10).status
            for s in ("liveness", *READY_SERVICES)}


def test_ready_services_follow_the_server_and_liveness_stays_serving(port):
    hp, stub = port
    assert statuses(stub) == {"liveness": SERVING, **dict.fromkeys(READY_SERVICES, NOT_SERVING)}  # starting
    hp.serving()
    assert statuses(stub) == dict.fromkeys(("liveness", *READY_SERVICES), SERVING)
    hp.draining()
    assert statuses(stub) == {"liveness": SERVING, **dict.fromkeys(READY_SERVICES, NOT_SERVING)}


def test_watch_sees_readiness_change(port):
    hp, stub = port
    watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"), timeout=30)
    assert next(watch).status == NOT_SERVING
    hp.serving()
    assert next(watch).status == SERVING
    hp.draining()
    assert next(watch).status == NOT_SERVING
    watch.cancel()


def test_unknown_service_is_not_found(port):
    _, stub = port
    with pytest.raises(grpc.RpcError) as err:
        stub.Check(health_pb2.HealthCheckRequest(service="nope"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_port_in_use_is_a_configuration_error():
    with socket.socket() as other:      # held by another program (no SO_REUSEPORT)
        other.bind(("127.0.0.1", 0))
        other.listen()
        with pytest.raises(ConfigError, match="--health-listen"):
            HealthPort(f"127.0.0.1:{other.getsockname()[1]}").start()


def test_a_successor_binds_beside_a_draining_replica(port):
    """A restart on the same address (extproc.transport.handover): the new process's health port binds
    while the old one still serves its own."""
    hp, _ = port
    successor = HealthPort(f"127.0.0.1:{hp.port}").start()
    successor.stop()


@pytest.mark.parametrize("args, address", [
    ([], None),                                                          # ace: off
    (["--protocol", "epp"], "127.0.0.1:9003"),                           # epp: --listen's host, 9003
    (["--protocol", "epp", "--listen", "0.0.0.0:9002"], "0.0.0.0:9003"),
    (["--protocol", "epp", "--health-listen", "off"], None),
    (["--health-listen", "127.0.0.1:0"], "127.0.0.1:0"),                 # ace, asked for
    (["--protocol", "epp", "--health-listen", "OFF"], None),
])
def test_health_listen_setting(state_file, args, address):
    assert Settings.from_args(["--config", str(state_file), *args]).health_address == address


def test_health_listen_from_the_environment(state_file, monkeypatch):
    monkeypatch.setenv("ACE_EXTPROC_PROTOCOL", "epp")
    monkeypatch.setenv("ACE_EXTPROC_HEALTH_LISTEN", "0.0.0.0:9003")
    s = Settings.from_args(["--config", str(state_file)])
    assert (s.protocol, s.health_address) == ("epp", "0.0.0.0:9003")


@pytest.mark.parametrize("value", ["9003", "host:port", "127.0.0.1:70000", "127.0.0.1:50051"])
def test_bad_health_listen_is_refused(state_file, value):
    with pytest.raises(ConfigError, match="--health-listen"):
        Settings.from_args(["--config", str(state_file), "--listen", "127.0.0.1:50051", "--health-listen", value])
