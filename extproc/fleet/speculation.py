"""Speculative prefetch in the gateway (the runtime around ``extproc.policy.speculator``):
learn each request's session step, prefetch the next.

```
 request path (ext_proc)                      background thread "speculation"
 decide() -> Decision ─ observe() ─ deque ──▶ SpeculationPlanner.sync(ResidencySnapshot)
            (one append, bounded)             SpeculationPlanner.step(ObservedRequest) -> [PrefetchSignal]
                                              ─ PrefetchSink.submit (AgentLink: bounded queue)
```

The request path only appends a tuple to a bounded deque (``observe``, well under a
microsecond; a full deque drops the step and counts it), and wakes the thread if it is
waiting for work (an ``Event.set``, only on the first request after an idle spell: while
requests keep coming the thread drains every ``poll_s`` and nobody wakes it). Speculation itself
(``Speculator.step`` of the serving host, the loop ``bench.sim`` runs too, 5-15 us a
step on this machine, plus syncs) runs in one daemon thread, so the ext_proc decision budget (<= 20 us
p99 for ``decide``) is not spent on it.

- **Session**: header ``x-ace-session-id`` › the OpenAI body field ``user`` (the end
  user: one agent's consecutive requests) › none. Without a session a request still
  counts as demand (popularity, pool model) but teaches no transition.
- **Which requests**: only requests that apply an adapter (``multi_lora=prod``). With
  ``dynamic_lora_prefetch=prod`` the planner's prefetches are submitted to the sink;
  with ``shadow`` they are decided and counted (``shadow_prefetches``) but never sent;
  ``off`` requests are counted (popularity for the next start's warm set; the pool size
  is still learned from residency) and teach the transition model (kept for the next
  start), never planned.
- **Where**: one ``Speculator`` (pool model, popularity) per upstream; one transition
  model, prediction ledger, session demand and first-step model for all of them (a
  session's steps may go to different hosts). A predicted adapter (a session's next
  step, or one of the tenant's likeliest session openers: signal reason ``first_step``)
  is offered to the host the routing policy would send it to, if the tenant may use it.
- **Horizon**: the bound compares use probabilities over a horizon; one shared
  ``StepPace`` sets it to twice the median gap between a session's consecutive steps as
  observed (last 256 gaps, clamped to 0.25-60 s; the settings' 10 s until 32 gaps are
  seen), so "likely to be used soon" means "before the sessions' next steps", whatever
  the traffic's pace. The simulator's ``speculative`` policy runs the same rule.
- **Pool model**: synced from the residency snapshot (the adapters on the ``device``) whenever
  the snapshot changes. Its capacity is the pool's size where the agent announces one
  (``ResidencySnapshot.slots``: vLLM's and SGLang's cache, which the engine's own loads
  overshoot for a moment, so counting would learn 5-6 for a cache of 4), else learned as
  the most adapters seen in one pool (the builtin engine's pool is sized in bytes). A bet
  an agent refuses (``AgentLink.on_refused`` -> ``refused``) leaves the model at the next
  drain, instead of counting as in flight for ``load_grace_s``.
- **Warm set**: at start-up, ``extproc.policy.warmset.warm_set`` over the request counts
  this gateway persisted (``PopularityFile``, next to the SQLite file); each host's
  list is submitted once, when its agent's residency first arrives. No file, no warm set.
- **Restart**: the same file carries the transition model's counts
  (``TransitionModel.to_state``), so a restarted gateway predicts the workflows it
  learned from the first step; sessions in progress are not kept (they do not survive
  a restart). The file is bounded (``PopularityFile.max_bytes``).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

from extproc.domain.decision import Decision
from extproc.policy.prediction import FirstSteps, PredictionLedger, SessionDemand, StepPace, TransitionModel
from extproc.policy.routing import RoutePolicy, place_by_demand
from extproc.policy.speculator import DEFAULT_LOAD_S, SpeculationSettings, Speculator
from extproc.policy.warmset import fill_set, warm_set
from extproc.domain.prefetch import PrefetchSignal, PrefetchSink
from extproc.state.residency import ResidencySnapshot, SentCounts, TierReport
from extproc.state.skill_modes import DYNAMIC_LORA_PREFETCH, OFF, PROD
from extproc.state.catalog import PUBLIC
from extproc.state.store import Snapshot
from ace_common.tiers import Tier

__all__ = ["HOLD_S", "GatewaySpeculation", "PopularityFile", "RequestObserver", "Saved",
           "SpeculationPlanner", "ObservedRequest", "demand_placement", "fill_signals", "route_by_policy",
           "warm_signals"]

log = logging.getLogger(__name__)


class RequestObserver(Protocol):
    def observe(self, d: Decision, tenant: str, session: str | None) -> bool:
        """Take note of a decided request without blocking; False if not taken."""
        ...


@dataclass(frozen=True, slots=True)
class ObservedRequest:
    """One observed request: served by ``upstream`` for ``tenant``, its prefetch ``mode``."""

    upstream: str
    tenant: str
    session: str | None
    adapter: str
    mode: str  # off: counted only; shadow: planned, not sent; prod: planned and sent


#: The longest a bet waits for the demand load of the request that planned it
#: (``SpeculationPlanner.hold_s``, ``--prefetch-hold-s``): a load that takes longer (or
#: that no residency update reports) no longer holds it back.
HOLD_S = 0.5

#: ``(snapshot, adapter name, residency, sent) -> upstream name`` (None: no such adapter)
PlannerRoute = Callable[[Snapshot, str, ResidencySnapshot, SentCounts], "str | None"]


class SpeculationPlanner:
    """The decisions, without threads or clocks: per-upstream ``Speculator`` s over a shared
    transition model. ``route(snapshot, adapter_name, residency, sent) -> upstream name``."""

    def __init__(self, settings: SpeculationSettings = SpeculationSettings(), *,
                 route: PlannerRoute | None = None,
                 initial_slots: int = 2, load_grace_s: float = 2.0,
                 slots: Mapping[str, int] | None = None, hold_s: float = HOLD_S) -> None:
        self.settings = settings
        self.route = route
        self.initial_slots = initial_slots
        self.load_grace_s = load_grace_s  # a prefetch not yet in the pool is in flight this long
        self.hold_s = hold_s  # the longest a bet waits for the demand load of the request that planned it
        self.held = 0  # bets planned behind a demand load (``PrefetchSignal.yields_to``)
        self.model = settings.transition_model()
        self.ledger = PredictionLedger()
        self.speculators: dict[str, Speculator] = {}
        self._slots = dict(slots or {})
        self.pace = StepPace(settings.horizon_s)
        self.expected = SessionDemand(settings.horizon_s, working_set=settings.working_set)
        self.first_steps = FirstSteps(settings.half_life_s, idle_timeout_s=settings.idle_timeout_s)
        self._typical: tuple[object, float] | None = None  # (the views it was read from, seconds)
        self._pooled: dict[str, frozenset[str]] = {}  # upstream -> its device tier at the last sync
        # upstream -> (its agent's table, the device tier read from it): the agents' tables are
        # frozen, and most syncs find most of them unchanged (a load measured, another host's
        # change), so each is read once (226 adapters x 4 hosts at hundreds, per sync)
        self._read: dict[str, tuple[Mapping[str, TierReport], frozenset[str]]] = {}
        self.full: set[str] = set()  # upstreams whose pool was seen evicting at its learned capacity

    def typical_load_s(self, residency: ResidencySnapshot) -> float:
        """What a load that no agent has measured yet is expected to take: the median of
        the loads the agents did measure (any adapter, any host), else ``DEFAULT_LOAD_S``.
        A fixed default beside measured times skews the price both ways: an adapter the
        engine loaded itself (never timed by its agent) looked 0.1 s to reload beside a
        candidate measured at 5 ms, so nearly every prefetch against it was refused.
        Read once per residency view."""
        views = residency.by_upstream
        memo = self._typical
        if memo is not None and memo[0] is views:
            return memo[1]
        known = sorted(r.cold_load_ms for view in views.values() for r in view.values() if r.cold_load_ms)
        typical = known[len(known) // 2] / 1000.0 if known else DEFAULT_LOAD_S
        self._typical = (views, typical)
        return typical

    def speculator(self, upstream: str) -> Speculator:
        spec = self.speculators.get(upstream)
        if spec is None:
            spec = Speculator(max(self.initial_slots, self._slots.get(upstream, 0)), self.settings,
                              model=self.model, ledger=self.ledger, pace=self.pace,
                              expected=self.expected, first_steps=self.first_steps, name=upstream)
            spec.set_horizon(self.pace.horizon_s)
            self.speculators[upstream] = spec
        return spec

    def sync(self, residency: ResidencySnapshot, now: float) -> None:
        """Align every known host's pool model with the agents' view, and note each pool
        seen evicting (``full``). A pool whose agent announces its size (``slots``: vLLM,
        SGLang) is modelled at that size; the others' size is learned. Each host's bets are
        priced with the waste share its agent announced (``Speculator.waste_share``)."""
        for upstream, table in residency.by_upstream.items():
            read = self._read.get(upstream)
            if read is None or read[0] is not table:
                read = self._read[upstream] = (table, frozenset(a for a, r in table.items() if r.tier == Tier.DEVICE))
            pooled = read[1]
            spec = self.speculator(upstream)
            slots = residency.slots.get(upstream)
            if slots:
                spec.cache.capacity = slots
            spec.waste_share = residency.waste_share.get(upstream, 0.0)
            before = self._pooled.get(upstream)
            if before is not None and before - pooled and len(before) >= spec.cache.capacity:
                self.full.add(upstream)  # it held the most it ever held and let one go: at capacity
            self._pooled[upstream] = pooled
            spec.sync(pooled, now, learn_capacity=not slots)

    def placement_slots(self) -> int | None:
        """The pool size placement may plan with: the smallest learned capacity among the
        pools seen evicting, None while none was (the learned capacity only grows with what
        a pool held, so before its first eviction it is a lower bound, and a cold fleet of
        16 adapters over 4 x 8 slots looked crowded at 2-4 slots a host: placement moved
        adapters for balance on engines 6% busy, each move a cold load)."""
        sizes = [self.speculators[u].cache.capacity for u in self.full if u in self.speculators]
        return min(sizes) if sizes else None

    def step(self, step: ObservedRequest, snapshot: Snapshot, residency: ResidencySnapshot, sent: SentCounts,
             now: float) -> list[PrefetchSignal]:
        """``Speculator.step`` on the serving host (the one speculation loop), wrapped with
        the gateway's parts: a predicted adapter must exist and be visible to the tenant,
        and is offered to the host the routing policy would send it to (over ``residency``
        and ``sent``, the board's); each prefetch becomes a ``PrefetchSignal`` naming the
        victim the pool model chose."""
        grace = self.load_grace_s
        multi = self.route is not None and len(snapshot.upstreams) > 1

        def place(name: str) -> Speculator | None:
            adapter = snapshot.adapters.get(name)
            if adapter is None or not adapter.visible_to(step.tenant):
                return None
            target = (self.route(snapshot, name, residency, sent) if multi else None) or step.upstream
            return self.speculator(target)

        def load_s(name: str) -> float:
            # the agents' measured load time from where the adapter lies (the slowest
            # report: the target host may hold it no closer than the others); unmeasured:
            # the typical measured load
            known = [r.cold_load_ms for view in residency.by_upstream.values()
                     if (r := view.get(name)) is not None and r.cold_load_ms]
            return max(known) / 1000.0 if known else self.typical_load_s(residency)

        got = self.speculator(step.upstream).step(step.tenant, step.session, step.adapter, now,
                                                  prefetch_load=lambda a, t: t + grace, place=place,
                                                  load_s=load_s)
        if not got.prefetches:
            return []
        grace = {u.name: u.victim_grace_s for u in snapshot.upstreams}
        demand = self.demand_load(step, residency)
        self.held += len(got.prefetches) if demand else 0
        return [PrefetchSignal(upstream=p.host, adapter=p.adapter, digest=snapshot.adapters[p.adapter].sha256,
                               priority=0, reason=p.reason,
                               evict=() if p.victim is None else (str(p.victim),),
                               probability=p.use_probability, victim_reuse_probability=p.victim_probability,
                               spare_s=grace.get(p.host, 0.0),
                               yields_to=demand, hold_until=now + self.hold_s if demand else 0.0)
                for p in got.prefetches]

    def demand_load(self, step: ObservedRequest, residency: ResidencySnapshot) -> tuple[str, str] | None:
        """``(upstream, adapter)`` when the request ``step`` was routed to a host whose agent
        does not report its adapter on the device tier: the engine loads it now, and the bets
        this step plans wait for that load (``PrefetchSignal.yields_to``), so they do not
        take the CPU, the link or the artifact store from it. None: resident (nothing to
        wait for), holding off (``hold_s`` 0), or no residency from that host (nothing
        would say when the load landed)."""
        if self.hold_s <= 0:
            return None
        table = residency.by_upstream.get(step.upstream)
        if table is None:
            return None
        report = table.get(step.adapter)
        if report is not None and report.tier == Tier.DEVICE:
            return None
        return step.upstream, step.adapter

    def victims(self, now: float, n: int | None = None) -> dict[str, tuple[str, ...]]:
        """Per upstream, the adapters its pool model would evict first, coldest first, the
        ``n`` first (None: its whole ranking) (``Speculator.victims``): what a request's
        ingress prefetch asks the agent to evict (``ResidencySnapshot.victims``; the
        decision names ``Upstream.victim_hints`` of them)."""
        return {u: tuple(map(str, s.victims(now, n))) for u, s in self.speculators.items()}

    def slots(self) -> dict[str, int]:
        """Learned pool capacity per upstream (persisted for the next start's warm set)."""
        return {u: s.cache.capacity for u, s in self.speculators.items()}

    def refused(self, upstream: str, adapter: str, now: float) -> bool:
        """``upstream``'s agent refused the prefetch of ``adapter`` (its speculation budget,
        no room, a full queue): the pool model drops it (``AdapterCache.withdraw``), so the
        room it held is free again and a later prediction may offer it anew. Before, the
        model kept a refused bet as in flight for ``load_grace_s``: its slot taken, and the
        adapter never offered again meanwhile. False when the model had no such bet."""
        spec = self.speculators.get(upstream)
        return spec is not None and spec.cache.withdraw(adapter, now)

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for spec in self.speculators.values():
            for k, v in spec.counters().items():
                if k.startswith("prefetch"):
                    total[k] = total.get(k, 0) + v
        st = self.ledger.stats
        total.update(predictions=st.predictions, predictions_used=st.used, predictions_wasted=st.wasted,
                     horizon_ms=round(1000 * self.pace.horizon_s), prefetch_held=self.held)
        return total


def route_by_policy(policy: RoutePolicy) -> PlannerRoute:
    """Adapt a gateway ``RoutePolicy`` to the planner: where would a request for it go?"""
    def route(snapshot: Snapshot, name: str, residency: ResidencySnapshot, sent: SentCounts) -> str | None:
        adapter = snapshot.adapters.get(name)
        return policy(snapshot.upstreams, adapter, residency, sent).name if adapter is not None else None
    return route


def demand_placement(counts: Mapping[str, float], residency: ResidencySnapshot,
                     slots: int | None) -> dict[str, tuple[str, ...]]:
    """The placement by demand (``routing.place_by_demand``) over the hosts and adapters
    the agents report, from the requests counted per adapter, starting from
    ``residency.placement`` (the one published last: placement is sticky); empty with
    one host. ``slots`` None: no pool is known to be full (nothing is copied or moved)."""
    hosts = list(residency.by_upstream)
    if len(hosts) < 2:
        return {}
    fleet = {a for view in residency.by_upstream.values() for a in view}
    return place_by_demand({a: c for a, c in counts.items() if a in fleet}, hosts, slots=slots, adapters=fleet,
                           previous=residency.placement)


#: at most this many start-up fill signals per host (the agent answers each at once and
#: refuses the rest with ``no_room`` once its pool is full)
FILL_MAX = 64


def fill_signals(snapshot: Snapshot, hosts: list[str], *, adapters: Iterable[str],
                 only: Iterable[str] | None = None, per_host: int = FILL_MAX) -> list[PrefetchSignal]:
    """The start-up fill when nothing was learned: ``warmset.fill_set`` over ``adapters``
    (the fleet's) that the catalog knows, each host's share filtered to its base model;
    ``room_only``, so the agent loads them only into free device room and evicts nothing
    for them. An empty pool holds nothing anyone asked for, so a fill costs no hit, and where
    the pools can hold the catalog (16 adapters over 4 x 8 slots) no first request waits for
    a load. Signals for the hosts in ``only`` (default all)."""
    base = {u.name: u.base_model for u in snapshot.upstreams}
    known = {a: snapshot.adapters[a].owner == PUBLIC for a in set(adapters) if a in snapshot.adapters}
    plan = fill_set(known, hosts)
    to = set(hosts if only is None else only)
    out: list[PrefetchSignal] = []
    for h in hosts:
        if h not in to:
            continue
        mine = [snapshot.adapters[a] for a in plan[h] if base.get(h) in (None, snapshot.adapters[a].base_model)]
        out += [PrefetchSignal(upstream=h, adapter=a.name, digest=a.sha256, priority=0, reason="fill",
                               room_only=True) for a in mine[:per_host]]
    return out


def warm_signals(counts: Mapping[str, float], snapshot: Snapshot, slots: Mapping[str, int],
                 hosts: list[str], *, adapters: Iterable[str] | None = None,
                 only: Iterable[str] | None = None) -> list[PrefetchSignal]:
    """The start-up prefetches: the most requested adapters, placed as routing would place
    them (over ``adapters``, the fleet's, when given), at most ``slots[host]`` (the pool
    size learned last time) per host; signals for the hosts in ``only`` (default all)."""
    known = {a: c for a, c in counts.items() if a in snapshot.adapters and c > 0}
    digests = {a: snapshot.adapters[a].sha256 or a for a in known}
    per_host = min((slots.get(h, 0) for h in hosts), default=0)
    plan = warm_set(known, digests, hosts, per_host, adapters=adapters)
    to = hosts if only is None else [h for h in hosts if h in set(only)]
    return [PrefetchSignal(upstream=h, adapter=a, digest=snapshot.adapters[a].sha256, priority=0,
                           reason="warm_set") for h in to for a in plan.get(h, [])]


@dataclass(frozen=True, slots=True)
class Saved:
    """What the previous run left: request counts per adapter, learned pool sizes per
    upstream, and the transition model's state (``TransitionModel.to_state``) or None."""

    counts: dict[str, float]
    slots: dict[str, int]
    transitions: dict | None = None


class PopularityFile:
    """Request counts, learned pool sizes and the transition model, kept across restarts (JSON).

    Bounded: ``save`` writes at most ``row_budget`` transition rows and never more than
    ``max_bytes`` (it halves the row budget until the file fits); ``read`` ignores a file
    larger than that. A file without ``transitions`` (written before they were kept)
    still gives its counts and slots.
    """

    def __init__(self, path: Path, *, max_bytes: int = 16 << 20, row_budget: int = 20_000) -> None:
        self.path = Path(path)
        self.max_bytes = max_bytes
        self.row_budget = row_budget

    def read(self) -> Saved:
        try:
            with self.path.open("rb") as f:
                raw = f.read(self.max_bytes + 1)
            if len(raw) > self.max_bytes:
                raise ValueError(f"larger than {self.max_bytes} bytes")
            data = json.loads(raw)
            counts = {str(k): float(v) for k, v in data.get("counts", {}).items()}
            slots = {str(k): int(v) for k, v in data.get("slots", {}).items()}
            transitions = data.get("transitions")
            return Saved(counts, slots, transitions if isinstance(transitions, dict) else None)
        except FileNotFoundError:
            return Saved({}, {})
        except (OSError, ValueError, AttributeError, TypeError, RecursionError) as exc:
            log.warning("ignoring unreadable popularity file %s: %s", self.path, exc)
            return Saved({}, {})

    def load(self) -> tuple[dict[str, float], dict[str, int]]:
        """Counts and slots only (what start-up needs before the planner exists)."""
        saved = self.read()
        return saved.counts, saved.slots

    def save(self, counts: Mapping[str, float], slots: Mapping[str, int],
             model: TransitionModel | None = None) -> None:
        budget = self.row_budget
        while True:
            data: dict[str, Any] = {"counts": dict(counts), "slots": dict(slots)}
            if model is not None:
                data["transitions"] = model.to_state(row_budget=budget)
            text = json.dumps(data, sort_keys=True)  # ASCII: len(text) is the size in bytes
            if len(text) <= self.max_bytes or model is None or budget == 0:
                break
            budget //= 2
        if len(text) > self.max_bytes:
            log.warning("not saving %s: %d bytes is over the %d byte bound", self.path, len(text), self.max_bytes)
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)


class GatewaySpeculation:
    """The planner behind a bounded hand-off, on its own daemon thread."""

    def __init__(self, store, board, sink: PrefetchSink, planner: SpeculationPlanner | None = None, *,
                 popularity: PopularityFile | None = None, max_pending: int = 4096,
                 poll_s: float = 0.005, idle_wait_s: float = 0.1, save_every_s: float = 30.0,
                 warm_wait_s: float = 10.0,
                 place_every_s: float = 5.0, fill: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.board, self.sink = store, board, sink
        self.fill = fill  # with nothing learned, fill each empty pool at start-up (fill_signals)
        self.popularity = popularity
        saved = popularity.read() if popularity is not None else Saved({}, {})
        self.counts: dict[str, float] = saved.counts
        self.planner = planner or SpeculationPlanner(slots=saved.slots)
        self._warm_slots = saved.slots
        if saved.transitions is not None:
            self._restore(saved.transitions)
        self.max_pending, self.poll_s, self.save_every_s, self.clock = max_pending, poll_s, save_every_s, clock
        self.idle_wait_s = idle_wait_s
        self.place_every_s = place_every_s
        self._pending: deque[tuple] = deque()
        self._refusals: deque[tuple[str, str]] = deque(maxlen=max_pending)  # (upstream, adapter)
        self.observed = self.dropped = self.sent = self.send_dropped = self.shadow_prefetches = 0
        self.warm_sent = self.fill_sent = 0
        self._warmed: set[str] = set()
        self.warm_wait_s = warm_wait_s
        self._started = clock()
        self._seen: ResidencySnapshot | None = None
        self._stop = threading.Event()
        # set by ``observe`` when the thread waits for work (``_idle``), so an idle gateway's
        # thread sleeps instead of polling (a 5 ms poll cost ~2% of a core, doing nothing)
        self._wake = threading.Event()
        self._idle = False
        self._thread = threading.Thread(target=self._run, name="speculation", daemon=True)

    # -- request path: one append, nothing else
    def observe(self, d: Decision, tenant: str, session: str | None) -> bool:
        """Hand one decided request to the planner; False when not observed or dropped."""
        if d.adapter is None or not d.applies_adapter:
            return False
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            return False
        self._pending.append((d.upstream.name, tenant, session, d.adapter.name, d.skills[DYNAMIC_LORA_PREFETCH]))
        self._wake_if_idle()
        return True

    def refused(self, upstream: str, adapter: str) -> None:
        """An agent refused a bet (``AgentLink.on_refused``, from its sender thread): the
        planner's thread withdraws it from that pool's model at its next drain."""
        self._refusals.append((upstream, adapter))
        self._wake_if_idle()

    def _wake_if_idle(self) -> None:
        """Work was queued: if the thread waits for work, wake it (once; it clears the flag)."""
        if self._idle:
            self._idle = False
            self._wake.set()

    # -- background
    def start(self) -> "GatewaySpeculation":
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._save()
        log.info("speculation counters: %s", json.dumps(self.counters(), sort_keys=True))

    def drain(self) -> int:
        """Process everything pending now (the thread's loop body; tests call it directly);
        then publish the pools' first victims if they changed."""
        n = 0
        refusals = self._refusals
        while refusals:
            upstream, adapter = refusals.popleft()
            self.planner.refused(upstream, adapter, self.clock())
        pending = self._pending
        while pending:
            item = pending.popleft()
            self._handle(ObservedRequest(*item))
            n += 1
            time.sleep(0)  # release the GIL between steps: a request waits one step at most
        if n:
            victims = self.planner.victims(self.clock())
            if victims != dict(self.board.current.victims):
                self.board.suggest_victims(victims)
        return n

    def place(self) -> bool:
        """Publish the placement by demand (``demand_placement``) when it changed."""
        current = self.board.current
        placement = demand_placement(self.counts, current, self.planner.placement_slots())
        if placement == dict(current.placement):
            return False
        self.board.place(placement)
        return True

    def _run(self) -> None:
        last_save = last_place = self.clock()
        while not self._stop.is_set():
            try:
                self._warm()
                if self.drain():
                    self._stop.wait(self.poll_s)  # busy: batch what arrives in the next poll_s
                else:
                    self._wait_for_work()
                if self.clock() - last_place >= self.place_every_s:
                    self.place()
                    last_place = self.clock()
                if self.clock() - last_save >= self.save_every_s:
                    self._save()
                    last_save = self.clock()
                    log.info("speculation counters: %s", json.dumps(self.counters(), sort_keys=True))
            except Exception:  # speculation is a hint: log and keep serving
                log.exception("speculation step failed")

    def _wait_for_work(self) -> None:
        """Sleep until ``observe`` hands over a request, or ``idle_wait_s`` (the warm set,
        placement and saves are checked then). The flag is raised before the queue is looked
        at again, so a request appended in between is either seen here or wakes the wait."""
        self._idle = True
        if not self._pending and not self._refusals and not self._stop.is_set():
            self._wake.wait(self.idle_wait_s)
        self._idle = False
        self._wake.clear()

    def _sync(self, now: float) -> ResidencySnapshot:
        residency = self.board.current
        if residency is not self._seen:
            self._seen = residency
            self.planner.sync(residency, now)
        return residency

    def _handle(self, step: ObservedRequest) -> None:
        now = self.clock()
        residency = self._sync(now)
        self.counts[step.adapter] = self.counts.get(step.adapter, 0.0) + 1.0
        self.observed += 1
        if step.mode == OFF:  # learn the workflow for the next start; predict nothing
            if step.session is not None:
                self.planner.model.observe(step.tenant, step.session, step.adapter)
            return
        for signal in self.planner.step(step, self.store.snapshot, residency, self.board.sent, now):
            if step.mode != PROD:
                self.shadow_prefetches += 1
                log.debug("shadow: would prefetch %s on %s", signal.adapter, signal.upstream)
            elif self.sink.submit(signal):
                self.sent += 1
            else:
                self.send_dropped += 1

    def _warm(self) -> None:
        """Submit each host's warm set once, when its agent's residency first arrives;
        placed over every agent host (routing's placement), so the first hosts wait for
        the others up to ``warm_wait_s``. With nothing learned (no counts or pool sizes
        from a previous run): the fill of free room (``fill_signals``) instead, unless
        ``fill`` is off."""
        residency = self.board.current
        hosts = [h for h in residency.by_upstream if h not in self._warmed]
        if not hosts:
            return
        snap = self.store.snapshot
        agents = {u.name for u in snap.upstreams if u.agent}
        if not agents <= set(residency.by_upstream) and self.clock() - self._started < self.warm_wait_s:
            return
        self._warmed.update(hosts)
        if not _prefetch_enabled(snap):
            return
        fleet = {a for view in residency.by_upstream.values() for a in view}
        if self.counts and self._warm_slots:
            for signal in warm_signals(self.counts, snap, self._warm_slots, list(residency.by_upstream),
                                       adapters=fleet, only=hosts):
                if self.sink.submit(signal):
                    self.warm_sent += 1
            return
        if not self.fill:
            return
        for signal in fill_signals(snap, list(residency.by_upstream), adapters=fleet, only=hosts):
            if self.sink.submit(signal):
                self.fill_sent += 1

    def _restore(self, transitions: dict) -> None:
        """What the last run learned about workflows; sessions start afresh."""
        try:
            rows = self.planner.model.load_state(transitions)
        except ValueError as exc:
            log.warning("ignoring the transition model in %s: %s", self.popularity.path, exc)
        else:
            log.info("restored %d transition rows from %s", rows, self.popularity.path)

    def _save(self) -> None:
        if self.popularity is None or not self.counts:
            return
        try:
            self.popularity.save(self.counts, {**self._warm_slots, **self.planner.slots()}, self.planner.model)
        except (OSError, RuntimeError) as exc:  # RuntimeError: close() after a join that timed out
            log.warning("cannot save popularity to %s: %s", self.popularity.path, exc)

    def counters(self) -> dict[str, int]:
        return {**self.planner.counters(), "observed": self.observed, "dropped": self.dropped,
                "signals_sent": self.sent, "signals_dropped": self.send_dropped,
                "shadow_prefetches": self.shadow_prefetches, "warm_sent": self.warm_sent, "fill_sent": self.fill_sent}


def _prefetch_enabled(snap: Snapshot) -> bool:
    """Warm only where prefetching is on somewhere: globally or for a tenant."""
    if snap.default_skills.get(DYNAMIC_LORA_PREFETCH) == PROD:
        return True
    return any(t.skills.get(DYNAMIC_LORA_PREFETCH) == PROD for t in snap.tenants.values())
