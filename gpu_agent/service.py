"""The agent's gRPC API: a thin translation between the wire and `ResidencyManager`.

Decisions live in the manager; this module converts messages, maps outcomes to replies,
checks credentials and serves standard gRPC health (`grpc.health.v1`, open without
credentials so probes work): "" is SERVING while the server runs, `ace.agent.v1.Agent`
is NOT_SERVING while the engine is unreachable.
"""
from __future__ import annotations

import asyncio
import hmac
import logging
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from gpu_agent.connectors.base import EngineLoad
from gpu_agent.errors import AgentError
from gpu_agent.load import LoadChange
from gpu_agent.residency.manager import AdapterView, ResidencyManager, ResidencyOutcome, ResidencyResult
from ace_common.tiers import Tier

__all__ = ["AgentService", "TokenAuth", "start_server", "view_to_pb", "load_to_pb", "SERVICE_NAME"]

log = logging.getLogger(__name__)
SERVICE_NAME = "ace.agent.v1.Agent"

_TIER_TO_PB = {Tier.DEVICE: pb.TIER_DEVICE, Tier.HOST: pb.TIER_HOST, Tier.DISK: pb.TIER_DISK,
               Tier.REMOTE: pb.TIER_REMOTE, Tier.ABSENT: pb.TIER_ABSENT}
_PB_TO_TIER = {v: k for k, v in _TIER_TO_PB.items()}
_PREFETCH_OUTCOME = {ResidencyOutcome.ACCEPTED: pb.PrefetchReply.ACCEPTED,
                     ResidencyOutcome.ALREADY_RESIDENT: pb.PrefetchReply.ALREADY_RESIDENT,
                     ResidencyOutcome.REJECTED: pb.PrefetchReply.REJECTED}


def view_to_pb(view: AdapterView) -> pb.AdapterStatus:
    msg = pb.AdapterStatus(adapter=view.name, tier=_TIER_TO_PB[view.tier], bytes=view.bytes,
                           pinned=view.pinned, digest=view.digest, loading=view.loading,
                           loaded_by=view.loaded_by)
    if view.cold_load_ms is not None:
        msg.cold_load_ms = view.cold_load_ms
    return msg


def load_to_pb(load: EngineLoad | None) -> pb.EngineLoad | None:
    if load is None:
        return None
    return pb.EngineLoad(running=load.running, waiting=load.waiting, measured_unix_ms=load.measured_unix_ms)


class AgentService(pb_grpc.AgentServicer):
    def __init__(self, manager: ResidencyManager):
        self.manager = manager

    async def Prefetch(self, request, context):
        result = self.manager.prefetch(
            request.adapter, request.digest, request.priority, request.reason, evict=request.evict,
            keep=request.keep, room_only=request.room_only,
            probability=request.probability if request.HasField("probability") else None,
            victim_reuse_probability=(request.victim_reuse_probability
                                      if request.HasField("victim_reuse_probability") else None))
        return pb.PrefetchReply(outcome=_PREFETCH_OUTCOME[result.outcome], reason=result.reason)

    async def Status(self, request, context):
        return view_to_pb(self.manager.view(request.adapter))

    def _event(self, kind, seq: int, view: AdapterView | None = None, *,
                load: EngineLoad | None = None) -> pb.ResidencyEvent:
        """Every event carries the host's facts: engine up, base model bytes, device slots,
        the speculation budget's waste share, whether the engine brings a request's adapter
        itself (the gateway's request signals redundant), engine load."""
        return pb.ResidencyEvent(kind=kind, seq=seq, status=view_to_pb(view) if view is not None else None,
                                 engine_up=self.manager.engine_up,
                                 base_model_bytes=self.manager.base_model_bytes,
                                 device_slots=self.manager.device_slots,
                                 prefetch_waste_share=self.manager.prefetch_waste_share,
                                 request_signals_redundant=self.manager.request_signals_redundant,
                                 load=load_to_pb(load if kind == pb.ResidencyEvent.LOAD
                                                 else self.manager.engine_load))

    async def WatchResidency(self, request, context):
        sub = self.manager.subscribe()
        try:
            seq = 0
            for view in self.manager.snapshot():
                seq += 1
                yield self._event(pb.ResidencyEvent.INITIAL, seq, view)
            seq += 1
            yield self._event(pb.ResidencyEvent.SYNC, seq)
            async for item in sub:
                if item is None:  # the manager is shutting down
                    return
                seq += 1
                if isinstance(item, LoadChange):
                    yield self._event(pb.ResidencyEvent.LOAD, seq, load=item.load)
                else:
                    yield self._event(pb.ResidencyEvent.CHANGE, seq, item)
        finally:
            sub.close()

    async def Evict(self, request, context):
        down_to = _PB_TO_TIER.get(request.down_to, Tier.DISK)
        try:
            result = await self.manager.evict(request.adapter, down_to)
        except AgentError as exc:  # the engine failed the unload: an error, answered as a refusal
            result = ResidencyResult(ResidencyOutcome.REJECTED, f"engine_error: {exc}")
        return pb.EvictReply(evicted=result.ok, reason=result.reason,
                             status=view_to_pb(self.manager.view(request.adapter)))

    async def Pin(self, request, context):
        result = self.manager.pin(request.adapter)
        return pb.PinReply(ok=result.ok, reason=result.reason, status=view_to_pb(self.manager.view(request.adapter)))

    async def Unpin(self, request, context):
        result = self.manager.unpin(request.adapter)
        return pb.PinReply(ok=result.ok, reason=result.reason, status=view_to_pb(self.manager.view(request.adapter)))


class TokenAuth(grpc.aio.ServerInterceptor):
    """Requires `authorization: Bearer <token>` on every RPC except health checks."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1.Health/"):
            return handler
        got = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler
        return _deny(handler)


def _deny(handler):
    async def unary(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid agent token")

    async def stream(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid agent token")
        yield  # pragma: no cover - makes this an async generator

    # the request is not parsed: a peer without the token never reaches the protobuf parser
    # (its garbage was an UNKNOWN and a logged traceback per call, not UNAUTHENTICATED)
    kw = dict(request_deserializer=None, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(stream, **kw)
    return grpc.unary_unary_rpc_method_handler(unary, **kw)


async def start_server(manager: ResidencyManager, host: str = "127.0.0.1", port: int = 0, *,
                       token: str | None = None, tls: tuple[Path, Path, Path] | None = None
                       ) -> tuple[grpc.aio.Server, int, asyncio.Task]:
    """Start the gRPC server; returns (server, bound port, health-updating task).

    `token`: shared-token auth; `tls`: (cert, key, client CA) for mTLS (client
    certificates required). Neither: no authentication (loopback tests only).
    """
    interceptors = [TokenAuth(token)] if token else []
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_AgentServicer_to_server(AgentService(manager), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{host}:{port}"
    if tls is not None:
        cert, key, ca = (Path(p).read_bytes() for p in tls)
        creds = grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=True)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)

    async def follow_engine() -> None:
        last = None
        while True:
            status = (health_pb2.HealthCheckResponse.SERVING if manager.engine_up
                      else health_pb2.HealthCheckResponse.NOT_SERVING)
            if status != last:
                await health_servicer.set(SERVICE_NAME, status)
                last = status
            await asyncio.sleep(0.5)

    return server, bound, asyncio.create_task(follow_engine())
