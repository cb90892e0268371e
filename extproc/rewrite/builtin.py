"""The agent's builtin engine selects adapters exactly as vLLM does (docs/contracts.md)."""
from __future__ import annotations

from extproc.rewrite.vllm import model_for

__all__ = ["model_for"]
