"""The gRPC loop: ext_proc stream <-> ``Exchange``, plus the standard health service.

Knows nothing about OpenAI. Three flavours: ``h2`` (the default, ``extproc.h2server``) and
two on grpcio (``aio``, ``threads``: the reference behaviour, slower here). ``serve(settings)`` blocks until SIGTERM/SIGINT, then marks
the service NOT_SERVING and drains in-flight streams for a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent import futures

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.epp import EppStats, EppStream
from extproc.processor import CONTINUE, Gateway
from extproc.h2server import H2Server, serve_h2
from extproc.health_port import ServerLifecycle
from extproc.serving_cert import ServingCert
from extproc.wire import HEALTH_SERVICES, NO_PHASE, head_from_attributes, request_head, to_response

__all__ = ["ExternalProcessor", "H2Server", "build_server", "serve", "serve_aio", "serve_h2"]

log = logging.getLogger(__name__)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, gateway: Gateway, protocol: str = "ace") -> None:
        self.gateway = gateway
        self.epp = EppStats() if protocol == "epp" else None

    def Process(self, request_iterator, context):
        if self.epp is not None:   # the endpoint picker protocol: extproc.epp answers
            stream = EppStream(self.gateway, self.epp)
            for msg in request_iterator:
                yield from stream.handle(msg)
            return
        exchange = self.gateway.exchange()
        for msg in request_iterator:
            phase = msg.WhichOneof("request")
            if phase == "request_headers":
                outcome = exchange.on_request_headers(request_head(msg.request_headers))
            elif phase == "request_body":
                outcome = exchange.on_request_body(
                    msg.request_body.body,
                    head_from_attributes(msg) if exchange.handler is None else None)
            elif phase == "response_body":
                outcome = exchange.on_response_body(msg.response_body.body)
            elif phase is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_PHASE)
            else:
                outcome = CONTINUE
            yield to_response(phase, outcome)
            if exchange.done_after(phase):
                return   # ends the stream: Envoy needs us no more for this request


class AioExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The same loop on grpc.aio with the read/write API: one thread, no hand-offs."""

    def __init__(self, gateway: Gateway, protocol: str = "ace") -> None:
        self.gateway = gateway
        self.epp = EppStats() if protocol == "epp" else None

    async def Process(self, request_iterator, context):
        read, write, eof = context.read, context.write, grpc.aio.EOF
        if self.epp is not None:   # the endpoint picker protocol: extproc.epp answers
            stream = EppStream(self.gateway, self.epp)
            while (msg := await read()) is not eof:
                for answer in stream.handle(msg):
                    await write(answer)
            return
        exchange = self.gateway.exchange()
        while True:
            msg = await read()
            if msg is eof:
                return
            phase = msg.WhichOneof("request")
            if phase == "request_body":
                outcome = exchange.on_request_body(
                    msg.request_body.body,
                    head_from_attributes(msg) if exchange.handler is None else None)
            elif phase == "request_headers":
                outcome = exchange.on_request_headers(request_head(msg.request_headers))
            elif phase == "response_body":
                outcome = exchange.on_response_body(msg.response_body.body)
            elif phase is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, NO_PHASE)
            else:
                outcome = CONTINUE
            await write(to_response(phase, outcome))
            if exchange.done_after(phase):
                return   # ends the stream: Envoy needs us no more for this request


def _add_port(server, listen: str, tls: ServingCert | None) -> int:
    if tls is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)]))


async def serve_aio(gateway: Gateway, listen: str, grace_s: float = 5.0, protocol: str = "ace",
                    tls: ServingCert | None = None, lifecycle: ServerLifecycle | None = None) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(AioExternalProcessor(gateway, protocol), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, listen, tls)
    for name in HEALTH_SERVICES:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.start()
    log.info("ext_proc (aio) listening on %s (port %d)", listen, port)
    if lifecycle is not None:
        lifecycle.serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if lifecycle is not None:
        lifecycle.draining()
    await health_servicer.enter_graceful_shutdown()
    await server.stop(grace_s)
    log.info("ext_proc stopped")


def build_server(gateway: Gateway, listen: str, workers: int, protocol: str = "ace",
                 tls: ServingCert | None = None) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                         options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(gateway, protocol), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, listen, tls)
    for name in HEALTH_SERVICES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer, port


def serve(gateway: Gateway, listen: str, workers: int, grace_s: float = 5.0, protocol: str = "ace",
          tls: ServingCert | None = None, lifecycle: ServerLifecycle | None = None) -> None:
    server, health_servicer, port = build_server(gateway, listen, workers, protocol, tls)
    server.start()
    log.info("ext_proc listening on %s (port %d)", listen, port)
    if lifecycle is not None:
        lifecycle.serving()
    stop = threading.Event()

    def on_signal(signum, frame):
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    stop.wait()
    if lifecycle is not None:
        lifecycle.draining()
    health_servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait()
    log.info("ext_proc stopped")
