"""vLLM selects a LoRA adapter by serving it under its own model name."""
from __future__ import annotations

from extproc.state.catalog import Adapter, Upstream
from extproc.state.paths import CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES

#: the inference routes vLLM's OpenAI server serves, each selecting the adapter by ``model``
#: (``/v1/embeddings`` answers only for a pooling model: vLLM's own error otherwise)
ROUTES = frozenset({CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS})


def model_for(adapter: Adapter, upstream: Upstream) -> str:
    return adapter.name
