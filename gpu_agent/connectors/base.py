"""The seam between the residency manager and a serving engine.

A connector translates "make adapter X resident / drop it / what do you hold" (and "how
busy are you": `engine_load`) into one engine's API. It keeps no residency policy of its own: budgets, LRU and pinning live in
`gpu_agent.residency` (the manager's parts: holdings, pipeline, reconcile, operations), which call
these methods one at a time per adapter.

    ConnectorError          the engine refused or failed a load/unload
    └── EngineUnavailable   the engine cannot be reached (down, restarting)
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ace_common.catalog import Adapter
from gpu_agent.errors import AgentError

__all__ = ["ConnectorError", "EngineUnavailable", "EngineConnector", "EngineLoad", "listed_adapters"]


class ConnectorError(AgentError):
    """The engine answered a load/unload with a failure."""


class EngineUnavailable(ConnectorError):
    """The engine did not answer (connection refused, timeout, 5xx on a probe)."""


@dataclass(frozen=True)
class EngineLoad:
    """Requests the engine holds now: in its running batch, and queued for a place there.

    ``measured_unix_ms`` (stamped by the agent's load monitor) takes no part in equality:
    two measurements with the same counts are the same load."""

    running: int
    waiting: int
    measured_unix_ms: int = field(default=0, compare=False)

    @property
    def requests(self) -> int:
        return self.running + self.waiting


class EngineConnector(abc.ABC):
    """One serving engine's adapter API."""

    kind: str = "abstract"
    #: How many adapters the engine holds at once (vLLM: --max-cpu-loras); None = no
    #: count limit (the builtin pool is bounded by bytes instead).
    capacity: int | None = None
    #: True when the engine owns its device tier (the builtin pool evicts by its own record
    #: of use; the agent keeps no device budget): an adapter missing from `loaded()` then
    #: just dropped a tier; False (vLLM, SGLang): the agent is the only one that unloads,
    #: so a missing adapter means the engine restarted.
    self_managed: bool = False
    #: True when the engine loads a request's adapter itself when the request arrives, in
    #: the agent's own process (builtin): a request's own prefetch (the gateway's ingress
    #: signal, ``reason="request_*"``) would only repeat that load on the event loop the
    #: request is served from, so the agent only fetches its files ahead and loads nothing
    #: (gpu_agent.residency.admission); and since that loop is the engine's, a prefetch's
    #: fetch waits for ``prefetch_turn`` too (gpu_agent.residency.pipeline).
    loads_on_demand: bool = False
    #: True when the engine also fetches a request's adapter files itself, through the
    #: agent's own artifact store (builtin): a request's own prefetch then adds nothing the
    #: request does not bring, while its RPC, handled on the engine's event loop, delays the
    #: fetch of the very files it names (~1.6 ms per cold request at hundreds x 4 hosts,
    #: docs/bench-history.md 2026-12-06 15:41). The agent announces it on its residency
    #: stream (``ResidencyEvent.request_signals_redundant``) and the gateway stops sending
    #: them here. False where the request needs the agent to bring the files first (vLLM's
    #: filesystem resolver reads the disk tier the agent fills).
    request_signals_redundant: bool = False
    #: The share of a load's time the engine's compute loses to it: a speculative load
    #: that is not used costs whoever arrives meanwhile that much, and the speculation
    #: budget charges it so (``HintBet.waste_ms`` = share x the load's expected time).
    #: 1.0 where a load stops the engine's steps (vLLM and SGLang run it on their
    #: scheduler loop between two steps); the builtin engine's own (by its device).
    load_compute_share: float = 0.0
    #: True when the engine's adapter cache drops its own least recently used adapter
    #: whenever it reads one, and an unload only forgets the name (vLLM: its CPU cache,
    #: ``--max-cpu-loras``, keeps an unloaded adapter's weights, under an id no later
    #: request uses, until that LRU drops them). A victim named by anyone else (the
    #: gateway's ``evict`` hints, its ranking) then leaves a dead copy in the cache while
    #: the cache drops its LRU adapter, still registered, which the next request for it
    #: re-reads: the agent's view and the engine's part. So on such an engine the agent's
    #: own LRU (its view of the engine's order of use) alone picks victims.
    evicts_own_lru: bool = False

    async def start(self) -> None:
        """Open clients / start the in-process engine."""

    async def close(self) -> None:
        """Release clients; never raises."""

    @abc.abstractmethod
    async def load(self, spec: Adapter, path: Path, *, pinned: bool = False,
                   demand: bool = False) -> None:
        """Make `spec` (files verified at `path`) resident. Already resident is success.
        `demand`: a request waits for this load; otherwise it is a prefetch, which an
        engine that orders its own loads (builtin) runs after, and pauses for, requests'
        loads. vLLM and SGLang load in one HTTP call: they cannot pause it."""

    @abc.abstractmethod
    async def unload(self, name: str) -> None:
        """Drop `name` from the engine. Not loaded is success."""

    @abc.abstractmethod
    async def loaded(self) -> set[str]:
        """Adapter names the engine holds now; EngineUnavailable when it cannot tell."""

    #: The engine keeps an adapter's name when the agent evicts it and drops only its
    #: weights (vLLM with ace's plugin, ``--vllm-keep-registered``): ``loaded`` then names
    #: what its cache holds, ``registered`` what it serves by name, and a name its cache
    #: dropped by itself is a tier lost, not an engine reset (the reconcile).
    keeps_registered: bool = False

    async def registered(self) -> set[str]:
        """The adapters the engine serves by name, their weights cached or not; what
        ``loaded`` names where the two are one."""
        return await self.loaded()

    def keeps_name(self, name: str) -> bool:
        """``keeps_registered``, and `name`'s files stay where the engine reads them again
        (not the agent's disk cache of a remote store, whose budget may delete them)."""
        return False

    async def cached(self) -> set[str] | None:
        """The adapters whose weights the engine's own cache holds now, where its registry
        can name more than that cache holds (vLLM: a registered adapter its CPU LRU dropped
        is read again by its next request). None where the two are one, or the engine
        cannot tell: then every adapter ``loaded`` names is held."""
        return None

    def set_pinned(self, name: str, pinned: bool) -> None:
        """Tell an engine that evicts by itself (builtin) that a resident adapter is (un)pinned;
        ConnectorError when it is not resident. Engines the agent alone evicts ignore it."""

    #: ``prefer_victims`` sets the order in which the engine's own cache evicts, and it
    #: keeps that order until the next call (vLLM with ace's evicting plugin): the
    #: engine's load of a request's adapter then takes the first named victim itself,
    #: and the agent unloads nothing ahead of it on the request's path
    ranks_victims: bool = False

    def prefer_victims(self, loading: str, victims: tuple[str, ...]) -> None:
        """An engine that loads a request's adapter itself (``loads_on_demand``) evicts
        ``victims`` first when that load of ``loading`` needs room: the gateway's choice,
        sent with the request's ingress signal. Engines the agent loads for apply the
        hints in the agent's own load (``TierHoldings``) and ignore this."""

    def watch_device(self, changed: Callable[[str], None]) -> bool:
        """Call ``changed(name)`` on the event loop whenever the engine's device tier gains
        or loses ``name``, whoever loaded or evicted it (builtin: its pool's own loads and
        evictions); True when it will. False (the default): the engine tells nobody, and
        the reconcile's interval is how late the agent learns of its own loads."""
        return False

    async def busy(self) -> set[str]:
        """Adapters used by running or waiting requests, or (builtin) accepted requests
        about to use them (never evicted)."""
        return set()

    async def prefetch_turn(self) -> bool:
        """Wait until the engine has no request's load in flight and (builtin, at most its
        ``prefetch_compute_defer_ms``) computes nothing; True when it had to wait. Others
        answer False at once."""
        return False

    def load_order_stats(self) -> dict[str, dict[str, int] | int]:
        """An engine that orders its own loads (builtin): ``{"preemptions": {stage: n},
        "cancelled": {reason: n}, "compute_waits": {outcome: n}, "node_waits": n}`` of its
        prefetch loads so far; {} otherwise."""
        return {}

    async def needs_room(self, spec: Adapter) -> bool:
        """Loading `spec` now would make the engine evict on its own (a pool with limits of
        its own: builtin). False where the agent's device budgets are the engine's only
        limits (vLLM, SGLang): the agent then knows from its budgets alone."""
        return False

    def demand_loads(self) -> int:
        """Requests' loads the engine itself has queued or running (builtin: it loads on
        demand, the agent never sees those); 0 where the agent makes every load."""
        return 0

    def has_room(self, spec: Adapter) -> bool | None:
        """Loading `spec` now needs no eviction in an engine with its own pool (builtin);
        None where the agent's device budgets decide (or the engine cannot tell)."""
        return None

    async def engine_load(self) -> EngineLoad | None:
        """Running and waiting requests now; None when the engine does not report them.
        Raises ConnectorError (EngineUnavailable) when it could not be read: the caller,
        a background loop, then publishes the load as unknown. Named apart from `load`,
        which loads an adapter."""
        return None

    def in_host(self, name: str) -> bool:
        """The engine keeps its own host-memory copy of `name` (builtin)."""
        return False

    def pool_stats(self) -> dict[str, int]:
        """Pool gauges for /metrics (`pages_used`, `pages_free`, ...) where the engine has one."""
        return {}

    @property
    def url(self) -> str | None:
        """Where requests for this engine go (None for in-process without HTTP)."""
        return None


async def listed_adapters(client, engine: str, url: str) -> set[str]:
    """Adapters an OpenAI-style server lists in ``GET /v1/models`` (entries with a
    ``parent``: vLLM and SGLang both list an adapter with its base model as parent)."""
    import httpx

    try:
        resp = await client.get("/v1/models")
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"{engine} {url}/v1/models: {exc!r}") from exc
    if resp.status_code != 200:
        raise EngineUnavailable(f"{engine} /v1/models: HTTP {resp.status_code}")
    return {m["id"] for m in resp.json().get("data", []) if m.get("parent")}
