from __future__ import annotations

import pytest

from extproc.errors import InvalidField, NotFound
from extproc.domain.selection import select_adapter

CASES = [
    # body, tenant, expected adapter, source
    ({"model": "x", "extra_body": {"lora_name": "code-python"}, "lora_name": "acme-legal"}, "acme",
     "code-python", "extra_body.lora_name"),
    ({"model": "acme-legal", "lora_name": "code-python"}, "acme", "code-python", "lora_name"),
    ({"model": "code-python"}, "acme", "code-python", "model"),
    ({"model": "ace-tiny-llama"}, "acme", None, "base_model"),
    ({"model": "gpt-4o"}, "acme", "acme-legal", "tenant_default"),
    # another tenant's adapter named by model is an unknown name: no trace of it (was a 404,
    # while an unknown name got the default: the difference told that it exists)
    ({"model": "globex-secret"}, "acme", "acme-legal", "tenant_default"),
    ({"model": "acme-legal"}, "globex", None, "none"),
    ({}, "acme", "acme-legal", "tenant_default"),
    ({"model": "gpt-4o"}, "globex", None, "none"),
    ({"extra_body": {"temperature": 1}}, "globex", None, "none"),
]


@pytest.mark.parametrize("body,tenant,adapter,source", CASES)
def test_first_match_wins(snapshot, body, tenant, adapter, source):
    sel = select_adapter(snapshot, snapshot.tenants[tenant], body)
    assert (sel.adapter.name if sel.adapter else None, sel.source) == (adapter, source)


@pytest.mark.parametrize("body", [
    {"lora_name": "globex-secret"}, {"lora_name": "nope"}, {"extra_body": {"lora_name": "globex-secret"}}])
def test_other_tenant_and_unknown_are_the_same_404(snapshot, body):
    with pytest.raises(NotFound) as exc:
        select_adapter(snapshot, snapshot.tenants["acme"], body)
    assert exc.value.status == 404 and exc.value.code == "adapter_not_found"


@pytest.mark.parametrize("body,code", [
    ({"lora_name": "code-python", "adapter_rank": 16}, "adapter_rank_mismatch"),
    ({"extra_body": {"lora_name": "code-python", "adapter_rank": 4}}, "adapter_rank_mismatch"),
    ({"lora_name": "code-python", "adapter_rank": "8"}, "invalid_value"),
    ({"model": "ace-tiny-llama", "adapter_rank": 8}, "invalid_value"),
    ({"lora_name": 3}, "invalid_value"),
    ({"model": 3}, "invalid_value"),
    ({"extra_body": "x"}, "invalid_value"),
])
def test_invalid_fields_are_422(snapshot, body, code):
    with pytest.raises(InvalidField) as exc:
        select_adapter(snapshot, snapshot.tenants["globex"], body)
    assert exc.value.status == 422 and exc.value.code == code


def test_matching_rank_is_accepted(snapshot):
    sel = select_adapter(snapshot, snapshot.tenants["acme"], {"lora_name": "acme-legal", "adapter_rank": 16})
    assert sel.adapter.name == "acme-legal"
