"""Which request paths exist at ace's edge (docs/gateway.md, "Routes"): default deny.

- The inference routes reach an engine, each decided by the gateway (adapter, skills,
  routing, rewrite): ``INFERENCE_PATHS``; the ones only some engine flavours serve are
  routed only to those (``extproc.rewrite.SERVED_ROUTES``).
- An upstream's ``allow_paths`` (state file) add engine routes such as ``/tokenize``:
  key-checked and routed to an upstream that lists them. ``check_allow_path`` refuses the
  engines' administration, their metrics and the gateway's own paths there.
- ``GET /v1/models`` and ``/v1/models/{id}`` are the gateway's answer (``extproc.app.model_list``).
- ``OPEN_PATHS``: liveness, no key.
- Anything else: 404 from the gateway, after the key check (an unauthenticated caller
  cannot tell which paths an upstream allow-lists).
"""
from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["CHAT", "COMPLETIONS", "RESPONSES", "EMBEDDINGS", "EXECUTE", "INFERENCE_PATHS", "MODELS",
           "MODELS_PREFIX", "OPEN_PATHS", "ENGINE_ADMIN_PATHS", "check_allow_path", "normalize"]

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
EMBEDDINGS = "/v1/embeddings"
EXECUTE = "/v1/execute"          # ace's native API, sent upstream as a chat completion
#: the routes on which the gateway decides and an engine answers
INFERENCE_PATHS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS, EXECUTE)
MODELS = "/v1/models"
MODELS_PREFIX = MODELS + "/"
#: open without a key, GET/HEAD only: liveness for load balancers; carries no tenant data
OPEN_PATHS = frozenset({"/health"})
#: the engines' own administration (vLLM's and SGLang's runtime adapter, weight, cache and
#: profiler endpoints) and their metrics (other tenants' adapter names: vLLM's
#: ``vllm:lora_requests_info``). The gateway and the agents own what an engine loads, and
#: metrics stay on the operators' port: no state file may allow-list these.
ENGINE_ADMIN_PATHS = frozenset({
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter",                       # vLLM
    "/load_lora_adapter", "/unload_lora_adapter",                             # SGLang
    "/update_weights_from_disk", "/update_weights_from_tensor", "/update_weights_from_distributed",
    "/init_weights_update_group", "/flush_cache", "/reset_prefix_cache", "/start_profile",
    "/stop_profile", "/sleep", "/wake_up", "/collective_rpc", "/pause", "/resume", "/abort_request",
    "/metrics", "/server_info", "/get_server_info", "/get_model_info",
})
_SLASHES = re.compile(r"/{2,}")
_GATEWAY_PREFIXES = ("/api/", "/settings", MODELS)


def normalize(path: str) -> str:
    """The path as an engine's router reads it: percent-decoded, slashes merged, no trailing
    slash (Envoy normalizes too; the checks here must not depend on it)."""
    return _SLASHES.sub("/", unquote(path)).rstrip("/") or "/"


def check_allow_path(path: object) -> str | None:
    """Why ``path`` cannot be an upstream's ``allow_paths`` entry; None when it can."""
    if not isinstance(path, str) or not path.startswith("/"):
        return "must be a path starting with /"
    if normalize(path) != path or "?" in path or "#" in path:
        return f"must be written normalized (no query, no trailing or double slash, no %-escape): {normalize(path)!r}"
    if path in ENGINE_ADMIN_PATHS:
        return f"{path} is an engine's administration or metrics route: never exposed to clients"
    if path in INFERENCE_PATHS or path in OPEN_PATHS or path.startswith(_GATEWAY_PREFIXES):
        return f"{path} is a gateway route already"
    return None
