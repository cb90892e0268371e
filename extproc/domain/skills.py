"""The order in which a request's skill modes are resolved (the skills, their modes and
their parser: extproc.state.skill_modes).

Resolution, first that sets a skill wins: header ``x-ace-skill-override``, body
``skill_overrides``, the developer key's settings, the tenant's, the global default.
``shadow`` decides and traces but does not change the request.
"""
from __future__ import annotations

from types import MappingProxyType
from typing import Mapping, Sequence

from extproc.domain.headers import SKILL_OVERRIDE_HEADER
from extproc.errors import InvalidField
from extproc.state.skill_modes import OFF, SKILLS, validate_skills

__all__ = ["parse_override_header", "resolve", "resolve_sources"]

_EMPTY: Mapping[str, str] = MappingProxyType({})


def parse_override_header(value: str | None) -> Mapping[str, str]:
    """``multi_lora=prod,dynamic_lora_prefetch=shadow`` -> mapping (422 if malformed)."""
    if not value:
        return _EMPTY
    out: dict[str, str] = {}
    for part in value.split(","):
        part = part.strip()
        if not part:
            continue
        skill, sep, mode = part.partition("=")
        if not sep:
            raise InvalidField(f"{SKILL_OVERRIDE_HEADER} entry {part!r} is not skill=mode",
                               param=SKILL_OVERRIDE_HEADER, code="invalid_skill_mode")
        out[skill.strip()] = mode.strip()
    return validate_skills(out, SKILL_OVERRIDE_HEADER)


def resolve(*layers: Mapping[str, str]) -> dict[str, str]:
    """Mode per skill from layers ordered most specific first (the last is the default)."""
    out = {}
    for skill in SKILLS:
        for layer in layers:
            mode = layer.get(skill)
            if mode is not None:
                out[skill] = mode
                break
        else:
            out[skill] = OFF
    return out


def resolve_sources(layers: Sequence[tuple[str, Mapping[str, str]]]) -> dict[str, tuple[str, str]]:
    """``resolve`` that also names the layer each mode came from: ``[(name, layer), ...]``
    most specific first -> ``{skill: (mode, name)}``; ``(off, "unset")`` when none sets it."""
    out = {}
    for skill in SKILLS:
        out[skill] = next(((layer[skill], name) for name, layer in layers if layer.get(skill) is not None),
                          (OFF, "unset"))
    return out
