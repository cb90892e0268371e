"""Builders for gateway test state: a catalog, tenants, keys and upstreams on disk; the
ext_proc message Envoy sends on the one-message route."""
from __future__ import annotations

import hashlib
from pathlib import Path

import yaml

KEYS = {"alice": "sk-alice-0001", "bob": "sk-bob-0002", "carol": "sk-carol-0003"}

CATALOG = {
    "base_model": {"name": "ace-tiny-llama", "path": "model"},
    "adapters": [
        {"name": "code-python", "base_model": "ace-tiny-llama", "rank": 8, "alpha": 16,
         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"], "size_bytes": 131072,
         "owner": "public", "domain": "coding", "uri": "adapters/code-python", "sha256": "a" * 64},
        {"name": "acme-legal", "base_model": "ace-tiny-llama", "rank": 16, "alpha": 32,
         "target_modules": ["q_proj", "v_proj"], "size_bytes": 262144, "owner": "acme",
         "domain": "legal", "uri": "adapters/acme-legal", "sha256": "b" * 64},
        {"name": "globex-secret", "base_model": "ace-tiny-llama", "rank": 8, "alpha": 16,
         "target_modules": ["q_proj", "v_proj"], "size_bytes": 131072, "owner": "globex",
         "domain": "finance", "uri": "adapters/globex-secret", "sha256": "c" * 64},
    ],
}


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def write_state(tmp: Path, upstreams: list[dict], *, max_body_bytes: int = 65536,
                skills: dict | None = None, include_catalog: bool = True, **fields) -> Path:
    """``fields``: more top-level state file fields (``public_model_list=True``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "catalog.yaml").write_text(yaml.safe_dump(CATALOG, sort_keys=False))
    state = {
        "tenants": [
            {"id": "acme", "default_adapter": "acme-legal",
             "skills": {"multi_lora": "prod", "dynamic_lora_prefetch": "shadow"}},
            {"id": "globex", "skills": {}},
        ],
        "keys": [
            {"name": "alice", "sha256": sha(KEYS["alice"]), "tenant": "acme", "skills": {}, "role": "admin"},
            {"name": "bob", "sha256": sha(KEYS["bob"]), "tenant": "globex",
             "skills": {"multi_lora": "prod"}},
            {"name": "carol", "sha256": sha(KEYS["carol"]), "tenant": "acme",
             "skills": {"multi_lora": "shadow"}},
        ],
        "upstreams": upstreams,
        "skills": skills or {"multi_lora": "prod", "dynamic_lora_prefetch": "off"},
        "limits": {"max_body_bytes": max_body_bytes},
    }
    state.update(fields)
    if include_catalog:
        state["include"] = ["catalog.yaml"]
    path = tmp / "state.yaml"
    path.write_text(yaml.safe_dump(state, sort_keys=False))
    return path


def upstream(name: str = "local", address: str = "127.0.0.1:1", flavour: str = "vllm",
             hints: str = "body", allow_paths: list[str] | None = None) -> dict:
    entry = {"name": name, "address": address, "flavour": flavour,
             "base_model": "ace-tiny-llama", "hints": hints}
    if allow_paths is not None:
        entry["allow_paths"] = allow_paths
    return entry


def body_request(body: bytes, path: str = "/v1/chat/completions", method: str = "POST", **headers: str):
    """The one-message route's ``ProcessingRequest``: the body plus request_attributes, as
    Envoy sends it (``content_type=`` is the header ``content-type``)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    msg = pb.ProcessingRequest()
    msg.request_body.body = body
    msg.request_body.end_of_stream = True
    fields = msg.attributes["envoy.filters.http.ext_proc"].fields
    fields["request.url_path"].string_value = path
    fields["request.method"].string_value = method
    for name, value in headers.items():
        fields[f"request.headers['{name.replace('_', '-')}']"].string_value = value
    return msg
