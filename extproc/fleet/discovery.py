"""Where the engine hosts are: a source of endpoints, and the task that applies them.

``--discovery`` names the source (docs/gateway.md "Host discovery"):

- ``static``: the state file's ``upstreams:`` list (read once at start-up);
- ``dns:<name>:<port>``: the A/AAAA records of ``<name>`` (a Kubernetes headless
  Service), each ``IP:<port>``, resolved every ``--discovery-interval-s``;
- ``file:<path>``: a JSON list of ``"IP:port"`` strings (or ``{"address", "name"}``
  objects), re-read every ``--discovery-interval-s`` (for whatever writes a file);
- ``inferencepool:[<namespace>/]<name>``: the ready Pods an ``InferencePool`` selects, one
  endpoint per ``targetPorts`` entry, followed with the Kubernetes API's watch
  (``extproc.fleet.inferencepool``).

A source runs in a background thread and calls ``publish(endpoints)`` with the whole
current set whenever it changes. ``HostDiscovery`` turns that set into ``Upstream``
values with the ``--discovery-*`` template (flavour, base model, hints, agent port),
swaps the store's snapshot (the request path reads one reference, as ever: requests in
flight keep the snapshot they hold) and starts or stops the GPU agent links. A source
that fails keeps the last good set and logs once; it never touches the request path.
"""
from __future__ import annotations

import ipaddress
import json
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Protocol

from extproc.state.catalog import FLAVOURS, HINT_MODES, Upstream
from extproc.errors import AceError, ConfigError

__all__ = ["DiscoveryError", "Endpoint", "HostDiscovery", "HostSource", "PollingSource", "UpstreamTemplate",
           "dns_lookup", "file_lookup", "parse_discovery"]

log = logging.getLogger(__name__)

Publish = Callable[[frozenset["Endpoint"]], None]


class DiscoveryError(AceError):
    """A source could not read the current hosts this time (DNS, file, Kubernetes API)."""


@dataclass(frozen=True, order=True, slots=True)
class Endpoint:
    address: str        # IP:port ([IPv6]:port), what Envoy's ORIGINAL_DST cluster connects to
    name: str = ""      # the upstream's name (a pod's name); "" = the address

    @property
    def upstream_name(self) -> str:
        return self.name or self.address

    @property
    def ip(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")


def endpoint_address(ip: str, port: int) -> str:
    """``IP:port``, IPv6 in brackets."""
    return f"[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"{ip}:{port}"


@dataclass(frozen=True, slots=True)
class UpstreamTemplate:
    """What a discovered host is: the fields the state file would give each upstream.
    ``agent_port``: its GPU agent listens on the host's IP at this port (None: no agent)."""

    flavour: str = "vllm"
    base_model: str = ""
    hints: str = "body"
    agent_port: int | None = None

    def upstream(self, ep: Endpoint) -> Upstream:
        agent = endpoint_address(ep.ip, self.agent_port) if self.agent_port else None
        return Upstream(name=ep.upstream_name, address=ep.address, flavour=self.flavour,
                        base_model=self.base_model, hints=self.hints, agent=agent)


@dataclass(frozen=True, slots=True)
class DiscoverySpec:
    kind: str                 # static | dns | file | inferencepool
    name: str = ""            # dns: the name; file: the path; inferencepool: the pool
    port: int = 0             # dns: the engines' port
    namespace: str | None = None  # inferencepool: None = the gateway pod's own


def parse_discovery(spec: str) -> DiscoverySpec:
    """``static`` | ``dns:<name>:<port>`` | ``file:<path>`` | ``inferencepool:[<ns>/]<name>``."""
    kind, _, rest = spec.partition(":")
    if kind == "static" and not rest:
        return DiscoverySpec("static")
    if kind == "dns":
        name, _, port = rest.rpartition(":")
        if name and port.isdigit() and 0 < int(port) < 65536:
            return DiscoverySpec("dns", name, int(port))
    elif kind == "file" and rest:
        return DiscoverySpec("file", rest)
    elif kind == "inferencepool" and rest:
        ns, _, name = rest.rpartition("/")
        if name and "/" not in ns:
            return DiscoverySpec("inferencepool", name, namespace=ns or None)
    raise ConfigError(f"--discovery must be static, dns:<name>:<port>, file:<path> or "
                      f"inferencepool:[<namespace>/]<name>, got {spec!r}")


def check_template(t: UpstreamTemplate) -> None:
    if t.flavour not in FLAVOURS:
        raise ConfigError(f"--discovery-flavour must be one of {FLAVOURS}, got {t.flavour!r}")
    if t.hints not in HINT_MODES:
        raise ConfigError(f"--discovery-hints must be one of {HINT_MODES}, got {t.hints!r}")
    if not t.base_model:
        raise ConfigError("--discovery-base-model is required with a --discovery source other than static")
    if t.agent_port is not None and not 0 < t.agent_port < 65536:
        raise ConfigError(f"--discovery-agent-port must be a port, got {t.agent_port}")


# ---------- polled sources: DNS and file ----------

Resolver = Callable[..., list]


def dns_lookup(name: str, port: int, getaddrinfo: Resolver = socket.getaddrinfo
               ) -> Callable[[], frozenset[Endpoint]]:
    """The A and AAAA records of ``name``, each ``IP:port`` (a headless Service answers
    one record per ready pod). ``getaddrinfo``: injected by tests."""
    def lookup() -> frozenset[Endpoint]:
        try:
            infos = getaddrinfo(name, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:   # socket.gaierror is an OSError
            raise DiscoveryError(f"cannot resolve {name}: {exc}") from exc
        return frozenset(Endpoint(endpoint_address(info[4][0].partition("%")[0], port)) for info in infos)
    return lookup


def file_lookup(path: Path) -> Callable[[], frozenset[Endpoint]]:
    """A JSON list of ``"IP:port"`` or ``{"address": "IP:port", "name": ...}``."""
    def lookup() -> frozenset[Endpoint]:
        try:
            entries = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise DiscoveryError(f"cannot read {path}: {exc}") from exc
        if not isinstance(entries, list):
            raise DiscoveryError(f"{path}: a JSON list of endpoints expected")
        out = []
        for e in entries:
            if isinstance(e, str):
                out.append(Endpoint(e))
            elif isinstance(e, dict) and isinstance(e.get("address"), str):
                out.append(Endpoint(e["address"], str(e.get("name") or "")))
            else:
                raise DiscoveryError(f"{path}: not an endpoint: {e!r}")
        return frozenset(out)
    return lookup


class HostSource(Protocol):
    def start(self, publish: Publish) -> "HostSource": ...
    def close(self) -> None: ...


class PollingSource:
    """Calls ``lookup`` every ``interval_s`` in a background thread; publishes the set when
    it changes. A failed lookup keeps the last good set and is logged once (until a lookup
    succeeds again)."""

    def __init__(self, lookup: Callable[[], frozenset[Endpoint]], interval_s: float, what: str):
        self.lookup, self.interval_s, self.what = lookup, interval_s, what
        self.current: frozenset[Endpoint] | None = None
        self.failures = 0
        self._failing = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self, publish: Publish) -> None:
        """One lookup (the thread's step; tests call it directly)."""
        try:
            found = self.lookup()
        except DiscoveryError as exc:
            self.failures += 1
            if not self._failing:
                log.warning("discovery %s: %s; keeping the last %d hosts", self.what, exc,
                            len(self.current or ()))
            self._failing = True
            return
        if self._failing:
            log.info("discovery %s: answering again", self.what)
        self._failing = False
        if found != self.current:
            self.current = found
            publish(found)

    def start(self, publish: Publish) -> "PollingSource":
        def run() -> None:
            while True:
                self.poll(publish)
                if self._stop.wait(self.interval_s):
                    return
        self._thread = threading.Thread(target=run, name=f"discovery-{self.what}", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


# ---------- applying a set ----------

class HostDiscovery:
    """Applies each published set: the store's upstreams, then the agent links. Logs what
    came and went. ``link``: an ``AgentLink`` (or None: no agents)."""

    def __init__(self, store, template: UpstreamTemplate, link=None) -> None:
        self.store, self.template, self.link = store, template, link
        self._lock = threading.Lock()
        self.applied = 0

    def publish(self, endpoints: Iterable[Endpoint]) -> None:
        upstreams = []
        for ep in sorted(endpoints):
            try:
                upstreams.append(self.template.upstream(ep))
            except (ConfigError, ValueError) as exc:
                log.warning("discovery: skipping %s: %s", ep.address, exc)
        with self._lock:   # sources may publish from two threads (pool and pods)
            before = {u.name for u in self.store.snapshot.upstreams}
            self.store.set_upstreams(tuple(upstreams))
            if self.link is not None:
                self.link.set_agents({u.name: u.agent for u in upstreams if u.agent})
            self.applied += 1
        after = {u.name for u in upstreams}
        if before != after:
            log.info("discovery: %d hosts (added %s, removed %s)", len(after),
                     sorted(after - before) or "none", sorted(before - after) or "none")


def make_source(spec: str, interval_s: float = 5.0) -> HostSource | None:
    """The source ``--discovery`` names; None for ``static`` (the state file's list)."""
    parsed = parse_discovery(spec)
    if parsed.kind == "dns":
        return PollingSource(dns_lookup(parsed.name, parsed.port), interval_s, f"dns:{parsed.name}")
    if parsed.kind == "file":
        return PollingSource(file_lookup(Path(parsed.name)), interval_s, f"file:{parsed.name}")
    if parsed.kind == "inferencepool":
        from extproc.fleet.inferencepool import InferencePoolSource
        return InferencePoolSource(parsed.name, parsed.namespace)
    return None
