"""A prefetch also waits while every core of the node runs something else (the engines
beside its own): ``NodeCpu`` reads it, ``LoadOrder`` waits on it, looking again every
``NODE_POLL_S`` since nothing notifies when another engine's pass ends."""
from __future__ import annotations

import asyncio
import time

import pytest

from gpu_agent.engine.load_order import LoadOrder, LoadTicket
from gpu_agent.engine.node_cpu import NodeCpu
from tests.support.wait import async_wait_until, scaled


def _loadavg(tmp_path, running: int, total: int = 120):
    p = tmp_path / "loadavg"
    p.write_text(f"0.50 0.40 0.30 {running}/{total} 4242\n")
    return p


@pytest.mark.parametrize("running,busy", [(1, False), (2, False), (3, True), (9, True)])
def test_busy_when_the_others_fill_every_core(tmp_path, running, busy):
    """Two cores: the caller is one runnable task; two others fill both cores."""
    node = NodeCpu(cores=2, path=str(_loadavg(tmp_path, running)))
    assert node.busy() is busy


def test_an_unreadable_or_odd_file_means_never_busy(tmp_path):
    assert NodeCpu(cores=1, path=str(tmp_path / "absent")).busy() is False
    odd = tmp_path / "odd"
    odd.write_text("not a loadavg line\n")
    node = NodeCpu(cores=1, path=str(odd))
    assert node.busy() is False and node.runnable() is None


def test_cores_must_be_positive():
    with pytest.raises(ValueError):
        NodeCpu(cores=0)


def test_the_real_file_reads_on_linux():
    node = NodeCpu()
    n = node.runnable()
    assert n is None or n >= 1   # the caller itself runs
    assert node.cores >= 1


def test_a_prefetch_waits_for_the_node_and_goes_when_a_core_frees_without_a_notify():
    """Nothing calls notify() when the node's other engines go quiet: the waiting prefetch
    looks again by itself. Fails without the node's part: the slot is taken at once."""
    async def main():
        busy = {"node": True}
        order = LoadOrder(compute_defer_s=scaled(60), node_busy=lambda: busy["node"])
        ticket = LoadTicket("a", prefetch=True)
        entered = asyncio.Event()

        async def prefetch():
            async with order.prefetch_slot(ticket):
                entered.set()
        task = asyncio.ensure_future(prefetch())
        while order.node_waits == 0:          # it looked, and waits for the node
            await asyncio.sleep(0)
        assert not entered.is_set() and ticket.node_deadline is not None
        busy["node"] = False                  # no notify()
        await asyncio.wait_for(entered.wait(), scaled(30))
        await task
        assert order.node_waits == 1 and order.compute_overruns == 0
    asyncio.run(main())


def test_a_busy_node_stops_a_running_prefetch_at_its_checkpoint_and_never_a_request():
    order = LoadOrder(compute_defer_s=scaled(60), node_busy=lambda: True)
    prefetch, request = LoadTicket("p", prefetch=True), LoadTicket("r", prefetch=False)
    assert order.should_yield(prefetch, "copy") is True
    assert order.should_yield(request, "copy") is False


def test_the_node_wait_is_bounded_by_the_compute_deferral():
    """A node busy for good still gets its prefetches: after ``compute_defer_s`` (0 here)
    or ``NODE_DEFER_S``, whichever is less."""
    order = LoadOrder(compute_defer_s=0.0, node_busy=lambda: True)
    ticket = LoadTicket("p", prefetch=True)
    assert order.should_yield(ticket, "copy") is False
    assert order.node_waits == 1 and ticket.node_deadline is not None


def test_a_prefetch_waits_for_a_node_busy_for_good_at_most_node_defer_s():
    async def main():
        order = LoadOrder(compute_defer_s=scaled(60), node_busy=lambda: True)
        ticket = LoadTicket("p", prefetch=True)
        await asyncio.wait_for(order.turn(ticket), scaled(30))   # returns: no notify needed
        assert order.node_waits == 1 and order.compute_waits == 0
        assert ticket.node_deadline is not None and time.monotonic() >= ticket.node_deadline
    asyncio.run(main())


def test_without_a_node_watch_only_the_engine_counts():
    order = LoadOrder(compute_defer_s=scaled(60))
    assert order.should_yield(LoadTicket("p", prefetch=True), "copy") is False
    assert order.node_waits == 0


def test_the_engine_watches_the_node_unless_told_not_to_and_shows_the_count(fixtures):
    """``prefetch_node_cpu`` (on by default; the agent's ``--no-prefetch-node-cpu``) wires
    ``NodeCpu.busy`` into the engine's load order, and /metrics shows its count."""
    from gpu_agent.engine import Engine, EngineSettings
    from gpu_agent.engine.metrics import render_metrics
    from gpu_agent.engine.server import HttpStats

    async def main():
        def make(**kw):
            return Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", pool_bytes=16 << 20,
                                                host_cache_bytes=0, **kw))
        on, off = make(), make(prefetch_node_cpu=False)
        try:
            assert on.adapters.order.node_busy is not None and off.adapters.order.node_busy is None
            on.adapters.order.node_waits = 3
            assert "ace_engine_prefetch_node_waits_total 3.0" in render_metrics(on, HttpStats())
        finally:
            await on.close()
            await off.close()
    asyncio.run(main())


@pytest.mark.parametrize("wait", ["turn", "idle"])
def test_a_prefetch_behind_a_requests_load_past_its_compute_deadline_waits_without_spinning(wait):
    """Regression (a fleet benchmark's agent hung at 86% CPU): a prefetch waited for the
    engine's compute, a request's load began, and the compute deadline passed while it ran.
    The wait then returned at once, again and again, without yielding, so the event loop
    never ran the request's load to its end. Now it waits for the next change."""
    async def main():
        order = LoadOrder(compute_defer_s=scaled(0.05), compute_busy=lambda: True)
        calls = {"n": 0}
        real = order._wait_change

        async def counted(ticket):
            calls["n"] += 1
            if calls["n"] > 10_000:
                raise AssertionError("the wait spins without yielding to the event loop")
            await real(ticket)

        order._wait_change = counted
        ticket = LoadTicket("a", prefetch=True)
        waiter = asyncio.create_task(order.turn(ticket) if wait == "turn" else order.idle())
        release = asyncio.Event()
        entered = asyncio.Event()

        async def request_load():
            async with order.demand():
                entered.set()
                await release.wait()

        await async_wait_until(lambda: order.compute_waits == 1, what="the prefetch waits for compute")
        load = asyncio.create_task(request_load())
        await entered.wait()
        deadline = time.monotonic() + scaled(0.05)
        await async_wait_until(lambda: time.monotonic() > deadline + 0.01, what="the compute deadline passed")
        assert not waiter.done()
        release.set()
        await load
        await waiter   # the request's load ended: the prefetch goes (compute past its deadline)
        assert calls["n"] < 100
    asyncio.run(main())


def test_a_compute_deadline_that_passed_before_the_wait_returns_at_once_without_a_request_load():
    """The deadline may pass between the caller's look and its wait: with no request's load
    in flight the wait returns at once (the caller then marks the overrun and goes), as it
    must not sit until some unrelated change; with one in flight it waits for that load."""
    async def main():
        order = LoadOrder(compute_defer_s=scaled(60), compute_busy=lambda: True)
        ticket = LoadTicket("a", prefetch=True)
        ticket.compute_deadline = time.monotonic() - 1.0
        first = asyncio.create_task(order._wait_change(ticket))
        await async_wait_until(first.done, what="the wait returns (nothing notifies here)")
        assert not ticket.compute_overrun
        entered, release = asyncio.Event(), asyncio.Event()

        async def request_load():
            async with order.demand():
                entered.set()
                await release.wait()

        load = asyncio.create_task(request_load())
        await entered.wait()
        waiting = asyncio.create_task(order._wait_change(ticket))
        await asyncio.sleep(0)
        assert not waiting.done()                  # behind the request's load: waits
        release.set()
        await load
        await async_wait_until(waiting.done, what="the wait ends with the request's load")
    asyncio.run(main())
