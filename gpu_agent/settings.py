"""The agent's one settings object: flags (`python -m gpu_agent serve --help`) and env.

Validated once at start-up; nothing reads configuration from module globals afterwards.
Secrets come from the environment or a file, never from a flag (flags show up in `ps`).
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

from gpu_agent.errors import AgentError

__all__ = ["AgentSettings", "SettingsError", "parse_args"]

ENGINES = ("builtin", "vllm", "sglang")
# The agent announces every measurement (gpu_agent.load.LOAD_HEARTBEAT_S = 0); the gateway
# forgets a host's load it has not heard about for 5 s and counts the requests it sent
# since the last measurement, so measuring less often than every 2 s would leave it with
# stale loads and long-running counts.
MAX_LOAD_INTERVAL_S = 2.0


class SettingsError(AgentError, ValueError):
    """A setting is missing or inconsistent (reported before anything starts). A
    ``ValueError`` too, as before it joined the agent's one hierarchy."""


def _f(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class AgentSettings:
    catalog: Path = _f(None, "catalog.yaml listing the adapters this agent may load (required)")
    engine: str = _f("builtin", "engine connector: builtin (in-process), vllm or sglang")
    engine_url: str = _f("", "base URL of the vLLM/SGLang server (vllm, sglang)")
    engine_host: str = _f("127.0.0.1", "builtin only: address the in-process engine's OpenAI HTTP API binds")
    engine_port: int = _f(0, "builtin only: port of the in-process engine's OpenAI HTTP API (0 = ephemeral)")
    engine_api_key_env: str = _f("", "name of the env var holding the engine's API key, if it has one")
    grpc_host: str = _f("127.0.0.1", "address the gRPC API binds")
    grpc_port: int = _f(50061, "gRPC API port (0 = ephemeral; the bound port is printed)")
    metrics_port: int = _f(0, "Prometheus /metrics port (0 = ephemeral, -1 = off)")
    cache_dir: Path = _f(Path("var/agent-cache"), "disk tier: verified copies of remote adapters, by digest")
    disk_budget_mb: int = _f(4096, "disk tier budget (MiB), LRU; 0 = resident-only: keep only the files of "
                                   "adapters on the device, loading or pinned (a file is dropped when its "
                                   "adapter leaves the builtin pool, at the next fetch with other engines): "
                                   "every re-load fetches and verifies again")
    host_budget_mb: int = _f(0, "agent host tier budget (MiB), LRU; 0 = off (vLLM/SGLang read files themselves)")
    engine_host_mb: int = _f(512, "builtin only: the engine's own host tier of parsed adapters (MiB), LRU; "
                                  "0 = none: a parsed adapter lives only for its load, so one that left "
                                  "the pool comes back from disk (or remote)")
    device_max_adapters: int = _f(0, "device tier count budget; 0 = the engine's (vLLM: --max-cpu-loras); "
                                    "builtin: the pool's adapter count, which the pool enforces on every load")
    device_budget_mb: int = _f(0, "device tier byte budget (MiB), vLLM/SGLang; 0 = none "
                                  "(builtin: the pool's bytes are --pool-mb)")
    max_cpu_loras: int = _f(4, "vllm: the engine's --max-cpu-loras, mirrored by the device tier")
    vllm_resolver: bool = _f(False, "vllm: the engine has a LoRA resolver (VLLM_PLUGINS=lora_filesystem_resolver) "
                                    "and registers a request's unregistered adapter itself; the agent then "
                                    "leaves a request's own load to it (the gateway's ingress signal only "
                                    "fetches the files ahead) and adopts what it registered. Off: the agent "
                                    "makes that load, since nothing else would")
    vllm_unload_evicts: bool = _f(False, "vllm: the engine loads ace's evicting plugin (VLLM_PLUGINS=...,ace_evict; "
                                         "tools/vllm_evict), so an unload drops the adapter from its CPU cache: the "
                                         "agent then evicts the victims the gateway names, before a load needs the "
                                         "room, and sends them as its cache's ranking (read by vLLM's own loads), instead "
                                         "of leaving the choice to vLLM's LRU. Checked on every unload: an answer "
                                         "without the plugin's mark turns it off, with an error logged")
    vllm_keep_registered: bool = _f(False, "vllm, with --vllm-unload-evicts (plugin 1.3): an evicted adapter keeps "
                                           "its registration and leaves vLLM's CPU cache only (its next request "
                                           "re-reads it, +0.9 ms, instead of the resolver's registration, +2.2 "
                                           "ms); the device tier is that cache. Not for adapters the agent "
                                           "registered from its disk cache of a remote store (unregistered as "
                                           "before); an engine whose plugin lacks the routes turns it off, with "
                                           "an error logged")
    max_loaded_loras: int = _f(0, "sglang: the engine's --max-loaded-loras (0 = no count limit)")
    queue_size: int = _f(64, "pending prefetches beyond which new ones are rejected")
    workers: int = _f(1, "concurrent background loads")
    prefetch_link_budget_ms: float = _f(200.0, "speculation budget: a prefetch hint that carries a probability is "
                                                 "refused (link_busy) while more than this much load work (ms, "
                                                 "expected from measured loads) is queued or running ahead of it")
    prefetch_waste_share: float | None = _f(None, "speculation budget: the share of a bet's load time charged "
                                                   "against it when it goes unused, as the time the engine's "
                                                   "compute loses to the load (0-1); default: the engine's "
                                                   "(vLLM/SGLang 1: a load stops their steps; builtin: 1 on "
                                                   "the CPU, where loads take the forward's cores, 0 on "
                                                   "CUDA, where they run on a side stream)")
    gil_switch_ms: float = _f(0.5, "how long one thread may hold the GIL while another waits for it "
                                   "(sys.setswitchinterval): the builtin engine's forward, its loads and the "
                                   "agent's loop share one process, and at Python's default (5 ms) a forward "
                                   "step could wait that long behind a load's parsing; 0: Python's default")
    reconcile_interval_s: float = _f(2.0, "how often the engine's adapter list is compared with ours")
    load_interval_s: float = _f(0.5, "how often the engine's load (running + waiting requests: vLLM/SGLang "
                                     "from GET /metrics, builtin from its batcher) is measured and sent on "
                                     "WatchResidency (every measurement) for the gateway's routing "
                                     f"(seconds, at most {MAX_LOAD_INTERVAL_S:g}); 0 = off: the load stays unknown")
    auth: str = _f("token", "gRPC auth: token (shared token in metadata), mtls, or none")
    token_env: str = _f("ACE_AGENT_TOKEN", "env var holding the shared token (auth=token)")
    token_file: Path | None = _f(None, "file holding the shared token (auth=token; wins over env)")
    tls_cert: Path | None = _f(None, "server certificate, PEM (auth=mtls)")
    tls_key: Path | None = _f(None, "server private key, PEM (auth=mtls)")
    tls_client_ca: Path | None = _f(None, "CA that signs client certificates, PEM (auth=mtls)")
    pool_mb: int = _f(64, "builtin only: bytes of the paged adapter pool (MiB)")
    prefetch_compute_defer_ms: float = _f(1000.0, "builtin only: a prefetch load waits while the engine has a "
                                                 "request accepted, queued or running, for at most this "
                                                 "long in all, then goes on (yielding to requests' loads "
                                                 "only); 0 = never waits for compute (the engine's "
                                                 "--prefetch-compute-defer-ms)")
    prefetch_node_cpu: bool = _f(True, "builtin only: a prefetch load also waits (at most 100 ms) while every "
                                       "core of the node runs another task, such as the engines beside this "
                                       "one (the engine's prefetch_node_cpu; docs/engine.md)")
    log_level: str = _f("INFO", "logging level")

    def token(self) -> str:
        if self.token_file is not None:
            return self.token_file.read_text().strip()
        return os.environ.get(self.token_env, "").strip()


    def validate(self) -> "AgentSettings":
        if self.catalog is None or not Path(self.catalog).is_file():
            raise SettingsError(f"--catalog must name an existing catalog.yaml (got {self.catalog})")
        if self.engine not in ENGINES:
            raise SettingsError(f"--engine must be one of {', '.join(ENGINES)}")
        if self.engine in ("vllm", "sglang") and not self.engine_url.startswith(("http://", "https://")):
            raise SettingsError(f"--engine-url (http[s]://host:port) is required for {self.engine}")
        if self.auth not in ("token", "mtls", "none"):
            raise SettingsError("--auth must be token, mtls or none")
        if self.auth == "token" and not self.token():
            raise SettingsError(f"auth=token needs a token in ${self.token_env} or --token-file")
        if self.auth == "mtls" and not (self.tls_cert and self.tls_key and self.tls_client_ca):
            raise SettingsError("auth=mtls needs --tls-cert, --tls-key and --tls-client-ca")
        for flag, value in (("--disk-budget-mb", self.disk_budget_mb), ("--host-budget-mb", self.host_budget_mb),
                            ("--engine-host-mb", self.engine_host_mb), ("--device-budget-mb", self.device_budget_mb)):
            if value < 0:
                raise SettingsError(f"{flag} must be >= 0")
        if self.pool_mb < 1:
            raise SettingsError("--pool-mb must be >= 1")
        if not self.prefetch_compute_defer_ms >= 0:
            raise SettingsError("--prefetch-compute-defer-ms must be >= 0")
        if self.engine == "builtin" and self.device_budget_mb:
            raise SettingsError("--device-budget-mb: the builtin engine's device tier is its pool; size it "
                                "with --pool-mb (and --device-max-adapters for a count)")
        if self.vllm_keep_registered and not (self.engine == "vllm" and self.vllm_unload_evicts):
            raise SettingsError("--vllm-keep-registered needs --engine vllm and --vllm-unload-evicts (ace's evicting "
                                "plugin, version 1.3, in vLLM: docs/engine.md)")
        if self.device_max_adapters < 0:
            raise SettingsError("--device-max-adapters must be >= 0 (0 = the engine's)")
        if not 0 <= self.load_interval_s <= MAX_LOAD_INTERVAL_S:
            raise SettingsError(f"--load-interval-s must be between 0 (off) and {MAX_LOAD_INTERVAL_S:g} "
                                "(the gateway forgets a load it has not heard about for 5 s)")
        if self.prefetch_link_budget_ms < 0:
            raise SettingsError("--prefetch-link-budget-ms must be >= 0")
        if self.prefetch_waste_share is not None and not 0 <= self.prefetch_waste_share <= 1:
            raise SettingsError("--prefetch-waste-share must be between 0 and 1")
        if not 0 <= self.gil_switch_ms <= 100:
            raise SettingsError("--gil-switch-ms must be between 0 (Python's default) and 100")
        if self.queue_size < 1 or self.workers < 1:
            raise SettingsError("--queue-size and --workers must be >= 1")
        return self


def parse_args(argv: Sequence[str] | None = None) -> AgentSettings:
    parser = argparse.ArgumentParser(prog="python -m gpu_agent serve",
                                     description="GPU agent: adapter residency and prefetch API")
    for f in fields(AgentSettings):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=f.metadata["help"])
            continue
        kind = {int: int, float: float, str: str}.get(
            type(f.default), Path if "Path" in str(f.type) else float if "float" in str(f.type) else str)
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default, help=f.metadata["help"])
    ns = parser.parse_args(argv)
    return AgentSettings(**vars(ns)).validate()
