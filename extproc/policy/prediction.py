"""Speculative prefetch: which adapter a session needs next, and whether it is worth a slot.

Four small pieces, all plain Python and bounded in memory:

- ``TransitionModel``: per tenant, counts of "adapter A was followed by adapter B in the
  same session" (and of what followed the last two steps, and the session's steps so far),
  learned online from traffic (agentic workflows such as code -> review -> sql).
  ``predict_session(tenant, session, k)`` (and ``predict_next(tenant, adapter, k)``)
  return the k likeliest next adapters with their empirical probabilities; a tenant with
  too little history (a new tenant: churn)
  falls back to the model learned over all tenants. Counts age (halved when a row grows
  past ``halve_at``) so a changed workflow is relearned.
- ``DecayedPopularity``: an exponentially decayed request rate per adapter (half-life
  ``half_life_s``): how hot an adapter is now.
- ``should_speculate(candidate_score, victim_score)``: the bound. Both scores are the
  probability that the adapter is used within the same horizon, so speculation never
  evicts something hotter than what it brings in.
- ``prefetch_pays(PrefetchCase)``: the price. A prefetch pays only when the stall it is
  expected to save exceeds the reload it may cause plus the load link time it takes
  from the demand loads queued behind it.

- ``FirstSteps``: per tenant, which adapters open its sessions (a session's first
  request has no previous step to predict it from) and how often sessions open.

``PredictionLedger`` counts every prediction as used (the session's next step asked for
it) or wasted (it asked for something else, or never came back).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable, Hashable

__all__ = [
    "DecayedPopularity",
    "FirstSteps",
    "SessionDemand",
    "StepPace",
    "PredictionLedger",
    "TransitionModel",
    "PrefetchCase",
    "candidate_score",
    "prefetch_pays",
    "should_speculate",
    "use_probability",
    "victim_score",
]


def use_probability(rate_per_s: float, horizon_s: float) -> float:
    """P(at least one request within ``horizon_s``) for a Poisson rate: 1 - exp(-rate*horizon)."""
    if rate_per_s <= 0.0:
        return 0.0
    return 1.0 - math.exp(-rate_per_s * horizon_s)


def candidate_score(p_next: float, rate_per_s: float, horizon_s: float) -> float:
    """Use probability of a predicted adapter: the session's next step, or anyone else's demand."""
    return 1.0 - (1.0 - p_next) * (1.0 - use_probability(rate_per_s, horizon_s))


def victim_score(rate_per_s: float, horizon_s: float, pending: float = 0.0) -> float:
    """Use probability of an adapter a prefetch would evict.

    ``pending`` is the prediction score of a victim that was itself prefetched and not
    used yet: it was brought in for a reason, which still counts.
    """
    return max(use_probability(rate_per_s, horizon_s), pending)


def should_speculate(candidate_score: float, victim_score: float, *, min_score: float = 0.0) -> bool:
    """Prefetch only what is likelier to be used than what it evicts (0 = free slot).

    Score tiers: a candidate below ``min_score`` is never loaded (a load costs bandwidth
    even into a free slot); otherwise it must beat the victim strictly, so ties keep what
    is already resident.
    """
    return candidate_score >= min_score and candidate_score > victim_score


@dataclass(frozen=True)
class PrefetchCase:
    """What one prefetch decision weighs, all for the same horizon.

    ``p_use``: probability that the candidate is used within the horizon
    (``candidate_score``); ``load_s``: its load time (the stall a hit saves);
    ``victim_p`` / ``victim_load_s``: the same for the adapter it would evict (0 / 0: a free
    slot); ``link_busy``: share of the horizon the host's load link is already busy with
    loads in flight (0-1): a demand load that arrives meanwhile queues behind this one;
    ``waste_share``: the share of the load's time a wasted bet takes from the engine's
    requests (the agent's speculation budget charges it: ``ResidencyEvent.
    prefetch_waste_share``; 0: not announced, or a load that takes nothing, as on CUDA)."""

    p_use: float
    load_s: float
    victim_p: float = 0.0
    victim_load_s: float = 0.0
    link_busy: float = 0.0
    waste_share: float = 0.0


def prefetch_pays(case: PrefetchCase, *, min_p: float = 0.0) -> bool:
    """Expected saving > expected cost:
    ``p_use * load_s > victim_p * victim_load_s + link_busy * load_s
    + (1 - p_use) * waste_share * load_s``, and never a candidate below ``min_p`` or one no
    likelier to be used than its victim (ties keep what is resident). The last term is the
    agent's own (``gpu_agent.residency.prefetch_budget.decide_hint``): a bet it prices
    differently is sent only to be refused."""
    if case.p_use < min_p or case.p_use <= case.victim_p:
        return False
    saving = case.p_use * case.load_s
    cost = (case.victim_p * case.victim_load_s + min(1.0, max(0.0, case.link_busy)) * case.load_s
            + (1.0 - case.p_use) * min(1.0, max(0.0, case.waste_share)) * case.load_s)
    return saving > cost


class StepPace:
    """How long sessions take between steps: the horizon "soon" should mean.

    ``observe(tenant, session, now)`` records the gap since the session's previous step;
    every ``every`` gaps, ``horizon_s`` becomes ``factor`` times the median of the last
    ``window`` gaps, clamped to [``lo``, ``hi``]. Until then it is ``initial_s``. Bounded:
    ``max_sessions`` last-step times (LRU)."""

    def __init__(self, initial_s: float = 10.0, *, factor: float = 2.0, window: int = 256, every: int = 32,
                 lo: float = 0.25, hi: float = 60.0, max_sessions: int = 200_000) -> None:
        self.horizon_s = initial_s
        self.factor, self.every, self.lo, self.hi, self.max_sessions = factor, every, lo, hi, max_sessions
        self._at: OrderedDict[tuple[Hashable, Hashable], float] = OrderedDict()
        self._gaps: deque[float] = deque(maxlen=window)
        self._new = 0

    def observe(self, tenant: Hashable, session: Hashable, now: float) -> bool:
        """Record a step; True when ``horizon_s`` was recomputed."""
        key = (tenant, session)
        last = self._at.pop(key, None)
        self._at[key] = now
        if len(self._at) > self.max_sessions:
            self._at.popitem(last=False)
        if last is None:
            return False
        self._gaps.append(now - last)
        self._new += 1
        if self._new < self.every:
            return False
        self._new = 0
        gaps = sorted(self._gaps)
        self.horizon_s = min(self.hi, max(self.lo, self.factor * gaps[len(gaps) // 2]))
        return True


class DecayedPopularity:
    """Exponentially decayed request count per key; ``rate`` is in requests per second."""

    __slots__ = ("half_life_s", "_lambda", "_state", "max_keys")

    def __init__(self, half_life_s: float = 300.0, max_keys: int = 1_000_000) -> None:
        self.half_life_s = half_life_s
        self._lambda = math.log(2.0) / half_life_s
        self._state: dict[Hashable, tuple[float, float]] = {}
        self.max_keys = max_keys

    def hit(self, key: Hashable, now: float) -> None:
        old = self._state.get(key)
        if old is None:
            if len(self._state) >= self.max_keys:
                self._forget_coldest(now)
            self._state[key] = (1.0, now)
        else:
            value, t = old
            self._state[key] = (value * math.exp(-self._lambda * (now - t)) + 1.0, now)

    def rate(self, key: Hashable, now: float) -> float:
        old = self._state.get(key)
        if old is None:
            return 0.0
        value, t = old
        return value * math.exp(-self._lambda * (now - t)) * self._lambda

    def top(self, n: int, now: float) -> list[Hashable]:
        """The ``n`` hottest keys, hottest first (ties by key for determinism)."""
        ranked = sorted(self._state, key=lambda k: (-self.rate(k, now), str(k)))
        return ranked[:n]

    def _forget_coldest(self, now: float) -> None:
        coldest = min(self._state, key=lambda k: self.rate(k, now))
        del self._state[coldest]


class _Row:
    """Successor counts of one (tenant, adapter)."""

    __slots__ = ("total", "counts")

    def __init__(self) -> None:
        self.total = 0.0
        self.counts: dict[Hashable, float] = {}


class TransitionModel:
    """Online per-tenant model of adapter transitions within sessions: the last step, the
    last two, and the session's steps so far (``context_steps``)."""

    def __init__(
        self,
        *,
        max_sessions: int = 200_000,
        max_tenants: int = 10_000,
        max_successors: int = 16,
        halve_at: float = 512.0,
        min_support: float = 3.0,
        order: int = 2,
        max_rows: int = 4096,
        context_steps: int = 12,
        smoothing: float = 1.0,
    ) -> None:
        """``order=2``: also count ``(before, adapter) -> next`` (the two latest steps of a
        session), used when it has ``min_support`` observations; ``predict_next`` backs off
        to the first-order row otherwise. A workflow that visits an adapter twice (notes ->
        triage -> notes -> translate) is told apart by where it came from.

        ``max_rows``: rows per tenant (and in the all-tenant model) that ``load_state``
        keeps, strongest first. ``observe`` needs no such cap: it only creates rows for
        adapters the gateway serves, so the catalog bounds them.

        ``context_steps``: also count, per tenant, ``the session's steps so far -> next``
        (a repeated step written once) for sessions of at most that many distinct steps
        (0: off). ``predict_session`` uses that row when it has ``min_support``
        observations: it tells two workflows apart where their last two steps agree (after
        sql -> code, one workflow goes on to review, another, which opened with code, to
        sql). Bounded: ``max_rows`` such rows per tenant, least recently counted first out.

        ``smoothing`` (> 0, the default 1): a row with fewer than ``min_support``
        observations is not ignored but weighed against the rows coarser than it (the
        session's last two steps for this tenant, then its last step, then all tenants'
        last two steps, then all tenants' last step): ``p(b) = (count(b) + smoothing *
        p_coarser(b)) / (total + smoothing)``, where ``p_coarser`` is what the finest
        coarser row with ``min_support`` observations says (itself so weighed by any
        sparser rows between). So a tenant's habit seen once already shifts the guess,
        without being taken as a certainty. ``0``: such a row is ignored (the finest row
        with ``min_support`` observations speaks alone, and the all-tenant pair rows are
        not used). The session's-steps rows speak alone from ``min_support`` either way.
        """
        if order not in (1, 2):
            raise ValueError(f"order must be 1 or 2, got {order}")
        if not (smoothing >= 0.0 and math.isfinite(smoothing)):
            raise ValueError(f"smoothing must be a finite number >= 0, got {smoothing}")
        self.smoothing = float(smoothing)
        if context_steps < 0:
            raise ValueError(f"context_steps must be >= 0, got {context_steps}")
        self.context_steps = context_steps
        self.order = order
        self.max_sessions = max_sessions
        self.max_tenants = max_tenants
        self.max_successors = max_successors
        self.halve_at = halve_at
        self.min_support = min_support
        self.max_rows = max_rows
        self._last: OrderedDict[tuple[Hashable, Hashable], Hashable] = OrderedDict()
        self._before: dict[tuple[Hashable, Hashable], Hashable] = {}  # the step before the last (order 2)
        self._tenants: OrderedDict[Hashable, dict[Hashable, _Row]] = OrderedDict()
        self._global: dict[Hashable, _Row] = {}
        # a session's distinct steps so far (context_steps); None once it has more
        self._steps: dict[tuple[Hashable, Hashable], tuple | None] = {}
        self._contexts: OrderedDict[Hashable, OrderedDict[tuple, _Row]] = OrderedDict()

    def observe(self, tenant: Hashable, session: Hashable, adapter: Hashable) -> Hashable | None:
        """A session step: learn ``previous -> adapter``; returns the previous adapter or None."""
        key = (tenant, session)
        last = self._last
        prev = last.get(key)
        before = self._before.pop(key, None)
        last[key] = adapter
        last.move_to_end(key)
        if prev is not None and self.order == 2:
            self._before[key] = prev
        if self.context_steps:
            self._count_context(tenant, key, adapter)
        if len(last) > self.max_sessions:
            gone, _ = last.popitem(last=False)
            self._before.pop(gone, None)
            self._steps.pop(gone, None)
        if prev is not None:
            rows = self._tenants.get(tenant)
            if rows is None:
                rows = self._tenants[tenant] = {}
                if len(self._tenants) > self.max_tenants:
                    self._tenants.popitem(last=False)
            else:
                self._tenants.move_to_end(tenant)
            self._count(rows, prev, adapter)
            self._count(self._global, prev, adapter)
            if before is not None:
                self._count(rows, (before, prev), adapter)
                self._count(self._global, (before, prev), adapter)
        return prev

    def _count_context(self, tenant: Hashable, key: tuple[Hashable, Hashable], adapter: Hashable) -> None:
        """``steps so far -> adapter`` for the session ``key``, then ``adapter`` joins its steps."""
        steps = self._steps.get(key, ())
        if steps is None:
            return  # longer than context_steps: the order-2 and order-1 rows speak for it
        if steps:
            rows = self._contexts.get(tenant)
            if rows is None:
                rows = self._contexts[tenant] = OrderedDict()
                if len(self._contexts) > self.max_tenants:
                    self._contexts.popitem(last=False)
            else:
                self._contexts.move_to_end(tenant)
            self._count(rows, steps, adapter)
            rows.move_to_end(steps)
            if len(rows) > self.max_rows:
                rows.popitem(last=False)
        if not steps or steps[-1] != adapter:
            steps = steps + (adapter,) if len(steps) < self.context_steps else None
        self._steps[key] = steps

    def _count(self, rows: dict[Hashable, _Row], prev: Hashable, nxt: Hashable) -> None:
        row = rows.get(prev)
        if row is None:
            row = rows[prev] = _Row()
        counts = row.counts
        counts[nxt] = counts.get(nxt, 0.0) + 1.0
        row.total += 1.0
        if len(counts) > self.max_successors:
            weakest = min(counts, key=counts.__getitem__)
            row.total -= counts.pop(weakest)
        if row.total > self.halve_at:
            for k in list(counts):
                v = counts[k] * 0.5
                if v < 0.5:
                    del counts[k]
                else:
                    counts[k] = v
            row.total = sum(counts.values())

    def predict_next(self, tenant: Hashable, adapter: Hashable, k: int = 2, *,
                     before: Hashable | None = None) -> list[tuple[Hashable, float]]:
        """The ``k`` likeliest next adapters after ``adapter`` for ``tenant``, with probabilities.

        ``before``: the session's step before ``adapter`` (``previous``); with ``order=2``
        the tenant's ``(before, adapter)`` row is used when it has ``min_support``
        observations. Else the tenant's own counts when it has ``min_support``
        observations after this adapter, else the all-tenant counts; empty when neither
        knows the adapter. With ``smoothing`` > 0 (the default), the all-tenant
        ``(before, adapter)`` row also counts, and a row with fewer than ``min_support``
        observations is weighed against the coarser rows rather than ignored
        (``_interpolated``).
        """
        rows = self._tenants.get(tenant)
        pair = (before, adapter) if before is not None and self.order == 2 else None
        return self._interpolated(
            [rows.get(pair) if rows is not None and pair is not None else None,
             rows.get(adapter) if rows is not None else None,
             self._global.get(pair) if pair is not None and self.smoothing > 0.0 else None,
             self._global.get(adapter)], k)

    def predict_session(self, tenant: Hashable, session: Hashable, k: int = 2) -> list[tuple[Hashable, float]]:
        """The ``k`` likeliest next adapters of the session (tenant, session) after its last
        observed step: from the tenant's row for the session's steps so far when it has
        ``min_support`` observations (``context_steps``), else ``predict_next`` of its
        last step (and the one before it). Empty for a session never observed."""
        key = (tenant, session)
        last = self._last.get(key)
        if last is None:
            return []
        steps = self._steps.get(key) if self.context_steps else None
        if steps:
            rows = self._contexts.get(tenant)
            row = rows.get(steps) if rows is not None else None
            if row is not None and row.total >= self.min_support and row.total > 0.0:
                ranked = sorted(row.counts.items(), key=lambda kv: -kv[1])[:k]
                return [(a, c / row.total) for a, c in ranked]
        return self.predict_next(tenant, last, k, before=self._before.get(key))

    def _interpolated(self, chain: list, k: int) -> list[tuple[Hashable, float]]:
        """The ``k`` likeliest next adapters over ``chain`` (rows, finest first; None: a
        row not there). From the coarsest row up: the coarsest row there, and any row
        with ``min_support`` observations, speaks alone; a sparser one is weighed against
        what the coarser rows say, ``(count(b) + smoothing * p(b | coarser)) / (total +
        smoothing)``, or skipped with ``smoothing`` 0. Ties keep the finest row's order.
        Empty when no row is there."""
        a = self.smoothing
        dist: dict[Hashable, float] = {}
        for row in reversed(chain):
            if row is None or row.total <= 0.0:
                continue
            if not dist or row.total >= self.min_support:
                dist = {b: c / row.total for b, c in row.counts.items()}
                continue
            if a == 0.0:
                continue
            scale = 1.0 / (row.total + a)
            mixed = {b: c * scale for b, c in row.counts.items()}
            for b, p in dist.items():
                mixed[b] = mixed.get(b, 0.0) + a * scale * p
            dist = mixed
        if not dist:
            return []
        if k == 1:
            best = max(dist, key=dist.__getitem__)
            return [(best, dist[best])]
        return sorted(dist.items(), key=lambda kv: -kv[1])[:k]

    def last_adapter(self, tenant: Hashable, session: Hashable) -> Hashable | None:
        return self._last.get((tenant, session))

    def previous(self, tenant: Hashable, session: Hashable) -> Hashable | None:
        """The session's step before its last one (order 2; None otherwise or at its first step)."""
        return self._before.get((tenant, session))

    # -- persistence: what was learned survives a restart; sessions in progress do not

    STATE_VERSION = 1
    MAX_NAME = 256  # characters of a tenant or adapter name read back from a state

    def to_state(self, *, row_budget: int | None = None) -> dict:
        """The learned counts as plain JSON data (no session state: ``_last``, ``_before``, ``_steps``).

        ``{"version": 1, "order": 1|2, "global": ROWS, "tenants": [{"tenant": t, "rows": ROWS,
        "contexts": CONTEXTS}]}`` (``contexts``, optional: the ``context_steps`` rows, ``after``
        a list of the session's steps so far)
        with ``ROWS = [{"after": a | [before, a], "next": [[b, count], ...]}]``: a pair key is
        a 2-element list, never a joined string (a name may contain any separator); lists
        keep the order of tenants (least recently used first) and of successors (ties in
        ``predict_next``), whatever the JSON writer does with object keys.

        ``row_budget``: at most that many rows in all, the all-tenant rows first, then the
        most recently used tenants, each row set strongest first when cut. Names must be
        strings (the gateway's are); anything else raises ``TypeError``.
        """
        budget = row_budget if row_budget is not None else math.inf
        glob = self._rows_state(self._global, budget)
        budget -= len(glob)
        tenants = []
        for tenant in reversed(self._tenants):
            if budget <= 0:
                break
            rows = self._rows_state(self._tenants[tenant], budget)
            budget -= len(rows)
            item = {"tenant": self._state_name(tenant), "rows": rows}
            contexts = self._contexts.get(tenant)
            if contexts and budget > 0:
                item["contexts"] = self._rows_state(contexts, budget)
                budget -= len(item["contexts"])
            tenants.append(item)
        tenants.reverse()
        return {"version": self.STATE_VERSION, "order": self.order, "global": glob, "tenants": tenants}

    @staticmethod
    def _rows_state(rows: dict[Hashable, _Row], budget: float) -> list[dict]:
        name = TransitionModel._state_name
        keys: list[Hashable] = list(rows)
        if len(keys) > budget:
            keys = sorted(keys, key=lambda k: -rows[k].total)[:int(budget)]
        return [{"after": [name(a) for a in k] if isinstance(k, tuple) else name(k),
                 "next": [[name(b), c] for b, c in rows[k].counts.items()]} for k in keys]

    def _contexts_from(self, raw: object) -> OrderedDict[tuple, _Row]:
        if not self.context_steps:
            return OrderedDict()
        return OrderedDict(self._rows_from(raw, self._context_key))

    def _context_key(self, after: object) -> Hashable | None:
        """A context row's key: 1-``context_steps`` valid names."""
        if (isinstance(after, list) and 0 < len(after) <= self.context_steps
                and all(self._valid_name(a) for a in after)):
            return tuple(after)
        return None

    def _pair_key(self, after: object) -> Hashable | None:
        """A transition row's key: a name, or (order 2) ``[before, name]``."""
        if isinstance(after, list):
            if self.order != 2 or len(after) != 2 or not all(self._valid_name(a) for a in after):
                return None
            return (after[0], after[1])
        return after if self._valid_name(after) else None

    @classmethod
    def from_state(cls, state: object, **kwargs) -> "TransitionModel":
        """A model with ``kwargs`` (the state's ``order`` unless given) and ``state``'s counts."""
        if isinstance(state, dict) and "order" not in kwargs and state.get("order") in (1, 2):
            kwargs["order"] = state["order"]
        model = cls(**kwargs)
        model.load_state(state)
        return model

    def load_state(self, state: object) -> int:
        """Replace the learned counts with ``state``'s (``to_state``'s format); returns the rows kept.

        A state of the wrong shape (not an object, another version, ``global``/``tenants``
        of the wrong type) raises ``ValueError`` and leaves the model as it was. Inside it,
        whatever is not a valid row is skipped: names that are not strings of 1-``MAX_NAME``
        characters, pair rows in an order-1 model, counts that are not positive numbers
        (NaN, booleans, strings). The rest is clipped to this model's bounds: the
        ``max_tenants`` most recent tenants, ``max_rows`` rows each, ``max_successors`` per
        row (strongest first), each count to ``halve_at`` (infinity included) and a row
        whose total passes ``halve_at`` scaled down to it, dropping what falls under 0.5
        (the aging rule: one huge count cannot pin a row forever). A state written by
        ``to_state`` loads back exactly. Session state is untouched.
        """
        if not isinstance(state, dict) or state.get("version") != self.STATE_VERSION:
            raise ValueError("not a transition model state of version %d" % self.STATE_VERSION)
        glob, tenants = state.get("global", []), state.get("tenants", [])
        if not isinstance(glob, list) or not isinstance(tenants, list):
            raise ValueError("transition state: 'global' and 'tenants' must be lists")
        new_global = self._rows_from(glob)
        new_tenants: OrderedDict[Hashable, dict[Hashable, _Row]] = OrderedDict()
        new_contexts: OrderedDict[Hashable, OrderedDict[tuple, _Row]] = OrderedDict()
        for item in tenants[-self.max_tenants:] if self.max_tenants > 0 else ():
            if not isinstance(item, dict) or not self._valid_name(item.get("tenant")):
                continue
            rows = self._rows_from(item.get("rows"))
            if rows:
                new_tenants.pop(item["tenant"], None)  # a repeated tenant: the later entry wins
                new_tenants[item["tenant"]] = rows
                contexts = self._contexts_from(item.get("contexts"))
                new_contexts.pop(item["tenant"], None)
                if contexts:
                    new_contexts[item["tenant"]] = contexts
        self._global, self._tenants, self._contexts = new_global, new_tenants, new_contexts
        return (len(new_global) + sum(len(r) for r in new_tenants.values())
                + sum(len(r) for r in new_contexts.values()))

    def _rows_from(self, raw: object,
                   key_of: Callable[[object], Hashable | None] | None = None) -> dict[Hashable, _Row]:
        """Rows of a state list, keyed by ``key_of(after)`` (default ``_pair_key``; None
        skips the row), the ``max_rows`` strongest kept."""
        if not isinstance(raw, list):
            return {}
        key_of = key_of or self._pair_key
        rows: dict[Hashable, _Row] = {}
        for item in raw:
            if not isinstance(item, dict):
                continue
            key = key_of(item.get("after"))
            if key is None:
                continue
            row = self._row_from(item.get("next"))
            if row is not None:
                rows[key] = row
        if len(rows) > self.max_rows:
            keep = set(sorted(rows, key=lambda k: -rows[k].total)[:max(self.max_rows, 0)])
            rows = {k: r for k, r in rows.items() if k in keep}
        return rows

    def _row_from(self, raw: object) -> _Row | None:
        if not isinstance(raw, list):
            return None
        counts: dict[Hashable, float] = {}
        for pair in raw:
            if not (isinstance(pair, list) and len(pair) == 2 and self._valid_name(pair[0])):
                continue
            c = pair[1]
            if isinstance(c, bool) or not isinstance(c, (int, float)):
                continue
            try:
                c = float(c)
            except OverflowError:  # an int past float's range
                c = math.inf
            if c > 0.0 and not math.isnan(c):
                counts[pair[0]] = min(c, self.halve_at)
        if len(counts) > self.max_successors:
            keep = set(sorted(counts, key=lambda b: -counts[b])[:max(self.max_successors, 0)])
            counts = {b: c for b, c in counts.items() if b in keep}
        total = sum(counts.values())
        if total > self.halve_at:
            scale = self.halve_at / total
            counts = {b: c * scale for b, c in counts.items() if c * scale >= 0.5}
            total = sum(counts.values())
        if total <= 0.0:
            return None
        row = _Row()
        row.counts, row.total = counts, total
        return row

    @staticmethod
    def _state_name(x: Hashable) -> str:
        if not isinstance(x, str):
            raise TypeError(f"transition state names must be strings, got {type(x).__name__}")
        return x

    @classmethod
    def _valid_name(cls, x: object) -> bool:
        return isinstance(x, str) and 0 < len(x) <= cls.MAX_NAME


class FirstSteps:
    """Which adapters open a tenant's sessions, and how soon the next session opens.

    A session's first request is the one no transition can predict: nothing came before
    it. ``observe(tenant, session, adapter, now)`` says whether the request opens a
    session (its id was not seen before, or it was idle longer than ``idle_timeout_s``)
    and, if so, counts ``adapter`` as an opener of ``tenant`` (decayed counts, half-life
    ``half_life_s``; at most ``per_tenant`` openers kept per tenant, the weakest dropped).

    ``likely(tenant, now, horizon_s, k)`` returns the ``k`` likeliest openers with the
    probability that a new session of the tenant opens with each within ``horizon_s``:
    the tenant's session-open rate thinned by the opener's share, as a Poisson use
    probability (``1 - exp(-rate * share * horizon_s)``). Bounded: ``max_sessions``
    last-seen times and ``max_tenants`` tenants (least recently seen dropped first).
    """

    def __init__(self, half_life_s: float = 600.0, *, idle_timeout_s: float = 600.0, per_tenant: int = 8,
                 max_sessions: int = 200_000, max_tenants: int = 100_000) -> None:
        if half_life_s <= 0 or idle_timeout_s <= 0 or per_tenant <= 0:
            raise ValueError("half_life_s, idle_timeout_s and per_tenant must be positive")
        self._lambda = math.log(2.0) / half_life_s
        self.idle_timeout_s = idle_timeout_s
        self.per_tenant, self.max_sessions, self.max_tenants = per_tenant, max_sessions, max_tenants
        self._seen: OrderedDict[tuple[Hashable, Hashable], float] = OrderedDict()
        # tenant -> [opens (decayed), at, {adapter: decayed count}]
        self._tenants: OrderedDict[Hashable, list] = OrderedDict()
        self.first_steps = 0

    def observe(self, tenant: Hashable, session: Hashable, adapter: Hashable, now: float) -> bool:
        """Record a request; True when it opens a session (and ``adapter`` was counted)."""
        key = (tenant, session)
        last = self._seen.pop(key, None)
        self._seen[key] = now
        if len(self._seen) > self.max_sessions:
            self._seen.popitem(last=False)
        if last is not None and now - last <= self.idle_timeout_s:
            return False
        self.first_steps += 1
        row = self._tenants.pop(tenant, None)
        if row is None:
            row = [0.0, now, {}]
        self._tenants[tenant] = row
        if len(self._tenants) > self.max_tenants:
            self._tenants.popitem(last=False)
        decay = math.exp(-self._lambda * (now - row[1])) if now > row[1] else 1.0
        counts: dict = row[2]
        if decay != 1.0:
            for a in counts:
                counts[a] *= decay
        row[0] = row[0] * decay + 1.0
        row[1] = now
        counts[adapter] = counts.get(adapter, 0.0) + 1.0
        if len(counts) > self.per_tenant:
            del counts[min(counts, key=counts.__getitem__)]
        return True

    def is_open(self, tenant: Hashable, session: Hashable, now: float) -> bool:
        """Would a request of (tenant, session) at ``now`` continue a session (not open one)?"""
        last = self._seen.get((tenant, session))
        return last is not None and now - last <= self.idle_timeout_s

    def likely(self, tenant: Hashable, now: float, horizon_s: float, k: int = 2) -> list[tuple[Hashable, float]]:
        """The ``k`` likeliest openers of ``tenant``'s next sessions, with their use
        probabilities within ``horizon_s``, likeliest first (ties by name)."""
        row = self._tenants.get(tenant)
        if row is None or k <= 0:
            return []
        opens, at, counts = row
        # decayed open rate (per second) of the tenant's sessions, as DecayedPopularity.rate
        rate = opens * math.exp(-self._lambda * max(0.0, now - at)) * self._lambda
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], str(kv[0])))[:k]
        return [(a, use_probability(rate * c / opens, horizon_s)) for a, c in ranked]

    def openers(self, tenant: Hashable) -> dict[Hashable, float]:
        """Share of the tenant's (decayed) session opens per adapter."""
        row = self._tenants.get(tenant)
        if row is None:
            return {}
        return {a: c / row[0] for a, c in row[2].items()}


NEED_EPS = 1e-4  # SessionDemand.need stops once at most this far from certain ...
NEED_TERMS = 64  # ... or after the this many most recent sessions (older ones weigh least)


class SessionDemand:
    """What the sessions in progress are expected to ask for next.

    After each step of a session, ``expect(tenant, session, predicted, now)`` replaces
    that session's expectation with the model's next-step predictions ``[(adapter, p)]``.
    ``need(adapter, now)`` is the probability that at least one session in progress asks
    for ``adapter`` at its next step: ``1 - prod(1 - p_s * w_s)`` over the sessions
    expecting it, where ``w_s = exp(-age_s / horizon_s)`` fades a session that has not come
    back (it may have ended: sessions do not say so). An expectation older than
    ``expire_horizons`` horizons is dropped. One session's wrong guess is forgotten at its
    next step, unlike a score left on a cache entry.

    This is what eviction needs to tell "another session is thinking over this adapter"
    from "nobody is coming back for it": recency and popularity cannot. Bounded:
    ``max_sessions`` sessions (least recently stepped dropped first).
    """

    def __init__(self, horizon_s: float = 10.0, *, expire_horizons: float = 4.0,
                 max_sessions: int = 200_000, working_set: int = 0) -> None:
        """``working_set``: also expect the session's last ``working_set`` other adapters
        back, each with the revisit rate measured so far (the share of steps that asked
        for an adapter the session had used before, other than the previous step's)
        spread over them; 0: only the model's predictions."""
        self.horizon_s = horizon_s
        self.expire_horizons = expire_horizons
        self.max_sessions = max_sessions
        self.working_set = working_set
        self._sessions: OrderedDict[tuple[Hashable, Hashable], tuple[tuple[Hashable, ...], float]] = OrderedDict()
        self._by_adapter: dict[Hashable, dict[tuple[Hashable, Hashable], tuple[float, float]]] = {}
        self._used: OrderedDict[tuple[Hashable, Hashable], tuple[Hashable, ...]] = OrderedDict()
        self.steps = self.revisits = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def expect(self, tenant: Hashable, session: Hashable, predicted: list[tuple[Hashable, float]],
               now: float) -> None:
        """The session just took a step; its next step is ``predicted`` (may be empty)."""
        key = (tenant, session)
        self._forget(key)
        if self.working_set:
            predicted = self._with_working_set(key, predicted)
        if not predicted:
            return
        for adapter, p in predicted:
            self._by_adapter.setdefault(adapter, {})[key] = (p, now)
        self._sessions[key] = (tuple(a for a, _ in predicted), now)
        if len(self._sessions) > self.max_sessions:
            self._forget(next(iter(self._sessions)))

    def _with_working_set(self, key: tuple[Hashable, Hashable],
                          predicted: list[tuple[Hashable, float]]) -> list[tuple[Hashable, float]]:
        """``predicted`` plus the session's earlier adapters (``used`` ends with the
        current step's), each with the revisit rate spread over them, where higher."""
        earlier = self._used.get(key, ())[:-1]
        if not earlier or not self.steps:
            return predicted
        p_back = self.revisits / self.steps / len(earlier)
        out = dict(predicted)
        for a in earlier:
            if out.get(a, 0.0) < p_back:
                out[a] = p_back
        return sorted(out.items(), key=lambda kv: -kv[1])

    def step(self, tenant: Hashable, session: Hashable, adapter: Hashable) -> None:
        """Record the session's step (before ``expect``): the working set and the revisit rate."""
        if not self.working_set:
            return
        key = (tenant, session)
        used = self._used.pop(key, ())
        if used:
            self.steps += 1
            if adapter in used[:-1] and adapter != used[-1]:
                self.revisits += 1
        used = tuple(a for a in used if a != adapter)[-self.working_set:] + (adapter,)
        self._used[key] = used
        if len(self._used) > self.max_sessions:
            self._used.popitem(last=False)

    def _forget(self, key: tuple[Hashable, Hashable]) -> None:
        old = self._sessions.pop(key, None)
        if old is None:
            return
        for adapter in old[0]:
            waiting = self._by_adapter.get(adapter)
            if waiting is not None:
                waiting.pop(key, None)
                if not waiting:
                    del self._by_adapter[adapter]

    def need(self, adapter: Hashable, now: float) -> float:
        waiting = self._by_adapter.get(adapter)
        if not waiting:
            return 0.0
        expire = self.expire_horizons * self.horizon_s
        # entries are in the order their sessions stepped: the expired ones lead
        stale = []
        for key, (_, t) in waiting.items():
            if now - t <= expire:
                break
            stale.append(key)
        for key in stale:
            self._forget(key)
        waiting = self._by_adapter.get(adapter)
        if not waiting:
            return 0.0
        inv_h = 1.0 / self.horizon_s
        miss = 1.0
        # newest first (the heaviest weights), at most NEED_TERMS of them, stopping once
        # the product is below NEED_EPS: a hot adapter with thousands of sessions waiting
        # costs tens of terms, not thousands
        for n, (p, t) in enumerate(reversed(waiting.values())):
            if miss < NEED_EPS or n == NEED_TERMS:
                break
            age = now - t
            miss *= 1.0 - p * math.exp(-age * inv_h) if age > 0 else 1.0 - p
        return 1.0 - miss


@dataclass
class LedgerStats:
    predictions: int = 0
    used: int = 0
    wasted: int = 0

    @property
    def precision(self) -> float:
        done = self.used + self.wasted
        return self.used / done if done else 0.0


class PredictionLedger:
    """Counts each prediction as used or wasted when its session's next step is seen."""

    def __init__(self, max_pending: int = 200_000) -> None:
        self.max_pending = max_pending
        self.stats = LedgerStats()
        self._pending: OrderedDict[tuple[Hashable, Hashable], tuple[Hashable, ...]] = OrderedDict()

    def resolve(self, tenant: Hashable, session: Hashable, adapter: Hashable) -> bool:
        """The session's next step asked for ``adapter``: settle its pending predictions."""
        pending = self._pending.pop((tenant, session), None)
        if not pending:
            return False
        hit = adapter in pending
        self.stats.used += 1 if hit else 0
        self.stats.wasted += len(pending) - (1 if hit else 0)
        return hit

    def record(self, tenant: Hashable, session: Hashable, predicted: tuple[Hashable, ...]) -> None:
        if not predicted:
            return
        key = (tenant, session)
        old = self._pending.pop(key, None)
        if old:
            self.stats.wasted += len(old)
        self._pending[key] = predicted
        self.stats.predictions += len(predicted)
        if len(self._pending) > self.max_pending:
            _, dropped = self._pending.popitem(last=False)
            self.stats.wasted += len(dropped)

    def flush(self) -> None:
        """End of trace: whatever is still pending was never used."""
        for predicted in self._pending.values():
            self.stats.wasted += len(predicted)
        self._pending.clear()
