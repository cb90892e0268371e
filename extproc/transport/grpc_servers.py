"""The grpcio servers: ext_proc streams (``extproc.transport.dispatch``) and the standard health service.

Transports only: they know nothing about OpenAI nor the phases. Three flavours: ``h2``
(the default, ``extproc.transport.h2server``) and two on grpcio (``aio``, ``threads``: the reference
behaviour, slower here). ``serve(gateway, listen, workers, ...)`` (threads) and
``serve_aio(gateway, listen, ...)`` block until SIGTERM/SIGINT, then mark the
service NOT_SERVING, serves on until a successor listens (``handover_s``: extproc.transport.handover)
and drains in-flight streams for a grace period.
"""
from __future__ import annotations

import asyncio
import logging
import signal
import threading
from concurrent import futures
from typing import TYPE_CHECKING

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2_grpc

from extproc.transport.dispatch import Dispatcher, ServingHealth
from extproc.errors import InvalidMessage
from extproc.protocols.wire import parse_request, pb
from extproc.transport.handover import await_handover, serve_until_signal
from extproc.transport.h2server import H2Server, serve_h2
from extproc.transport.health_port import ServerLifecycle
from extproc.transport.serving_cert import ServingCert

if TYPE_CHECKING:
    from extproc.app.context import Gateway

__all__ = ["ExternalProcessor", "AioExternalProcessor", "H2Server", "build_server", "serve",
           "serve_aio", "serve_h2"]

log = logging.getLogger(__name__)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``Process`` on grpcio's thread pool: a stream of ``extproc.transport.dispatch`` per call."""

    def __init__(self, gateway: Gateway, protocol: str = "ace") -> None:
        self.dispatcher = Dispatcher(gateway, protocol)

    def Process(self, request_iterator, context):
        stream = self.dispatcher.open()
        for msg in request_iterator:
            try:
                answers = stream.answer(msg)
            except InvalidMessage as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            yield from answers
            if stream.ended:
                return   # ends the stream: Envoy needs us no more for this request


class AioExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """The same on grpc.aio with the read/write API: one thread, no hand-offs."""

    def __init__(self, gateway: Gateway, protocol: str = "ace") -> None:
        self.dispatcher = Dispatcher(gateway, protocol)

    async def Process(self, request_iterator, context):
        read, write, eof = context.read, context.write, grpc.aio.EOF
        stream = self.dispatcher.open()
        while (msg := await read()) is not eof:
            try:
                answers = stream.answer(msg)
            except InvalidMessage as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            for answer in answers:
                await write(answer)
            if stream.ended:
                return   # ends the stream: Envoy needs us no more for this request


def _add_processor(server, servicer: pb_grpc.ExternalProcessorServicer) -> None:
    """``add_ExternalProcessorServicer_to_server``, but a message that does not parse reaches
    ``Process`` as ``wire.UNREADABLE`` (``wire.parse_request``), answered with a 400, instead of
    grpcio ending the call INTERNAL (a 503 from a fail-closed Envoy)."""
    handler = grpc.method_handlers_generic_handler("envoy.service.ext_proc.v3.ExternalProcessor", {
        "Process": grpc.stream_stream_rpc_method_handler(
            servicer.Process, request_deserializer=parse_request,
            response_serializer=pb.ProcessingResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))


def _add_port(server, listen: str, tls: ServingCert | None) -> int:
    if tls is None:
        return server.add_insecure_port(listen)
    return server.add_secure_port(listen, grpc.ssl_server_credentials([(tls.key_pem, tls.cert_pem)]))


# SO_REUSEPORT: a successor binds beside us while we hand over (extproc.transport.handover)
_OPTIONS = [("grpc.so_reuseport", 1)]


async def serve_aio(gateway: Gateway, listen: str, grace_s: float = 5.0, protocol: str = "ace",
                    tls: ServingCert | None = None, lifecycle: ServerLifecycle | None = None,
                    handover_s: float = 0.0) -> None:
    server = grpc.aio.server(options=_OPTIONS)
    _add_processor(server, AioExternalProcessor(gateway, protocol))
    health_servicer = await ServingHealth().grpcio_aio_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, listen, tls)
    await server.start()
    log.info("ext_proc (aio) listening on %s (port %d)", listen, port)
    await serve_until_signal(lifecycle)
    await health_servicer.enter_graceful_shutdown()
    await await_handover(listen, handover_s)
    await server.stop(grace_s)
    log.info("ext_proc stopped")


def build_server(gateway: Gateway, listen: str, workers: int, protocol: str = "ace",
                 tls: ServingCert | None = None) -> tuple[grpc.Server, health.HealthServicer, int]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_OPTIONS)
    _add_processor(server, ExternalProcessor(gateway, protocol))
    health_servicer = ServingHealth().grpcio_servicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = _add_port(server, listen, tls)
    return server, health_servicer, port


def serve(gateway: Gateway, listen: str, workers: int, grace_s: float = 5.0, protocol: str = "ace",
          tls: ServingCert | None = None, lifecycle: ServerLifecycle | None = None,
          handover_s: float = 0.0) -> None:
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
    asyncio.run(await_handover(listen, handover_s))   # the pool's threads serve meanwhile
    server.stop(grace_s).wait()
    log.info("ext_proc stopped")
