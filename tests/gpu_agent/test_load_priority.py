"""Loading that never hurts: a request's load goes before prefetches, a prefetch yields to
one that arrives, and a prefetch never evicts an adapter a request is about to use.

The interleavings are driven by hooks (threading events in the engine's load thread),
never by sleeps. The first test is the regression of the benchmark's 404: a valid
request answered ``404 not_found_error`` by the engine while a prefetch ran.
"""
from __future__ import annotations

import asyncio
import os
import sys
import threading
from pathlib import Path

import httpx
import pytest

from gpu_agent.artifacts import ArtifactStore, Catalog, DiskCache
from tests.gpu_agent.agent_support import remote_catalog, static_server
from tests.support.wait import async_wait_until, scaled


def run(coro):
    return asyncio.run(coro)


class LoadHook:
    """Wraps the engine's load thread (``AdapterTiers.ensure``): the calls for ``name`` are
    counted, and each can be held (``hold_after``: after its pool copy; ``hold_before``:
    before it starts) until the test lets it go."""

    def __init__(self, tiers, name: str):
        self.tiers, self.name, self.real = tiers, name, tiers.ensure
        self.calls = 0
        self.reached = [threading.Event(), threading.Event()]
        self.go = [threading.Event(), threading.Event()]
        tiers.ensure = self

    def __call__(self, name, *args, **kwargs):
        if name != self.name:
            return self.real(name, *args, **kwargs)
        i = min(self.calls, 1)
        self.calls += 1
        if i == 0:  # the first load of `name`: hold it after its copy into the pool
            out = self.real(name, *args, **kwargs)
            self.reached[0].set()
            self.go[0].wait(scaled(30))
            return out
        self.reached[1].set()  # a second load of `name`: hold it before it reads its files
        self.go[1].wait(scaled(30))
        return self.real(name, *args, **kwargs)


async def _builtin_agent(fixtures: Path, tmp_path: Path, base: str, max_adapters: int):
    from gpu_agent.connectors.builtin import BuiltinConnector
    from gpu_agent.engine.core import EngineSettings
    from gpu_agent.residency.manager import ResidencyBudgets, ResidencyManager

    cat_path = remote_catalog(fixtures, tmp_path, base)
    catalog = Catalog.from_yaml(cat_path)
    # make bench's cold setting: resident-only disk cache, no parsed host copies
    store = ArtifactStore(catalog, DiskCache(tmp_path / "cache", 0))
    conn = BuiltinConnector(store, EngineSettings(catalog=cat_path, pool_bytes=16 << 20,
                                                  host_cache_bytes=0, max_adapters=max_adapters,
                                                  batch_window_ms=0.0), http_port=0)
    mgr = ResidencyManager(catalog, store, conn, ResidencyBudgets(reconcile_interval_s=0))
    await mgr.start()
    return mgr, conn


def test_a_prefetch_hint_never_evicts_the_adapter_a_request_is_loading_regression_404(fixtures, tmp_path):
    """The benchmark's 404, reproduced. A request for X is accepted and X's cold load has
    just put it in the pool; before the request holds it, the gateway's speculation
    prefetches Y naming X as the victim (its model of the pool had X as LRU). Before the
    fix the agent evicted X (not yet "busy"), the request loaded X again with nothing
    protecting X's files, a fetch of another adapter dropped them from the resident-only
    disk cache, and the request got ``404 not_found_error``. Now X is the request's from
    the moment the engine accepts it (claimed), and the prefetch waits for the request's
    load before it decides anything: X is loaded once and the request is served."""
    X, A, Y, Z = "code-sql", "med-triage", "fin-reports", "tr-de-en"

    async def main():
        async with static_server(fixtures / "adapters") as (base, _hits):
            mgr, conn = await _builtin_agent(fixtures, tmp_path, base, max_adapters=2)
            hook = LoadHook(conn.engine.adapters.tiers, X)
            try:
                await mgr.ensure_resident(A)
                async with httpx.AsyncClient(base_url=conn.url, timeout=scaled(60)) as client:
                    req = asyncio.ensure_future(client.post(
                        "/v1/completions", json={"model": X, "prompt": "SELECT", "max_tokens": 2}))
                    await async_wait_until(hook.reached[0].is_set, what="X copied into the pool")
                    await mgr.reconcile()  # the agent sees X in the pool (its reconcile loop)
                    mgr.prefetch(Y, reason="predicted", evict=[X])

                    def hint_decided_or_waiting():
                        m = mgr.metrics
                        order = getattr(conn.engine.adapters, "order", None)  # (None before the fix)
                        return (m.counter("ace_agent_evictions_total", tier="device", reason="hint")
                                + m.counter("ace_agent_prefetch_victims_skipped_total", reason="in_use")
                                + (order.idle_waiters if order is not None else 0))
                    await async_wait_until(hint_decided_or_waiting,
                                           what="the prefetch's hint decided, or the prefetch waiting its turn")
                    hook.go[0].set()
                    await async_wait_until(lambda: hook.reached[1].is_set() or req.done(),
                                           what="the request served, or X loaded again")
                    if hook.reached[1].is_set():
                        # X is being loaded again: a fetch for another adapter runs meanwhile
                        mgr.prefetch(Z, reason="predicted")
                        await async_wait_until(lambda: mgr.store.local_path(mgr.catalog.get(Z)) is not None,
                                               what="Z fetched")
                        hook.go[1].set()
                    r = await req
                assert r.status_code == 200, r.text
                assert hook.calls == 1                       # X was loaded once, never again
                await async_wait_until(lambda: mgr.view(Y).tier.value == "device", what="Y loaded after")
                # the prefetch waited for the request once: before fetching Y (it was not local)
                waits = {stage: mgr.metrics.counter("ace_agent_prefetch_preemptions_total", stage=stage)
                         for stage in ("agent_fetch", "agent")}
                assert waits == {"agent_fetch": 1, "agent": 0}, waits
            finally:
                for ev in hook.go:
                    ev.set()
                await mgr.close()
    run(main())


# ---- the engine's load order (builtin engine, driven directly) ------------------------------

BIG, SMALL, OTHER = "legal-review", "code-sql", "med-triage"   # 919,616 B: a copy in chunks


def _engine(fixtures: Path, **kw):
    from gpu_agent.engine import Engine, EngineSettings

    kw.setdefault("pool_bytes", 16 << 20)
    kw.setdefault("prefetch_node_cpu", False)  # these tests drive the engine's own compute; the node's: test_node_cpu
    return Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", host_cache_bytes=0,
                                        batch_window_ms=0.0, **kw))


class Checkpoints:
    """``LoadOrder.checkpoint_hook``: records every prefetch checkpoint and holds the one
    numbered ``hold_at`` of ``stage`` (on the load thread) until ``go`` is set."""

    def __init__(self, order, stage: str, hold_at: int = 1):
        self.stage, self.hold_at = stage, hold_at
        self.seen: list[tuple[str, str]] = []
        self.reached, self.go = threading.Event(), threading.Event()
        order.checkpoint_hook = self

    def __call__(self, name: str, stage: str) -> None:
        self.seen.append((name, stage))
        if stage == self.stage and sum(s == stage for _, s in self.seen) == self.hold_at:
            self.reached.set()
            self.go.wait(scaled(30))


def _preempted_by_a_request(fixtures, stage: str, hold_at: int):
    """A prefetch of BIG held at its ``hold_at``-th ``stage`` checkpoint; meanwhile a second
    prefetch is queued and a request for SMALL arrives; then the prefetch is let go."""
    async def main():
        engine = _engine(fixtures)
        res = engine.adapters
        hook = Checkpoints(res.order, stage, hold_at)
        events = hook.seen  # checkpoints (name, stage) and finished loads ("done", label)

        async def step(label, coro):
            await coro
            events.append(("done", label))
        try:
            first = asyncio.ensure_future(step("prefetch", res.prefetch(BIG)))
            await async_wait_until(hook.reached.is_set, what=f"the prefetch at its {stage} checkpoint")
            queued = asyncio.ensure_future(step("queued prefetch", res.prefetch(OTHER)))
            request = asyncio.ensure_future(step("request", res.ensure_resident(SMALL, hold=True)))
            await async_wait_until(lambda: res.order.demand_in_flight == 1, what="the request's load in flight")
            marker = len(events)
            hook.go.set()
            await asyncio.gather(first, queued, request)
            after = events[marker:]
            # the request's load finished before any prefetch checkpoint ran again: the held
            # prefetch stopped and resumed only after it; the queued one started after it
            assert after[0] == ("done", "request"), after
            assert [e for e in after if e[0] == "done"] == [("done", "request"), ("done", "prefetch"),
                                                           ("done", "queued prefetch")]
            assert res.tier(BIG) == "device" and res.tier(OTHER) == "device"
            assert res.order.preemptions == {stage: 1}
            assert res.order.demand_in_flight == 0
            res.release(SMALL)
            engine.pool.check_invariants()
            from gpu_agent.engine.metrics import render_metrics
            from gpu_agent.engine.server import HttpStats
            return res.loads, render_metrics(engine, HttpStats())
        finally:
            hook.go.set()
            await engine.close()
    return run(main())


def test_a_prefetch_yields_mid_copy_to_a_request_that_arrives(fixtures):
    """Held between two chunks of its pool copy: the request's load arrives, the prefetch
    stops there (its partial copy freed), the request loads, then the prefetch loads."""
    from gpu_agent.engine.pool import COPY_CHUNK_BYTES

    assert 919616 > 2 * COPY_CHUNK_BYTES
    loads, text = _preempted_by_a_request(fixtures, "copy", hold_at=2)  # 1st: before it evicts anything
    assert loads["disk"] == 3
    assert 'ace_engine_prefetch_preemptions_total{stage="copy"} 1' in text  # the engine's /metrics


def test_a_request_goes_before_a_prefetch_about_to_read(fixtures):
    _preempted_by_a_request(fixtures, "read", hold_at=1)


def test_a_request_joining_a_prefetch_of_its_adapter_promotes_it(fixtures):
    """The request needs the adapter the prefetch is loading: it waits for that load, which
    no longer yields (it would wait for itself)."""
    async def main():
        engine = _engine(fixtures)
        res = engine.adapters
        hook = Checkpoints(res.order, "read")
        try:
            first = asyncio.ensure_future(res.prefetch(BIG))
            await async_wait_until(hook.reached.is_set, what="the prefetch at its read checkpoint")
            request = asyncio.ensure_future(res.ensure_resident(BIG, hold=True))
            await async_wait_until(lambda: res.order.demand_in_flight == 1, what="the request's load in flight")
            hook.go.set()
            tier, _ms = await asyncio.wait_for(request, scaled(30))
            await first
            assert tier == "disk" and res.held(BIG) == 1
            assert res.order.preemptions == {} and res.loads["disk"] == 1
            res.release(BIG)
        finally:
            hook.go.set()
            await engine.close()
    run(main())


def test_eviction_never_takes_an_adapter_a_request_was_accepted_for(fixtures):
    """Claimed (accepted, not yet finished) = never evicted: not by the pool's LRU, not by
    ``evict`` (the agent's hint); a prefetch that could only make room that way is given up
    at once (cancelled, ``no_room``) instead of waiting."""
    from gpu_agent.connectors.builtin import BuiltinConnector
    from gpu_agent.errors import AdapterBusy, PoolExhausted

    async def main():
        engine = _engine(fixtures, max_adapters=1)
        res = engine.adapters
        try:
            await res.ensure_resident(SMALL, hold=True)    # accepted and running ...
            res.release(SMALL)
            res._claims[SMALL] = 1                          # ... a second request accepted, not yet held
            with pytest.raises(AdapterBusy):
                res.evict(SMALL)
            assert SMALL in await BuiltinConnector(None, engine=engine).busy()  # the agent skips it
            with pytest.raises(PoolExhausted):
                await asyncio.wait_for(res.prefetch(OTHER), scaled(30))
            assert res.tier(SMALL) == "device" and res.order.cancelled == {"no_room": 1}
            res._unclaim(SMALL)
            await res.prefetch(OTHER)                       # unclaimed: the LRU may take it now
            assert res.tier(SMALL) != "device" and res.tier(OTHER) == "device"
        finally:
            await engine.close()
    run(main())


def test_engine_choice_of_pool_victims_skips_claimed_adapters(fixtures):
    from gpu_agent.errors import AdapterBusy

    async def main():
        engine = _engine(fixtures, max_adapters=2)
        res, pool = engine.adapters, engine.pool
        try:
            await res.ensure_resident(SMALL)
            await res.ensure_resident(OTHER)
            res._claims[SMALL] = 1                           # SMALL is the LRU, but claimed
            await res.ensure_resident(BIG)
            assert set(pool.resident()) == {SMALL, BIG}
            with pytest.raises(AdapterBusy):
                res.evict(SMALL)
            pool.check_invariants()
            assert res.evictions_by() == {("device", "budget"): 1}
        finally:
            await engine.close()
    run(main())


# ---- the agent: a request's load before queued prefetches -------------------------------------

def test_agent_request_load_goes_before_queued_prefetches(tmp_path):
    from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager

    class GatedConnector(FakeConnector):
        def __init__(self):
            super().__init__()
            self.gates: dict[str, asyncio.Event] = {}
            self.entered: list[str] = []

        async def load(self, spec, path, *, pinned=False, demand=False):
            self.entered.append(spec.name)
            gate = self.gates.get(spec.name)
            if gate is not None:
                await gate.wait()
            await super().load(spec, path, pinned=pinned, demand=demand)

    async def main():
        eng = GatedConnector()
        eng.gates["p1"] = asyncio.Event()
        mgr = make_manager(make_catalog(tmp_path, ["p1", "p2", "p3", "d"]), tmp_path / "cache", eng)
        await mgr.start()
        try:
            for name in ("p1", "p2", "p3"):
                mgr.prefetch(name, reason="predicted")
            await async_wait_until(lambda: eng.entered == ["p1"], what="p1 in its device stage")
            request = asyncio.ensure_future(mgr.ensure_resident("d"))
            await async_wait_until(lambda: "d" in mgr.pipeline.inflight, what="the request's load started")
            eng.gates["p1"].set()
            await request
            await async_wait_until(lambda: len(eng.calls) == 4, what="every load done")
            assert [n for _, n in eng.calls] == ["p1", "d", "p2", "p3"]
            assert eng.demands == [False, True, False, False]
        finally:
            await mgr.close()
    run(main())


def test_agent_metrics_show_the_engine_load_order_counters(tmp_path):
    """The builtin engine counts its own preemptions and cancellations; the agent's
    /metrics shows them beside its own (stage="agent"), read at every scrape."""
    from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager

    class OrderingEngine(FakeConnector):
        stats = {"preemptions": {"copy": 2, "read": 1}, "cancelled": {"no_room": 3}}

        def load_order_stats(self):
            return self.stats

    eng = OrderingEngine()
    mgr = make_manager(make_catalog(tmp_path, ["a1"]), tmp_path / "cache", eng)
    mgr.metrics.inc("ace_agent_prefetch_preemptions_total", stage="agent")
    text = mgr.metrics.render()
    for line in ('ace_agent_prefetch_preemptions_total{stage="agent"} 1',
                 'ace_agent_prefetch_preemptions_total{stage="copy"} 2',
                 'ace_agent_prefetch_preemptions_total{stage="read"} 1',
                 'ace_agent_prefetch_cancelled_total{reason="no_room"} 3',
                 "# TYPE ace_agent_prefetch_preemptions_total counter"):
        assert line in text
    eng.stats = {"preemptions": {"copy": 5}, "cancelled": {}}
    assert mgr.metrics.counter("ace_agent_prefetch_preemptions_total", stage="copy") == 5


class HeldCopy(Checkpoints):
    """A prefetch held mid-copy (its 2nd ``copy`` checkpoint: after the first chunk) for
    longer than any failure deadline of the test, so a step that waits for it fails."""

    def __call__(self, name: str, stage: str) -> None:
        self.seen.append((name, stage))
        if stage == self.stage and sum(s == stage for _, s in self.seen) == self.hold_at:
            self.reached.set()
            self.go.wait(scaled(120))


def test_a_request_on_a_resident_adapter_is_served_while_another_load_is_held_mid_copy(fixtures):
    """The engine's forward loop never waits behind a load: with a prefetch of BIG held
    between two chunks of its pool copy, a request for the resident SMALL is served over
    HTTP (its pin, its forward steps, its streamed tokens), and BIG appears only after."""
    from gpu_agent.engine import serve

    async def main():
        engine = _engine(fixtures)
        res = engine.adapters
        runner, port = await serve(engine)
        hook = HeldCopy(res.order, "copy", hold_at=2)
        try:
            await res.ensure_resident(SMALL)
            prefetch = asyncio.ensure_future(res.prefetch(BIG))
            await async_wait_until(hook.reached.is_set, what="the prefetch held mid-copy")
            body = {"model": SMALL, "prompt": "def f(x):", "max_tokens": 4, "ignore_eos": True}
            resp = await asyncio.to_thread(httpx.post, f"http://127.0.0.1:{port}/v1/completions",
                                           json=body, timeout=scaled(30))
            assert resp.status_code == 200, resp.text
            assert resp.headers["x-ace-adapter-tier"] == "device"
            assert resp.json()["usage"]["completion_tokens"] == 4
            assert not hook.go.is_set() and not prefetch.done()   # the copy is still held open
            assert res.tier(BIG) != "device" and engine.batcher.stats.forward_passes >= 4
            hook.go.set()
            await prefetch
            assert res.tier(BIG) == "device"
            engine.pool.check_invariants()
        finally:
            hook.go.set()
            await runner.cleanup()
    run(main())


@pytest.mark.skipif(not hasattr(os, "getpriority") or not sys.platform.startswith("linux"),
                    reason="thread niceness is per thread on Linux only")
def test_loads_run_off_the_loop_and_a_prefetch_on_its_own_thread_at_the_configured_priority(fixtures):
    """Neither load runs on the event loop; a prefetch's runs on its own thread, nicer by
    ``prefetch_load_nice`` (default 0: see gpu_agent/engine/load_order.py)."""
    async def main():
        engine = _engine(fixtures, prefetch_load_nice=5)
        res = engine.adapters
        seen: dict[str, tuple[str, int]] = {}
        real = res.tiers.ensure

        def ensure(name, *args, **kwargs):
            tid = threading.get_native_id()
            seen[name] = (threading.current_thread().name, os.getpriority(os.PRIO_PROCESS, tid))
            return real(name, *args, **kwargs)
        res.tiers.ensure = ensure
        loop_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        try:
            await res.prefetch(BIG)
            await res.ensure_resident(SMALL)
        finally:
            await engine.close()
        assert threading.current_thread().name not in (seen[BIG][0], seen[SMALL][0])
        assert seen[BIG][0] != seen[SMALL][0]
        assert seen[BIG][1] == min(19, loop_nice + 5) and seen[SMALL][1] == loop_nice, seen
    run(main())


# ---- a prefetch stays off the engine's compute ----------------------------------------------

class HeldForward:
    """Holds the batcher's forward step (on the forward thread) until ``go`` is set: the
    engine is computing for as long as the test likes."""

    def __init__(self, batcher):
        self.real, self.reached, self.go = batcher._step, threading.Event(), threading.Event()
        batcher._step = self

    def __call__(self, seqs):
        self.reached.set()
        self.go.wait(scaled(30))
        return self.real(seqs)


async def _request_held_in_its_forward(engine, res):
    """A request on the resident SMALL, accepted (claimed) and held in its first forward."""
    await res.ensure_resident(SMALL)
    held = HeldForward(engine.batcher)
    await res.ensure_resident(SMALL, hold=True)

    async def request():
        try:
            async for ev in engine.generate(SMALL, [1, 2, 3], max_tokens=2):
                if ev.finish_reason is not None:
                    return "done"
        finally:
            res.release(SMALL)
    task = asyncio.ensure_future(request())
    await async_wait_until(held.reached.is_set, what="the request in its forward pass")
    return held, task


def test_a_prefetch_waits_while_the_engine_computes_and_goes_when_it_is_idle(fixtures):
    """Fails before the change: the prefetch of BIG started (and parsed and copied) while a
    request's forward pass ran. Now it does not pass its first step until the request has
    finished, and then it loads."""
    async def main():
        engine = _engine(fixtures)
        res = engine.adapters
        hook = Checkpoints(res.order, "copy", hold_at=10**6)   # records every checkpoint, holds none
        held = None
        try:
            held, request = await _request_held_in_its_forward(engine, res)
            prefetch = asyncio.ensure_future(res.prefetch(BIG))
            await async_wait_until(lambda: getattr(res.order, "compute_waits", 0) == 1 or hook.seen,
                                   what="the prefetch waiting for compute (or, before the change, loading)")
            assert hook.seen == [] and res.loading() == {BIG} and res.tier(BIG) != "device"
            held.go.set()
            assert await asyncio.wait_for(request, scaled(30)) == "done"
            await asyncio.wait_for(prefetch, scaled(30))
            assert res.tier(BIG) == "device" and hook.seen           # it went, through its checkpoints
            assert res.order.compute_overruns == 0 and res.order.preemptions == {}
            engine.pool.check_invariants()
        finally:
            if held is not None:
                held.go.set()
            await engine.close()
    run(main())


def test_a_prefetch_mid_copy_stops_for_a_request_the_engine_accepts_and_resumes_after_it(fixtures):
    """Held between two chunks of its copy while a request on the resident SMALL is accepted
    and computing: let go, the prefetch stops at its next checkpoint (its partial copy freed)
    and finishes only after the request has."""
    async def main():
        engine = _engine(fixtures)
        res = engine.adapters
        await res.ensure_resident(SMALL)
        hook = Checkpoints(res.order, "copy", hold_at=2)
        held = None
        try:
            prefetch = asyncio.ensure_future(res.prefetch(BIG))
            await async_wait_until(hook.reached.is_set, what="the prefetch held mid-copy")
            held, request = await _request_held_in_its_forward(engine, res)
            hook.go.set()
            await async_wait_until(lambda: res.order.preemptions.get("copy") == 1 or prefetch.done(),
                                   what="the prefetch stopped at its next copy checkpoint (or done)")
            assert not prefetch.done() and res.tier(BIG) != "device"
            held.go.set()
            assert await asyncio.wait_for(request, scaled(30)) == "done"
            await asyncio.wait_for(prefetch, scaled(30))
            assert res.tier(BIG) == "device"
            engine.pool.check_invariants()
        finally:
            hook.go.set()
            if held is not None:
                held.go.set()
            await engine.close()
    run(main())


def test_a_prefetch_waits_for_compute_at_most_the_configured_time(fixtures):
    """A busy engine still gets its prefetches: past ``prefetch_compute_defer_ms`` (0 here)
    the prefetch goes on while the request computes, counted as an overrun."""
    async def main():
        engine = _engine(fixtures, prefetch_compute_defer_ms=0.0)
        res = engine.adapters
        held = None
        try:
            held, request = await _request_held_in_its_forward(engine, res)
            await asyncio.wait_for(res.prefetch(BIG), scaled(30))
            assert res.tier(BIG) == "device" and not request.done()
            assert (res.order.compute_waits, res.order.compute_overruns) == (1, 1)
            from gpu_agent.engine.metrics import render_metrics
            from gpu_agent.engine.server import HttpStats
            assert 'ace_engine_prefetch_compute_waits_total{outcome="overrun"} 1' in render_metrics(engine, HttpStats())
            held.go.set()
            assert await asyncio.wait_for(request, scaled(30)) == "done"
        finally:
            if held is not None:
                held.go.set()
            await engine.close()
    run(main())


def test_the_agent_fetches_a_prefetch_only_while_its_builtin_engine_is_idle(fixtures, tmp_path):
    """The agent's fetch of a prefetch's files runs on the event loop the engine serves from:
    it waits for the engine's compute too (stage ``agent_fetch``), and fetches after it."""
    async def main():
        async with static_server(fixtures / "adapters") as (base, hits):
            mgr, conn = await _builtin_agent(fixtures, tmp_path, base, max_adapters=4)
            engine, res = conn.engine, conn.engine.adapters
            held = None
            try:
                await mgr.ensure_resident(SMALL)
                fetched_before = sum(hits.values())
                held, request = await _request_held_in_its_forward(engine, res)
                mgr.prefetch(BIG, reason="predicted")
                await async_wait_until(lambda: res.order.idle_waiters == 1 or sum(hits.values()) > fetched_before,
                                       what="the agent's fetch waiting (or, before the change, fetching)")
                assert sum(hits.values()) == fetched_before                       # nothing fetched yet
                held.go.set()
                assert await asyncio.wait_for(request, scaled(30)) == "done"
                await async_wait_until(lambda: mgr.view(BIG).tier.value == "device", what="BIG loaded after")
                assert mgr.metrics.counter("ace_agent_prefetch_preemptions_total", stage="agent_fetch") == 1
            finally:
                if held is not None:
                    held.go.set()
                await mgr.close()
    run(main())

