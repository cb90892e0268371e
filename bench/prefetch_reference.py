"""What prediction is worth on an arm's own routing: the same caches replayed with
predictors of increasing knowledge (pure, by count).

A hit-ratio target that the miss causes (``bench.bounds.miss_causes``) do not bound
(its ceiling is above the target) is missed by prediction or by eviction. This module
tells which, and by how much: it replays one run's requests, in the order they were
sent, on the hosts that run sent them to, through per-host caches of ``slots`` adapters
and one fixed prefetch rule, five times, changing only what the predictor knows:

- ``none``: no prediction, least recently used eviction (what affinity's agents do);
- ``learned``: each session's next *different* adapter from an online second-order model
  over the sessions' distinct steps (the last two different adapters -> the next one,
  backing off to the last one), counted from the requests already sent in this replay:
  no future, nothing from another run;
- ``seen_workflows``: ``workflow`` below for a session whose workflow an earlier session
  (one that began before it) followed, else ``learned``: a model that learns a habit
  perfectly from its first session, and knows nothing of one it has not seen;
- ``workflow``: the trace generator's own plan of each session (the ``workflow`` label:
  its habitual chain), followed through the steps seen so far (a repeat stays in place,
  a stray is skipped), its next step predicted: what a model that had learned every
  tenant's habits perfectly would say; strays and early ends stay unknown;
- ``next_step``: each session's actual next step.

The rule, the same for all four: a prediction of a session's next adapter is live for
``live_s`` after the session's latest step (the trace's think times are seconds) and
targets the host that adapter's latest request went to (where the arm's routing keeps
it), else the host of the step just sent. A missing adapter is loaded on its request,
evicting the resident adapter with the fewest live predictions, least recently used among
equals (with no prediction: LRU). A prediction whose adapter is absent is loaded at once
if its host has room, else if the victim that rule picks has fewer live predictions than
it. Loads are instant: timing is not modelled.

These are references, not bounds: a better rule with the same predictor can do better,
and no row of this module is checked as a ceiling (``bench.bounds`` holds the bounds).
The one self-check: ``none`` is a demand-caching policy, so Belady's optimum on the same
host sequences is at least its hits (``ReferenceBroken`` otherwise).
"""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict
from typing import Hashable, Mapping, Sequence

from bench.bounds import belady_hits, host_sequences

__all__ = ["PREDICTORS", "LIVE_S", "learnability", "prefetch_reference", "workflow_next"]

PREDICTORS = ("none", "learned", "seen_workflows", "workflow", "next_step")
LIVE_S = 6.0


class ReferenceBroken(RuntimeError):
    """A reference broke its own invariant (a bug in this module, never a finding)."""


def workflow_next(seen: Sequence[Hashable], chain: Sequence[Hashable]) -> Hashable | None:
    """The step of ``chain`` after the session's steps ``seen``, following the chain as far
    as the steps match it: the next chain step advances, a repeat stays, an adapter found
    later in the chain jumps there, anything else (a stray) is skipped. None at its end."""
    pos = -1
    for a in seen:
        if pos + 1 < len(chain) and chain[pos + 1] == a:
            pos += 1
        elif pos >= 0 and chain[pos] == a:
            continue
        elif a in chain[pos + 1:]:
            pos = chain.index(a, pos + 1)
    return chain[pos + 1] if pos + 1 < len(chain) else None


class _Sessions:
    """What the predictors know of the sessions as requests are sent: each session's steps
    and distinct steps, whether its workflow was followed by a session that began before
    it, and an online second-order model over distinct steps (the last two different
    adapters -> the next one, backing off to the last one)."""

    def __init__(self) -> None:
        self.seen: dict[Hashable, list] = defaultdict(list)
        self.distinct: dict[Hashable, list] = defaultdict(list)
        self.known: dict[Hashable, bool] = {}
        self._flows: set[str] = set()
        self._two: dict[tuple, Counter] = defaultdict(Counter)
        self._one: dict[Hashable, Counter] = defaultdict(Counter)

    def step(self, session: Hashable, adapter: Hashable, flow: str) -> None:
        if session not in self.known:
            self.known[session] = flow in self._flows
            self._flows.add(flow)
        distinct = self.distinct[session]
        if distinct and distinct[-1] != adapter:
            self._one[distinct[-1]][adapter] += 1
            if len(distinct) >= 2:
                self._two[(distinct[-2], distinct[-1])][adapter] += 1
        self.seen[session].append(adapter)
        if not distinct or distinct[-1] != adapter:
            distinct.append(adapter)

    def learned(self, session: Hashable) -> Hashable | None:
        distinct = self.distinct[session]
        row = self._two.get(tuple(distinct[-2:])) if len(distinct) >= 2 else None
        row = row or self._one.get(distinct[-1])
        return row.most_common(1)[0][0] if row else None

    def plan(self, session: Hashable, flow: str) -> Hashable | None:
        return workflow_next(self.seen[session], flow.split("->")) if flow and flow != "one-off" else None


def _next_adapters(ordered: Sequence[Mapping]) -> list[Hashable | None]:
    """Per request of ``ordered``: the adapter of its session's next request (None: its last)."""
    out: list[Hashable | None] = [None] * len(ordered)
    last: dict[Hashable, int] = {}
    for i, r in enumerate(ordered):
        if r["session"] in last:
            out[last[r["session"]]] = r["adapter"]
        last[r["session"]] = i
    return out


def _replay(ordered: list[Mapping], slots: int, predictor: str, labels: Mapping[str, str],
            next_of: Sequence[Hashable | None], live_s: float) -> dict:
    caches: dict[str, OrderedDict] = defaultdict(OrderedDict)
    live: dict[Hashable, tuple[Hashable, str, float]] = {}   # session -> (adapter, host, at_s)
    where: dict[Hashable, str] = {}                          # adapter -> host of its latest request
    sessions = _Sessions()
    hits = prefetches = predictions = right = 0

    def need(host: str, now: float) -> Counter:
        n: Counter = Counter()
        for a, h, at in live.values():
            if h == host and now - at < live_s:
                n[a] += 1
        return n

    def victim(cache: OrderedDict, n: Counter) -> Hashable:
        return min(enumerate(cache), key=lambda ia: (n[ia[1]], ia[0]))[1]

    for i, r in enumerate(ordered):
        a, host, now, s = r["adapter"], r["host"] or "unknown", float(r["at_s"]), r["session"]
        cache = caches[host]
        if a in cache:
            hits += 1
            cache.move_to_end(a)
        else:
            if len(cache) >= slots:
                del cache[victim(cache, need(host, now))]
            cache[a] = None
        where[a] = host
        flow = labels.get(r.get("id"), "")
        sessions.step(s, a, flow)
        live.pop(s, None)
        if predictor == "none":
            continue
        if predictor == "next_step":
            p = next_of[i]
        elif predictor == "workflow" or (predictor == "seen_workflows" and sessions.known[s]):
            p = sessions.plan(s, flow)
        else:
            p = sessions.learned(s)
        if p is None:
            continue
        predictions += 1
        right += p == next_of[i]
        target = where.get(p, host)
        live[s] = (p, target, now)
        cache = caches[target]
        if p in cache:
            continue
        if len(cache) < slots:
            cache[p] = None
            prefetches += 1
            continue
        n = need(target, now)
        v = victim(cache, n)
        if n[v] < n[p]:
            del cache[v]
            cache[p] = None
            prefetches += 1
    return {"hits": hits, "hit_ratio": hits / len(ordered) if ordered else None, "prefetches": prefetches,
            "predictions": predictions, "predictions_right": right}


def prefetch_reference(rows: Sequence[Mapping], slots: int, *, labels: Mapping[str, str] | None = None,
                       live_s: float = LIVE_S) -> dict:
    """``rows``: one run's requests with ``id``, ``host``, ``adapter``, ``session``,
    ``sent_s`` (send order) and ``at_s`` (seconds, the trace's clock); ``labels``: request
    id -> the trace's ``workflow``. Returns each predictor's hits, prefetches, predictions
    and how many named the session's next request, beside Belady's demand optimum on the
    same host sequences."""
    if slots < 1:
        raise ValueError(f"slots must be at least 1, got {slots}")
    ordered = sorted(rows, key=lambda r: r["sent_s"])
    next_of = _next_adapters(ordered)
    labels = labels or {}
    out = {p: _replay(ordered, slots, p, labels, next_of, live_s) for p in PREDICTORS}
    belady = sum(belady_hits(seq, slots) for seq in host_sequences(ordered).values())
    if out["none"]["hits"] > belady:
        raise ReferenceBroken(f"LRU ({out['none']['hits']}) beat Belady's optimum ({belady}) on the same sequences")
    return {"slots": slots, "live_s": live_s, "requests": len(ordered), "belady_hits": belady,
            "predictors": out}


def learnability(requests: Sequence[Mapping]) -> dict:
    """How well each predictor names a session's next request over a whole trace, in its
    time order (``t``), split by whether an earlier session followed the same workflow
    (``later``) or not (``first``: nothing learned online can name its steps, only shared
    stretches of other habits can): ``learned`` (this module's model), ``gateway`` (the
    gateway's own transition model with its default settings, ``predict_session``'s first
    guess) and ``workflow`` (the generator's plan). Needs the trace's ``workflow`` labels."""
    from extproc.policy.speculator import SpeculationSettings

    ordered = sorted(requests, key=lambda r: r["t"])
    gateway, sessions = SpeculationSettings().transition_model(), _Sessions()
    out = {g: dict.fromkeys(("steps", "learned", "gateway", "workflow"), 0) for g in ("first", "later")}
    for r, nxt in zip(ordered, _next_adapters(ordered)):
        s, a, flow = r["session"], r["adapter"], r.get("workflow", "")
        sessions.step(s, a, flow)
        gateway.observe(r["tenant"], s, a)
        if nxt is None:
            continue
        g = out["later" if sessions.known[s] else "first"]
        g["steps"] += 1
        g["learned"] += sessions.learned(s) == nxt
        guess = gateway.predict_session(r["tenant"], s, 1)
        g["gateway"] += bool(guess) and guess[0][0] == nxt
        g["workflow"] += sessions.plan(s, flow) == nxt
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m bench.prefetch_reference TRACE...``: each trace's ``learnability``, as JSON."""
    import argparse
    import json

    from bench.trace import load_trace

    ap = argparse.ArgumentParser(prog="python -m bench.prefetch_reference", description=main.__doc__)
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    print(json.dumps({t: learnability(load_trace(t)) for t in args.traces}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
