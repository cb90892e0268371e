from __future__ import annotations

import pytest

from extproc.errors import InvalidField
from extproc.domain.skills import parse_override_header, resolve
from extproc.state.skill_modes import validate_skills


def test_header_parse():
    assert dict(parse_override_header("multi_lora=prod, dynamic_lora_prefetch=shadow")) == {
        "multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}
    assert dict(parse_override_header(None)) == {}
    assert dict(parse_override_header("")) == {}


@pytest.mark.parametrize("value", ["multi_lora", "multi_lora=on", "turbo=prod", "multi_lora=PROD"])
def test_header_invalid_is_422(value):
    with pytest.raises(InvalidField):
        parse_override_header(value)


@pytest.mark.parametrize("raw", [[], "prod", {"multi_lora": 1}, {"x": "off"}])
def test_validate_rejects(raw):
    with pytest.raises(InvalidField):
        validate_skills(raw, "skill_overrides")


# header, body, key, tenant, default -> expected
ORDER = [
    ({"multi_lora": "off"}, {"multi_lora": "prod"}, {"multi_lora": "prod"}, {}, {}, "off"),
    ({}, {"multi_lora": "shadow"}, {"multi_lora": "prod"}, {}, {}, "shadow"),
    ({}, {}, {"multi_lora": "prod"}, {"multi_lora": "off"}, {}, "prod"),
    ({}, {}, {}, {"multi_lora": "shadow"}, {"multi_lora": "prod"}, "shadow"),
    ({}, {}, {}, {}, {"multi_lora": "prod"}, "prod"),
    ({}, {}, {}, {}, {}, "off"),
]


@pytest.mark.parametrize("header,body,key,tenant,default,expected", ORDER)
def test_resolution_order(header, body, key, tenant, default, expected):
    assert resolve(header, body, key, tenant, default)["multi_lora"] == expected


def test_object_form_equals_string_form():
    raw = {"multi_lora": {"mode": "prod"}, "dynamic_lora_prefetch": "shadow"}
    assert dict(validate_skills(raw, "skill_overrides")) == {
        "multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}


@pytest.mark.parametrize("raw,param", [
    ({"multi_lora": {"mode": "on"}}, "skill_overrides.multi_lora.mode"),
    ({"multi_lora": {"mode": ["prod"]}}, "skill_overrides.multi_lora.mode"),
    ({"multi_lora": {}}, "skill_overrides.multi_lora.mode"),
    ({"multi_lora": {"mode": "prod", "level": 2}}, "skill_overrides.multi_lora.level"),
    ({"multi_lora": "on"}, "skill_overrides.multi_lora"),
    ({"turbo": {"mode": "prod"}}, "skill_overrides.turbo"),
])
def test_object_form_errors_name_the_field(raw, param):
    with pytest.raises(InvalidField) as exc:
        validate_skills(raw, "skill_overrides")
    assert exc.value.param == param
    assert exc.value.status == 422


def test_resolve_sources_names_the_layer_each_mode_came_from():
    from extproc.domain.skills import resolve_sources
    layers = (("key", {"multi_lora": "shadow"}), ("tenant", {"dynamic_lora_prefetch": "prod", "multi_lora": "off"}),
              ("default", {}))
    assert resolve_sources(layers) == {"multi_lora": ("shadow", "key"), "dynamic_lora_prefetch": ("prod", "tenant")}
    assert resolve_sources((("default", {}),)) == {"multi_lora": ("off", "unset"), "dynamic_lora_prefetch": ("off", "unset")}
