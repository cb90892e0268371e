"""The ext_proc service's settings: one object, from flags, environment, a file or defaults.

Every field can be set with ``--flag``, ``ACE_EXTPROC_<FIELD>`` or a key of the YAML
file given with ``--settings`` (in that order of precedence); each has help text
(``python -m extproc --help``). Validated once at start-up.
"""
from __future__ import annotations

import argparse
import os
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

from extproc.fleet.discovery import UpstreamTemplate, check_template, parse_discovery
from extproc.errors import ConfigError

__all__ = ["AgentTLS", "Settings"]

HEALTH_PORT = 9003   # extproc.transport.health_port.DEFAULT_PORT (not imported: it pulls in grpc)

_HELP = {
    "config": "state YAML (GitOps): adapters/include, tenants, keys, upstreams, skills, limits",
    "config_poll_s": "seconds between checks of the state file (and the catalogs it includes) for a change "
                     "(its mtime, size, inode and symlink target, so a ConfigMap's ..data swap is seen); a "
                     "valid change is applied without a restart, an invalid one refused, logged and counted "
                     "(docs/gateway.md \"Reloading the state file\"). 0: no polling (SIGHUP still reloads)",
    "catalog": "extra adapter catalog YAML in the docs/contracts.md format (optional)",
    "db": "SQLite file for runtime changes (dev-key skills, revoked keys) on one node; "
          "survives restarts. With --database-url only the learned request counts beside it "
          "(<db>.popularity.json) use its path",
    "database_url": "postgresql://user:password@host:port/db: the runtime changes shared by "
                    "several gateway replicas (docs/gateway.md, \"Shared state\"); instead of --db",
    "listen": "host:port the gRPC ext_proc + health service binds",
    "metrics_listen": "host:port of the Prometheus GET /metrics server (its own port, off the "
                      "request path; port 0: any free port, logged at start-up), or off",
    "workers": "gRPC worker threads; each in-flight HTTP request holds one stream",
    "routing_policy": "module:function choosing the upstream (default extproc.policy.routing:choose_upstream with one upstream, extproc.policy.routing:route with several)",
    "prefetch_queue": "bound of the out-of-band prefetch signal queue",
    "startup_fill": "on: with nothing learned (no <db>.popularity.json), each GPU agent's empty pool is "
                    "offered, once, the adapters routing places on its host, loaded only into free room "
                    "(docs/prediction.md, \"Warm set and restart\"); off: pools fill on demand only",
    "prefetch_hold_s": "a speculative prefetch planned on a request whose own adapter is being loaded "
                       "waits for that load to land on its host (the residency stream says so), at most "
                       "this many seconds, so it never competes with the load a request waits for "
                       "(docs/prediction.md, \"Bets wait for the demand load\"); 0: sent at once",
    "prediction_context_steps": "prediction also counts, per tenant, a session's distinct adapters so far "
                                "-> its next one, for sessions of up to this many steps (docs/prediction.md, "
                                "\"Prediction\"); 0: only the last two steps",
    "prediction_smoothing": "prediction weighs a tenant's transition rows seen fewer than twice against the "
                            "coarser rows (all tenants'), with this weight (docs/prediction.md, \"Prediction\"); "
                            "0: such rows are ignored until seen twice",
    "log_level": "logging level (DEBUG, INFO, WARNING, ...)",
    "server": "gRPC server flavour: h2 (default: gRPC on a bare asyncio HTTP/2 loop, fewest "
              "syscalls, see docs/gateway.md), aio (grpc.aio) or threads (grpc thread pool)",
    "h2_max_streams": "--server h2: open streams allowed per connection (advertised as "
                      "SETTINGS_MAX_CONCURRENT_STREAMS; more are refused with REFUSED_STREAM). "
                      "Envoy opens one stream per request in flight and another connection when one is full",
    "agent_tls_ca": "TLS towards the GPU agents: CA that signed their server certificates, PEM "
                    "(agents started with --auth mtls; without it the system roots are used)",
    "agent_tls_cert": "TLS towards the GPU agents: this gateway's client certificate, PEM "
                      "(with --agent-tls-key; an agent with --auth mtls requires it)",
    "agent_tls_key": "TLS towards the GPU agents: the client certificate's private key, PEM",
    "protocol": "ext_proc protocol: ace (ace's own Envoy config, envoy/) or epp (the Gateway API "
                "Inference Extension's endpoint picker protocol, docs/epp.md)",
    "secure_serving": "TLS on the ext_proc port: auto (on with --protocol epp, off with ace), true, false",
    "tls_cert": "TLS on the ext_proc port: certificate PEM (default: a self-signed one made at start-up)",
    "tls_key": "TLS on the ext_proc port: the certificate's private key PEM",
    "shed_load": "--protocol epp: answer 429 when every eligible host carries this many requests "
                 "(its agent's load + requests sent since); 0: never shed",
    "epp_fallbacks": "--protocol epp: fallback endpoints after the pick, in routing order (the gateway "
                     "tries them in turn; Envoy's ORIGINAL_DST reads only one address: keep 0 there)",
    "agent_tls_server_name": "TLS towards the GPU agents: the name their certificates are checked "
                             "against, when not the host of the upstream's agent: address",
    "discovery": "where the engine hosts come from (docs/gateway.md \"Host discovery\"): static (the "
                 "state file's upstreams), dns:<name>:<port> (a headless Service's A/AAAA records), "
                 "file:<path> (a JSON list of IP:port) or inferencepool:[<namespace>/]<name> (the "
                 "ready Pods of an InferencePool, Kubernetes API watch; needs the kubernetes extra)",
    "discovery_interval_s": "dns: and file: discovery: seconds between lookups",
    "discovery_flavour": "discovered hosts: the engine flavour (vllm, sglang or builtin)",
    "discovery_base_model": "discovered hosts: the base model they serve (required unless static)",
    "discovery_hints": "discovered hosts: how adapter hints are sent (body, headers or off)",
    "discovery_agent_port": "discovered hosts: the port of each host's GPU agent, on the host's IP "
                            "(0: no agents)",
    "health_listen": "host:port of a plaintext grpc.health.v1 port beside the ext_proc port, for "
                     "the kubelet's grpc probes (services liveness, readiness; docs/epp.md \"The plaintext health port\"), "
                     "or off; auto: off with --protocol ace, --listen's host and port 9003 with epp",
    "drain_handover_s": "SIGTERM: seconds to go on serving (health NOT_SERVING) until a successor "
                        "listens on --listen's port, before the drain; ends early when one does or "
                        "no connection is open (extproc/transport/handover.py); 0: drain at once",
    "gil_switch_ms": "how long another thread may hold the GIL before the request path gets it back "
                     "(sys.setswitchinterval): the speculation thread's steps and saves are pure Python, and "
                     "at Python's default (5 ms) every socket read or write of a request in flight could wait "
                     "that long behind them (docs/gateway.md, \"The request path and the speculation "
                     "thread\"). Set only where the speculation thread runs (upstreams with agents): alone, the request "
                     "path switches for nothing, and 0.5 ms cost about 5 percent of the throughput at c=8 in make "
                     "bench-gateway; 0: Python's default",
}


@dataclass(frozen=True)
class AgentTLS:
    """TLS (mTLS with a client certificate) towards the agents: the CA that signed their
    certificates (None: the system roots), our certificate and key, and the name to check
    their certificates against when it is not the address's host."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    server_name: str | None = None


@dataclass(frozen=True)
class Settings:
    config: Path
    catalog: Path | None = None
    config_poll_s: float = 1.0
    db: Path = Path("ace-gateway.sqlite3")
    database_url: str | None = None
    listen: str = "127.0.0.1:50051"
    metrics_listen: str = "127.0.0.1:9464"
    workers: int = 32
    routing_policy: str | None = None
    prefetch_queue: int = 1024
    startup_fill: str = "on"
    prefetch_hold_s: float = 0.5    # extproc.fleet.speculation.HOLD_S (not imported: it pulls in the planner)
    prediction_context_steps: int = 12  # extproc.policy.speculator.SpeculationSettings.context_steps
    prediction_smoothing: float = 1.0  # extproc.policy.speculator.SpeculationSettings.smoothing
    log_level: str = "INFO"
    server: str = "h2"
    h2_max_streams: int = 4096      # extproc.transport.h2server.MAX_STREAMS (not imported: it pulls in grpc)
    agent_tls_ca: Path | None = None
    agent_tls_cert: Path | None = None
    agent_tls_key: Path | None = None
    agent_tls_server_name: str | None = None
    protocol: str = "ace"
    secure_serving: str = "auto"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    shed_load: int = 0
    epp_fallbacks: int = 0
    discovery: str = "static"
    discovery_interval_s: float = 5.0
    discovery_flavour: str = "vllm"
    discovery_base_model: str | None = None
    discovery_hints: str = "body"
    discovery_agent_port: int = 0
    health_listen: str = "auto"
    drain_handover_s: float = 10.0
    gil_switch_ms: float = 0.5

    def __post_init__(self) -> None:
        if not Path(self.config).is_file():
            raise ConfigError(f"--config {self.config}: no such file")
        if self.catalog is not None and not Path(self.catalog).is_file():
            raise ConfigError(f"--catalog {self.catalog}: no such file")
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"--listen must be host:port, got {self.listen!r}")
        if self.metrics_listen != "off":
            host, _, port = self.metrics_listen.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"--metrics-listen must be host:port or off, got {self.metrics_listen!r}")
        if self.database_url is not None and not self.database_url.startswith(("postgresql://", "postgres://")):
            raise ConfigError("--database-url must be a postgresql:// URL")
        if self.server not in ("aio", "threads", "h2"):
            raise ConfigError(f"--server must be aio, threads or h2, got {self.server!r}")
        if self.startup_fill not in ("on", "off"):
            raise ConfigError(f"--startup-fill must be on or off, got {self.startup_fill!r}")
        if not 0 <= self.prefetch_hold_s <= 60:   # NaN fails both comparisons
            raise ConfigError(f"--prefetch-hold-s must be in 0..60 seconds, got {self.prefetch_hold_s!r}")
        if not 0 <= self.prediction_context_steps <= 64:
            raise ConfigError(f"--prediction-context-steps must be in 0..64, got {self.prediction_context_steps}")
        if not 0 <= self.prediction_smoothing <= 100:
            raise ConfigError(f"--prediction-smoothing must be in 0..100, got {self.prediction_smoothing}")
        if self.workers < 1 or self.prefetch_queue < 1:
            raise ConfigError("--workers and --prefetch-queue must be positive")
        if not 1 <= self.h2_max_streams <= (1 << 31) - 1:
            raise ConfigError(f"--h2-max-streams must be in 1..2^31-1, got {self.h2_max_streams}")
        for name in ("agent_tls_ca", "agent_tls_cert", "agent_tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file")
        if (self.agent_tls_cert is None) != (self.agent_tls_key is None):
            raise ConfigError("--agent-tls-cert and --agent-tls-key go together")
        if self.protocol not in ("ace", "epp"):
            raise ConfigError(f"--protocol must be ace or epp, got {self.protocol!r}")
        if self.secure_serving not in ("auto", "true", "false"):
            raise ConfigError(f"--secure-serving must be auto, true or false, got {self.secure_serving!r}")
        for name in ("tls_cert", "tls_key"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"--{name.replace('_', '-')} {path}: no such file")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.shed_load < 0 or self.epp_fallbacks < 0:
            raise ConfigError("--shed-load and --epp-fallbacks must be 0 or more")
        if self.agent_tls_server_name and self.agent_tls() is None:
            raise ConfigError("--agent-tls-server-name needs --agent-tls-ca or --agent-tls-cert")
        if parse_discovery(self.discovery).kind != "static":
            check_template(self.upstream_template())
        if not 0 <= self.drain_handover_s <= 3600:
            raise ConfigError(f"--drain-handover-s must be in 0..3600, got {self.drain_handover_s}")
        if self.health_listen not in ("auto", "off"):
            host, _, port = self.health_listen.rpartition(":")
            if not host or not port.isdigit() or int(port) > 65535:
                raise ConfigError(f"--health-listen must be host:port, auto or off, got {self.health_listen!r}")
        if self.health_address == self.listen:
            raise ConfigError(f"--health-listen {self.health_address} is --listen's address: "
                              "give it another port, or off")
        if not 0 <= self.gil_switch_ms <= 100:
            raise ConfigError(f"--gil-switch-ms must be in 0..100 (0: Python's default), got {self.gil_switch_ms}")
        if not self.config_poll_s >= 0:
            raise ConfigError(f"--config-poll-s must be 0 (off) or positive, got {self.config_poll_s}")
        if not self.discovery_interval_s > 0:
            raise ConfigError(f"--discovery-interval-s must be positive, got {self.discovery_interval_s}")

    @property
    def discovers(self) -> bool:
        """True when a discovery source, not the state file, gives the upstreams."""
        return parse_discovery(self.discovery).kind != "static"

    def upstream_template(self) -> UpstreamTemplate:
        return UpstreamTemplate(flavour=self.discovery_flavour, base_model=self.discovery_base_model or "",
                                hints=self.discovery_hints, agent_port=self.discovery_agent_port or None)

    @property
    def serves_tls(self) -> bool:
        """Whether the ext_proc port speaks TLS (``--secure-serving``; auto: with epp)."""
        if self.secure_serving == "auto":
            return self.protocol == "epp"
        return self.secure_serving == "true"

    @property
    def health_address(self) -> str | None:
        """Where the plaintext health port binds (``--health-listen``), or None: off."""
        if self.health_listen == "auto":
            return f"{self.listen.rpartition(':')[0]}:{HEALTH_PORT}" if self.protocol == "epp" else None
        return None if self.health_listen == "off" else self.health_listen

    def agent_tls(self) -> AgentTLS | None:
        """TLS towards the agents, or None (plaintext) when no agent TLS file is set."""
        if self.agent_tls_ca is None and self.agent_tls_cert is None:
            return None
        return AgentTLS(self.agent_tls_ca, self.agent_tls_cert, self.agent_tls_key,
                        self.agent_tls_server_name or None)

    def state_db(self) -> Path | str:
        """What ``extproc.state.store.Store`` opens: the PostgreSQL URL when set, else the SQLite file."""
        return self.database_url or self.db

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> "Settings":
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--settings", type=Path)
        known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
        from_file = _read_settings_file(known.settings) if known.settings else {}
        parser = argparse.ArgumentParser(prog="python -m extproc", description=__doc__)
        parser.add_argument("--settings", type=Path,
                            help="YAML file of settings (keys as the flags, with _ for -)")
        for f in fields(cls):
            env = os.environ.get(f"ACE_EXTPROC_{f.name.upper()}")
            default = env if env is not None else from_file.get(
                f.name, None if f.default is MISSING else f.default)
            required = f.name == "config" and default is None
            parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=default,
                                required=required, help=_HELP[f.name])
        ns = vars(parser.parse_args(argv))
        ns.pop("settings")
        try:
            return cls(config=Path(ns["config"]),
                       catalog=Path(ns["catalog"]) if ns["catalog"] else None,
                       config_poll_s=float(ns["config_poll_s"]),
                       db=Path(ns["db"]), database_url=ns["database_url"] or None, listen=str(ns["listen"]),
                       metrics_listen=str(ns["metrics_listen"]), workers=int(ns["workers"]),
                       routing_policy=ns["routing_policy"] or None,
                       prefetch_queue=int(ns["prefetch_queue"]), startup_fill=str(ns["startup_fill"]).lower(),
                       prefetch_hold_s=float(ns["prefetch_hold_s"]),
                       prediction_context_steps=int(ns["prediction_context_steps"]),
                       prediction_smoothing=float(ns["prediction_smoothing"]),
                       log_level=str(ns["log_level"]),
                       server=str(ns["server"]), h2_max_streams=int(ns["h2_max_streams"]),
                       **{name: Path(ns[name]) if ns[name] else None
                          for name in ("agent_tls_ca", "agent_tls_cert", "agent_tls_key")},
                       agent_tls_server_name=ns["agent_tls_server_name"] or None,
                       protocol=str(ns["protocol"]), secure_serving=str(ns["secure_serving"]).lower(),
                       tls_cert=Path(ns["tls_cert"]) if ns["tls_cert"] else None,
                       tls_key=Path(ns["tls_key"]) if ns["tls_key"] else None,
                       shed_load=int(ns["shed_load"]), epp_fallbacks=int(ns["epp_fallbacks"]),
                       discovery=str(ns["discovery"]), discovery_interval_s=float(ns["discovery_interval_s"]),
                       discovery_flavour=str(ns["discovery_flavour"]),
                       discovery_base_model=ns["discovery_base_model"] or None,
                       discovery_hints=str(ns["discovery_hints"]),
                       discovery_agent_port=int(ns["discovery_agent_port"] or 0),
                       health_listen=str(ns["health_listen"]).lower(),
                       drain_handover_s=float(ns["drain_handover_s"]),
                       gil_switch_ms=float(ns["gil_switch_ms"]))
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc


def _read_settings_file(path: Path) -> dict:
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--settings {path}: {exc}") from exc
    names = {f.name for f in fields(Settings)}
    if not isinstance(data, dict) or not set(data) <= names:
        raise ConfigError(f"--settings {path}: a mapping with keys among {sorted(names)}")
    return data

