"""The builtin OpenAI-compatible engine: a Llama in plain torch serving many LoRA adapters
from one paged pool, batching requests with different adapters into one forward pass.

Public API (torch is imported only when an engine is created)::

    from gpu_agent.engine import Engine, EngineSettings, serve
    engine = Engine.create(EngineSettings(catalog=Path(".fixtures/catalog.yaml")))
    runner, port = await serve(engine, "127.0.0.1", 0)
    await engine.adapters.prefetch("code-sql")   # tiers: disk -> host -> device
    ...
    await runner.cleanup()

CLI: ``python -m gpu_agent.engine --model DIR --catalog catalog.yaml --port N --pool-bytes B``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Engine", "EngineSettings", "EngineAdapters", "Batcher", "build_app", "serve"]

if TYPE_CHECKING:
    from gpu_agent.engine.batcher import Batcher
    from gpu_agent.engine.core import Engine, EngineSettings
    from gpu_agent.engine.adapters import EngineAdapters
    from gpu_agent.engine.server import build_app, serve

_WHERE = {"Engine": "core", "EngineSettings": "core", "EngineAdapters": "adapters",
          "Batcher": "batcher", "build_app": "server", "serve": "server"}


def __getattr__(name: str) -> Any:
    mod = _WHERE.get(name)
    if mod is None:
        raise AttributeError(name)
    import importlib

    return getattr(importlib.import_module(f"gpu_agent.engine.{mod}"), name)
