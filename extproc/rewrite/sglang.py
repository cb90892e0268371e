"""SGLang selects a LoRA adapter with ``"model": "<base>:<adapter>"``."""
from __future__ import annotations

from extproc.state.catalog import Adapter, Upstream


def model_for(adapter: Adapter, upstream: Upstream) -> str:
    return f"{upstream.base_model}:{adapter.name}"
