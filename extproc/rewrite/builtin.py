"""The agent's builtin engine selects adapters exactly as vLLM does (docs/contracts.md)."""
from __future__ import annotations

from extproc.state.paths import CHAT, COMPLETIONS, RESPONSES
from extproc.rewrite.vllm import model_for

__all__ = ["model_for", "ROUTES"]

#: gpu_agent/engine/server.py: no embeddings (a causal LM only)
ROUTES = frozenset({CHAT, COMPLETIONS, RESPONSES})
