"""Whether a prefetch is taken: decided at once, its load runs in the background.

A prefetch is refused when its adapter is unknown or its digest differs; it is
``already_resident`` on the device; a duplicate coalesces with the queued or running load.
A request's own prefetch (the gateway's ingress signal) to an engine that loads the
request's adapter itself (builtin) only starts the fetch of its files: the request's own
load joins it, and nothing is loaded twice; its ``evict`` hints become that load's first
victims (``EngineConnector.prefer_victims``); on vLLM with ace's evicting unload
(``--vllm-unload-evicts``), where the resolver makes that load, they become its cache's
standing ranking (``prefer_victims``, ``ranks_victims``), which the resolver's read into
the full cache takes its victim from, and the agent's (``TierHoldings.rank_victims``,
standing): the shrink that follows once the reconcile sees vLLM's new adapter unloads the
same name, so vLLM's list and the agent's stay alike, and nothing is unloaded on the
request's path. An engine that loads on demand into a cache it does not rank (vLLM's
plugin before the ranking) gets the named victims unloaded at once
(``LoadPipeline.evict_ahead``). An engine whose cache evicts its own
LRU (vLLM without that plugin) takes no named victim at all (``_victim_hints``). A hint that says how likely it is
(``probability``) is put to the speculation budget
(``gpu_agent.residency.prefetch_budget``), fed here with measured load times, the queue
and the engine's own request loads; past the queue's bound it is ``queue_full``.
"""
from __future__ import annotations

import itertools
from typing import Callable, Iterable, Mapping

from ace_common.catalog import Adapter
from ace_common.engine_fields import MAX_EVICT_FIRST
from gpu_agent.metrics import AgentMetrics
from gpu_agent.residency.pipeline import LoadPipeline
from gpu_agent.residency.prefetch_budget import HintBet, HintVerdict, LinkState, decide_hint
from gpu_agent.residency.records import AdapterState, ResidencyOutcome, ResidencyResult, rejected

__all__ = ["PrefetchAdmission"]

# the reasons of a request's own prefetch (the gateway's ingress signal: request_cold,
# request_unknown), as opposed to a prediction's (predicted, first_step, warm_set)
REQUEST_REASON = "request_"


class PrefetchAdmission:
    """Admits into the queue of ``pipeline`` (which knows the catalog, the tiers' holdings,
    the loads in flight and their expected times)."""

    def __init__(self, pipeline: LoadPipeline, *, queue_size: int, link_budget_ms: float,
                 metrics: AgentMetrics, publish: Callable[[str], None], waste_share: float | None = None):
        self.pipeline = pipeline
        self.catalog, self.holdings, self.queue = pipeline.catalog, pipeline.holdings, pipeline.queue
        self._states: Mapping[str, AdapterState] = pipeline.states
        self.queue_size, self.link_budget_ms = queue_size, link_budget_ms
        # the share of a wasted bet's load time charged against it (HintBet.waste_ms);
        # None: the engine's (EngineConnector.load_compute_share)
        self._waste_share = waste_share
        self.metrics = metrics
        self._publish = publish

    def prefetch(self, name: str, digest: str = "", priority: int = 0, reason: str = "",
                 evict: Iterable[str] = (), *, probability: float | None = None,
                 victim_reuse_probability: float | None = None, keep: Iterable[str] = (),
                 room_only: bool = False) -> ResidencyResult:
        """``evict``: adapters to evict first should the load need device room (catalog
        names only; others are ignored). A duplicate of a still-queued prefetch replaces
        the queued hints with its own when it has any. ``probability`` (the sender's
        chance that a request needs it here; None: an older sender, taken as before) and
        ``victim_reuse_probability`` feed the speculation budget: a hint it refuses is
        REJECTED with its verdict. ``keep``: adapters the sender just sent requests for to
        this engine; no eviction takes them for a while (``TierHoldings.keep``), whatever
        becomes of this hint. ``room_only``: load it only into free device room, never
        evicting for it: REJECTED ``no_room`` when there is none now, given up when there is
        none by its turn (the gateway's start-up fill)."""
        if keep:
            self.holdings.keep(self._known_hints("", keep))
        spec = self.catalog.get(name)
        if spec is None:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_unknown")
            return rejected("unknown_adapter")
        if digest and digest.lower() != spec.sha256:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_digest")
            return rejected("digest_mismatch")
        device = self.holdings.device
        if name in device:
            device.move_to_end(name)
            self.metrics.inc("ace_agent_prefetch_total", outcome="already_resident")
            return ResidencyResult(ResidencyOutcome.ALREADY_RESIDENT)
        if room_only and not self.holdings.has_free_room(spec):
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_no_room")
            return rejected("no_room")
        if probability is None and reason.startswith(REQUEST_REASON) and self.holdings.connector.loads_on_demand:
            # a request's own load, which this engine makes itself when the request arrives:
            # fetch its files ahead (the engine's load joins the fetch), load nothing here;
            # the gateway's victims are the ones that load evicts first: the builtin engine
            # takes them with the load, vLLM (with ace's evicting unload) sees them leave now
            hints = self._victim_hints(name, evict)
            connector = self.holdings.connector
            connector.prefer_victims(name, hints)
            if hints and connector.ranks_victims:
                # the engine's read takes the first ranked victim's weights; its name leaves
                # with the shrink after the reconcile adopts the request's adapter, by the same
                # ranking, off the request's path (an unload now would wait on vLLM's API
                # loop and engine core beside the very request it makes room for)
                self.holdings.rank_victims(hints, standing=True)
            elif hints and not connector.self_managed:
                self.pipeline.evict_ahead(spec, hints)
            self.pipeline.fetch_ahead(spec)
            self.metrics.inc("ace_agent_prefetch_total", outcome="left_to_engine")
            return ResidencyResult(ResidencyOutcome.ACCEPTED, "engine_loads_on_demand")
        hints = self._victim_hints(name, evict)
        if probability is None and hints and reason.startswith(REQUEST_REASON):
            self.holdings.rank_victims(hints)
        inflight = self.pipeline.inflight
        if name in inflight or name in self.queue:
            if hints and name not in inflight:
                self._states[name].pending_evict = hints
            self.metrics.inc("ace_agent_prefetch_total", outcome="coalesced")
            return ResidencyResult(ResidencyOutcome.ACCEPTED, "coalesced")
        verdict = decide_hint(self._bet(spec, hints, probability, victim_reuse_probability), self._link())
        if verdict is not HintVerdict.ACCEPT:
            self.metrics.inc("ace_agent_prefetch_total", outcome=f"rejected_{verdict.value}")
            return rejected(verdict.value)
        if len(self.queue) >= self.queue_size:
            self.metrics.inc("ace_agent_prefetch_total", outcome="rejected_queue_full")
            return rejected("queue_full")
        self.queue.push(name, priority)
        self._states[name].pending_reason = reason
        self._states[name].pending_evict = hints
        self._states[name].priced = probability is not None
        self._states[name].room_only = room_only
        self.metrics.inc("ace_agent_prefetch_total", outcome="accepted")
        self._publish(name)
        return ResidencyResult(ResidencyOutcome.ACCEPTED)

    def _victim_hints(self, name: str, evict: Iterable[str]) -> tuple[str, ...]:
        """The named victims this engine lets the agent follow: none where its cache evicts
        its own LRU whatever is unloaded (``EngineConnector.evicts_own_lru``: vLLM, where
        a named victim would stay cached, dead, while the cache drops a registered adapter);
        the agent's LRU, in the engine's order of use, picks there."""
        return () if self.holdings.connector.evicts_own_lru else self._known_hints(name, evict)

    def _known_hints(self, name: str, evict: Iterable[str]) -> tuple[str, ...]:
        """The hinted names that are catalog adapters (looked up, never used as paths)."""
        out: list[str] = []
        # at most MAX_EVICT_FIRST names, as of the victims in a builtin request's body
        for hint in itertools.islice(evict, MAX_EVICT_FIRST):
            if hint != name and hint not in out and self.catalog.get(hint) is not None:
                out.append(hint)
        return tuple(out)

    # ---- the speculation budget's inputs -----------------------------------------------
    @property
    def waste_share(self) -> float:
        if self._waste_share is not None:
            return self._waste_share
        return self.holdings.connector.load_compute_share

    def _link(self) -> LinkState:
        ahead = self.queue.queued | set(self.pipeline.inflight)
        load_ms = self.pipeline.load_ms
        return LinkState(demand_loads=len(self.pipeline.demand) + self.holdings.connector.demand_loads(),
                         busy_ms=sum(load_ms(self._states[n].spec) for n in ahead),
                         budget_ms=self.link_budget_ms)

    def _bet(self, spec: Adapter, hints: tuple[str, ...], probability: float | None,
             victim_reuse_probability: float | None) -> HintBet:
        if probability is None:
            return HintBet(None, 0.0)
        load_ms = self.pipeline.load_ms
        mine = load_ms(spec)
        waste = mine * self.waste_share
        victim = self.holdings.likely_victim(spec, hints)
        reuse = victim_reuse_probability or 0.0   # checked even with no victim: never ignored if invalid
        if victim is None:
            return HintBet(probability, mine, reuse, waste_ms=waste)
        return HintBet(probability, mine, reuse, load_ms(self._states[victim].spec), waste_ms=waste)
