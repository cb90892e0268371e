"""The builtin engine's adapters: where each lives (remote → disk → host → device) and how
it moves up.

:class:`EngineAdapters` is the seam the agent service drives in-process:

- ``await ensure_resident(name, hold=False) -> (tier_before, wait_ms)``: make the adapter
  usable by a batch; ``hold=True`` also keeps it in the pool until :meth:`release`
  (the engine holds an adapter for as long as one of its sequences runs).
- ``await prefetch(name, tier="device") -> tier_before``: move it up ahead of a request.
  A prefetch's load yields to every request's load (:mod:`gpu_agent.engine.load_order`):
  it starts only while none is in flight, pauses at its checkpoints when one arrives,
  and gives up rather than wait for room.
- Claims: from the moment ``ensure_resident(hold=True)`` is called (the engine accepted
  the request) until :meth:`release` (or the failed load), the adapter is *claimed*:
  neither the pool's eviction (this store's choice) nor :meth:`evict` takes it, so nothing (a prefetch, the agent's
  eviction hint, another request's load) can evict it between its load and its use.
- ``evict(name, tier="device")``: drop it from the pool (and from host memory with
  ``tier="host"``); refused (AdapterBusy) while a sequence holds it or a request claims it.
- ``pin`` / ``unpin``: keep an adapter in the pool regardless of LRU.
- What leaves the pool is decided here, once: the pool asks ``_choose_victims``
  (``gpu_agent.eviction.plan_evictions`` over the pool's LRU order, never a claimed
  adapter) and frees exactly those pages. ``prefer_victims(loading, names)``: the
  adapters the next load of ``loading`` evicts first (the gateway's model of this pool,
  lowest predicted use first, sent with a request's ingress signal; the agent relays it),
  for ``VICTIM_HINT_TTL_S``; the latest names given for any load come next (standing
  victims: a request's load often starts before its signal's hint arrives), less those a
  request claimed since; the LRU order covers the rest. Every eviction is counted by tier and reason
  (``evictions_by()``: ``ace_engine_adapter_evictions_total``).
- ``register`` / ``unregister``: adapters added at run time (vLLM-style load endpoint).
- ``on_left_pool(listener)``: ``listener`` is called on the event loop with the name of every adapter that
  left the pool (its LRU, its count cap, or :meth:`evict`) and is neither back nor being
  loaded again (the agent drops its disk copy there when the disk tier keeps only what
  is resident). ``on_pool_change(listener)``: the name of every adapter that entered or
  left the pool, whoever loaded or evicted it (the agent mirrors the device tier from it).

Tiers (``ace_common.tiers.Tier`` values): ``device`` (its pages in the paged pool), ``host``
(a parsed copy in host memory), ``disk`` (a local directory), ``remote`` (an http(s) uri
the source must fetch). A host budget of 0 keeps no parsed copy: an adapter that leaves
the pool comes back from disk (or remote).

The host and device tiers are ``gpu_agent.engine.staging.AdapterTiers`` (host LRU + paged pool,
with per-tier timings); this module adds what an engine needs on top: names from the
catalog, a pluggable source for the outer tiers, holds that keep an adapter in the pool
while its sequences run, and async waits. Pool calls are thread-safe (the pool has its
own lock, never held across a copy); disk reads and host→pool copies run on the load
threads (``LoadThreads``: one for requests' loads, one for prefetches') so the event loop
and the forward keep going while a cold load is under way. Concurrent loads of one adapter share one future.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence

from ace_common.catalog import PUBLIC, Adapter
from gpu_agent import errors as core
from gpu_agent.engine.errors import AdapterUnavailable, EngineError, ModelNotFound
from gpu_agent.engine.load_order import LoadOrder, LoadThreads, LoadTicket
from gpu_agent.eviction import Candidate, EvictReason, Shortfall, hinted_first, plan_evictions
from ace_common.tiers import ORDER, Tier

__all__ = ["entry_dir", "read_catalog", "AdapterSource", "LocalSource", "EngineAdapters",
           "TIERS"]

DEVICE, HOST = Tier.DEVICE.value, Tier.HOST.value
TIERS = tuple(t.value for t in ORDER)  # device, host, disk, remote
# host -> pool copies up to this size run inline on the event loop (CPU pool only)
INLINE_SWAP_BYTES = 4 << 20
# how long a victim hint (prefer_victims) waits for its load: the request it came with
# reaches the engine within milliseconds; an older hint describes a pool that has moved on
VICTIM_HINT_TTL_S = 5.0

log = logging.getLogger("gpu_agent.engine")


def _unavailable(name: str, exc: BaseException) -> AdapterUnavailable:
    """An unexpected failure while loading ``name`` (an OSError from the disk tier, a bug):
    logged with its traceback, answered as a 503 that says what happened (never a bare 500)."""
    log.error("loading adapter %s failed: %s: %s", name, type(exc).__name__, exc, exc_info=exc)
    return AdapterUnavailable(f"adapter {name} could not be loaded: {type(exc).__name__}: {exc}",
                              param="model", code="adapter_load_failed")


def entry_dir(entry: Adapter, root: Path | None = None) -> Path:
    """The directory of a local entry; ``root``: the folder a relative ``uri`` is under
    (the catalog file's; ``register``'s entries are absolute)."""
    path = entry.local_dir(root)
    if path is None:
        raise AdapterUnavailable(f"adapter {entry.name}: {entry.uri} is not a local path", param="model")
    return path


def read_catalog(path: str | Path) -> tuple[str, Path | None, dict[str, Adapter]]:
    """``(base model name, base model dir or None, adapters by name)`` of a catalog.yaml
    (checked by ``ace_common.catalog_schema``: a ``SchemaError``, a ``ValueError``, names
    the field)."""
    from ace_common.catalog_schema import CatalogBaseModel, read_catalog_file

    p = Path(path)
    doc = read_catalog_file(p)
    base = doc.base_model
    base_dir = (p.parent / base.path).resolve() if isinstance(base, CatalogBaseModel) and base.path else None
    entries = {raw.name: Adapter.from_entry(raw, doc.base_model_of(raw)) for raw in doc.adapters}
    return doc.base_model_name, base_dir, entries


class AdapterSource(Protocol):
    """Turns a catalog entry into a local directory (fetching it when remote)."""

    def tier(self, entry: Adapter) -> str:
        """``disk`` when a local copy exists, else ``remote``."""

    async def local_dir(self, entry: Adapter) -> tuple[Path, bool]:
        """The adapter's directory and whether its digest still needs checking."""

    def fetches_in_flight(self) -> int:
        """Downloads (or first checks) under way now: what a load starting now shares."""


class LocalSource:
    """Local paths and file:// URIs only; http(s) needs a fetching source (the agent's).
    ``root``: the folder relative paths are under (the catalog file's)."""

    def __init__(self, root: Path | None = None):
        self.root = root

    def tier(self, entry: Adapter) -> str:
        return "remote" if entry.is_remote else "disk"

    def fetches_in_flight(self) -> int:
        return 0  # it never fetches

    async def local_dir(self, entry: Adapter) -> tuple[Path, bool]:
        if entry.is_remote:
            raise AdapterUnavailable(
                f"adapter {entry.name} is remote ({entry.uri}) and this engine has no fetcher",
                param="model")
        return entry_dir(entry, self.root), True


@dataclass
class LoadRecord:
    tier_before: str
    ms: float
    at: float


class EngineAdapters:
    def __init__(self, pool: Any, spec: Any, entries: Mapping[str, Adapter], *,
                 source: AdapterSource | None = None, host_budget_bytes: int = 1 << 30,
                 room_timeout_s: float = 30.0, prefetch_nice: int = 0, root: Path | None = None):
        """``root``: the catalog file's folder, which relative ``uri``s are under (the
        default source's; a given ``source`` resolves its own)."""
        from gpu_agent.engine.staging import AdapterTiers

        self.pool = pool
        self.spec = spec
        self.tiers = AdapterTiers(pool, host_budget_bytes)
        self._entries: dict[str, Adapter] = dict(entries)
        self.source: AdapterSource = source or LocalSource(root)
        self._verified: set[str] = set()  # digests checked once, when first read from disk
        self._holds: dict[str, int] = {}
        self._claims: dict[str, int] = {}  # requests accepted and not finished, per adapter
        self._user_pins: set[str] = set()
        self._inflight: dict[str, asyncio.Future] = {}
        self._tickets: dict[str, LoadTicket] = {}
        self.order = LoadOrder()
        self.threads = LoadThreads(prefetch_nice)  # loads never run on the loop or the forward thread
        # loads into the pool by the tier they came from: one per load, however many
        # requests shared it
        self.loads: dict[str, int] = {t: 0 for t in TIERS}
        self.last_load: dict[str, LoadRecord] = {}
        # the last finished load of each adapter from a source (its ticket): where its time went
        self.load_stages: dict[str, LoadTicket] = {}
        self.room_timeout_s = room_timeout_s
        self._room = asyncio.Event()  # replaced on every set: one wake-up per release
        self.room_waits = 0  # times a load found the pool full of held adapters and waited
        # seconds spent in the tiers' load work (read, parse, copy into the pool), prefetch or
        # demand, counted when a load ends: what a request's TTFT window shares with loads
        self.load_seconds = 0.0
        self._left_pool_listeners: list[Callable[[str], None]] = []
        self._pool_change_listeners: list[Callable[[str], None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        # evictions by (tier, reason): the pool's (its owner's choice below, or evict) and the
        # host copies' (their byte budget)
        self.evictions: dict[tuple[str, str], int] = {}
        # loading name -> (victims to evict first, monotonic time given): prefer_victims
        self._victim_hints: dict[str, tuple[tuple[str, ...], float]] = {}
        # the latest victims named for any load (monotonic time given), minus what requests
        # claimed since: the order of every other load that needs room (_choose_victims)
        self._standing_victims: tuple[tuple[str, ...], float] = ((), 0.0)
        self._hinted_out: set[str] = set()  # the last choice's hinted victims (released as "hint")
        pool.release_listeners.append(self._pool_released)
        pool.admit_listeners.append(self._pool_admitted)
        pool.choose_victims = self._choose_victims  # this store decides what leaves the pool

    # -- names and tiers ---------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> Adapter:
        try:
            return self._entries[name]
        except KeyError:
            raise ModelNotFound(name) from None

    def knows(self, name: str) -> bool:
        return name in self._entries

    def register(self, name: str, path: str | Path, sha256: str | None = None) -> Adapter:
        """Add (or replace) an adapter at run time from a local directory."""
        entry = Adapter(name=name, base_model=self.spec.name, rank=0, target_modules=(), size_bytes=0,
                        owner=PUBLIC, uri=str(Path(path).resolve()), sha256=sha256 or "")
        self._entries[name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self.entry(name)
        self.evict(name, tier="host")
        self._entries.pop(name, None)

    def tier(self, name: str) -> str:
        entry = self.entry(name)
        return self.tiers.where(name) or self.source.tier(entry)

    def held(self, name: str) -> int:
        return self._holds.get(name, 0)

    def claimed(self, name: str) -> bool:
        """A request the engine accepted is about to use (or uses) ``name``."""
        return self._claims.get(name, 0) > 0

    def has_claims(self) -> bool:
        """A request the engine accepted has not finished (thread-safe read)."""
        return bool(self._claims)

    def claimed_names(self) -> set[str]:
        return {n for n, c in list(self._claims.items()) if c > 0}

    def prefer_victims(self, loading: str, victims: Sequence[str]) -> None:
        """The next load of ``loading`` (within ``VICTIM_HINT_TTL_S``) evicts ``victims``
        first, in this order, where it needs room and they may go; the LRU order after them.
        An empty ``victims`` forgets the hint."""
        if victims:
            given = (tuple(victims), time.monotonic())
            self._victim_hints[loading] = given
            self._standing_victims = given
        else:
            self._victim_hints.pop(loading, None)

    def _spare_from_standing(self, name: str) -> None:
        """A request claimed ``name``: the standing victims were named before it was wanted."""
        standing, given = self._standing_victims
        if name in standing:
            self._standing_victims = (tuple(n for n in standing if n != name), given)

    def _choose_victims(self, loading: str, short: Shortfall, order: Sequence[Candidate]) -> list[str]:
        """What leaves the pool for ``loading`` (pool lock held, on the loading thread): the
        victims hinted for this load first (``prefer_victims``), then the latest victims
        hinted for any load (the standing victims: the gateway's latest view of this pool,
        for a load whose own hint has not arrived or was never sent, less what requests
        claimed since), then the pool's policy order; never an adapter a request the
        engine accepted is about to use."""
        now = time.monotonic()
        hint = self._victim_hints.pop(loading, None)
        hints = hint[0] if hint is not None and now - hint[1] <= VICTIM_HINT_TTL_S else ()
        standing, given = self._standing_victims
        if now - given <= VICTIM_HINT_TTL_S:
            hints = (*hints, *standing)  # hinted_first keeps each name's first place
        cands = [c if c.evictable and not self.claimed(c.name) else replace(c, evictable=False) for c in order]
        out = plan_evictions(hinted_first(cands, hints), short)
        self._hinted_out = set(out).intersection(hints)  # the pool releases them next, lock held
        return out

    def evictions_by(self) -> dict[tuple[str, str], int]:
        """Evictions so far by ``(tier, reason)``, the host copies' budget included."""
        out = dict(self.evictions)
        if self.tiers.host.evictions:
            key = (HOST, EvictReason.BUDGET.value)
            out[key] = out.get(key, 0) + self.tiers.host.evictions
        return out

    # -- moving up ---------------------------------------------------------------------

    async def ensure_resident(self, name: str, *, hold: bool = False,
                              prefetch: bool = False) -> tuple[str, float]:
        """Make ``name`` resident in the pool; ``(tier it was in, measured wait in ms)``.

        ``hold=True`` (a request): claimed from now on, held once resident, until
        :meth:`release`. ``prefetch=True``: a load that yields to requests' loads and
        gives up (PoolExhausted) rather than wait for room."""
        t0 = time.perf_counter()
        tier_before = self.tier(name)
        if hold:
            self._claims[name] = self._claims.get(name, 0) + 1
            self._spare_from_standing(name)
        try:
            if hold and self._holds.get(name, 0) > 0:
                self._holds[name] += 1  # pinned already by an earlier holder
                self.pool.touch(name)
                return DEVICE, (time.perf_counter() - t0) * 1e3
            if tier_before == DEVICE:
                try:
                    if hold:
                        self.pool.pin(name)
                    else:
                        self.pool.touch(name)
                except core.AdapterNotResident:  # evicted between the check and the pin
                    tier_before = self.tier(name)
                else:
                    if hold:
                        self._holds[name] = 1
                    return DEVICE, (time.perf_counter() - t0) * 1e3
            await self._load_when_room(name, pin=hold, prefetch=prefetch and not hold)
        except BaseException:
            if hold:
                self._unclaim(name)
            raise
        if hold:
            self._holds[name] = self._holds.get(name, 0) + 1
        ms = (time.perf_counter() - t0) * 1e3
        self.last_load[name] = LoadRecord(tier_before, ms, time.time())
        return tier_before, ms

    def _unclaim(self, name: str) -> None:
        n = self._claims.get(name, 0) - 1
        if n > 0:
            self._claims[name] = n
        else:
            self._claims.pop(name, None)
            self._wake_room()
            if not self._claims:
                self.order.notify()  # the last request ended: deferred prefetches may go

    def _wake_room(self) -> None:
        self._room.set()  # pages may have become evictable: wake loads waiting for room
        self._room = asyncio.Event()

    def release(self, name: str) -> None:
        """One holder is done; the last one unpins (unless pinned on purpose)."""
        n = self._holds.get(name, 0) - 1
        if n > 0:
            self._holds[name] = n
            self._unclaim(name)
            return
        self._holds.pop(name, None)
        if name not in self._user_pins:
            try:
                self.pool.unpin(name)
            except core.AdapterNotResident:
                pass
        self._unclaim(name)

    async def prefetch(self, name: str, tier: str = DEVICE) -> str:
        """Move ``name`` up to ``tier`` (``device`` or ``host``); returns where it was."""
        if tier not in (DEVICE, HOST):
            raise ValueError(f"prefetch tier must be device or host, got {tier!r}")
        before = self.tier(name)
        if tier == DEVICE:
            await self.ensure_resident(name, prefetch=True)
        elif before not in (DEVICE, HOST):
            await self._to_host(name)
        return before

    def evict(self, name: str, tier: str = DEVICE) -> bool:
        """Drop ``name`` from the pool (``tier="host"``: from host memory too).

        AdapterBusy while a running sequence holds it or it is pinned.
        """
        self.entry(name)
        if self._holds.get(name) or self.claimed(name):
            raise core.AdapterBusy(f"adapter {name!r} is used by running or accepted requests")
        self._note_loop()
        removed = False
        if self.pool.contains(name):
            try:
                self.pool.evict(name)
                removed = True
            except core.AdapterNotResident:
                pass
        if tier == HOST and name in self.tiers.host:
            self.tiers.host.drop(name)
            self._count_eviction(HOST, EvictReason.OPERATOR)
            removed = True
        return removed

    def pin(self, name: str) -> None:
        """Pin a resident adapter; AdapterNotResident (nothing changed) if it is not in the
        pool: use :meth:`ensure_pinned` to load and pin."""
        was_pinned = name in self._user_pins
        self._user_pins.add(name)
        try:
            self.pool.pin(name)
        except core.AdapterNotResident:
            if not was_pinned:
                self._user_pins.discard(name)
            raise

    async def ensure_pinned(self, name: str, *, prefetch: bool = False) -> str:
        """Load ``name`` and pin it in one step (no window in which another load's LRU
        eviction can take it between the load and the pin); returns the tier it was in.
        ``prefetch``: as in :meth:`ensure_resident`."""
        self.entry(name)
        before = self.tier(name)
        was_pinned = name in self._user_pins
        self._user_pins.add(name)  # first: a holder's release must not unpin it meanwhile
        try:
            await self._load_when_room(name, pin=True, prefetch=prefetch)
        except BaseException:
            if not was_pinned:
                self._user_pins.discard(name)
            raise
        return before

    def close(self) -> None:
        """Stop the load threads (loads still queued are cancelled)."""
        self.threads.close()

    def loading(self) -> set[str]:
        """Adapters with a cold load under way."""
        return set(self._inflight)

    def unpin(self, name: str) -> None:
        self._user_pins.discard(name)
        if not self._holds.get(name):
            try:
                self.pool.unpin(name)
            except core.AdapterNotResident:
                pass

    def snapshot(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, e in self._entries.items():
            rec = self.last_load.get(name)
            out[name] = {"tier": self.tier(name), "held": self._holds.get(name, 0),
                         "pinned": name in self._user_pins, "size_bytes": e.size_bytes,
                         "last_cold_load_ms": rec.ms if rec else None}
        return out

    # -- internals ---------------------------------------------------------------------

    def _note_loop(self) -> None:
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:  # called outside a loop (tests): listeners hear nothing
            pass

    def _count_eviction(self, tier: str, reason: EvictReason) -> None:
        key = (tier, reason.value)
        self.evictions[key] = self.evictions.get(key, 0) + 1

    def on_left_pool(self, listener: Callable[[str], None]) -> None:
        """``listener(name)`` on the event loop for every adapter that left the pool for good."""
        self._left_pool_listeners.append(listener)

    def on_pool_change(self, listener: Callable[[str], None]) -> None:
        """``listener(name)`` on the event loop after ``name`` entered or left the pool (any
        load or eviction, whoever made it). The pool may have changed again since: a
        listener asks it what it holds now (the agent's mirror of this device tier)."""
        self._note_loop()
        self._pool_change_listeners.append(listener)

    def _pool_admitted(self, name: str) -> None:
        """Pool admit hook (pool lock held, any thread): hand the name to the loop."""
        if self._pool_change_listeners:
            self._to_loop(self._pool_changed, name)

    def _pool_released(self, name: str, reason: EvictReason) -> None:
        """Pool release hook (pool lock held, any thread): count it, hand the name to the loop."""
        if reason is EvictReason.BUDGET and name in self._hinted_out:
            reason = EvictReason.HINT
        self._count_eviction(DEVICE, reason)
        if self._left_pool_listeners:
            self._to_loop(self._left_pool, name)
        if self._pool_change_listeners:
            self._to_loop(self._pool_changed, name)

    def _to_loop(self, fn: Callable[[str], None], name: str) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(fn, name)
        except RuntimeError:  # the loop is closed (shutting down)
            pass

    def _pool_changed(self, name: str) -> None:
        for listener in list(self._pool_change_listeners):
            try:
                listener(name)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the engine
                log.exception("pool-change listener failed for %s", name)

    def _left_pool(self, name: str) -> None:
        if self.pool.contains(name) or name in self._inflight:
            return  # back already, or on its way back
        for listener in list(self._left_pool_listeners):
            try:
                listener(name)
            except Exception:  # noqa: BLE001 - a listener's failure must not stop the engine
                log.exception("left-pool listener failed for %s", name)

    async def _load_when_room(self, name: str, *, pin: bool, prefetch: bool = False) -> None:
        """Load; when the pool is full of held adapters, wait for a holder to finish
        (as S-LoRA queues a request whose adapter does not fit yet) instead of failing.
        A request's load counts as in flight (prefetches yield to it) the whole time; a
        prefetch never waits for room: it is given up (cancelled, ``no_room``)."""
        if prefetch:
            try:
                await self._load(name, pin=pin, prefetch=True)
            except core.PoolExhausted:
                self.order.cancel("no_room")
                raise
            return
        async with self.order.demand():
            deadline = time.monotonic() + self.room_timeout_s
            while True:
                room = self._room
                try:
                    await self._load(name, pin=pin, prefetch=False)
                    return
                except core.PoolExhausted:
                    adapter = self.tiers.host.get(name)
                    never_fits = adapter is not None and self.pool.pages_for(adapter) > self.pool.num_pages
                    left = deadline - time.monotonic()
                    # room comes back only when a request using a resident adapter ends
                    waitable = any(n != name and self.pool.contains(n) for n in list(self._claims))
                    if never_fits or not waitable or left <= 0:
                        raise
                self.room_waits += 1
                try:
                    await asyncio.wait_for(room.wait(), timeout=left)
                except asyncio.TimeoutError:
                    pass  # one last try, then raise

    async def _load(self, name: str, *, pin: bool, prefetch: bool) -> None:
        self._loop = asyncio.get_running_loop()  # pool releases during the load are heard here
        while True:
            fut = self._inflight.get(name)
            if fut is None and not prefetch and self._swap_inline(name, pin):
                return
            if fut is None:
                ticket = LoadTicket(name, prefetch, others_loading=len(self._inflight),
                                    fetches_at_start=self.source.fetches_in_flight())
                fut = asyncio.ensure_future(self._load_once(name, ticket))
                self._inflight[name] = fut
                self._tickets[name] = ticket
                fut.add_done_callback(lambda _f, n=name: self._load_finished(n, _f))
            elif not prefetch and name in self._tickets:
                self.order.promote(self._tickets[name])  # a request joined a prefetch's load
            await asyncio.shield(fut)
            if not pin:
                return
            try:
                self.pool.pin(name)
                return
            except core.AdapterNotResident:  # evicted right after the shared load: load again
                continue                     # (registered as loading, like any load)

    def _load_finished(self, name: str, fut: asyncio.Future) -> None:
        if self._inflight.get(name) is fut:
            del self._inflight[name]
            ticket = self._tickets.pop(name, None)
            if ticket is not None and not fut.cancelled() and fut.exception() is None:
                self.load_stages[name] = ticket

    def _swap_inline(self, name: str, pin: bool) -> bool:
        """A small host -> pool copy on a CPU pool, done right here on the loop when no other
        load holds the tiers: True when done. The copy (< INLINE_SWAP_BYTES, ~0.1-0.5 ms)
        costs less than the worker-thread round trip and the loop hops it replaces."""
        adapter = self.tiers.host.get(name)
        if (adapter is None or self.pool.device.type != "cpu" or adapter.nbytes > INLINE_SWAP_BYTES
                or not self.tiers.lock.acquire(blocking=False)):
            return False
        t0 = time.perf_counter()
        try:
            self.tiers.ensure(name, pin=pin)
        except (core.AgentError, EngineError):
            raise
        except Exception as exc:  # noqa: BLE001 - as in _load_once
            raise _unavailable(name, exc) from exc
        finally:
            self.tiers.lock.release()
            self.load_seconds += time.perf_counter() - t0
        self.loads["host"] = self.loads.get("host", 0) + 1
        return True

    async def _load_once(self, name: str, ticket: LoadTicket) -> None:
        try:
            if ticket.prefetch:
                async with self.order.prefetch_slot(ticket):
                    await self._load_from_source(name, ticket)
            else:
                await self._load_from_source(name, ticket)
        except (core.AgentError, EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - anything else is an internal load failure
            raise _unavailable(name, exc) from exc

    async def _load_from_source(self, name: str, ticket: LoadTicket) -> None:
        tier = self.tier(name)
        while True:
            path, digest = None, None
            if self.tiers.where(name) is None:  # not in host memory: the source gives a directory
                entry = self.entry(name)
                t_fetch = time.perf_counter()
                try:
                    path, verify = await self.source.local_dir(entry)
                finally:
                    ticket.fetch_s += time.perf_counter() - t_fetch
                if verify and entry.sha256 and entry.sha256 not in self._verified:
                    digest = entry.sha256
                if self.order.should_yield(ticket, "fetch"):
                    await self.order.pause(ticket, "fetch")
                    continue  # its files are kept meanwhile: it is loading (``loading()``)
            t0 = time.perf_counter()
            try:
                await self.threads.run(ticket.prefetch, self.tiers.ensure, name, path, digest, pin=False,
                                       should_yield=lambda stage: self.order.should_yield(ticket, stage))
            except core.LoadYielded as exc:
                await self.order.pause(ticket, exc.stage)
                continue
            except core.AdapterNotFound:
                if path is None and self.tiers.where(name) is None:
                    continue  # its host copy left between the check and the read: from disk
                raise
            except FileNotFoundError as exc:
                raise core.AdapterNotFound(f"adapter {name}: {exc}") from exc
            finally:
                took = time.perf_counter() - t0
                self.load_seconds += took
                ticket.tiers_s += took
            break
        if digest:
            self._verified.add(digest)
        if tier != DEVICE:
            self.loads[tier] = self.loads.get(tier, 0) + 1

    async def _to_host(self, name: str) -> None:
        try:
            await self._to_host_from_source(name)
        except (core.AgentError, EngineError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001
            raise _unavailable(name, exc) from exc

    async def _to_host_from_source(self, name: str) -> None:
        from gpu_agent.engine.peft import load_peft_dir

        entry = self.entry(name)
        path, verify = await self.source.local_dir(entry)
        digest = entry.sha256 if verify and entry.sha256 and entry.sha256 not in self._verified else None
        adapter = await self.threads.run(True, load_peft_dir, path, self.spec, digest, name=name,
                                         pin_memory=self.tiers.pin_host)
        if digest:
            self._verified.add(digest)
        self.tiers.host.put(adapter)
