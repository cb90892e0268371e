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


def _stat(tmp_path, ran: dict[int, int]):
    """A /proc/stat whose core ``c`` ran ``ran[c]`` ticks (user 1/2, system 1/2; idle,
    iowait and steal beside them so that only the right fields are summed)."""
    p = tmp_path / "stat"
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for c, t in sorted(ran.items()):
        lines.append(f"cpu{c} {t // 2} 0 {t - t // 2} 99999 777 0 0 0 0 0")
    lines += ["intr 1 2 3", "ctxt 42", "procs_running 3"]
    p.write_text("\n".join(lines) + "\n")
    return p


class _Clock:
    """Whole milliseconds, so that ten 10 ms steps are exactly the 100 ms window."""

    def __init__(self) -> None:
        self.ms, self.own_ms = 1_000_000, 5_000

    @property
    def now(self) -> float:
        return self.ms / 1000

    @property
    def own(self) -> float:
        return self.own_ms / 1000

    def advance(self, s: float, own_s: float = 0.0) -> None:
        self.ms += round(s * 1000)
        self.own_ms += round(own_s * 1000)


def _node(tmp_path, running: int, clock: _Clock, cpus=(1,), **kw) -> NodeCpu:
    return NodeCpu(cores=len(cpus), path=str(_loadavg(tmp_path, running)), cpus=cpus,
                   stat_path=str(tmp_path / "stat"), clock=lambda: clock.now,
                   own_cpu_s=lambda: clock.own, **{"ticks_per_s": 100, **kw})


@pytest.mark.parametrize("running,busy", [(1, False), (2, False), (3, True), (9, True)])
def test_busy_when_the_others_fill_every_core(tmp_path, running, busy):
    """Two cores: the caller is one runnable task; two others fill both cores (no per-core
    counts here: the count alone decides)."""
    node = NodeCpu(cores=2, path=str(_loadavg(tmp_path, running)), stat_path=str(tmp_path / "absent"))
    assert node.busy() is busy


def test_others_on_other_cores_do_not_hold_a_prefetch(tmp_path):
    """Pinned to core 1 while core 0 runs the request path: the machine's count says busy,
    but over the last window only this process ran on core 1, so the prefetch goes. Fails
    on the count-only rule (busy whenever anything else on the machine runs)."""
    clock = _Clock()
    node = _node(tmp_path, 3, clock)
    _stat(tmp_path, {0: 0, 1: 0})
    assert node.busy() is True                  # no earlier look: the count alone decides
    clock.advance(0.2, own_s=0.18)              # this process ran 180 ms of the 200 on core 1
    _stat(tmp_path, {0: 20, 1: 18})             # core 0 ran 200 ms: not this process's core
    assert node.others_share() == pytest.approx(0.0)
    clock.advance(0.2, own_s=0.18)
    _stat(tmp_path, {0: 40, 1: 36})
    assert node.busy() is False


def test_others_on_this_process_cores_hold_it(tmp_path):
    """The other engines on the same core used it for 150 of the last 200 ms (this process
    30): share 0.75 >= 0.5, busy; with the count low, never busy."""
    clock = _Clock()
    node = _node(tmp_path, 3, clock)
    _stat(tmp_path, {0: 0, 1: 0})
    node.busy()
    clock.advance(0.2, own_s=0.03)
    _stat(tmp_path, {0: 0, 1: 18})
    assert node.busy() is True
    assert node.others_share() is not None
    _loadavg(tmp_path, 1)
    clock.advance(0.2, own_s=0.03)
    _stat(tmp_path, {0: 0, 1: 36})
    assert node.busy() is False


def test_the_share_is_over_the_newest_look_at_least_a_window_old(tmp_path):
    """Looks every 10 ms: each is measured against the newest look at least ``window_s``
    (100 ms) before it, never a younger one (a tick is 10 ms: a shorter span is noise)."""
    clock = _Clock()
    node = _node(tmp_path, 3, clock)
    ran = 0
    _stat(tmp_path, {1: ran})
    assert node.others_share() is None
    for _ in range(9):                          # 10..90 ms: nothing a window old yet
        clock.advance(0.01)
        ran += 1                                # others run the core the whole time
        _stat(tmp_path, {1: ran})
        assert node.others_share() is None
    clock.advance(0.01)
    ran += 1
    _stat(tmp_path, {1: ran})
    assert node.others_share() == pytest.approx(1.0)   # 100 ms against the first look
    for _ in range(10):                         # others stop: the share falls look by look
        clock.advance(0.01)
        _stat(tmp_path, {1: ran})
        share = node.others_share()
    assert share == pytest.approx(0.0)


def test_two_cores_share_is_over_both(tmp_path):
    clock = _Clock()
    node = _node(tmp_path, 5, clock, cpus=(1, 2))
    _stat(tmp_path, {0: 0, 1: 0, 2: 0})
    node.others_share()
    clock.advance(0.1, own_s=0.05)
    _stat(tmp_path, {0: 10, 1: 10, 2: 0})      # others: 100 + 0 - 50 ms of 200: 0.25
    assert node.others_share() == pytest.approx(0.25)


def test_a_look_older_than_max_age_is_dropped(tmp_path):
    clock = _Clock()
    node = _node(tmp_path, 3, clock, max_age_s=1.0)
    _stat(tmp_path, {1: 0})
    node.others_share()
    clock.advance(2.0)
    assert node.others_share() is None and node.busy() is True


def test_per_core_counts_that_lack_this_process_core_leave_the_count_alone(tmp_path):
    clock = _Clock()
    node = _node(tmp_path, 3, clock, cpus=(3,))
    _stat(tmp_path, {0: 0, 1: 0})
    node.busy()
    clock.advance(0.2)
    assert node.others_share() is None and node.busy() is True
    node = _node(tmp_path, 3, clock)
    (tmp_path / "stat").write_text("cpu1 garbage\n")
    assert node.others_share() is None and node.busy() is True


@pytest.mark.parametrize("kw", [{"share": 0.0}, {"share": 1.5}, {"window_s": 0.0},
                                {"window_s": 2.0, "max_age_s": 1.0}, {"cpus": ()}])
def test_settings_out_of_range_are_refused(kw):
    with pytest.raises(ValueError):
        NodeCpu(**kw)


def test_an_unreadable_or_odd_file_means_never_busy(tmp_path):
    assert NodeCpu(cores=1, path=str(tmp_path / "absent")).busy() is False
    odd = tmp_path / "odd"
    odd.write_text("not a loadavg line\n")
    node = NodeCpu(cores=1, path=str(odd))
    assert node.busy() is False and node.runnable() is None


def test_cores_must_be_positive():
    with pytest.raises(ValueError):
        NodeCpu(cores=0)


def test_the_real_files_read_on_linux():
    node = NodeCpu()
    n = node.runnable()
    assert n is None or n >= 1   # the caller itself runs
    assert node.cores >= 1
    node.others_share()
    deadline = time.monotonic() + node.window_s
    while time.monotonic() < deadline:   # spins this process: its own time is not others'
        pass
    share = node.others_share()
    assert share is None or 0.0 <= share <= 1.0


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


def test_a_look_within_a_tick_gives_the_last_answer_without_reading(tmp_path):
    """The per-core counts move in 10 ms ticks: asked again sooner, the answer is the last
    one and the file is not read (a waiting prefetch looks every 5 ms, and a copy asks at
    every checkpoint)."""
    clock = _Clock()
    node = _node(tmp_path, 3, clock)
    _stat(tmp_path, {1: 0})
    node.others_share()
    clock.advance(0.1)
    _stat(tmp_path, {1: 10})
    assert node.others_share() == pytest.approx(1.0)
    clock.advance(0.005)
    (tmp_path / "stat").write_text("not read\n")     # read now, it would turn the reading off
    assert node.others_share() == pytest.approx(1.0) and node.busy() is True
    clock.advance(0.005)
    _stat(tmp_path, {1: 10})
    assert node.others_share() == pytest.approx(0.1 / 0.11)   # a tick on: read again


def test_a_look_holds_the_lock_while_it_reads_and_changes_the_looks(tmp_path):
    """The event loop and a load thread (a copy's checkpoint) ask at once, and the looks
    they share are popped and indexed in several steps: a look runs under the node's lock
    (checked from inside it, where a second caller would interleave)."""
    clock = _Clock()
    held: list[bool] = []

    def own_cpu() -> float:
        free = node._lock.acquire(blocking=False)
        if free:
            node._lock.release()
        held.append(not free)
        return clock.own

    node = NodeCpu(cores=1, path=str(_loadavg(tmp_path, 3)), cpus=(1,),
                   stat_path=str(_stat(tmp_path, {1: 0})), clock=lambda: clock.now,
                   own_cpu_s=own_cpu, ticks_per_s=100)
    node.busy()
    clock.advance(0.2)
    node.busy()
    assert held == [True, True]
