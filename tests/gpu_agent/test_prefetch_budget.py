"""The speculation budget: when the agent takes a prefetch hint (pure), and the same
decision through the gRPC API (loopback server, fake engine)."""
from __future__ import annotations

import asyncio
import math

import grpc
import pytest

from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from gpu_agent.residency.prefetch_budget import HintBet, HintVerdict, LinkState, decide_hint
from gpu_agent.service import start_server
from gpu_agent.residency.manager import ResidencyOutcome
from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager
from tests.support.wait import async_wait_until

IDLE = LinkState(demand_loads=0, busy_ms=0.0, budget_ms=100.0)

A, D, L, N, I = (HintVerdict.ACCEPT, HintVerdict.DEMAND_QUEUED, HintVerdict.LINK_BUSY,
                 HintVerdict.NOT_WORTH, HintVerdict.INVALID)


@pytest.mark.parametrize("bet, link, want", [
    # an older sender (no probability): taken as before, whatever the link or the victim
    (HintBet(None, 50.0), IDLE, A),
    (HintBet(None, 50.0, 1.0, 500.0), LinkState(3, 1e6, 100.0), A),
    # no room needed: any chance of a saving pays
    (HintBet(0.01, 50.0), IDLE, A),
    (HintBet(0.0, 50.0), IDLE, N),                       # no chance: no saving
    # saving p x stall against cost q x reload, strictly greater
    (HintBet(0.5, 40.0, 0.5, 30.0), IDLE, A),            # 20 > 15
    (HintBet(0.5, 40.0, 0.5, 40.0), IDLE, N),            # 20 = 20: not worth the churn
    (HintBet(0.2, 40.0, 0.9, 10.0), IDLE, N),            # 8 < 9
    (HintBet(0.9, 10.0, 0.1, 80.0), IDLE, A),            # 9 > 8
    (HintBet(1.0, 10.0, 0.0, 1e9), IDLE, A),             # a victim no one wants again costs nothing
    # an engine whose loads stop its steps (vLLM): a wasted load costs its time to requests
    (HintBet(0.4, 10.0, waste_ms=10.0), IDLE, N),        # 4 < 0.6 x 10
    (HintBet(0.6, 10.0, waste_ms=10.0), IDLE, A),        # 6 > 0.4 x 10
    (HintBet(0.6, 10.0, 0.2, 10.0, waste_ms=10.0), IDLE, N),  # 6 = 2 + 4
    (HintBet(1.0, 10.0, waste_ms=1e9), IDLE, A),         # a sure use wastes nothing
    # the link: requests' loads go first; no more than the budget queued ahead
    (HintBet(1.0, 50.0), LinkState(1, 0.0, 100.0), D),
    (HintBet(1.0, 50.0), LinkState(0, 100.0, 100.0), A),  # at the budget: still fits
    (HintBet(1.0, 50.0), LinkState(0, 100.5, 100.0), L),
    (HintBet(1.0, 50.0), LinkState(0, 1.0, 0.0), L),      # budget 0: nothing may be queued ahead
    (HintBet(1.0, 50.0), LinkState(2, 500.0, 100.0), D),  # demand is named first
    # nonsense probabilities are refused, never guessed
    (HintBet(1.5, 50.0), IDLE, I),
    (HintBet(-0.1, 50.0), IDLE, I),
    (HintBet(math.nan, 50.0), IDLE, I),
    (HintBet(0.5, 50.0, 2.0, 1.0), IDLE, I),
])
def test_decide_hint(bet, link, want):
    assert decide_hint(bet, link) is want


class GatedConnector(FakeConnector):
    """Loads of the adapters in ``gated`` wait until ``go`` is set."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.gated: set[str] = set()
        self.go = asyncio.Event()

    async def load(self, spec, path, *, pinned=False, demand=False):
        if spec.name in self.gated:
            await self.go.wait()
        await super().load(spec, path, pinned=pinned, demand=demand)


def test_the_agent_refuses_a_bet_that_does_not_pay_and_holds_off_while_a_request_loads(tmp_path):
    async def main():
        engine = GatedConnector(capacity=1)
        manager = make_manager(make_catalog(tmp_path, ["a1", "a2", "a3"]), tmp_path / "cache", engine)
        await manager.start()
        server, port, health = await start_server(manager, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                stub = pb_grpc.AgentStub(ch)

                async def prefetch(name, **kw):
                    r = await stub.Prefetch(pb.PrefetchRequest(adapter=name, **kw))
                    return pb.PrefetchReply.Outcome.Name(r.outcome), r.reason

                assert await prefetch("a1") == ("ACCEPTED", "")          # an older sender
                await async_wait_until(lambda: manager.view("a1").tier.value == "device")
                # the one device place is a1's: a2 would displace it. A long shot against a
                # victim that is surely wanted again is refused...
                assert await prefetch("a2", probability=0.001, victim_reuse_probability=1.0,
                                      evict=["a1"]) == ("REJECTED", "not_worth")
                assert manager.view("a1").tier.value == "device" and "a2" not in engine.held
                # ...a likely request against an unwanted victim is taken
                assert await prefetch("a2", probability=0.9, victim_reuse_probability=0.0) == ("ACCEPTED", "")
                await async_wait_until(lambda: manager.view("a2").tier.value == "device")
                # while a request's load runs, a bet waits its turn; an older sender's hint queues
                engine.gated.add("a3")
                request = asyncio.ensure_future(manager.ensure_resident("a3"))
                await async_wait_until(lambda: ("load", "a3") in engine.calls or manager.pipeline.demand,
                                       what="the request's load in flight")
                assert await prefetch("a1", probability=1.0) == ("REJECTED", "demand_queued")
                assert await prefetch("a1", probability=float("nan")) == ("REJECTED", "invalid_probability")
                # checked whether or not the load would need a victim
                assert await prefetch("a1", probability=1.0, victim_reuse_probability=float("inf")) == \
                    ("REJECTED", "invalid_probability")
                assert await prefetch("a1") == ("ACCEPTED", "")
                engine.go.set()
                await request
            m = manager.metrics
            for outcome, n in (("rejected_not_worth", 1), ("rejected_demand_queued", 1),
                               ("rejected_invalid_probability", 2)):
                assert m.counter("ace_agent_prefetch_total", outcome=outcome) == n, outcome
        finally:
            health.cancel()
            await server.stop(grace=None)
            await manager.close()
    asyncio.run(main())


class BlockingConnector(FakeConnector):
    """An engine whose loads stop its steps (vLLM, SGLang)."""

    load_compute_share = 1.0


def test_on_an_engine_whose_loads_stop_its_steps_a_bet_pays_for_the_time_a_wasted_load_takes(tmp_path):
    """vLLM runs a load between two steps: a speculative load that is not used delays the
    requests that arrive meanwhile (2 hosts, 120 requests: with the agent's bets a cold
    request waited 6-8 ms longer than under affinity; without them 2 ms). The same 40%
    bet with room to spare is taken where loads run beside the compute and refused there."""
    async def main():
        for eng, want in ((FakeConnector(capacity=3), ResidencyOutcome.ACCEPTED),
                          (BlockingConnector(capacity=3), ResidencyOutcome.REJECTED)):
            mgr = make_manager(make_catalog(tmp_path / eng.__class__.__name__, ["a1", "a2"]),
                               tmp_path / eng.__class__.__name__ / "cache", eng)
            await mgr.start()
            try:
                got = mgr.prefetch("a1", reason="predicted", probability=0.4)
                assert got.outcome is want
                if want is ResidencyOutcome.REJECTED:
                    assert got.reason == "not_worth"
                assert mgr.prefetch("a2", reason="predicted", probability=0.9).outcome is ResidencyOutcome.ACCEPTED
            finally:
                await mgr.close()
    asyncio.run(main())


def test_a_set_waste_share_overrides_the_engines_and_the_builtin_engine_charges_by_its_device(tmp_path):
    """``--prefetch-waste-share`` (ResidencyBudgets.waste_share) replaces the connector's
    share: the 40% bet the free-running fake takes is refused when its wasted load is
    charged in full. The builtin engine charges CPU_LOAD_COMPUTE_SHARE on the CPU (its loads
    take the cores its forward passes use) and nothing on CUDA (a side stream)."""
    from types import SimpleNamespace

    import torch

    from gpu_agent.connectors.builtin import CPU_LOAD_COMPUTE_SHARE, BuiltinConnector
    from gpu_agent.settings import SettingsError, parse_args

    async def main():
        for share, want in ((None, ResidencyOutcome.ACCEPTED), (1.0, ResidencyOutcome.REJECTED)):
            where = tmp_path / f"share-{share}"
            mgr = make_manager(make_catalog(where, ["a1"]), where / "cache", FakeConnector(capacity=3),
                               waste_share=share)
            await mgr.start()
            try:
                assert mgr.prefetch("a1", reason="predicted", probability=0.4).outcome is want
            finally:
                await mgr.close()
    asyncio.run(main())

    conn = BuiltinConnector(store=None)
    for device, share in (("cpu", CPU_LOAD_COMPUTE_SHARE), ("cuda", 0.0)):
        conn.engine = SimpleNamespace(pool=SimpleNamespace(device=torch.device(device)))
        assert conn.load_compute_share == share, device
    assert 0.0 < CPU_LOAD_COMPUTE_SHARE <= 1.0
    (tmp_path / "c.yaml").write_text("adapters: []\n")
    args = ["--catalog", str(tmp_path / "c.yaml"), "--auth", "none"]
    assert parse_args(args).prefetch_waste_share is None
    assert parse_args(args + ["--prefetch-waste-share", "0.25"]).prefetch_waste_share == 0.25
    with pytest.raises(SettingsError, match="prefetch-waste-share"):
        parse_args(args + ["--prefetch-waste-share", "1.5"])
