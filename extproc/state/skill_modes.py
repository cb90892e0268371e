"""The skills, their modes, and the one parser of skill settings (``validate_skills``).

A mode is ``"prod"`` or ``{"mode": "prod"}`` wherever skills are given: body
``skill_overrides``, ``/v1/execute``, the skills APIs and the state file. The state reads
it here; the order in which a request's mode is resolved is extproc.domain.skills'.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Any, Literal, Mapping, overload

from extproc.errors import InvalidField

__all__ = ["SKILLS", "MODES", "MULTI_LORA", "DYNAMIC_LORA_PREFETCH", "OFF", "SHADOW", "PROD", "validate_skills"]

MULTI_LORA = "multi_lora"
DYNAMIC_LORA_PREFETCH = "dynamic_lora_prefetch"
SKILLS = (MULTI_LORA, DYNAMIC_LORA_PREFETCH)
OFF, SHADOW, PROD = "off", "shadow", "prod"
MODES = (OFF, SHADOW, PROD)

_EMPTY: Mapping[str, str] = MappingProxyType({})


def _mode(raw: Any, param: str, skill: str) -> str:
    """One skill's mode, given as ``"prod"`` or as ``{"mode": "prod"}`` (the seeds' form)."""
    where = f"{param}.{skill}"
    if isinstance(raw, dict):
        for key in raw:
            if key != "mode":
                raise InvalidField(f"{where} takes only \"mode\", got {key!r}",
                                   param=f"{where}.{key}", code="invalid_skill_mode")
        if "mode" not in raw:
            raise InvalidField(f"{where}.mode is required (off|shadow|prod)",
                               param=f"{where}.mode", code="invalid_skill_mode")
        raw, where = raw["mode"], f"{where}.mode"
    if not isinstance(raw, str) or raw not in MODES:
        raise InvalidField(f"{where} must be one of off|shadow|prod, got {raw!r}",
                           param=where, code="invalid_skill_mode")
    return raw


@overload
def validate_skills(raw: Any, param: str, *, unset: Literal[False] = False) -> Mapping[str, str]: ...
@overload
def validate_skills(raw: Any, param: str, *, unset: Literal[True]) -> Mapping[str, str | None]: ...


def validate_skills(raw: Any, param: str, *, unset: bool = False) -> Mapping[str, str | None]:
    """Check ``{skill: mode}`` or ``{skill: {"mode": mode}}`` from a client or a file (422 on
    anything else, naming the field path) and return ``{skill: mode}``. The one parser of
    skill settings: body ``skill_overrides``, ``/v1/execute``, the skills APIs, the state
    file. ``unset=True`` (the skills APIs' writes): ``null`` is a value too, kept as
    ``None``: remove that skill's runtime setting."""
    if raw is None:
        return _EMPTY
    if not isinstance(raw, dict):
        raise InvalidField(f"{param} must be an object of skill: mode", param=param)
    out = {}
    for skill, mode in raw.items():
        if skill not in SKILLS:
            raise InvalidField(f"unknown skill {skill!r}; known: {', '.join(SKILLS)}",
                               param=f"{param}.{skill}", code="unknown_skill")
        out[skill] = None if unset and mode is None else _mode(mode, param, skill)
    return MappingProxyType(out)
