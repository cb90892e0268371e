"""vLLM selects a LoRA adapter by serving it under its own model name."""
from __future__ import annotations

from extproc.state.catalog import Adapter, Upstream


def model_for(adapter: Adapter, upstream: Upstream) -> str:
    return adapter.name
