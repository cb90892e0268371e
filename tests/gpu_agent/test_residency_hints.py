"""A Prefetch's `evict` list: the caller's victims go first when (and only when) the load
needs device room; hints that may not go (pinned, in use, unknown) leave it to the LRU."""
from __future__ import annotations

import asyncio

import yaml

from gpu_agent.residency.manager import ResidencyOutcome, ResidencyResult

from ace_common.tiers import Tier

from tests.gpu_agent.agent_support import FakeConnector, make_catalog, make_manager, write_adapter
from tests.support.wait import async_wait_until

DONE = ResidencyResult(ResidencyOutcome.DONE)

NAMES = ["a1", "a2", "a3", "a4"]


def run(coro):
    return asyncio.run(coro)


async def pool_of(tmp_path, eng, *names, **budgets):
    """A started manager with ``names`` on the device, the first least recently used."""
    mgr = make_manager(make_catalog(tmp_path, NAMES), tmp_path / "cache", eng, **budgets)
    await mgr.start()
    for name in names:
        await mgr.ensure_resident(name)
    return mgr


async def full_pool(tmp_path, eng, **budgets):
    """a1, a2, a3 on the device, a1 least recently used."""
    return await pool_of(tmp_path, eng, "a1", "a2", "a3", **budgets)


def unloads(eng):
    return [n for op, n in eng.calls if op == "unload"]


def test_a_full_pool_evicts_the_hinted_adapter_not_the_lru(tmp_path):
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            assert mgr.prefetch("a4", evict=["a3"]).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE)
            assert unloads(eng) == ["a3"]
            assert set(eng.held) == {"a1", "a2", "a4"}
            assert mgr.view("a3").tier is Tier.DISK
            m = mgr.metrics
            assert m.counter("ace_agent_evictions_total", tier="device", reason="hint") == 1
            assert m.counter("ace_agent_evictions_total", tier="device", reason="budget") == 0  # no LRU eviction
            assert 'ace_agent_evictions_total{reason="hint",tier="device"} 1' in m.render()
        finally:
            await mgr.close()
    run(main())


def test_hints_that_may_not_go_fall_back_to_the_lru(tmp_path):
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            assert mgr.pin("a3") == DONE
            eng.busy_set = {"a2"}
            # pinned, in use, not in the catalog, unsafe as a path, the adapter itself
            r = mgr.prefetch("a4", evict=["a3", "a2", "nope", "../a1", "a4"])
            assert r.outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE)
            assert unloads(eng) == ["a1"]          # the LRU, as without hints
            assert set(eng.held) == {"a2", "a3", "a4"}
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="hint") == 0
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="budget") == 1
            # the one a request was about to use is counted as skipped (pinned ones are not)
            assert mgr.metrics.counter("ace_agent_prefetch_victims_skipped_total", reason="in_use") == 1
        finally:
            await mgr.close()
    run(main())


def test_no_hinted_eviction_while_there_is_room(tmp_path):
    async def main():
        eng = FakeConnector(capacity=4)
        mgr = await full_pool(tmp_path, eng)
        try:
            mgr.prefetch("a4", evict=["a3"])
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE)
            assert unloads(eng) == []
            assert set(eng.held) == {"a1", "a2", "a3", "a4"}
        finally:
            await mgr.close()
    run(main())


def test_hints_go_first_and_the_lru_makes_the_rest_of_the_room(tmp_path):
    async def main():
        # a byte budget of four small adapters; the big one needs the room of two
        sizes = {"s1": 4096, "s2": 4096, "s3": 4096, "s4": 4096, "big": 8192}
        entries = []
        for name, n in sizes.items():
            digest, size = write_adapter(tmp_path / "adapters" / name, name, n)
            entries.append({"name": name, "base_model": "ace-tiny-llama", "rank": 8, "size_bytes": size,
                            "uri": f"adapters/{name}", "sha256": digest})
        cat = tmp_path / "catalog.yaml"
        cat.write_text(yaml.safe_dump({"base_model": {"name": "ace-tiny-llama"}, "adapters": entries}))
        eng = FakeConnector()
        mgr = make_manager(cat, tmp_path / "cache", eng, device_bytes=4 * 4096)
        await mgr.start()
        try:
            for name in ("s1", "s2", "s3", "s4"):
                await mgr.ensure_resident(name)
            mgr.prefetch("big", evict=["s4"])
            await async_wait_until(lambda: mgr.view("big").tier is Tier.DEVICE)
            assert unloads(eng) == ["s4", "s1"]    # the hint, then the LRU
            assert set(eng.held) == {"s2", "s3", "big"}
        finally:
            await mgr.close()
    run(main())


def test_a_duplicate_of_a_queued_prefetch_brings_its_hints(tmp_path):
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            assert mgr.prefetch("a4").outcome is ResidencyOutcome.ACCEPTED    # queued, no worker yet
            r = mgr.prefetch("a4", evict=["a3"])
            assert (r.outcome, r.reason) == (ResidencyOutcome.ACCEPTED, "coalesced")
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE)
            assert unloads(eng) == ["a3"]
        finally:
            await mgr.close()
    run(main())



class OnDemandConnector(FakeConnector):
    """An engine that loads a request's adapter itself when the request arrives and makes
    its own room, taking the gateway's victims with that load (builtin)."""

    loads_on_demand = True
    self_managed = True


class ResolverConnector(FakeConnector):
    """An engine that loads a request's adapter itself (vLLM's resolver) into a cache the
    agent keeps at its size, whose unloads evict (ace's evicting plugin)."""

    loads_on_demand = True


def test_a_requests_own_prefetch_to_an_engine_that_loads_on_demand_only_fetches_ahead(tmp_path):
    """The gateway's ingress signal (``request_cold``) to an engine that loads the request's
    adapter itself: the agent fetches the files ahead (the engine's load joins that fetch)
    and loads nothing (no queue, no device stage, no eviction). A prediction's prefetch
    (with a probability) still loads."""
    async def main():
        eng = OnDemandConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            calls = list(eng.calls)
            spec = mgr.catalog.get("a4")
            got = mgr.prefetch("a4", priority=1, reason="request_cold", evict=["a3"])
            assert (got.outcome, got.reason) == (ResidencyOutcome.ACCEPTED, "engine_loads_on_demand")
            assert "a4" not in mgr.pipeline.inflight and "a4" not in mgr.queue
            assert mgr.metrics.counter("ace_agent_prefetch_total", outcome="left_to_engine") == 1
            await async_wait_until(lambda: mgr.store.local_path(spec) is not None, what="a4's files fetched ahead")
            assert eng.calls == calls and mgr.view("a4").tier is Tier.DISK       # nothing loaded or evicted
            assert mgr.prefetch("a4", reason="predicted", probability=0.9).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="the prediction's load")
        finally:
            await mgr.close()
    run(main())


def test_a_requests_own_prefetch_to_vllm_with_a_resolver_evicts_the_named_victim_ahead(tmp_path):
    """vLLM with a resolver loads the request's adapter itself, evicting its own least
    recently used; with ace's evicting unload the agent makes that room first, from the
    signal's named victims (never from its LRU), and loads nothing itself."""
    async def main():
        eng = ResolverConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            got = mgr.prefetch("a4", priority=1, reason="request_cold", evict=["a3"])
            assert (got.outcome, got.reason) == (ResidencyOutcome.ACCEPTED, "engine_loads_on_demand")
            await async_wait_until(lambda: unloads(eng) == ["a3"], what="the named victim unloaded ahead")
            assert "a4" not in mgr.pipeline.inflight and mgr.view("a4").tier is not Tier.DEVICE
            assert set(eng.held) == {"a1", "a2"}
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="hint") == 1
            # with room already there, or with no victim named, nothing leaves
            got = mgr.prefetch("a3", priority=1, reason="request_cold", evict=["a1"])
            assert got.reason == "engine_loads_on_demand"
            await async_wait_until(lambda: not mgr.pipeline._ahead, what="the eviction ahead done")
            assert unloads(eng) == ["a3"]
        finally:
            await mgr.close()
    run(main())


class RankingConnector(ResolverConnector):
    """vLLM with ace's evicting plugin and its ranking route: the resolver's read into the
    full cache takes the first ranked victim's weights; the name stays registered."""

    ranks_victims = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rankings: list[tuple[str, ...]] = []

    def prefer_victims(self, loading, victims):
        self.rankings.append(tuple(victims))


def test_a_requests_own_prefetch_to_a_ranking_vllm_unloads_nothing_on_the_requests_path(tmp_path):
    """With the ranking in vLLM's cache nothing is unloaded when the signal comes: the
    read takes the ranked victim; its name leaves with the shrink after the reconcile sees
    vLLM's new adapter, by the same ranking however late that reconcile comes (not the
    agent's LRU, whose weights vLLM kept)."""
    async def main():
        now = [1000.0]
        eng = RankingConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng, clock=lambda: now[0])       # a1 least recently used
        try:
            got = mgr.prefetch("a4", priority=1, reason="request_cold", evict=["a3", "a1"])
            assert (got.outcome, got.reason) == (ResidencyOutcome.ACCEPTED, "engine_loads_on_demand")
            assert eng.rankings == [("a3", "a1")]
            await async_wait_until(lambda: not mgr.pipeline._ahead, what="the fetch ahead done")
            assert unloads(eng) == []
            eng.held["a4"] = eng.held["a1"]      # the resolver registered a4 (a3's weights went)
            now[0] += 30.0                       # the reconcile comes long after the signal
            await mgr.reconcile()
            assert unloads(eng) == ["a3"] and mgr.view("a4").tier is Tier.DEVICE
            assert set(eng.held) == {"a1", "a2", "a4"}
            # a ranked adapter a request used since the ranking came is skipped, as vLLM's
            # cache skips it: the next ranked one leaves
            mgr.prefetch("a3", priority=1, reason="request_cold", evict=["a2", "a1"])
            now[0] += 1.0
            mgr.prefetch("a2", reason="predicted", probability=0.0, keep=["a2"])   # a request for a2
            eng.held["a3"] = eng.held["a4"]
            now[0] += 30.0
            await mgr.reconcile()
            assert unloads(eng) == ["a3", "a1"] and set(eng.held) == {"a2", "a3", "a4"}
        finally:
            await mgr.close()
    run(main())


def test_other_engines_still_load_a_requests_own_prefetch(tmp_path):
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            assert mgr.prefetch("a4", priority=1, reason="request_cold", evict=["a3"]).reason != "engine_loads_on_demand"
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="the request's prefetch loaded")
            assert unloads(eng) == ["a3"]
        finally:
            await mgr.close()
    run(main())


def test_adapters_the_gateway_just_sent_requests_for_are_nobodys_victim_for_a_while(tmp_path):
    """``keep`` (PrefetchRequest): vLLM lists a request as busy only some time after it
    arrives; what the gateway says it just sent requests for is skipped by every eviction,
    the LRU's included, for ``adopt_grace_s``; and having just been used, they become the
    most recently used (the engine's own cache order has them so)."""
    async def main():
        now = [1000.0]
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng, clock=lambda: now[0])       # a1 least recently used
        try:
            assert mgr.prefetch("a4", priority=1, reason="request_cold", keep=["a1", "nope"]).outcome \
                is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="a4 loaded")
            assert unloads(eng) == ["a2"]                                   # not a1, the LRU
            now[0] += 10.0                                                  # past the grace
            assert mgr.prefetch("a2", priority=1, reason="request_cold").outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a2").tier is Tier.DEVICE, what="a2 loaded")
            assert unloads(eng) == ["a2", "a3"]                             # a1 was used after a3
        finally:
            await mgr.close()
    run(main())


def test_a_room_only_prefetch_loads_into_free_room_and_never_evicts(tmp_path):
    """PrefetchRequest.room_only (the gateway's start-up fill): refused at once on a full
    pool, loaded where there is room, given up if the room is gone by its turn."""
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            got = mgr.prefetch("a4", reason="fill", room_only=True)
            assert (got.outcome, got.reason) == (ResidencyOutcome.REJECTED, "no_room")
            assert unloads(eng) == [] and mgr.metrics.counter("ace_agent_prefetch_total",
                                                              outcome="rejected_no_room") == 1
            await mgr.evict("a3")                                        # room for one
            assert mgr.prefetch("a4", reason="fill", room_only=True).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="a4 filled in")
            assert unloads(eng) == ["a3"]                                # only the explicit eviction
        finally:
            await mgr.close()
    run(main())


def test_a_room_only_prefetch_whose_room_was_taken_by_its_turn_is_given_up(tmp_path):
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await pool_of(tmp_path, eng, "a1", "a2")
        try:
            eng.load_delay_s = 0.05
            busy = asyncio.ensure_future(mgr.ensure_resident("a3"))      # a request's load takes the room
            await async_wait_until(lambda: ("load", "a3") in eng.calls, what="a3 loading")
            assert mgr.prefetch("a4", reason="fill", room_only=True).outcome is ResidencyOutcome.ACCEPTED
            await busy
            await async_wait_until(
                lambda: mgr.metrics.counter("ace_agent_prefetch_cancelled_total", reason="no_room") == 1,
                what="the fill given up")
            assert mgr.view("a4").tier is not Tier.DEVICE and unloads(eng) == []
            assert ("load", "a4") not in eng.calls
        finally:
            await mgr.close()
    run(main())


def test_a_room_only_prefetch_is_refused_by_a_pool_full_of_adapters_that_may_not_go(tmp_path):
    """No free room is no free room, whether or not something could be evicted."""
    async def main():
        eng = FakeConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            for name in ("a1", "a2", "a3"):
                mgr.pin(name)
            got = mgr.prefetch("a4", reason="fill", room_only=True)
            assert (got.outcome, got.reason) == (ResidencyOutcome.REJECTED, "no_room")
        finally:
            await mgr.close()
    run(main())


def test_the_shrink_after_an_engine_load_evicts_by_the_gateways_latest_ranking(tmp_path):
    """vLLM's resolver often loads a request's adapter before the agent's own load of it
    runs; the reconcile then adopts it and shrinks the device tier. That shrink follows the
    victims the request's signal ranked (the gateway's model of what each session needs
    next), not the agent's LRU, while the ranking is fresh (``adopt_grace_s``)."""
    async def main():
        now = [1000.0]
        eng = FakeConnector(capacity=3)
        mgr = await pool_of(tmp_path, eng, "a1", "a2", adopt_grace_s=2.0, clock=lambda: now[0])
        try:
            got = mgr.prefetch("a3", priority=1, reason="request_cold", evict=["a2", "nope", "a1"])
            assert got.outcome is ResidencyOutcome.ACCEPTED
            assert mgr.holdings.ranking() == ("a2", "a1")    # catalog names only, in order
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE, what="a3 loaded")
            assert unloads(eng) == []                        # there was room
            now[0] += 5.0
            assert mgr.holdings.ranking() == ()              # a stale ranking is not followed
            mgr.holdings.rank_victims(("a2",))
            eng.held.update({"a4": tmp_path})                # the resolver loaded a4 for a request
            await mgr.reconcile()                            # 4 on a device of 3: one goes
            assert unloads(eng) == ["a2"]                    # the ranked one, not a1 (the LRU)
        finally:
            await mgr.close()
    run(main())


class ListingConnector(RankingConnector):
    """vLLM with ace's evicting plugin, which also lists its CPU cache: ``dropped`` names
    stay registered (``held``) but their weights left the cache."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.dropped: set[str] = set()
        self.listings = 0

    async def cached(self):
        self.listings += 1
        return set(self.held) - self.dropped


def test_the_shrink_unregisters_a_name_whose_weights_vllms_cache_dropped_before_the_ranked_one(tmp_path):
    """The resolver's read into vLLM's full cache took a2's weights, not the ranked a3's
    (the ranking did not steer it): the shrink after the reconcile unregisters a2, which
    loses nothing (its next request reads it either way), not the cached a3 its ranking
    names (a hit lost). A dropped adapter a request waits for is never unregistered."""
    async def main():
        now = [1000.0]
        eng = ListingConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng, clock=lambda: now[0])
        try:
            mgr.prefetch("a4", priority=1, reason="request_cold", evict=["a3", "a1"])
            await async_wait_until(lambda: not mgr.pipeline._ahead, what="the fetch ahead done")
            eng.held["a4"] = eng.held["a1"]
            eng.dropped = {"a2"}
            now[0] += 30.0
            await mgr.reconcile()
            assert unloads(eng) == ["a2"] and set(eng.held) == {"a1", "a3", "a4"}
            m = mgr.metrics
            assert m.counter("ace_agent_evictions_total", tier="device", reason="engine_dropped") == 1
            assert m.counter("ace_agent_evictions_total", tier="device", reason="budget") == 0
            # dropped, but a queued request waits for it: the ranking's victim goes instead
            mgr.prefetch("a2", priority=1, reason="request_cold", evict=["a3"])
            eng.held["a2"] = eng.held["a4"]
            eng.dropped, eng.busy_set = {"a1"}, {"a1"}
            now[0] += 30.0
            await mgr.reconcile()
            assert unloads(eng) == ["a2", "a3"] and set(eng.held) == {"a1", "a2", "a4"}
        finally:
            await mgr.close()
    run(main())


def test_the_agents_own_load_makes_room_from_a_dropped_name_before_its_named_victim(tmp_path):
    """A prefetch's load into a full vLLM registry: a1's weights already left the cache,
    so its name goes first and the hinted a3 (cached) stays. The cache is listed only when
    a load needs room."""
    async def main():
        eng = ListingConnector(capacity=3)
        mgr = await pool_of(tmp_path, eng, "a1", "a2")
        try:
            eng.dropped = {"a1"}
            assert mgr.prefetch("a3", evict=["a2"]).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE, what="a3 loaded into room")
            assert unloads(eng) == [] and eng.listings == 0
            assert mgr.prefetch("a4", evict=["a3"]).outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="a4 loaded")
            assert unloads(eng) == ["a1"] and set(eng.held) == {"a2", "a3", "a4"}
            m = mgr.metrics
            assert m.counter("ace_agent_evictions_total", tier="device", reason="engine_dropped") == 1
            assert m.counter("ace_agent_evictions_total", tier="device", reason="hint") == 0
        finally:
            await mgr.close()
    run(main())


class OwnLRUConnector(FakeConnector):
    """An engine whose cache evicts its own least recently used adapter, whatever the
    agent unloads (vLLM's CPU cache)."""
    evicts_own_lru = True


def test_an_engine_that_evicts_its_own_lru_gets_the_lru_as_victim_not_the_hinted_one(tmp_path):
    """vLLM keeps an unloaded adapter's weights in its CPU cache and drops its own LRU
    one when it reads the next: a hinted victim there would leave a dead copy cached and
    the LRU adapter, still registered, re-read by its next request. So hints, priced bets'
    included, leave the victim to the LRU there."""
    async def main():
        eng = OwnLRUConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            r = mgr.prefetch("a4", evict=["a3"], probability=0.9, victim_reuse_probability=0.0)
            assert r.outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="a4 loaded")
            assert unloads(eng) == ["a1"]                  # the LRU, as the engine's cache drops
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="hint") == 0
            assert mgr.metrics.counter("ace_agent_evictions_total", tier="device", reason="budget") == 1
            # a request's ingress ranking does not order the shrink either
            mgr.prefetch("a1", reason="request_cold", evict=["a4"])
            await async_wait_until(lambda: mgr.view("a1").tier is Tier.DEVICE, what="a1 loaded")
            assert unloads(eng) == ["a1", "a2"]
        finally:
            await mgr.close()
    run(main())


def test_on_an_engine_that_evicts_its_own_lru_a_bet_whose_hinted_victim_is_busy_still_loads(tmp_path):
    """The bet was priced against a victim the agent does not pick there: its victim being
    in use gives nothing up; the LRU that is not busy goes."""
    async def main():
        eng = OwnLRUConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            eng.busy_set = {"a3"}
            r = mgr.prefetch("a4", evict=["a3"], probability=0.9, victim_reuse_probability=0.0)
            assert r.outcome is ResidencyOutcome.ACCEPTED
            await async_wait_until(lambda: mgr.view("a4").tier is Tier.DEVICE, what="a4 loaded")
            assert unloads(eng) == ["a1"]
            assert mgr.metrics.counter("ace_agent_prefetch_cancelled_total", reason="victim_in_use") == 0
        finally:
            await mgr.close()
    run(main())


class KeepingConnector(FakeConnector):
    """vLLM whose agent keeps names registered (``--vllm-keep-registered``): ``held`` is
    its CPU cache, ``names`` what it serves by name; an unload drops only the weights."""

    keeps_registered = True

    def __init__(self, **kw):
        super().__init__(**kw)
        self.names: set[str] = set()

    async def load(self, spec, path, *, pinned=False, demand=False):
        await super().load(spec, path, pinned=pinned, demand=demand)
        self.names.add(spec.name)

    async def registered(self):
        return set(self.names)

    def keeps_name(self, name):
        return True


def test_a_name_vllms_cache_dropped_while_it_stays_registered_is_a_tier_lost_not_a_reset(tmp_path):
    """With names kept registered, an adapter missing from vLLM's cache but still served
    by name lost its weights to one of vLLM's own reads: counted ``engine_gone``, not
    reloaded. One vLLM no longer serves at all (it restarted) is a reset: reloaded."""
    async def main():
        eng = KeepingConnector(capacity=3)
        mgr = await full_pool(tmp_path, eng)
        try:
            del eng.held["a2"]                     # vLLM's read took a2's weights
            await mgr.reconcile()
            m = mgr.metrics
            assert mgr.view("a2").tier is not Tier.DEVICE
            assert m.counter("ace_agent_evictions_total", tier="device", reason="engine_gone") == 1
            assert m.counter("ace_agent_engine_resets_total") == 0
            loads = [n for op, n in eng.calls if op == "load"]
            del eng.held["a3"]
            eng.names.discard("a3")                # forgotten: vLLM restarted under it
            await mgr.reconcile()
            assert m.counter("ace_agent_engine_resets_total") == 1
            await async_wait_until(lambda: mgr.view("a3").tier is Tier.DEVICE, what="a3 reloaded")
            assert [n for op, n in eng.calls if op == "load"] == [*loads, "a3"]
        finally:
            await mgr.close()
    run(main())
