"""Speculative prefetch for one engine host: the decision loop the gateway runs per request.

``Speculator`` owns a model of the host's pool (``AdapterCache``, slots = the pool's
adapter capacity) and its decayed popularity; the transition model, prediction ledger,
sessions' pace, session demand and first-step model may be shared between the hosts of
a fleet. ``step`` is the loop, per request:

1. records the demand (the adapter enters the pool model, evicting the coldest of the
   ``window`` least recently used entries by ``victim_score``);
2. notes whether the request opens a session (``FirstSteps``: the tenant's openers);
3. learns the session step (``TransitionModel.observe``) and settles the session's
   pending predictions (``PredictionLedger``);
4. offers the predicted next adapters (``predict_next``, probability at least ``min_p``)
   and the tenant's likeliest session openers (``FirstSteps.likely``) to the host
   ``place`` names (default: this one): one already resident only gets its prediction
   noted (it protects it from eviction); one that is not is prefetched if
   ``should_speculate`` says it is likelier to be used within ``horizon_s`` than the
   victim it would evict.

The gateway (``extproc.fleet.speculation.SpeculationPlanner.step``) and ``bench.sim`` (the
``speculative`` policy and the fleet's ``ace`` arm) call this same ``step``, so the
simulator measures the code the gateway runs. Time is passed in (``now``): no clock, no
I/O, no threads. ``load(adapter, now) -> ready_at`` says when a load started now
completes (the simulator models the load link; the gateway leaves demand at the default,
ready at ``now``: the engine loads it itself, and passes ``prefetch_load`` =
``now + load_grace_s`` for prefetches).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from extproc.policy.cache import AdapterCache, Entry
from extproc.policy.prediction import (
    DecayedPopularity,
    FirstSteps,
    PredictionLedger,
    SessionDemand,
    StepPace,
    TransitionModel,
    PrefetchCase,
    candidate_score,
    prefetch_pays,
    should_speculate,
    victim_score,
)

__all__ = ["DEFAULT_LOAD_S", "Prefetch", "SpeculationSettings", "Speculator", "StepResult"]

LoadFn = Callable[[Hashable, float], float]
LoadSeconds = Callable[[Hashable], float]


DEFAULT_LOAD_S = 0.1  # a load's time when nobody measured it (a mid-rank adapter from local disk)


def _unit_load(adapter: Hashable) -> float:
    return DEFAULT_LOAD_S


@dataclass(frozen=True)
class SpeculationSettings:
    k: int = 3  # next adapters considered per step
    min_p: float = 0.2  # least transition probability worth a load (the price, prefetch_pays, still decides)
    horizon_s: float = 10.0  # horizon of the use probabilities compared by should_speculate
    half_life_s: float = 300.0  # popularity half-life
    window: int = 0  # eviction looks at this many least recently used entries (1 = LRU, 0 = all)
    adaptive_horizon: bool = True  # horizon_s follows the sessions' pace (StepPace); False: fixed
    session_demand: bool = True  # victims scored by what sessions in progress expect next (SessionDemand)
    order: int = 2  # transition model context: 1 = the last step, 2 = the last two (backs off to 1)
    first_steps: int = 2  # likeliest session openers of the tenant offered per step (FirstSteps); 0 = off
    idle_timeout_s: float = 600.0  # a session idle this long opens anew at its next request
    priced: bool = True  # prefetch only when prefetch_pays (saving > reload + link cost); False: should_speculate
    max_inflight: int = 2  # per host: no new prefetch while this many are loading (0 = no limit)
    lookahead: int = 1  # 2: also offer the step after the next (P(b) x P(c | b)) when at least min_p
    working_set: int = 2  # SessionDemand also expects the session's last N other adapters back (0 = off)
    min_support: float = 2.0  # smoothing 0 only: observations a row needs before it speaks instead of coarser ones
    smoothing: float = 1.0  # TransitionModel: each row weighed against the coarser ones (0: the min_support rule)
    context_steps: int = 12  # the session's steps so far as a context, up to this many distinct steps (0 = off)
    opener_min_p: float | None = None  # least use probability of a session opener worth a load (None: min_p)

    def transition_model(self) -> TransitionModel:
        """A new transition model with these settings (the one place they are passed on)."""
        return TransitionModel(order=self.order, min_support=self.min_support, context_steps=self.context_steps,
                               smoothing=self.smoothing)


@dataclass(frozen=True)
class Prefetch:
    adapter: Hashable
    probability: float
    ready_at: float
    victim: Hashable | None = None  # what the pool model evicted to make room (None: there was room)
    host: Hashable | None = None  # the ``name`` of the Speculator (host) it was offered to
    reason: str = "predicted"  # predicted: a session's next step; first_step: a tenant's session opener
    use_probability: float = 0.0  # P(used within the horizon), what the decision weighed (>= probability)
    victim_probability: float = 0.0  # the victim's P(used within the horizon); 0 without a victim


@dataclass(frozen=True)
class StepResult:
    """What one request did: when its adapter is loaded, whether it opened a session,
    and the prefetches to send."""

    ready_at: float
    first_step: bool
    prefetches: list[Prefetch]


Place = Callable[[Hashable], "Speculator | None"]


def _now_load(adapter: Hashable, now: float) -> float:
    return now


class Speculator:
    def __init__(self, capacity: int, settings: SpeculationSettings = SpeculationSettings(), *,
                 model: TransitionModel | None = None, ledger: PredictionLedger | None = None,
                 pace: StepPace | None = None, expected: SessionDemand | None = None,
                 first_steps: FirstSteps | None = None, name: Hashable | None = None) -> None:
        """``model`` / ``ledger`` / ``pace`` / ``expected`` / ``first_steps``: shared between
        the Speculators of several hosts (the gateway and the fleet simulator: a session's
        steps may be served by different hosts); own ones by default. ``pace`` is used only
        with ``settings.adaptive_horizon``, ``expected`` only with ``settings.session_demand``,
        ``first_steps`` only with ``settings.first_steps``. ``name``: the host, as reported
        in ``Prefetch.host``."""
        self.settings = settings
        self.name = name
        self.first_steps = first_steps if first_steps is not None else FirstSteps(
            settings.half_life_s, idle_timeout_s=settings.idle_timeout_s)
        self.cache = AdapterCache(capacity)
        self.model = model if model is not None else settings.transition_model()
        self.popularity = DecayedPopularity(half_life_s=settings.half_life_s)
        self.ledger = ledger if ledger is not None else PredictionLedger()
        self.pace = pace if pace is not None else StepPace(settings.horizon_s)
        self.expected = expected if expected is not None else SessionDemand(settings.horizon_s,
                                                                             working_set=settings.working_set)
        self.horizon_s = settings.horizon_s
        # the share of a wasted bet's load time this host's agent charges it
        # (PrefetchCase.waste_share; the gateway sets it from the agent's announcement)
        self.waste_share = 0.0
        self._decay = 1.0 / settings.horizon_s
        self._now = 0.0

    def set_horizon(self, horizon_s: float) -> None:
        """Compare use probabilities over ``horizon_s`` from now on (the gateway sets it to
        the time sessions actually take between steps)."""
        if horizon_s <= 0:
            raise ValueError(f"horizon must be positive, got {horizon_s}")
        self.horizon_s = horizon_s
        self._decay = 1.0 / horizon_s
        self.expected.horizon_s = horizon_s

    def score(self, key: Hashable, entry: Entry) -> float:
        """Use probability within the horizon: decayed popularity, or what the sessions in
        progress expect (``session_demand``; else the latest prediction left on the entry)."""
        now = self._now
        if self.settings.session_demand:
            return victim_score(self.popularity.rate(key, now), self.horizon_s, self.expected.need(key, now))
        pending = entry.score * math.exp(-(now - entry.scored_at) * self._decay) if entry.score else 0.0
        return victim_score(self.popularity.rate(key, now), self.horizon_s, pending)

    def demand(self, adapter: Hashable, now: float, *, load: LoadFn = _now_load,
               engine_at: float | None = None) -> float:
        """A request for ``adapter`` seen at ``now``; returns when the adapter is (or will be) loaded.

        ``engine_at``: when the engine starts the request (for the hit/late/miss counts);
        defaults to ``now``.
        """
        self._now = now
        cache = self.cache
        if adapter not in cache:
            if cache.used + 1 > cache.capacity:
                cache.evict(cache.coldest(self.score, self.settings.window))
            cache.admit(adapter, load(adapter, now))
        entry = cache.get(adapter)
        ready_at = entry.ready_at
        cache.access(adapter, now if engine_at is None else engine_at)
        entry.score = 0.0  # its pending prediction came true; the model may renew it
        self.popularity.hit(adapter, now)
        return ready_at

    def learn(self, tenant: Hashable, session: Hashable, adapter: Hashable,
              now: float | None = None) -> list[tuple[Hashable, float]]:
        """Learn the step ``adapter`` of (tenant, session) seen at ``now``; settle the
        session's pending predictions; return the next adapters worth considering
        (probability >= ``min_p``). With ``adaptive_horizon`` the step also times the
        session's pace and the horizon follows it."""
        if now is not None and self.settings.adaptive_horizon:
            self.pace.observe(tenant, session, now)
            if self.pace.horizon_s != self.horizon_s:
                self.set_horizon(self.pace.horizon_s)
        self.ledger.resolve(tenant, session, adapter)
        self.model.observe(tenant, session, adapter)
        st = self.settings
        predicted = self.model.predict_session(tenant, session, st.k)
        if st.session_demand:
            self.expected.step(tenant, session, adapter)
            self.expected.expect(tenant, session, predicted, now if now is not None else self._now)
        return [(b, p) for b, p in predicted if p >= st.min_p]

    def step(self, tenant: Hashable, session: Hashable | None, adapter: Hashable, now: float, *,
             load: LoadFn = _now_load, engine_at: float | None = None, may_load: bool = True,
             place: Place | None = None, prefetch_load: LoadFn | None = None,
             load_s: LoadSeconds = _unit_load) -> StepResult:
        """One request served by this host: the speculation loop, the one implementation
        the gateway (``extproc.fleet.speculation.SpeculationPlanner``) and ``bench.sim`` run.

        1. ``demand``: the adapter enters this host's pool model;
        2. without a session, nothing else (it teaches no transition);
        3. ``FirstSteps.observe``: does the request open a session (counts the opener);
        4. ``learn``: the transition model's next adapters (probability >= ``min_p``);
        5. each is offered (``offer``) to the host ``place(adapter)`` names (None: skip it,
           e.g. an adapter the tenant may not use; default: this host);
        6. the tenant's likeliest session openers (``FirstSteps.likely``, ``first_steps``
           of them) are offered the same way, scored by the same bound: a pool keeps them
           only where they beat what the sessions in flight need;
        7. the session's predictions go to the ledger.

        ``load``: when a load started now completes; ``prefetch_load``: the same for
        prefetches, when it differs (the gateway: demand is loaded by the engine itself,
        a prefetch is in flight ``load_grace_s``). ``may_load=False`` (the load path is
        busy) still learns and notes predictions on resident adapters, but starts no load.
        """
        if self.settings.adaptive_horizon and self.horizon_s != self.pace.horizon_s:
            self.set_horizon(self.pace.horizon_s)
        ready = self.demand(adapter, now, load=load, engine_at=engine_at)
        if session is None:
            return StepResult(ready, False, [])
        first = self.first_steps.observe(tenant, session, adapter, now) if self.settings.first_steps else False
        return StepResult(ready, first, self._predict(tenant, session, adapter, now, load=prefetch_load or load,
                                                      may_load=may_load, place=place, load_s=load_s))

    def speculate(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float, *,
                  load: LoadFn = _now_load, may_load: bool = True, place: Place | None = None) -> list[Prefetch]:
        """Steps 4-7 of ``step`` (the demand was counted already)."""
        return self._predict(tenant, session, adapter, now, load=load, may_load=may_load, place=place)

    def _predict(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float, *,
                 load: LoadFn, may_load: bool, place: Place | None,
                 load_s: LoadSeconds = _unit_load) -> list[Prefetch]:
        predicted = self.learn(tenant, session, adapter, now)
        out: list[Prefetch] = []
        offers = [(b, p, "predicted") for b, p in predicted]
        if self.settings.lookahead > 1:
            offers += [(c, q, "predicted") for c, q in self._two_ahead(tenant, adapter, {b for b, _ in predicted})]
        if self.settings.first_steps:
            offers += [(b, p, "first_step") for b, p in
                       self.first_steps.likely(tenant, now, self.horizon_s, self.settings.first_steps)]
        for b, p, reason in offers:
            target = self if place is None else place(b)
            if target is None:
                continue
            if target is not self and target.horizon_s != self.horizon_s:
                target.set_horizon(self.horizon_s)
            got = target.offer(b, p, now, load=load, may_load=may_load,
                               in_use=adapter if target is self else None, reason=reason, load_s=load_s)
            if got is not None:
                out.append(got)
        self.ledger.record(tenant, session, tuple(b for b, _ in predicted if b != adapter))
        return out

    def _two_ahead(self, tenant: Hashable, adapter: Hashable, skip: set) -> list[tuple[Hashable, float]]:
        """The steps after the next: ``P(c) = sum over b of P(b | adapter) x P(c | b, adapter)``,
        those with at least ``min_p``, not in ``skip`` and not ``adapter``."""
        st = self.settings
        model = self.model
        # the session's context after this step: (previous, adapter) is in the model already
        nxt = model.predict_next(tenant, adapter, st.k)
        acc: dict[Hashable, float] = {}
        for b, p in nxt:
            for c, q in model.predict_next(tenant, b, st.k, before=adapter):
                acc[c] = acc.get(c, 0.0) + p * q
        return [(c, q) for c, q in sorted(acc.items(), key=lambda kv: -kv[1])
                if q >= st.min_p and c not in skip and c != adapter]

    def victims(self, now: float, n: int | None = 2) -> list[Hashable]:
        """The ``n`` entries (None: all) this host's model would evict first (lowest use
        probability, ties to the least recently used), coldest first; loads in flight are
        not offered."""
        self._now = now
        scored = [(self.score(k, e), i, k) for i, (k, e) in enumerate(self.cache.entries.items())
                  if not e.pinned and e.ready_at <= now]
        return [k for _, _, k in sorted(scored)[:n]]

    def inflight(self, now: float) -> list[Hashable]:
        """The prefetches this host's model still sees loading at ``now``."""
        return [k for k, e in self.cache.entries.items() if e.prefetched and e.ready_at > now]

    def offer(self, adapter: Hashable, p: float, now: float, *, load: LoadFn = _now_load,
              may_load: bool = True, in_use: Hashable | None = None, reason: str = "predicted",
              load_s: LoadSeconds = _unit_load) -> Prefetch | None:
        """A prediction: ``adapter`` is needed soon with probability ``p``. Resident: the
        prediction is noted on its entry (it protects it from eviction). Absent: loaded if
        it pays (``prefetch_pays``: the stall it saves, ``p_use x load_s(adapter)``, beats
        the victim's ``p_use x load_s(victim)`` plus the link time it takes, ``link_busy``
        = the seconds of prefetches in flight on this host over the horizon, plus the engine
        time a wasted bet takes, ``(1 - p_use) x waste_share x load_s(adapter)``; with
        ``priced=False``: ``should_speculate``) and fewer than ``max_inflight`` prefetches
        are loading here; ``in_use`` (the adapter of the request in flight) is never a
        victim. Returns the prefetch or None."""
        self._now = now
        cache = self.cache
        if cache.predict(adapter, p, now) or not may_load:
            return None
        st = self.settings
        flying = self.inflight(now) if st.priced or st.max_inflight else []
        if st.max_inflight and len(flying) >= st.max_inflight:
            return None
        current = cache.get(in_use) if in_use is not None else None
        was_pinned = current.pinned if current is not None else False
        if current is not None:
            current.pinned = True
        try:
            victim = None
            v = 0.0
            if cache.used + 1 > cache.capacity:
                victim = cache.coldest(self.score, self.settings.window)
                if victim is None:
                    return None
                v = self.score(victim, cache.get(victim))
            if self.settings.session_demand:
                p = max(p, self.expected.need(adapter, now))
            c = candidate_score(p, self.popularity.rate(adapter, now), self.horizon_s)
            if st.priced:
                busy = sum(load_s(k) for k in flying) / self.horizon_s
                case = PrefetchCase(c, load_s(adapter), v, load_s(victim) if victim is not None else 0.0, busy,
                                    self.waste_share)
                floor = st.opener_min_p if reason == "first_step" and st.opener_min_p is not None else st.min_p
                if not prefetch_pays(case, min_p=floor):
                    return None
            elif not should_speculate(c, v, min_score=st.min_p):
                return None
            if victim is not None:
                cache.evict(victim)
            ready = load(adapter, now)
            cache.admit(adapter, ready, prefetched=True, score=p, scored_at=now)
            return Prefetch(adapter, p, ready, victim, self.name, reason, c, v)
        finally:
            if current is not None:
                current.pinned = was_pinned

    def sync(self, resident: Iterable[Hashable], now: float, *, learn_capacity: bool = False) -> None:
        """Align the pool model with the agent's view (``ResidencySnapshot``: the adapters
        on the device). The engine evicts on its own, so the model drifts; call this when
        the snapshot changes. A model entry the pool no longer holds is dropped (an unused
        prefetch counts as wasted); a pooled adapter the model lacks is added while
        there is room. Loads in flight (not yet resident) are kept.

        ``learn_capacity``: the capacity grows to the most adapters seen in the pool at
        once (the gateway is not told the pool's size; it counts what the pool held)."""
        resident = set(resident)
        cache = self.cache
        if learn_capacity and len(resident) > cache.capacity:
            cache.capacity = len(resident)
        for key in list(cache):
            entry = cache.get(key)
            if key in resident:
                entry.ready_at = min(entry.ready_at, now)  # the agent says it is loaded
            elif entry.ready_at <= now:
                cache.evict(key)
        for key in resident:
            if key not in cache and cache.used + 1 <= cache.capacity:
                cache.admit(key, now)

    def on_request(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float, *,
                   load: LoadFn = _now_load) -> list[Prefetch]:
        """``step`` on this host alone; the prefetches."""
        return self.step(tenant, session, adapter, now, load=load).prefetches

    def counters(self) -> dict[str, int]:
        """Predictions used/wasted (model) and prefetches used/wasted (pool), as counted."""
        s = self.cache.stats
        return {
            "predictions": self.ledger.stats.predictions,
            "predictions_used": self.ledger.stats.used,
            "predictions_wasted": self.ledger.stats.wasted,
            "prefetches": s.prefetches,
            "prefetch_used": s.prefetch_used,
            "prefetch_wasted": s.prefetch_wasted,
            "prefetch_refused": s.prefetch_refused,
        }
