"""What the gateway knows about adapters, tenants and keys: plain immutable values.

The adapter entry is the one both sides use, ``ace_common.catalog.Adapter`` (the catalog
format of docs/contracts.md, parsed and checked by ``ace_common.catalog_schema``), named
here with the gateway's other entities. ``sha256`` is the digest of the adapter weights: it
is the cache key, so a changed adapter is a new key.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping

from ace_common.catalog import PUBLIC, Adapter
from extproc.errors import ConfigError

__all__ = ["Adapter", "Tenant", "DevKey", "Upstream", "PUBLIC", "FLAVOURS", "HINT_MODES", "ROLES",
           "DEVELOPER", "ADMIN", "KeyOrigin"]

FLAVOURS = ("builtin", "vllm", "sglang")
HINT_MODES = ("body", "headers", "off")
#: a key's role: a developer sets its own skills; a tenant admin also its tenant's defaults
#: and reads its tenant's keys (the settings page, docs/gateway.md)
DEVELOPER, ADMIN = "developer", "admin"
ROLES = (DEVELOPER, ADMIN)


@dataclass(frozen=True, slots=True)
class Tenant:
    id: str
    default_adapter: str | None = None
    skills: Mapping[str, str] = field(default_factory=dict)


class KeyOrigin(StrEnum):
    """Where a key was declared: the state file's ``keys:`` or the state database (issued
    with ``python -m extproc.admin create-key`` or the settings API)."""
    STATE_FILE = "state_file"
    DATABASE = "database"


@dataclass(frozen=True, slots=True)
class DevKey:
    """An API key, known only by the SHA-256 of its plaintext."""
    sha256: str
    tenant: str
    name: str = ""
    skills: Mapping[str, str] = field(default_factory=dict)
    role: str = DEVELOPER
    origin: KeyOrigin = KeyOrigin.STATE_FILE
    created_at: float | None = None     # epoch s; None: unknown (a state file key)
    expires_at: float | None = None     # epoch s; None: never

    @property
    def id(self) -> str:
        """What people call a key by (never the secret): the first 12 hex of its SHA-256."""
        return self.sha256[:12]

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


@dataclass(frozen=True, slots=True)
class Upstream:
    name: str
    address: str        # host:port, what Envoy's ORIGINAL_DST cluster connects to
    flavour: str        # builtin | vllm | sglang
    base_model: str
    hints: str = "body"  # body | headers | off
    agent: str | None = None
    allow_paths: frozenset[str] = frozenset()   # engine routes beyond the inference ones (extproc.state.paths)

    def __post_init__(self) -> None:
        if self.flavour not in FLAVOURS:
            raise ConfigError(f"upstream {self.name}: flavour must be one of {FLAVOURS}", field="flavour")
        if self.hints not in HINT_MODES:
            raise ConfigError(f"upstream {self.name}: hints must be one of {HINT_MODES}", field="hints")
        host, _, port = self.address.rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            host = ""
        if not host or not port.isdigit():
            # Envoy's ORIGINAL_DST cluster takes the destination header as is: no DNS.
            raise ConfigError(f"upstream {self.name}: address must be IP:port, got {self.address!r}",
                              field="address")

    @property
    def victim_grace_s(self) -> float:
        """How long an adapter a request was routed to here is nobody's hinted victim
        (``PrefetchSignal.spare_s``). vLLM and SGLang learn of a request only when it
        reaches them and list it as busy later still (vLLM's gauge is set once per engine
        step), and unloading the adapter of a request they have accepted fails it (vLLM
        0.32: 404, or its engine stops: docs/engine.md). 0.5 s there: several times the
        lead, the engine's accepting and a step on the CPU hosts measured (tens of ms);
        at 2 s most hinted victims on a 2-adapter vLLM cache were spared and the ace arm
        lost its hits (docs/bench-history.md). The builtin engine claims a request's adapter
        as it arrives and evicts no claimed one; one evicted just before costs a reload,
        not an error: 0."""
        return 0.0 if self.flavour == "builtin" else 0.5

    @property
    def victim_hints(self) -> int | None:
        """How many of this host's ranked victims (its pool model's, coldest first) a
        request's own load names (``PrefetchSignal.evict``); None: the whole ranking.
        Where just-routed adapters are spared (``victim_grace_s`` > 0: vLLM, SGLang) the
        sender drops them from the list (``spare_routed``), and two names often left none,
        so the agent chose by its own LRU, which knows no session's next step (33 of 105
        evictions in one ``make bench ENGINE=vllm`` ace arm; docs/bench-history.md): the
        whole ranking. Elsewhere (builtin, whose busy set is exact) the first two."""
        return None if self.victim_grace_s > 0 else 2
