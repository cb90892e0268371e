"""The plaintext gRPC health port beside the ext_proc port (``--health-listen``).

With ``--protocol epp`` the ext_proc port speaks TLS, and the kubelet's ``grpc:`` probe
speaks plaintext only. As the inference extension's reference picker does (port 9003),
a second port serves ``grpc.health.v1.Health`` (Check and Watch) without TLS, for the
services ``liveness``, ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor``
and ``""``. It follows the ext_proc server, which tells it ``serving()`` once it
listens and ``draining()`` when SIGTERM/SIGINT starts its drain (``ServerLifecycle``):

===========  =========  ===========  =====================
phase        liveness   readiness    ext_proc service, ""
===========  =========  ===========  =====================
starting     SERVING    NOT_SERVING  NOT_SERVING
serving      SERVING    SERVING      SERVING
draining     SERVING    NOT_SERVING  NOT_SERVING
===========  =========  ===========  =====================

Liveness stays SERVING while the server drains: the kubelet must not restart a pod that
is finishing its streams. It says the process is up, not that the ext_proc loop answers
(the port runs on grpcio's own threads); the ext_proc port's own health service, which
the gateway checks, answers on that loop. Any other service name: NOT_FOUND (Check),
SERVICE_UNKNOWN (Watch).
"""
from __future__ import annotations

import logging
from concurrent import futures
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc.errors import ConfigError
from extproc.protocols.wire import SERVICE

__all__ = ["DEFAULT_PORT", "LIVENESS", "READINESS", "HealthPort", "ServerLifecycle"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 9003   # the reference endpoint picker's gRPC health port
LIVENESS, READINESS = "liveness", "readiness"
#: the services that follow readiness
_READY_SERVICES = (READINESS, SERVICE, "")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ServerLifecycle(Protocol):
    """What an ext_proc server tells whoever reports its health (``extproc.transport.grpc_servers``)."""

    def serving(self) -> None:
        """The ext_proc port listens and answers."""

    def draining(self) -> None:
        """SIGTERM/SIGINT: no new streams wanted; open ones finish (the grace period)."""


class HealthPort:
    """``grpc.health.v1.Health`` on its own plaintext port; a ``ServerLifecycle``.
    ``start()`` binds (a ``ConfigError`` when it cannot), ``stop()`` closes."""

    def __init__(self, listen: str) -> None:
        self.listen = listen
        self.servicer = health.HealthServicer()   # Watch without a thread per watcher
        self.servicer.set(LIVENESS, _SERVING)
        for name in _READY_SERVICES:
            self.servicer.set(name, _NOT_SERVING)
        self._server: grpc.Server | None = None
        self.port = 0

    def start(self) -> "HealthPort":
        # SO_REUSEPORT: a successor binds beside us while we hand over (extproc.transport.handover)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="health"),
                             options=[("grpc.so_reuseport", 1)])
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        try:
            self.port = server.add_insecure_port(self.listen)
        except RuntimeError as exc:   # grpcio: "Failed to bind to address ..."
            raise ConfigError(f"--health-listen {self.listen}: {exc}") from exc
        server.start()
        self._server = server
        log.info("gRPC health (plaintext) on %s (port %d)", self.listen, self.port)
        return self

    def serving(self) -> None:
        for name in _READY_SERVICES:
            self.servicer.set(name, _SERVING)

    def draining(self) -> None:
        for name in _READY_SERVICES:
            self.servicer.set(name, _NOT_SERVING)

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None
