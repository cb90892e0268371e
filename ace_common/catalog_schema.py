"""The adapter catalog's format (docs/contracts.md), and the one typed schema language
the project's YAML files are checked with.

A schema is a frozen dataclass; ``parse(Schema, raw)`` builds it from what ``yaml``
read, checking every field against its annotation (``str``, ``int``, ``float``, ``bool``,
``Literal[...]``, ``X | None``, ``tuple[X, ...]``, ``Mapping[str, X]``, another schema).
A field without a default is required; a key the schema does not name is refused.
Every problem is a ``SchemaError`` naming the field's path::

    adapters[0].rank: expected an integer, got 'x'
    tenants[1].id: required field missing

The catalog is read by the gateway (``extproc.state.store``), the agent
(``gpu_agent.artifacts``) and the builtin engine (``gpu_agent.engine.adapters``), all
through ``read_catalog_file``, and each holds the entry as ``ace_common.catalog.Adapter``
(resolved: ``Adapter.from_entry``); the gateway's state file (``extproc.state.schema``) uses
the same language. It lives in the shared vocabulary (``ace_common``, which imports neither deployable),
with no dependency but ``yaml``; each side turns ``SchemaError`` into its own error at its
boundary (``ConfigError``, ``CatalogError``).
"""
from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from ace_common.errors import CommonError

__all__ = ["CatalogAdapter", "CatalogBaseModel", "CatalogFile", "SchemaError", "parse", "read_catalog_file",
           "read_yaml_mapping"]

T = TypeVar("T")


class SchemaError(CommonError, ValueError):
    """A YAML file does not match its schema: ``field`` is the path (``keys[2].tenant``),
    ``source`` the file when known. A ``ValueError`` too: the gateway and the engine's
    catalog reader catch it as one."""

    def __init__(self, field: str, problem: str, source: str | Path | None = None):
        super().__init__(": ".join(str(part) for part in (source, field, problem) if part))
        self.field, self.problem, self.source = field, problem, source

    def in_file(self, source: str | Path) -> "SchemaError":
        return SchemaError(self.field, self.problem, source)


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _show(raw: Any) -> str:
    if isinstance(raw, bool):  # YAML 1.1 reads bare yes/no/on/off as booleans
        return f"{raw} (YAML reads a bare yes/no/on/off as a boolean: quote it)"
    if isinstance(raw, dict):
        return "a mapping"
    if isinstance(raw, list):
        return "a list"
    return repr(raw)


_SCALARS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _describe(tp: Any) -> str:
    if tp in _SCALARS:
        return _SCALARS[tp]
    if get_origin(tp) is tuple:
        return "a list"
    return "a mapping"


def _value(tp: Any, raw: Any, where: str) -> Any:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        choices = [a for a in args if a is not type(None)]
        for choice in choices:  # the alternative whose shape the value has
            if _shape_fits(choice, raw):
                return _value(choice, raw, where)
        if len(choices) == 1:
            return _value(choices[0], raw, where)
        raise SchemaError(where, f"expected {' or '.join(map(_describe, choices))}, got {_show(raw)}")
    if origin is Literal:
        if isinstance(raw, str) and raw in args:
            return raw
        raise SchemaError(where, f"expected one of {', '.join(args)}, got {_show(raw)}")
    if origin is tuple:
        if not isinstance(raw, list):
            raise SchemaError(where, f"expected a list, got {_show(raw)}")
        return tuple(_value(args[0], item, f"{where}[{i}]") for i, item in enumerate(raw))
    if origin is Mapping:
        if not isinstance(raw, dict):
            raise SchemaError(where, f"expected a mapping, got {_show(raw)}")
        out = {}
        for key, item in raw.items():
            out[_value(args[0], key, where)] = _value(args[1], item, _join(where, str(key)))
        return types.MappingProxyType(out)
    if dataclasses.is_dataclass(tp):
        return parse(tp, raw, where)
    if tp in _SCALARS and _shape_fits(tp, raw):
        return float(raw) if tp is float else raw
    raise SchemaError(where, f"expected {_describe(tp)}, got {_show(raw)}")


def _shape_fits(tp: Any, raw: Any) -> bool:
    """Whether ``raw`` has the shape of ``tp`` (picks the alternative of a union)."""
    if dataclasses.is_dataclass(tp) or get_origin(tp) is Mapping:
        return isinstance(raw, dict)
    if get_origin(tp) is tuple:
        return isinstance(raw, list)
    if isinstance(raw, bool):
        return tp is bool
    return isinstance(raw, {str: str, int: int, float: (int, float)}.get(tp, ()))


def parse(schema: type[T], raw: Any, where: str = "") -> T:
    """``schema`` (a dataclass) built from ``raw``, every field checked; ``SchemaError`` if not.

    A field that is absent or null takes its default; without a default it is required."""
    if not isinstance(raw, dict):
        raise SchemaError(where, f"expected a mapping, got {_show(raw)}")
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in raw:
        if key not in fields:
            raise SchemaError(_join(where, str(key)), f"unknown field (known: {', '.join(fields)})")
    hints = get_type_hints(schema)
    values = {}
    for name, f in fields.items():
        path = _join(where, name)
        if raw.get(name) is None:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError(path, "required field missing")
            continue
        values[name] = _value(hints[name], raw[name], path)
    return schema(**values)


def read_yaml_mapping(path: Path) -> Any:
    """What ``yaml`` reads from ``path`` (an empty file is ``{}``); ``SchemaError`` if it cannot."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SchemaError("", f"cannot read it: {exc}", path) from exc
    return {} if data is None else data


@dataclasses.dataclass(frozen=True, slots=True)
class CatalogBaseModel:
    name: str
    path: str | None = None           # the model directory, relative to the catalog file


@dataclasses.dataclass(frozen=True, slots=True)
class CatalogAdapter:
    name: str
    uri: str                          # relative path, file:// or http(s):// URL of the directory
    rank: int
    base_model: str | None = None     # None: the file's base_model
    sha256: str | None = None         # hex digest of adapter_model.safetensors (the agent requires it)
    alpha: float | None = None
    target_modules: tuple[str, ...] = ()
    size_bytes: int = 0
    owner: str = "public"             # a tenant id or public
    domain: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class CatalogFile:
    base_model: CatalogBaseModel | str
    adapters: tuple[CatalogAdapter, ...] = ()

    @property
    def base_model_name(self) -> str:
        return self.base_model if isinstance(self.base_model, str) else self.base_model.name

    def base_model_of(self, adapter: CatalogAdapter) -> str:
        return adapter.base_model or self.base_model_name


def read_catalog_file(path: str | Path) -> CatalogFile:
    """The catalog at ``path``, checked; ``SchemaError`` names the file and the field."""
    raw = read_yaml_mapping(Path(path))
    try:
        return parse(CatalogFile, raw)
    except SchemaError as exc:
        raise exc.in_file(path) from None
