"""Speculative prefetch for one engine host: the decision loop the gateway runs per request.

``Speculator`` owns a model of the host's pool (``AdapterCache``, slots = the pool's
adapter capacity), the tenant transition model, decayed popularity and the prediction
ledger. For each request it:

1. records the demand (the adapter enters the pool model, evicting the coldest of the
   ``window`` least recently used entries by ``victim_score``);
2. learns the session step (``TransitionModel.observe``) and settles the session's
   pending predictions (``PredictionLedger``);
3. predicts the next adapters (``predict_next``, probability at least ``min_p``): one
   already resident only gets its prediction noted (it protects it from eviction);
   one that is not is prefetched if ``should_speculate`` says it is likelier to be used
   within ``horizon_s`` than the victim it would evict.

The same class drives ``bench.sim``'s ``speculative`` policy, so the simulator measures
the code the gateway runs. Time is passed in (``now``): no clock, no I/O, no threads.
``load(adapter, now) -> ready_at`` says when a load started now completes (the simulator
models the load link; the gateway passes the agent's measured ``cold_load_ms`` or 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable

from extproc.policy.cache import AdapterCache, Entry
from extproc.policy.prediction import (
    DecayedPopularity,
    PredictionLedger,
    TransitionModel,
    candidate_score,
    should_speculate,
    victim_score,
)

__all__ = ["Prefetch", "SpeculationSettings", "Speculator"]

LoadFn = Callable[[Hashable, float], float]


@dataclass(frozen=True)
class SpeculationSettings:
    k: int = 2  # next adapters considered per step
    min_p: float = 0.35  # least transition probability worth a load
    horizon_s: float = 10.0  # horizon of the use probabilities compared by should_speculate
    half_life_s: float = 600.0  # popularity half-life
    window: int = 16  # eviction looks at this many least recently used entries (1 = LRU)


@dataclass(frozen=True)
class Prefetch:
    adapter: Hashable
    probability: float
    ready_at: float


def _now_load(adapter: Hashable, now: float) -> float:
    return now


class Speculator:
    def __init__(self, capacity: int, settings: SpeculationSettings = SpeculationSettings()) -> None:
        self.settings = settings
        self.cache = AdapterCache(capacity)
        self.model = TransitionModel()
        self.popularity = DecayedPopularity(half_life_s=settings.half_life_s)
        self.ledger = PredictionLedger()
        self._decay = 1.0 / settings.horizon_s
        self._now = 0.0

    def score(self, key: Hashable, entry: Entry) -> float:
        """Use probability within the horizon: decayed popularity or a pending prediction."""
        now = self._now
        pending = entry.score * math.exp(-(now - entry.scored_at) * self._decay) if entry.score else 0.0
        return victim_score(self.popularity.rate(key, now), self.settings.horizon_s, pending)

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

    def speculate(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float, *,
                  load: LoadFn = _now_load, may_load: bool = True) -> list[Prefetch]:
        """Learn the step ``adapter`` of (tenant, session) and return the prefetches to send.

        ``may_load=False`` (the load path is busy) still learns and notes predictions on
        resident adapters, but starts no load.
        """
        self._now = now
        cache = self.cache
        self.ledger.resolve(tenant, session, adapter)
        self.model.observe(tenant, session, adapter)
        predicted = []
        out: list[Prefetch] = []
        current = cache.get(adapter)
        was_pinned = current.pinned if current is not None else False
        if current is not None:
            current.pinned = True  # the request in flight uses it: never a victim
        try:
            self._predict(tenant, adapter, now, load, may_load, predicted, out)
        finally:
            if current is not None:
                current.pinned = was_pinned
        self.ledger.record(tenant, session, tuple(predicted))
        return out

    def _predict(self, tenant, adapter, now, load, may_load, predicted, out) -> None:
        st = self.settings
        cache = self.cache
        for b, p in self.model.predict_next(tenant, adapter, st.k):
            if p < st.min_p:
                continue
            if b != adapter:
                predicted.append(b)
            if cache.predict(b, p, now) or not may_load:
                continue
            victim = None
            v = 0.0
            if cache.used + 1 > cache.capacity:
                victim = cache.coldest(self.score, st.window)
                if victim is None:
                    continue
                v = self.score(victim, cache.get(victim))
            c = candidate_score(p, self.popularity.rate(b, now), st.horizon_s)
            if should_speculate(c, v, min_score=st.min_p):
                if victim is not None:
                    cache.evict(victim)
                ready = load(b, now)
                cache.admit(b, ready, prefetched=True, score=p, scored_at=now)
                out.append(Prefetch(b, p, ready))

    def sync(self, resident: Iterable[Hashable], now: float) -> None:
        """Align the pool model with the agent's view (``ResidencySnapshot``: the adapters
        in the pool). The engine evicts on its own, so the model drifts; call this when
        the snapshot changes. A model entry the pool no longer holds is dropped (an unused
        prefetch counts as wasted); a pooled adapter the model lacks is added while
        there is room. Loads in flight (not yet resident) are kept."""
        resident = set(resident)
        cache = self.cache
        for key in list(cache):
            entry = cache.get(key)
            if key not in resident and entry.ready_at <= now:
                cache.evict(key)
        for key in resident:
            if key not in cache and cache.used + 1 <= cache.capacity:
                cache.admit(key, now)

    def on_request(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float, *,
                   load: LoadFn = _now_load) -> list[Prefetch]:
        """The gateway's one call per request: ``demand`` then ``speculate``."""
        self.demand(adapter, now, load=load)
        return self.speculate(tenant, session, adapter, now, load=load)

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
        }
