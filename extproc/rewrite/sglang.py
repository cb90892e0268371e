"""SGLang selects a LoRA adapter with ``"model": "<base>:<adapter>"``."""
from __future__ import annotations

from extproc.state.catalog import Adapter, Upstream
from extproc.state.paths import CHAT, COMPLETIONS, EMBEDDINGS

#: the inference routes ace sends to SGLang. Not ``/v1/responses``: SGLang serves it, but its
#: handler (srt/entrypoints/openai/serving_responses.py) builds the generate request without
#: ``lora_path``, so the adapter would be dropped silently and the base model answer.
ROUTES = frozenset({CHAT, COMPLETIONS, EMBEDDINGS})


def model_for(adapter: Adapter, upstream: Upstream) -> str:
    return f"{upstream.base_model}:{adapter.name}"
