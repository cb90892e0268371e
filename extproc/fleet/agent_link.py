"""The gateway's side of the GPU agents: prefetch signals out, residency views in.

``AgentLink`` is a ``PrefetchSink`` (``submit`` never blocks: a bounded queue per agent,
drained by a background thread that sends ``Prefetch`` with a short deadline) and keeps
``ResidencyBoard.current`` up to date from each agent's ``WatchResidency`` stream (a
background thread per agent builds a new immutable ``ResidencySnapshot`` and swaps the
reference). An agent that is down or slow costs the request path nothing: its signals are
dropped once its queue is full, its residency reads ``unknown``, and its stream is retried
with exponential backoff until it comes back.

Every event of the stream may carry the engine's load (running and waiting requests, as
the agent measured it; LOAD events carry nothing else). The link keeps each upstream's
latest load with the time it arrived and publishes it in ``ResidencySnapshot.loads``
while it is fresh: a load not heard about for ``load_max_age_s`` (the agent announces
every measurement, every ``--load-interval-s`` <= 2 s) is dropped by a small expiry
thread, so the routing decision, which reads only the snapshot, treats it as unknown.
Age is judged on this process's clock at arrival, not on the agent's ``measured_unix_ms``
(host clocks differ). With each load the link keeps ``board.sent``'s value at the
arrival and publishes it beside the load (``ResidencySnapshot.sent_at_load``), so the
requests counted as routed there since the measurement start again from 0 at each one.

Every agent is reached in plaintext with the shared token (``$ACE_AGENT_TOKEN``), or over
TLS when ``AgentTLS`` is given (``--agent-tls-ca/-cert/-key``: mTLS, what an agent started
with ``--auth mtls`` requires). ``stream_errors``/``last_error`` per agent say why a link
is not connected.

Agent tiers are the gateway's (``ace_common.tiers.Tier``): device, host, disk, remote;
absent -> ``none`` (the gateway's word for it). Only the gRPC stubs and the tier
vocabulary are imported from gpu_agent (no torch).
"""
from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from types import MappingProxyType
from typing import Callable, Mapping

import grpc

from extproc.domain.prefetch import PrefetchQueue, PrefetchSignal, Retry
from extproc.state.residency import UNKNOWN_TIER, ResidencyBoard, ResidencySnapshot, TierReport
from extproc.settings import AgentTLS
from ace_common.proto.ace.agent.v1 import agent_pb2 as pb
from ace_common.proto.ace.agent.v1 import agent_pb2_grpc as pb_grpc
from ace_common.tiers import Tier

__all__ = ["AgentLink", "AgentTLS", "event_load", "to_residency"]

log = logging.getLogger(__name__)

#: How often a bet held for a demand load (``AgentLink.held_for_demand``) looks again.
HOLD_POLL_S = 0.005

_TIERS = {pb.TIER_DEVICE: Tier.DEVICE, pb.TIER_HOST: Tier.HOST, pb.TIER_DISK: Tier.DISK,
          pb.TIER_REMOTE: Tier.REMOTE, pb.TIER_ABSENT: Tier.ABSENT}


def to_residency(status: pb.AdapterStatus, base_model_bytes: int = 0) -> TierReport:
    return TierReport(
        tier=_TIERS.get(status.tier, UNKNOWN_TIER),
        cold_load_ms=status.cold_load_ms if status.HasField("cold_load_ms") else None,
        bytes=status.bytes or None,
        prefetched=status.tier == pb.TIER_DEVICE and status.loaded_by == "prefetch",
        base_model_bytes=base_model_bytes or None)


def event_load(ev: pb.ResidencyEvent) -> int | None:
    """Requests the engine holds (running + waiting) as the event says; None = unknown."""
    if not ev.HasField("load"):
        return None
    return ev.load.running + ev.load.waiting


def event_waste_share(ev: pb.ResidencyEvent) -> float | None:
    """The waste share the agent's speculation budget charges a bet, as the event
    announces it; None when it does not (an older agent) or announces no share in [0, 1]."""
    if not ev.HasField("prefetch_waste_share"):
        return None
    share = ev.prefetch_waste_share
    return share if 0.0 <= share <= 1.0 else None   # NaN fails both comparisons


class _Agent:
    """One agent: its channel, prefetch sender and residency watcher."""

    def __init__(self, link: "AgentLink", upstream: str, target: str):
        self.link, self.upstream, self.target = link, upstream, target
        if link.tls is not None:
            tls = link.tls
            creds = grpc.ssl_channel_credentials(*(p.read_bytes() if p else None
                                                   for p in (tls.ca, tls.key, tls.cert)))
            options = [("grpc.ssl_target_name_override", tls.server_name)] if tls.server_name else []
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.AgentStub(self.channel)
        self.queue = PrefetchQueue(self._send, maxsize=link.queue_size)
        self.sent = self.failed = self.withdrawn = self.deferred = 0
        # a request's own signals not sent: the agent announced its engine brings a
        # request's adapter itself (``AgentLink.submit``)
        self.left_to_engine = 0
        self.held = self.hold_expired = 0  # bets held for a demand load; sent at their cap
        self.connected = False
        # WatchResidency attempts that ended in an error, and the last one's status code
        # (UNAVAILABLE: down, or refused our TLS; UNAUTHENTICATED: wrong token)
        self.stream_errors = 0
        self.last_error: grpc.StatusCode | None = None
        self._call = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"agent-watch-{upstream}", daemon=True)

    def _send(self, signal: PrefetchSignal) -> Retry | None:
        now = time.monotonic()
        hold = self.link.held_for_demand(signal, now)
        if isinstance(hold, tuple):
            self.held += not signal.held
            return hold
        if signal.yields_to is not None and signal.hold_until <= now:
            self.hold_expired += 1
        verdict = self.link.spare_routed(hold)
        if verdict is None:
            self.withdrawn += 1
            return None
        if isinstance(verdict, tuple):
            self.deferred += 1
            return verdict
        signal = verdict
        try:
            bet = {} if signal.probability is None else {
                "probability": signal.probability,
                "victim_reuse_probability": signal.victim_reuse_probability or 0.0}
            reply = self.stub.Prefetch(
                pb.PrefetchRequest(adapter=signal.adapter, digest=signal.digest,
                                   priority=signal.priority, reason=signal.reason, evict=signal.evict,
                                   keep=signal.keep, room_only=signal.room_only, **bet),
                timeout=self.link.send_timeout_s, metadata=self.link.metadata)
            self.sent += 1
            if reply.outcome == pb.PrefetchReply.REJECTED:
                log.info("agent %s rejected prefetch of %s: %s", self.upstream, signal.adapter, reply.reason)
                if signal.probability is not None and self.link.on_refused is not None:
                    self.link.on_refused(self.upstream, signal.adapter)
        except grpc.RpcError as exc:  # a prefetch is a hint: count it and move on
            self.failed += 1
            log.debug("prefetch to %s failed: %s", self.upstream, exc.code())

    def _watch(self) -> None:
        backoff = self.link.backoff_min_s
        while not self._stop.is_set():
            table: dict[str, TierReport] = {}
            try:
                self._call = self.stub.WatchResidency(pb.WatchRequest(), metadata=self.link.metadata)
                for ev in self._call:
                    if ev.kind == pb.ResidencyEvent.INITIAL:
                        table[ev.status.adapter] = to_residency(ev.status, ev.base_model_bytes)
                        continue
                    if ev.kind == pb.ResidencyEvent.CHANGE:
                        table[ev.status.adapter] = to_residency(ev.status, ev.base_model_bytes)
                    if not self.connected:
                        log.info("agent %s connected (%s)", self.upstream, self.target)
                    self.connected = True
                    backoff = self.link.backoff_min_s
                    if ev.kind == pb.ResidencyEvent.LOAD:  # residency unchanged
                        self.link._publish_load(self.upstream, event_load(ev))
                    else:
                        self.link._publish(self.upstream, table if ev.engine_up else None, event_load(ev),
                                           ev.device_slots, event_waste_share(ev), ev.request_signals_redundant)
            except grpc.RpcError as exc:
                if self._stop.is_set():
                    return
                self.stream_errors += 1
                self.last_error = exc.code()
                if self.connected:
                    log.warning("agent %s stream lost: %s", self.upstream, exc.code())
            self.connected = False
            self.link._publish(self.upstream, None)  # unknown until it is back
            self._stop.wait(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.link.backoff_max_s)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._call is not None:
            self._call.cancel()
        self.queue.close(timeout=0.5)
        if self._thread.ident is not None:   # started (a link removed before start was not)
            self._thread.join(timeout=2)
        self.channel.close()


@dataclasses.dataclass(frozen=True, slots=True)
class _Announced:
    """What an agent announced with its residency: its device slots (0: not announced),
    the waste share its speculation budget charges a bet (None: not announced), and
    whether its engine brings a request's adapter itself (False: not announced)."""
    slots: int = 0
    waste_share: float | None = None
    request_signals_redundant: bool = False


class AgentLink:
    """All agents this gateway talks to, keyed by upstream name.

    ``send_timeout_s``: each Prefetch's deadline. 2 s: the sender is off the request path,
    and an agent busy loading on a loaded host answers late (at 0.5 s the fleet benchmark
    lost two of each host's three warm-set prefetches at start-up)."""

    def __init__(self, agents: Mapping[str, str], board: ResidencyBoard | None = None, *,
                 token: str | None = None, tls: AgentTLS | None = None, queue_size: int = 256,
                 send_timeout_s: float = 2.0, backoff_min_s: float = 0.1, backoff_max_s: float = 5.0,
                 load_max_age_s: float = 5.0):
        self.board = board or ResidencyBoard()
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.tls = tls
        self.queue_size = queue_size
        self.send_timeout_s = send_timeout_s
        self.backoff_min_s, self.backoff_max_s = backoff_min_s, backoff_max_s
        self.load_max_age_s = load_max_age_s
        # told ``(upstream, adapter)`` when an agent refuses a bet (a signal that carries a
        # probability), from the sender's thread: the gateway's speculation withdraws it
        # from its pool model (``GatewaySpeculation.refused``)
        self.on_refused: Callable[[str, str], None] | None = None
        self._tables: dict[str, Mapping[str, TierReport]] = {}  # frozen per upstream
        # upstream -> (requests, monotonic arrival, board.sent's value at the arrival)
        self._loads: dict[str, tuple[int, float, int]] = {}
        # upstream -> what its agent announced with its residency (kept for the upstreams
        # in ``_tables`` only: set and dropped with the table)
        self._announced: dict[str, _Announced] = {}
        # the upstreams whose agent announced ``request_signals_redundant``: replaced whole
        # (in ``_swap``), never mutated, so ``submit`` reads it without the lock
        self._left_to_engine: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._expiry = threading.Thread(target=self._expire_loads, name="agent-load-expiry", daemon=True)
        # replaced whole, never mutated: ``submit`` reads it without a lock
        self.agents: Mapping[str, _Agent] = {upstream: _Agent(self, upstream, target)
                                             for upstream, target in agents.items()}
        self._started = False
        self._agents_lock = threading.Lock()

    def start(self) -> "AgentLink":
        for agent in self.agents.values():
            agent.start()
        self._expiry.start()
        self._started = True
        return self

    def set_agents(self, agents: Mapping[str, str]) -> None:
        """The agents now (upstream -> address), as host discovery found them: a link
        starts for each new one (or one whose address changed) and the link of each one
        gone is closed and its residency dropped from the board, so routing stops seeing it."""
        with self._agents_lock:
            current = dict(self.agents)
            gone = [a for name, a in current.items() if agents.get(name) != a.target]
            for agent in gone:
                del current[agent.upstream]
            new = [_Agent(self, name, target) for name, target in agents.items() if name not in current]
            current.update((agent.upstream, agent) for agent in new)
            self.agents = current
            for agent in gone:
                agent.close()
                self._publish(agent.upstream, None)
            if self._started:
                for agent in new:
                    agent.start()

    def close(self) -> None:
        self._stop.set()
        for agent in self.agents.values():
            agent.close()
        if self._expiry.is_alive():
            self._expiry.join(timeout=2)

    def held_for_demand(self, signal: PrefetchSignal, now: float | None = None) -> PrefetchSignal | Retry:
        """A bet planned on a request whose own adapter was loading (``signal.yields_to``,
        ``SpeculationPlanner.demand_load``) waits until the residency board shows that
        adapter on its host's device tier, checked every ``HOLD_POLL_S``, at most until
        ``signal.hold_until``: ``(signal, delay_s)`` while it waits, else the signal to send
        (``yields_to`` cleared). ``now``: ``time.monotonic()`` (read by the caller, so that
        it judges the cap at the same instant). A bet is for a later step of a session (its next request
        comes after the answer to this one and the client's think time), while the load
        it would compete with, for the CPU, the host's link and the artifact store, stalls
        a request now."""
        if signal.yields_to is None:
            return signal
        upstream, adapter = signal.yields_to
        left = signal.hold_until - (time.monotonic() if now is None else now)
        report = self.board.current.by_upstream.get(upstream, {}).get(adapter)
        if left <= 0 or (report is not None and report.tier == Tier.DEVICE):
            return dataclasses.replace(signal, yields_to=None)
        return dataclasses.replace(signal, held=True), min(left, HOLD_POLL_S)

    def spare_routed(self, signal: PrefetchSignal) -> PrefetchSignal | Retry | None:
        """What to do with ``signal`` given the requests routed lately: an adapter a request
        was routed to on its upstream within ``signal.spare_s`` (``Upstream.victim_grace_s``;
        ``board.sent.recent``) may be on its way to an engine that does not list it as busy
        yet (vLLM's gauge lags), and the agent could unload it under that request. Such
        adapters go in ``keep`` (the agent's evictions skip them, its LRU's too), and:

        - a request's own load is sent now without them in ``evict``;
        - a bet (``probability`` set), priced against the victim it names, is held back
          until that victim's grace has passed (``(signal, delay_s)``), once; then the
          agent's own busy check sees the request if it still runs. Still spared then
          (routed again): None, withdrawn.
        """
        grace = signal.spare_s
        if grace <= 0:
            return signal
        recent = self.board.sent.recent(signal.upstream, grace)
        if not recent:
            return signal
        spared = [v for v in signal.evict if v in recent]
        keep = tuple(recent)
        if not spared:
            return dataclasses.replace(signal, keep=keep)
        if signal.probability is None:
            return dataclasses.replace(signal, evict=tuple(v for v in signal.evict if v not in recent), keep=keep)
        if signal.deferred:
            return None
        return dataclasses.replace(signal, deferred=True), grace - min(recent[v] for v in spared)

    def submit(self, signal: PrefetchSignal) -> bool:
        """PrefetchSink: queue for the upstream's agent; False when none or its queue is full.

        A request's own signal (``signal.for_request``) to an upstream whose agent announced
        ``request_signals_redundant`` is not sent (counted ``left_to_engine``, True): that
        engine fetches and loads the request's adapter itself when the request arrives, and
        the RPC, handled on the engine's event loop, delayed the fetch of the files it named
        (docs/agent.md, "The builtin engine gets a request's victims with the request")."""
        agent = self.agents.get(signal.upstream)
        if agent is None:
            return False
        if signal.for_request and signal.upstream in self._left_to_engine:
            agent.left_to_engine += 1
            return True
        return agent.queue.submit(signal)

    def connected(self, upstream: str) -> bool:
        agent = self.agents.get(upstream)
        return agent is not None and agent.connected

    def _publish(self, upstream: str, table: Mapping[str, TierReport] | None,
                 load: int | None = None, slots: int = 0, waste_share: float | None = None,
                 request_signals_redundant: bool = False) -> None:
        """The upstream's residency (None: unknown, the upstream leaves the view), load,
        device slots (0: not announced), the waste share of its speculation budget (None:
        not announced) and whether its engine brings a request's adapter itself."""
        with self._lock:
            if table is None:
                self._loads.pop(upstream, None)
                self._announced.pop(upstream, None)
                if upstream not in self._tables:
                    return
                self._tables.pop(upstream)
            else:
                self._tables[upstream] = MappingProxyType(dict(table))
                self._set_load(upstream, load)
                self._announced[upstream] = _Announced(slots, waste_share, request_signals_redundant)
            self._swap()

    def _publish_load(self, upstream: str, load: int | None) -> None:
        """Only the upstream's load; the snapshot is rebuilt only when what it shows changes:
        another load, or requests sent there since the last one (which this one resets).
        The counter is read in ``_set_load`` first: if the current snapshot's mark still
        equals the counter after that, the new mark equals the old one."""
        with self._lock:
            self._set_load(upstream, load)
            current = self.board.current
            mark = current.sent_at_load.get(upstream)
            if upstream in self._tables and (current.loads.get(upstream) != load or (
                    mark is not None and self.board.sent.value(upstream) != mark)):
                self._swap()

    def _set_load(self, upstream: str, load: int | None) -> None:
        if load is None:
            self._loads.pop(upstream, None)
        else:
            self._loads[upstream] = (load, time.monotonic(), self.board.sent.value(upstream))

    def _swap(self) -> None:
        """Build and publish a new snapshot (under the lock): the tables as they are (each
        already frozen), the loads that are fresh, and the sent count at each one's arrival."""
        now = time.monotonic()
        fresh = [(u, n, base) for u, (n, at, base) in self._loads.items()
                 if u in self._tables and now - at <= self.load_max_age_s]
        loads = MappingProxyType({u: n for u, n, _ in fresh})
        marks = MappingProxyType({u: base for u, _, base in fresh})
        slots = MappingProxyType({u: a.slots for u, a in self._announced.items() if a.slots})
        waste = MappingProxyType({u: a.waste_share for u, a in self._announced.items()
                                  if a.waste_share is not None})
        self._left_to_engine = frozenset(u for u, a in self._announced.items() if a.request_signals_redundant)
        self.board.publish(ResidencySnapshot(MappingProxyType(dict(self._tables)), loads, marks, slots=slots,
                                             waste_share=waste))

    def _expire_loads(self) -> None:
        """Drop loads not heard about for load_max_age_s (an agent gone silent without its
        stream breaking), so the snapshot stops showing them."""
        while not self._stop.wait(max(0.01, self.load_max_age_s / 5)):
            with self._lock:
                now = time.monotonic()
                stale = [u for u, (_, at, _) in self._loads.items() if now - at > self.load_max_age_s]
                for u in stale:
                    del self._loads[u]
                if stale:
                    self._swap()
