"""The gateway's state file (docs/gateway.md "State file"), as a typed schema.

Checked with the project's one schema language (``ace_common.catalog_schema.parse``): its
``adapters`` entries are the catalog's own ``CatalogAdapter``. What the schema cannot say
(a key's tenant exists, a hash is 64 hex digits, skill names and modes) ``extproc.state.store``
checks next, with the same field paths. Every problem is a ``ConfigError`` whose
``field`` is the path, e.g. ``tenants[1].id: required field missing``.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from extproc.state.catalog import DEVELOPER, FLAVOURS, HINT_MODES, ROLES
from extproc.errors import ConfigError
from ace_common.catalog_schema import (CatalogAdapter, CatalogBaseModel, CatalogFile, SchemaError, parse,
                                      read_catalog_file, read_yaml_mapping)

__all__ = ["KeyEntry", "Limits", "StateFile", "TenantEntry", "UpstreamEntry", "config_error", "read_catalog",
           "read_state"]

DEFAULT_MAX_BODY_BYTES = 1 << 20
_NO_SKILLS: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class TenantEntry:
    id: str
    default_adapter: str | None = None
    skills: Mapping[str, str] = field(default_factory=lambda: _NO_SKILLS)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    sha256: str                       # hex SHA-256 of the key, never the key
    tenant: str
    name: str = ""
    skills: Mapping[str, str] = field(default_factory=lambda: _NO_SKILLS)
    role: Literal[ROLES] = DEVELOPER  # admin: also its tenant's default skills (settings page)


@dataclass(frozen=True, slots=True)
class UpstreamEntry:
    name: str
    address: str                      # IP:port
    flavour: Literal[FLAVOURS]
    base_model: str
    hints: Literal[HINT_MODES] = "body"
    agent: str | None = None          # host:port of its GPU agent
    allow_paths: tuple[str, ...] = ()  # engine routes beyond the inference ones (e.g. /tokenize)


@dataclass(frozen=True, slots=True)
class Limits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


@dataclass(frozen=True, slots=True)
class StateFile:
    upstreams: tuple[UpstreamEntry, ...] = ()   # required unless --discovery gives them
    include: str | tuple[str, ...] = ()
    base_model: CatalogBaseModel | str | None = None
    adapters: tuple[CatalogAdapter, ...] = ()
    tenants: tuple[TenantEntry, ...] = ()
    keys: tuple[KeyEntry, ...] = ()
    skills: Mapping[str, str] = field(default_factory=lambda: _NO_SKILLS)
    limits: Limits = field(default_factory=Limits)
    #: GET /v1/models without a key lists the base models and the public adapters
    #: (docs/gateway.md, "Routes": off by default, read its risk there)
    public_model_list: bool = False

    @property
    def includes(self) -> tuple[str, ...]:
        return (self.include,) if isinstance(self.include, str) else self.include


def config_error(source: Path, field: str, problem: str) -> ConfigError:
    """``<file>: <field path>: <problem>``, the one shape of every state/catalog error."""
    return ConfigError(str(SchemaError(field, problem, source)), field=field or None)


def _config_error(exc: SchemaError, source: Path) -> ConfigError:
    return config_error(source, exc.field, exc.problem)


def read_state(path: Path) -> StateFile:
    """The state file at ``path``, checked against the schema."""
    try:
        return parse(StateFile, read_yaml_mapping(path))
    except SchemaError as exc:
        raise _config_error(exc, path) from None


def read_catalog(path: Path) -> CatalogFile:
    """A catalog the state file includes (or ``--catalog``), checked against the schema."""
    try:
        return read_catalog_file(path)
    except SchemaError as exc:
        raise _config_error(exc, path) from None
