"""The agent's gRPC API over a real loopback grpc.aio server, fake engine behind it."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from gpu_agent.service import SERVICE_NAME, start_server

from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager
from tests.support.certs import make_certs, needs_openssl
from tests.support.wait import async_wait_until, scaled

NAMES = ["a1", "a2", "a3"]
TOKEN = "s3cret-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


def run(coro):
    return asyncio.run(coro)


class Agent:
    def __init__(self, tmp_path, token=TOKEN, tls=None, **budgets):
        self.tmp_path, self.token, self.tls, self.budgets = tmp_path, token, tls, budgets

    async def __aenter__(self):
        self.engine = FakeConnector(capacity=self.budgets.pop("capacity", None),
                                    load_delay_s=self.budgets.pop("load_delay_s", 0.0))
        self.manager = make_manager(make_catalog(self.tmp_path, NAMES), self.tmp_path / "cache",
                                    self.engine, **self.budgets)
        await self.manager.start()
        self.server, self.port, self.health_task = await start_server(
            self.manager, "127.0.0.1", 0, token=self.token, tls=self.tls)
        return self

    async def __aexit__(self, *exc):
        self.health_task.cancel()
        await self.server.stop(grace=None)
        await self.manager.close()


def test_prefetch_status_evict_pin_roundtrip(tmp_path):
    async def main():
        async with Agent(tmp_path) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                st = await stub.Status(pb.StatusRequest(adapter="a1"), metadata=AUTH)
                assert st.tier == pb.TIER_DISK and not st.HasField("cold_load_ms") and st.bytes == 4096
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="a1", priority=1, reason="t"), metadata=AUTH)
                assert r.outcome == pb.PrefetchReply.ACCEPTED
                await async_wait_until(lambda: agent.manager.view("a1").tier.value == "device")
                st = await stub.Status(pb.StatusRequest(adapter="a1"), metadata=AUTH)
                assert st.tier == pb.TIER_DEVICE and st.cold_load_ms > 0 and st.digest
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="a1"), metadata=AUTH)
                assert r.outcome == pb.PrefetchReply.ALREADY_RESIDENT
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="../a1"), metadata=AUTH)
                assert (r.outcome, r.reason) == (pb.PrefetchReply.REJECTED, "unknown_adapter")
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="a2", digest="ab" * 32), metadata=AUTH)
                assert (r.outcome, r.reason) == (pb.PrefetchReply.REJECTED, "digest_mismatch")
                p = await stub.Pin(pb.PinRequest(adapter="a1"), metadata=AUTH)
                assert p.ok and p.status.pinned
                e = await stub.Evict(pb.EvictRequest(adapter="a1"), metadata=AUTH)
                assert not e.evicted and e.reason == "pinned"
                await stub.Unpin(pb.PinRequest(adapter="a1"), metadata=AUTH)
                e = await stub.Evict(pb.EvictRequest(adapter="a1"), metadata=AUTH)
                assert e.evicted and e.status.tier == pb.TIER_DISK
                assert "a1" not in agent.engine.held
                st = await stub.Status(pb.StatusRequest(adapter="nope"), metadata=AUTH)
                assert st.tier == pb.TIER_ABSENT
    run(main())


def test_prefetch_returns_at_once_while_load_is_slow(tmp_path):
    async def main():
        async with Agent(tmp_path, load_delay_s=3.0) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                t0 = asyncio.get_running_loop().time()
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="a2"), metadata=AUTH)
                r2 = await stub.Prefetch(pb.PrefetchRequest(adapter="a2"), metadata=AUTH)
                assert asyncio.get_running_loop().time() - t0 < 1.5  # the load takes 3 s
                assert r.outcome == pb.PrefetchReply.ACCEPTED and r2.reason == "coalesced"
                st = await stub.Status(pb.StatusRequest(adapter="a2"), metadata=AUTH)
                assert st.loading
    run(main())


def test_prefetch_evict_list_reaches_the_manager(tmp_path):
    async def main():
        async with Agent(tmp_path, capacity=2) as agent:
            await agent.manager.ensure_resident("a1")            # LRU
            await agent.manager.ensure_resident("a2")
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                r = await stub.Prefetch(pb.PrefetchRequest(adapter="a3", evict=["a2", "no-such"]), metadata=AUTH)
                assert r.outcome == pb.PrefetchReply.ACCEPTED
                await async_wait_until(lambda: agent.manager.view("a3").tier.value == "device")
            assert set(agent.engine.held) == {"a1", "a3"}         # the hint went, not the LRU
    run(main())


def test_watch_residency_streams_snapshot_then_changes(tmp_path):
    async def main():
        async with Agent(tmp_path) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                call = stub.WatchResidency(pb.WatchRequest(), metadata=AUTH)
                initial = []
                async for ev in call:
                    if ev.kind == pb.ResidencyEvent.SYNC:
                        break
                    initial.append(ev.status.adapter)
                assert sorted(initial) == NAMES
                await stub.Prefetch(pb.PrefetchRequest(adapter="a3"), metadata=AUTH)
                async for ev in call:
                    assert ev.kind == pb.ResidencyEvent.CHANGE and ev.engine_up
                    if ev.status.adapter == "a3" and ev.status.tier == pb.TIER_DEVICE:
                        assert ev.status.cold_load_ms > 0
                        break
                call.cancel()
    run(main())


def test_watch_residency_carries_the_engine_load(tmp_path):
    """LOAD events when the load changes (no status), and every other event carries the
    load as last measured; unknown = the field unset."""
    from gpu_agent.connectors.base import EngineLoad

    async def main():
        async with Agent(tmp_path, load_interval_s=0.01) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                call = stub.WatchResidency(pb.WatchRequest(), metadata=AUTH)
                events = aiter(call)

                async def next_of(kind):
                    while True:
                        ev = await anext(events)
                        if ev.kind == kind:
                            return ev

                sync = await next_of(pb.ResidencyEvent.SYNC)
                assert not sync.HasField("load")                   # the fake engine says nothing yet
                agent.engine.engine_load_value = EngineLoad(running=3, waiting=1)
                ev = await next_of(pb.ResidencyEvent.LOAD)
                assert (ev.load.running, ev.load.waiting) == (3, 1) and ev.load.measured_unix_ms > 0
                assert not ev.HasField("status") and ev.engine_up
                await stub.Prefetch(pb.PrefetchRequest(adapter="a1"), metadata=AUTH)
                ev = await next_of(pb.ResidencyEvent.CHANGE)
                assert ev.status.adapter == "a1" and (ev.load.running, ev.load.waiting) == (3, 1)
                agent.engine.engine_load_value = None
                ev = await next_of(pb.ResidencyEvent.LOAD)
                while ev.HasField("load"):   # a heartbeat of the old load may come first
                    assert (ev.load.running, ev.load.waiting) == (3, 1)
                    ev = await next_of(pb.ResidencyEvent.LOAD)
                assert not ev.HasField("load")
                call.cancel()
    run(main())


def test_token_auth_required_but_health_open(tmp_path):
    async def main():
        async with Agent(tmp_path) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                stub = pb_grpc.AgentStub(ch)
                for md in (None, (("authorization", "Bearer wrong"),)):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await stub.Status(pb.StatusRequest(adapter="a1"), metadata=md)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.WatchResidency(pb.WatchRequest()):
                        pass
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                # bytes that are no message, without the token: refused before any parse
                for raw in (b"\xff\xff\xff", b"\x0a\x02\xc3\xff"):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await ch.unary_unary("/ace.agent.v1.Agent/Prefetch")(raw)
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                health = health_pb2_grpc.HealthStub(ch)
                h = await health.Check(health_pb2.HealthCheckRequest(service=""))
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                h = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert h.status == health_pb2.HealthCheckResponse.SERVING
    run(main())


def test_health_follows_engine(tmp_path):
    async def main():
        async with Agent(tmp_path, reconcile_interval_s=0.05) as agent:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{agent.port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)
                NS = health_pb2.HealthCheckResponse.NOT_SERVING
                watch = health.Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))

                async def statuses():
                    seen = []
                    async for h in watch:          # the current status, then each change
                        seen.append(h.status)
                        if h.status == health_pb2.HealthCheckResponse.SERVING:
                            agent.engine.down = True
                        if h.status == NS:
                            return seen
                seen = await asyncio.wait_for(statuses(), scaled(10))
                watch.cancel()
                assert health_pb2.HealthCheckResponse.SERVING in seen and seen[-1] == NS
                h = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
                assert h.status == NS
    run(main())


@needs_openssl
def test_mtls_requires_a_client_certificate(tmp_path):
    certs = make_certs(tmp_path / "certs")

    async def main():
        tls = (certs / "server.pem", certs / "server.key", certs / "ca.pem")
        async with Agent(tmp_path, token=None, tls=tls) as agent:
            ca = (certs / "ca.pem").read_bytes()
            good = grpc.ssl_channel_credentials(ca, (certs / "client.key").read_bytes(),
                                                (certs / "client.pem").read_bytes())
            async with grpc.aio.secure_channel(f"127.0.0.1:{agent.port}", good) as ch:
                st = await pb_grpc.AgentStub(ch).Status(pb.StatusRequest(adapter="a1"), timeout=10)
                assert st.tier == pb.TIER_DISK
            anon = grpc.ssl_channel_credentials(ca)
            async with grpc.aio.secure_channel(f"127.0.0.1:{agent.port}", anon) as ch:
                with pytest.raises(grpc.aio.AioRpcError):
                    await pb_grpc.AgentStub(ch).Status(pb.StatusRequest(adapter="a1"), timeout=10)
    run(main())
