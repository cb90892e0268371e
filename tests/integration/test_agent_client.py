"""The gateway's AgentLink against a real agent gRPC server (fake engine behind it).

The agent runs on its own event loop in a thread, like a separate process would; the
link is the threaded client the ext_proc uses. Covers: prefetch -> residency seen by the
gateway, agent down or slow never blocks `submit`, reconnect when the agent comes back,
the engine's load travelling into the gateway's snapshot (and leaving it when stale).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from dataclasses import replace

import grpc
import pytest

from extproc.fleet.agent_link import AgentLink, AgentTLS
from extproc.domain.prefetch import REQUEST_COLD, REQUEST_UNKNOWN, PrefetchSignal
from extproc.state.residency import SentCounts
from extproc.settings import Settings
from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from gpu_agent.service import start_server
from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager
from tests.extproc.builders import write_state
from tests.support.certs import make_certs, needs_openssl
from tests.support.procs import extproc_process, free_port
from tests.support.wait import scaled, wait_until

TOKEN = "link-token"
NAMES = ["a1", "a2", "a3"]


class AgentThread:
    """A real agent (manager + gRPC server) on its own loop, started/stopped on a fixed port."""

    def __init__(self, tmp_path, port: int, load_delay_s: float = 0.0, capacity: int | None = None,
                 load_interval_s: float = 0.5, token: str | None = TOKEN, tls=None,
                 request_signals_redundant: bool = False, **budgets):
        self.tmp_path, self.port, self.load_delay_s = tmp_path, port, load_delay_s
        self.budgets = budgets  # more ResidencyBudgets
        self.token, self.tls = token, tls
        self.capacity, self.load_interval_s = capacity, load_interval_s
        self.request_signals_redundant = request_signals_redundant
        self.catalog = make_catalog(tmp_path, NAMES)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.manager = None

    def _run(self, coro, timeout=30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        async def up():
            self.engine = FakeConnector(capacity=self.capacity, load_delay_s=self.load_delay_s)
            self.engine.request_signals_redundant = self.request_signals_redundant
            self.manager = make_manager(self.catalog, self.tmp_path / "cache", self.engine,
                                        load_interval_s=self.load_interval_s, **self.budgets)
            await self.manager.start()
            self.server, _, self.health = await start_server(self.manager, "127.0.0.1", self.port,
                                                             token=self.token, tls=self.tls)
        self._run(up())

    def stop(self) -> None:
        async def down():
            self.health.cancel()
            await self.server.stop(grace=None)
            await self.manager.close()
        if self.manager is not None:
            self._run(down())
            self.manager = None

    def close(self) -> None:
        self.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@contextlib.contextmanager
def linked(agent: AgentThread):
    """``agent`` started, and a link to it as upstream ``u1`` once it has the agent's view;
    both closed after."""
    agent.start()
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: "u1" in link.board.current.by_upstream, what="the agent's view")
        yield link
    finally:
        link.close()
        agent.close()


@pytest.fixture
def agent(tmp_path):
    a = AgentThread(tmp_path, free_port())
    a.start()
    yield a
    a.close()


def signal(adapter: str, upstream: str = "u1") -> PrefetchSignal:
    return PrefetchSignal(upstream=upstream, adapter=adapter, digest="", priority=1, reason="test")


def test_prefetch_through_the_link_shows_up_as_prefetched_device_residency(agent):
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk")
        assert link.board.current.of("u1", "a1").cold_load_ms is None
        assert link.submit(signal("a1"))
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "device")
        res = link.board.current.of("u1", "a1")
        assert res.prefetched and res.cold_load_ms > 0 and res.bytes == 4096
        assert not link.submit(signal("a1", upstream="no-such-upstream"))
        assert link.board.current.of("u1", "nope").tier == "unknown"
    finally:
        link.close()


@contextlib.contextmanager
def two_resident(tmp_path):
    """A real agent whose engine holds 2 adapters, a1 and a2 loaded through the link (a1
    least recently used), and the link: (agent, link); both closed after."""
    agent = AgentThread(tmp_path, free_port(), capacity=2)
    agent.start()
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN).start()
    try:
        for name in ("a1", "a2"):
            assert link.submit(signal(name))
            wait_until(lambda n=name: link.board.current.of("u1", n).tier == "device")
        yield agent, link
    finally:
        link.close()
        agent.close()


def test_a_signals_evict_list_travels_to_the_agent(tmp_path):
    with two_resident(tmp_path) as (agent, link):       # a1 least recently used
        assert link.submit(PrefetchSignal(upstream="u1", adapter="a3", digest="", priority=0,
                                          reason="predicted", evict=("a2",)))
        wait_until(lambda: link.board.current.of("u1", "a3").tier == "device")
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "disk")
        assert link.board.current.of("u1", "a1").tier == "device"
        assert set(agent.engine.held) == {"a1", "a3"}


def test_agent_down_signals_are_tried_and_counted_and_residency_is_unknown(tmp_path):
    port = free_port()   # nothing listens there
    link = AgentLink({"u1": f"127.0.0.1:{port}"}, token=TOKEN, queue_size=8).start()
    try:
        results = [link.submit(signal("a1")) for _ in range(1000)]
        agent = link.agents["u1"]
        assert results.count(False) == agent.queue.dropped     # bounded queue, drops counted
        wait_until(lambda: agent.failed == results.count(True), what="every queued signal tried")
        assert agent.sent == 0
        assert link.board.current.of("u1", "a1").tier == "unknown"
    finally:
        link.close()


@contextlib.contextmanager
def servicer_in_thread(servicer):
    """A grpc.aio server of ``servicer`` on its own event loop thread: yields (loop, port)."""
    loop = asyncio.new_event_loop()
    th = threading.Thread(target=loop.run_forever, daemon=True)
    th.start()

    async def up():
        server = grpc.aio.server()
        pb_grpc.add_AgentServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(up(), loop).result(scaled(10))
    try:
        yield loop, port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(scaled(10))
        loop.call_soon_threadsafe(loop.stop)
        th.join(scaled(5))


def test_a_stuck_agent_never_blocks_submit(tmp_path):
    """An agent whose Prefetch handler does not answer: the sender waits, the request path
    does not. Proved with the sender stuck in a call: submit returns at once, the bounded
    queue fills and further signals are dropped and counted; a short deadline frees it."""
    received: list[str] = []

    class Stuck(pb_grpc.AgentServicer):
        async def Prefetch(self, request, context):
            received.append(request.adapter)
            if request.adapter == "never":
                await asyncio.Event().wait()   # until the client's deadline cancels it
            await gate.wait()
            return pb.PrefetchReply(outcome=pb.PrefetchReply.ACCEPTED)

    gate = asyncio.Event()      # set from the server's loop: call_soon_threadsafe
    with servicer_in_thread(Stuck()) as (loop, port):
        link = AgentLink({"u1": f"127.0.0.1:{port}"}, queue_size=4, send_timeout_s=scaled(60)).start()
        quick = AgentLink({"u1": f"127.0.0.1:{port}"}, send_timeout_s=0.2).start()
        try:
            agent = link.agents["u1"]
            assert link.submit(signal("first"))
            wait_until(lambda: received == ["first"], what="the sender in its first call")
            results: list[bool] = []
            submitter = threading.Thread(target=lambda: results.extend(
                link.submit(signal(f"a{i}")) for i in range(200)))
            submitter.start()
            wait_until(lambda: not submitter.is_alive(), what="200 submits returned while the sender is stuck")
            assert results == [True] * 4 + [False] * 196 and agent.queue.dropped == 196
            assert received == ["first"] and agent.sent == 0        # the sender was stuck throughout
            loop.call_soon_threadsafe(gate.set)
            wait_until(lambda: agent.sent == 5, what="the queue drained once the agent answers")
            # the gateway's deadline (send_timeout_s) frees a sender the agent never answers
            assert quick.submit(signal("never"))
            wait_until(lambda: quick.agents["u1"].failed == 1, what="deadline exceeded, counted")
            assert quick.agents["u1"].sent == 0
        finally:
            link.close()
            quick.close()


def test_link_reconnects_when_the_agent_comes_back(tmp_path):
    agent = AgentThread(tmp_path, free_port())
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN, backoff_max_s=0.5).start()
    try:
        wait_until(lambda: link.agents["u1"].stream_errors >= 1, what="a failed attempt")
        assert link.board.current.of("u1", "a2").tier == "unknown"    # agent not started yet
        agent.start()
        wait_until(lambda: link.connected("u1"))
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "disk")
        agent.stop()                                                  # agent goes away
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "unknown")
        agent.start()                                                 # and comes back
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "disk")
        assert link.submit(signal("a2"))
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "device")
    finally:
        link.close()
        agent.close()


def test_wrong_token_is_refused_and_residency_stays_unknown(agent):
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token="wrong", backoff_max_s=0.2).start()
    try:
        agent = link.agents["u1"]
        wait_until(lambda: agent.stream_errors >= 2, what="refused, retried, refused again")
        assert agent.last_error == grpc.StatusCode.UNAUTHENTICATED
        assert not link.connected("u1")
        assert link.board.current.of("u1", "a1").tier == "unknown"
    finally:
        link.close()


@pytest.fixture
def mtls_agent(tmp_path):
    """An agent that requires a client certificate signed by the test's CA."""
    certs = make_certs(tmp_path / "certs")
    a = AgentThread(tmp_path, free_port(), token=None,
                    tls=(certs / "server.pem", certs / "server.key", certs / "ca.pem"))
    a.start()
    yield a, certs
    a.close()


def _agent_state(tmp_path, agent_port: int):
    return write_state(tmp_path / "gw", [{"name": "u1", "address": "127.0.0.1:8000", "flavour": "builtin",
                                          "base_model": "ace-tiny-llama", "agent": f"127.0.0.1:{agent_port}"}])


def _tls_flags(certs):
    return ["--agent-tls-ca", str(certs / "ca.pem"), "--agent-tls-cert", str(certs / "client.pem"),
            "--agent-tls-key", str(certs / "client.key")]


@needs_openssl
def test_link_over_mtls_gets_residency_and_one_without_a_client_certificate_is_refused(tmp_path, mtls_agent):
    agent, certs = mtls_agent
    settings = Settings.from_args(["--config", str(_agent_state(tmp_path, agent.port)), *_tls_flags(certs)])
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, tls=settings.agent_tls()).start()
    anonymous = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, tls=AgentTLS(ca=certs / "ca.pem"),
                          backoff_max_s=0.2).start()
    plaintext = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, backoff_max_s=0.2).start()
    try:
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk", what="residency over mTLS")
        assert link.submit(signal("a1"))                    # prefetch over the same channel
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "device", what="prefetched over mTLS")
        for refused in (anonymous, plaintext):
            wait_until(lambda r=refused: r.agents["u1"].stream_errors >= 2, what="handshakes refused")
            assert refused.agents["u1"].last_error == grpc.StatusCode.UNAVAILABLE
            assert not refused.connected("u1") and refused.board.current.of("u1", "a1").tier == "unknown"
    finally:
        for each in (link, anonymous, plaintext):
            each.close()


@needs_openssl
def test_python_m_extproc_reaches_an_mtls_agent_with_the_agent_tls_flags(tmp_path, mtls_agent):
    agent, certs = mtls_agent
    state = _agent_state(tmp_path, agent.port)
    with extproc_process(tmp_path / "gw", state, extproc_args=_tls_flags(certs)):
        wait_until(lambda: "agent u1 connected" in (tmp_path / "gw" / "extproc.log").read_text(),
                        interval=0.05, what="the gateway's link connected to the mTLS agent")


# ---- what the gateway's trace makes of agent residency (pure) ----

def _decision(res, mode="prod"):
    from extproc.state.catalog import Adapter, Upstream
    from extproc.domain.decision import Decision, _applied_action
    up = Upstream("u1", "127.0.0.1:1", "vllm", "ace-tiny-llama")
    ad = Adapter("code-python", "ace-tiny-llama", 8, ("q_proj",), 4096, "public", "adapters/x", "a" * 64)
    action = _applied_action(res)
    return Decision(upstream=up, adapter=ad, selected_by="model",
                    skills={"multi_lora": mode, "dynamic_lora_prefetch": "prod"}, residency=res,
                    multi_lora_action=action if mode == "prod" else "shadow",
                    multi_lora_would=None if mode == "prod" else action,
                    prefetch_action="not_needed", prefetch_signal=None)


@pytest.mark.parametrize("res,action,hit,saved,vram", [
    (dict(tier="device", cold_load_ms=27.5, bytes=4096, prefetched=True, base_model_bytes=3 << 20),
     "adapter_prefetched_applied", "true", "27.5", "3"),
    (dict(tier="device", cold_load_ms=27.5, bytes=4096, prefetched=False, base_model_bytes=3 << 20),
     "adapter_resident_applied", "false", "27.5", "3"),
    (dict(tier="disk", cold_load_ms=None, bytes=4096, base_model_bytes=3 << 20),
     "adapter_cold_loaded", "false", "0", "3"),
    (dict(tier="unknown", cold_load_ms=None, bytes=None), "adapter_applied", "unknown", "unknown", "unknown"),
])
def test_trace_reports_prefetch_hits_from_agent_residency(res, action, hit, saved, vram):
    from extproc.state.residency import TierReport
    from extproc.app.trace import trace_entries
    ml, _ = trace_entries(_decision(TierReport(**res)), None)
    assert (ml["action"], ml["is_prefetch_hit"], ml["swap_ms_saved"], ml["vram_mb_saved"]) == (
        action, hit, saved, vram)


def test_shadow_trace_says_what_prod_would_have_done():
    from extproc.state.residency import TierReport
    from extproc.app.trace import trace_entries
    res = TierReport("device", 12.0, 4096, prefetched=True, base_model_bytes=1 << 20)
    ml, _ = trace_entries(_decision(res, mode="shadow"), None)
    assert (ml["action"], ml["would"], ml["swap_ms_saved"]) == ("shadow", "adapter_prefetched_applied", "12")


def test_the_engines_load_travels_into_the_gateways_snapshot_while_fresh(tmp_path):
    from extproc.state.catalog import Adapter, Upstream
    from extproc.policy.routing import route
    from extproc.state.residency import ResidencySnapshot, SentCounts
    from gpu_agent.connectors.base import EngineLoad

    agent = AgentThread(tmp_path, free_port(), load_interval_s=0.02)
    agent.start()
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN, load_max_age_s=0.5).start()
    try:
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk")
        assert link.board.current.loads == {}                      # the engine says nothing yet: unknown
        agent.engine.engine_load_value = EngineLoad(running=3, waiting=4)
        wait_until(lambda: link.board.current.loads.get("u1") == 7)
        agent.engine.engine_load_value = EngineLoad(running=1, waiting=0)
        wait_until(lambda: link.board.current.loads.get("u1") == 1)
        # the routing decision reads it from the snapshot: u1 holds a2 but is overloaded
        # next to an idle host whose agent measured 0
        assert link.submit(signal("a2"))
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "device")
        agent.engine.engine_load_value = EngineLoad(running=40, waiting=10)
        wait_until(lambda: link.board.current.loads.get("u1") == 50)
        ups = [Upstream("u1", "127.0.0.1:1", "builtin", "ace-tiny-llama"),
               Upstream("u2", "127.0.0.1:2", "builtin", "ace-tiny-llama")]
        ad = Adapter("a2", "ace-tiny-llama", 8, ("q_proj",), 4096, "public", "adapters/a2", "")
        seen = link.board.current  # plus a second host, idle by its own agent's measurement
        both = ResidencySnapshot.build({**seen.by_upstream, "u2": {}}, {**seen.loads, "u2": 0})
        assert route(ups, ad, both, SentCounts()).name == "u2"
        unknown = ResidencySnapshot.build(both.by_upstream)   # no loads: residency wins, as before
        assert route(ups, ad, unknown, SentCounts()).name == "u1"
        # the engine's load becomes unknown: it leaves the snapshot, residency stays
        agent.engine.engine_load_value = None
        wait_until(lambda: "u1" not in link.board.current.loads)
        assert link.board.current.of("u1", "a2").tier == "device"
        # an agent that goes silent (no heartbeat): the load expires after load_max_age_s
        agent.manager.load_monitor.heartbeat_s = 60.0
        before = time.monotonic()            # the load below arrives after this
        agent.engine.engine_load_value = EngineLoad(running=2, waiting=0)
        wait_until(lambda: link.board.current.loads.get("u1") == 2)
        wait_until(lambda: "u1" not in link.board.current.loads)
        assert time.monotonic() - before >= 0.5      # not before load_max_age_s
        assert link.board.current.of("u1", "a2").tier == "device"
        # the agent goes away: host and load leave the view together
        agent.manager.load_monitor.heartbeat_s = 0.0  # the default: every measurement
        agent.engine.engine_load_value = EngineLoad(running=5, waiting=0)
        wait_until(lambda: link.board.current.loads.get("u1") == 5)
        agent.stop()
        wait_until(lambda: "u1" not in link.board.current.by_upstream)
        assert link.board.current.loads == {}
    finally:
        link.close()
        agent.close()


def test_a_busy_agent_still_gets_the_warm_set_with_the_default_deadline():
    """An agent busy loading (its Prefetch answers after ~1 s on a loaded host) still gets
    every signal: the default deadline is generous (the sender is off the request path)."""
    class Busy(pb_grpc.AgentServicer):
        async def Prefetch(self, request, context):
            await asyncio.sleep(1.0)
            return pb.PrefetchReply(outcome=pb.PrefetchReply.ACCEPTED)

    with servicer_in_thread(Busy()) as (_loop, port):
        link = AgentLink({"u1": f"127.0.0.1:{port}"}, queue_size=4).start()
        try:
            for name in ("a1", "a2"):
                assert link.submit(signal(name))
            wait_until(lambda: link.agents["u1"].sent + link.agents["u1"].failed >= 2)
            assert (link.agents["u1"].sent, link.agents["u1"].failed) == (2, 0)
        finally:
            link.close()


def test_discovery_adds_and_removes_agent_links(agent):
    """``set_agents`` (host discovery): a new host's link starts and its residency reaches
    the board; a removed host's link stops and its residency leaves the board, so routing
    no longer sees it; an unchanged host keeps its link."""
    link = AgentLink({}, token=TOKEN).start()
    try:
        link.set_agents({"u1": f"127.0.0.1:{agent.port}"})
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk", what="u1's residency")
        first = link.agents["u1"]
        link.set_agents({"u1": f"127.0.0.1:{agent.port}"})
        assert link.agents["u1"] is first
        link.set_agents({})
        assert "u1" not in link.agents and "u1" not in link.board.current.by_upstream
        assert not first._thread.is_alive()
        assert not link.submit(signal("a1"))
        link.set_agents({"u1": f"127.0.0.1:{agent.port}"})          # back again: a new link
        wait_until(lambda: link.connected("u1"), what="u1 reconnected")
        assert link.agents["u1"] is not first
    finally:
        link.close()


def test_a_speculations_bet_travels_to_the_agent_which_refuses_a_losing_one(tmp_path, caplog):
    agent = AgentThread(tmp_path, free_port(), capacity=2)
    agent.start()
    link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN).start()
    refused: list[tuple[str, str]] = []
    link.on_refused = lambda upstream, adapter: refused.append((upstream, adapter))
    caplog.set_level(logging.INFO, logger="extproc.fleet.agent_link")
    try:
        for name in ("a1", "a2"):
            assert link.submit(signal(name))
            wait_until(lambda n=name: link.board.current.of("u1", n).tier == "device")
        # a 1% bet that would evict what is 99% sure to be used again: the agent's budget says no
        assert link.submit(PrefetchSignal(upstream="u1", adapter="a3", digest="", priority=0, reason="predicted",
                                          evict=("a2",), probability=0.01, victim_reuse_probability=0.99))
        wait_until(lambda: "rejected prefetch of a3: not_worth" in caplog.text, what="the agent's refusal")
        # the speculation hears it (and withdraws the bet from its pool model)
        wait_until(lambda: refused == [("u1", "a3")], what="the refusal handed to on_refused")
        assert link.board.current.of("u1", "a2").tier == "device"
        # the same load without a bet (an older sender, or a request's own load): taken as before
        assert link.submit(PrefetchSignal(upstream="u1", adapter="a3", digest="", priority=0, reason="predicted",
                                          evict=("a2",)))
        wait_until(lambda: link.board.current.of("u1", "a3").tier == "device")
        assert refused == [("u1", "a3")]
    finally:
        link.close()
        agent.close()


def test_a_victim_a_request_was_just_routed_to_is_spared_on_an_engine_that_lists_requests_late(tmp_path):
    """vLLM fails a request whose adapter it unloads after accepting it, and lists the
    request as busy only later: a request's own load names no adapter the gateway just
    routed a request to there as a victim (spare_s: Upstream.victim_grace_s), and tells the
    agent to keep every such adapter, so its LRU spares them too."""
    with two_resident(tmp_path) as (agent, link):       # a1 least recently used
        link.board.sent.record("u1", "a2")                          # a request for a2 just left for u1
        assert link.submit(PrefetchSignal(upstream="u1", adapter="a3", digest="", priority=1,
                                          reason="request_cold", evict=("a2",), spare_s=3600.0))
        wait_until(lambda: link.board.current.of("u1", "a3").tier == "device")
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk")
        assert set(agent.engine.held) == {"a2", "a3"}
        # requests just left for both: no eviction may take either, the LRU's neither
        link.board.sent.record("u1", "a3")
        assert link.submit(PrefetchSignal(upstream="u1", adapter="a1", digest="", priority=1,
                                          reason="request_cold", spare_s=3600.0))
        failed = lambda: agent.manager.metrics.counter("ace_agent_load_failures_total",  # noqa: E731
                                                       reason="PoolExhausted")
        wait_until(lambda: failed() == 1, what="the load refused for want of room")
        assert set(agent.engine.held) == {"a2", "a3"}


def test_a_bet_against_a_just_routed_victim_waits_out_the_grace_once_then_goes_or_is_withdrawn():
    now = [100.0]
    link = AgentLink({})
    link.board.sent = SentCounts(clock=lambda: now[0])
    bet = PrefetchSignal(upstream="u1", adapter="a3", digest="", priority=0, reason="predicted",
                         evict=("a2",), probability=0.9, victim_reuse_probability=0.1, spare_s=0.5)
    assert link.spare_routed(bet) is bet                             # nothing routed to a2 yet
    link.board.sent.record("u1", "a2")
    now[0] += 0.2
    again, delay = link.spare_routed(bet)                            # held back for the rest of the grace
    assert again.deferred and again.evict == ("a2",) and delay == pytest.approx(0.3)
    now[0] += 0.3
    assert link.spare_routed(again) is again                         # its time came: sent as it was
    link.board.sent.record("u1", "a2")                               # routed there again meanwhile
    assert link.spare_routed(again) is None                          # withdrawn: deferred once only
    assert link.spare_routed(replace(bet, spare_s=0.0)).evict == ("a2",)   # builtin: no grace
    ingress = replace(bet, probability=None, victim_reuse_probability=None, evict=("a2", "a1"))
    sent = link.spare_routed(ingress)                                # a request's own load: sent without it,
    assert sent.evict == ("a1",) and sent.keep == ("a2",)            # and the agent told to keep it
    link.close()


def test_an_agent_announces_its_waste_share_and_the_gateway_prices_its_bets_with_it(tmp_path):
    """At hundreds x5 the gateway sent 500 bets and the agents refused 285 of them as
    ``not_worth``: the agent charges a wasted load its engine time, the gateway did not.
    The agent announces the share on its residency stream; each host's speculation takes it."""
    from extproc.fleet.speculation import SpeculationPlanner

    for share in (1.0, 0.25):
        agent = AgentThread(tmp_path / str(share), free_port(), waste_share=share)
        agent.start()
        link = AgentLink({"u1": f"127.0.0.1:{agent.port}"}, token=TOKEN).start()
        try:
            wait_until(lambda: link.board.current.waste_share.get("u1") == share, what="the announced share")
            planner = SpeculationPlanner()
            planner.sync(link.board.current, 0.0)
            assert planner.speculator("u1").waste_share == share
        finally:
            link.close()
            agent.stop()
    plain = AgentThread(tmp_path / "engine", free_port())   # the engine's own share (this fake's: 0)
    plain.start()
    link = AgentLink({"u1": f"127.0.0.1:{plain.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: "u1" in link.board.current.by_upstream, what="the agent's view")
        assert link.board.current.waste_share == {"u1": 0.0}
    finally:
        link.close()
        plain.stop()


def test_a_requests_own_signal_is_not_sent_to_an_agent_whose_engine_brings_the_adapter_itself(tmp_path):
    """The builtin engine fetches and loads a request's adapter when the request arrives;
    the gateway's signal for it only cost the engine's event loop an RPC while those very
    files were fetched (+1.6 ms per cold fetch at hundreds x 4 hosts). Its agent announces
    that; the link then leaves a request's own load to the engine (counted) and still sends
    bets. An agent that does not announce it gets every signal, as before."""
    def prefetches(agent) -> float:
        return sum(agent.manager.metrics.counter("ace_agent_prefetch_total", outcome=o)
                   for o in ("accepted", "coalesced", "already_resident", "left_to_engine"))

    own = PrefetchSignal(upstream="u1", adapter="a1", digest="", priority=1, reason=REQUEST_COLD)
    bet = PrefetchSignal(upstream="u1", adapter="a2", digest="", priority=0, reason="predicted",
                         probability=0.9, victim_reuse_probability=0.0)
    agent = AgentThread(tmp_path / "self", free_port(), request_signals_redundant=True)
    with linked(agent) as link:
        assert link.submit(own) and link.submit(replace(own, adapter="a3", reason=REQUEST_UNKNOWN))
        assert link.agents["u1"].left_to_engine == 2
        assert link.submit(bet)                                   # a bet is not a request's own
        wait_until(lambda: link.board.current.of("u1", "a2").tier == "device", what="the bet loaded")
        assert prefetches(agent) == 1                              # the bet only
        assert link.board.current.of("u1", "a1").tier != "device"
    plain = AgentThread(tmp_path / "plain", free_port())
    with linked(plain) as link:
        assert link.submit(own)
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "device", what="the request's own load")
        assert link.agents["u1"].left_to_engine == 0 and prefetches(plain) == 1


def test_an_agent_that_keeps_a_count_announces_its_slots_and_the_pool_model_uses_them(tmp_path):
    """vLLM's cache holds S adapters; its resolver overshoots it for a moment, so the most
    adapters seen at once overstated the pool (5-6 for S = 4 in ``make bench ENGINE=vllm``).
    The agent announces S on its residency stream; the gateway's pool model takes it."""
    from extproc.fleet.speculation import SpeculationPlanner

    counted = AgentThread(tmp_path / "counted", free_port(), capacity=2)
    counted.start()
    link = AgentLink({"u1": f"127.0.0.1:{counted.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: link.board.current.slots.get("u1") == 2, what="the announced slots")
        planner = SpeculationPlanner(initial_slots=8)
        planner.sync(link.board.current, 0.0)
        assert planner.slots() == {"u1": 2}
    finally:
        link.close()
        counted.stop()
    unbounded = AgentThread(tmp_path / "unbounded", free_port())
    unbounded.start()
    link = AgentLink({"u1": f"127.0.0.1:{unbounded.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: "u1" in link.board.current.by_upstream, what="the agent's view")
        assert link.board.current.slots == {}            # no count announced: learned as before
    finally:
        link.close()
        unbounded.stop()


def test_a_bet_planned_on_a_loading_request_waits_for_that_load_then_goes():
    """``AgentLink.held_for_demand``: a bet that yields to a demand load is held (looked at
    again every few ms) until the residency board shows that load's adapter on its host's
    device tier, or until its cap; a bet without one, or a request's own load, goes at once."""
    from types import MappingProxyType

    from extproc.state.residency import ResidencySnapshot, TierReport

    def board_with(tier: str) -> ResidencySnapshot:
        return ResidencySnapshot(by_upstream=MappingProxyType(
            {"u1": MappingProxyType({"a1": TierReport(tier=tier, cold_load_ms=5.0)})}))

    link = AgentLink({})
    bet = PrefetchSignal(upstream="u2", adapter="b", digest="", priority=0, reason="predicted",
                         probability=0.9, yields_to=("u1", "a1"), hold_until=time.monotonic() + 3600)
    link.board.publish(board_with("disk"))                        # u1 is loading a1
    again, delay = link.held_for_demand(bet)
    assert again.held and again.yields_to == ("u1", "a1") and 0 < delay <= 0.005
    link.board.publish(board_with("device"))                      # a1 landed: the bet goes
    sent = link.held_for_demand(again)
    assert sent.yields_to is None and sent.adapter == "b"
    link.board.publish(board_with("disk"))
    expired = replace(bet, hold_until=time.monotonic() - 1.0)     # the load outlived the cap
    assert link.held_for_demand(expired).yields_to is None
    plain = replace(bet, yields_to=None)
    assert link.held_for_demand(plain) is plain
    link.close()


def test_a_bet_on_another_host_lands_only_after_the_demand_load_it_yields_to(tmp_path):
    """Two real agents behind one link: u1 loads a1 for a request (slowly), and the bet that
    request planned goes to u2. Without the hold u2's quick load lands first, competing with
    u1's for the CPU and the artifact store; with it, no residency view shows the bet on u2's
    device before a1 on u1's, and each agent counts what it did."""
    slow = AgentThread(tmp_path / "u1", free_port(), load_delay_s=scaled(0.3))
    quick = AgentThread(tmp_path / "u2", free_port())
    slow.start()
    quick.start()
    link = AgentLink({"u1": f"127.0.0.1:{slow.port}", "u2": f"127.0.0.1:{quick.port}"}, token=TOKEN).start()
    try:
        wait_until(lambda: link.board.current.of("u1", "a1").tier == "disk"
                   and link.board.current.of("u2", "a2").tier == "disk", what="both agents' views")
        bet = PrefetchSignal(upstream="u2", adapter="a2", digest="", priority=0, reason="predicted",
                             probability=0.9, victim_reuse_probability=0.0,
                             yields_to=("u1", "a1"), hold_until=time.monotonic() + 3600)
        assert link.submit(signal("a1"))       # the request's own load on u1
        assert link.submit(bet)
        seen: list[str] = []

        def bet_landed() -> bool:
            snap = link.board.current          # one immutable view: both tiers at one instant
            if snap.of("u2", "a2").tier != "device":
                return False
            seen.append(snap.of("u1", "a1").tier)
            return True

        wait_until(bet_landed, what="the bet on u2's device")
        assert seen == ["device"]
        assert link.agents["u2"].held == 1 and link.agents["u2"].hold_expired == 0
        from prometheus_client import CollectorRegistry, generate_latest

        from extproc.observe.metrics import GatewayCollector, GatewayMetrics
        reg = CollectorRegistry()
        reg.register(GatewayCollector(GatewayMetrics(), link=link))
        text = generate_latest(reg).decode()
        assert 'ace_gateway_prefetch_signals_total{result="held",upstream="u2"} 1.0' in text
        assert 'ace_gateway_prefetch_signals_total{result="hold_expired",upstream="u2"} 0.0' in text
    finally:
        link.close()
        slow.close()
        quick.close()
