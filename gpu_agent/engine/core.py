"""The engine object: model + tokenizer + adapter pool + residency + batcher.

Embed it in-process (the agent service does)::

    settings = EngineSettings(model=Path(".fixtures/model"), catalog=Path(".fixtures/catalog.yaml"))
    engine = Engine.create(settings)            # loads the model, allocates the pool
    await engine.adapters.prefetch("code-sql")  # drive residency directly
    async for ev in engine.generate("code-sql", prompt_ids, max_tokens=8): ...
    await engine.close()

or serve it over HTTP with :func:`gpu_agent.engine.server.serve`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, AsyncIterator, Sequence

from gpu_agent.engine.adapters import AdapterSource, EngineAdapters, read_catalog
from gpu_agent.engine.batcher import Batcher, GenerationRequest, TokenEvent
from gpu_agent.engine.errors import InvalidRequest, ModelNotFound
from gpu_agent.engine.node_cpu import NodeCpu
from gpu_agent.engine.pool_copy import STAGING_MIN_SLOT_BYTES, STAGING_SLOT_BYTES, STAGING_SLOTS

__all__ = ["EngineSettings", "Engine"]

DEFAULT_POOL_BYTES = 64 << 20

log = logging.getLogger("gpu_agent.engine")


@dataclass(frozen=True)
class EngineSettings:
    """Everything the engine is configured with; validated by :meth:`validate`."""

    model: Path | None = field(default=None, metadata={
        "help": "HF-format Llama checkpoint directory (default: the catalog's base_model.path)"})
    catalog: Path | None = field(default=None, metadata={
        "help": "catalog.yaml listing the adapters this engine may serve"})
    model_name: str | None = field(default=None, metadata={
        "help": "name clients use for the base model (default: the catalog's base_model.name)"})
    pool_bytes: int = field(default=DEFAULT_POOL_BYTES, metadata={
        "help": "size of the paged adapter pool in bytes (one preallocated tensor)"})
    host_cache_bytes: int = field(default=1 << 30, metadata={
        "help": "host-memory tier for parsed adapters (LRU), in bytes; 0 = none (an adapter that "
                "left the pool is read from disk again)"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, cuda:N or auto"})
    staging_bytes: int = field(default=STAGING_SLOTS * STAGING_SLOT_BYTES, metadata={
        "help": "CUDA: pinned host memory the pool takes at start-up to carry adapter bytes to the "
                f"device, in {STAGING_SLOTS} buffers read in parallel parts (no memory is pinned while "
                "serving); ignored on CPU"})
    dtype: str = field(default="float32", metadata={"help": "float32, bfloat16 or float16"})
    max_batch_sequences: int = field(default=32, metadata={
        "help": "most sequences in one forward pass"})
    max_batch_tokens: int = field(default=4096, metadata={
        "help": "most token rows in one forward pass (prefill rows count)"})
    batch_window_ms: float = field(default=2.0, metadata={
        "help": "when idle, wait this long after a request so requests arriving together share a pass"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "context length (prompt + max_tokens); default max_position_embeddings"})
    prefetch_load_nice: int = field(default=0, metadata={
        "help": "Linux niceness added to the thread that runs prefetch loads (0 = as the engine's; "
                "a nicer thread preempted while it holds the GIL stalls the forward: see "
                "gpu_agent/engine/load_order.py)"})
    prefetch_compute_defer_ms: float = field(default=1000.0, metadata={
        "help": "a prefetch waits while a request is accepted, queued or running, for at most this "
                "long in all, then goes on (yielding to requests' loads only); 0 = never waits "
                "for compute (gpu_agent/engine/load_order.py)"})
    prefetch_node_cpu: bool = field(default=True, metadata={
        "help": "a prefetch also waits (at most 100 ms, and within prefetch_compute_defer_ms) while "
                "the cores this process runs on are taken by other tasks: the engines beside this one "
                "(gpu_agent/engine/node_cpu.py)"})
    max_adapters: int | None = field(default=None, metadata={
        "help": "most adapters resident in the pool at once (LRU eviction on every load); "
                "default: bounded by pool bytes only"})

    def validate(self) -> "EngineSettings":
        if self.model is None and self.catalog is None:
            raise ValueError("give --model or --catalog (whose base_model.path names the model)")
        if self.pool_bytes <= 0:
            raise ValueError("pool_bytes must be positive")
        if self.staging_bytes < STAGING_SLOTS * STAGING_MIN_SLOT_BYTES:
            raise ValueError(f"staging_bytes must be >= {STAGING_SLOTS * STAGING_MIN_SLOT_BYTES} "
                             f"({STAGING_SLOTS} buffers of at least {STAGING_MIN_SLOT_BYTES >> 10} KiB)")
        if self.host_cache_bytes < 0:
            raise ValueError("host_cache_bytes must be >= 0 (0 = no host tier)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r}: use float32, bfloat16 or float16")
        if self.max_batch_sequences < 1 or self.max_batch_tokens < 1:
            raise ValueError("batch limits must be >= 1")
        if self.max_adapters is not None and self.max_adapters < 1:
            raise ValueError("max_adapters must be >= 1 (or unset)")
        if not self.prefetch_compute_defer_ms >= 0:
            raise ValueError("prefetch_compute_defer_ms must be >= 0")
        if not 0 <= self.prefetch_load_nice <= 19:
            raise ValueError("prefetch_load_nice must be in [0, 19]")
        return self

    @staticmethod
    def help(name: str) -> str:
        return next(f.metadata.get("help", "") for f in fields(EngineSettings) if f.name == name)


class Engine:
    def __init__(self, settings: EngineSettings, *, model: Any, tokenizer: Any, pool: Any,
                 adapters: EngineAdapters, model_name: str, model_dir: Path):
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.pool = pool
        self.adapters = adapters
        self.model_name = model_name
        self.model_dir = model_dir
        self.warm_up_s: float | None = None  # set by warm_up(), which create() runs
        self.batcher = Batcher(model, pool, max_batch_sequences=settings.max_batch_sequences,
                               max_batch_tokens=settings.max_batch_tokens,
                               batch_window_ms=settings.batch_window_ms,
                               max_model_len=settings.max_model_len)
        # a prefetch stays off the compute: it waits while a request is accepted, queued or
        # running (gpu_agent.engine.load_order), and goes when the batcher runs dry
        adapters.order.compute_busy = lambda: adapters.has_claims() or self.batcher.busy
        adapters.order.compute_defer_s = settings.prefetch_compute_defer_ms / 1e3
        if settings.prefetch_node_cpu:
            adapters.order.node_busy = NodeCpu().busy
        self.batcher.idle_listeners.append(adapters.order.notify)
        stop = set(model.cfg.eos_ids())
        if tokenizer.eos_id is not None:
            stop.add(tokenizer.eos_id)
        self.stop_ids = tuple(sorted(stop))

    @classmethod
    def create(cls, settings: EngineSettings, *, source: AdapterSource | None = None) -> "Engine":
        import torch

        from gpu_agent.engine.model import LlamaModel
        from gpu_agent.engine.peft import BaseModelSpec
        from gpu_agent.engine.pool import AdapterPool
        from gpu_agent.engine.tokenizer import ModelTokenizer

        settings.validate()
        entries: dict = {}
        name, model_dir = settings.model_name, settings.model
        if settings.catalog is not None:
            cat_name, cat_dir, entries = read_catalog(settings.catalog)
            name = name or cat_name
            model_dir = model_dir or cat_dir
        if model_dir is None:
            raise ValueError("the catalog names no base_model.path; pass --model")
        model_dir = Path(model_dir)
        name = name or model_dir.name
        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = getattr(torch, settings.dtype)
        model = LlamaModel.from_dir(model_dir, device=device, dtype=dtype)
        spec = BaseModelSpec(name=name, num_layers=model.cfg.num_layers,
                             hidden_size=model.cfg.hidden_size, modules=model.cfg.module_shapes())
        pool = AdapterPool(spec, settings.pool_bytes, dtype=dtype, device=device,
                           max_adapters=settings.max_adapters, staging_bytes=settings.staging_bytes)
        root = Path(settings.catalog).parent.resolve() if settings.catalog is not None else None
        adapters = EngineAdapters(pool, spec, entries, source=source, root=root,
                                  host_budget_bytes=settings.host_cache_bytes,
                                  prefetch_nice=settings.prefetch_load_nice)
        engine = cls(settings, model=model, tokenizer=ModelTokenizer(model_dir), pool=pool,
                     adapters=adapters, model_name=name, model_dir=model_dir)
        engine.warm_up()
        return engine

    def warm_up(self) -> float:
        """Pay the first request's one-off costs before serving, as vLLM's start-up does:
        the chat template's compile (Jinja's import, ~50 ms on the event loop otherwise),
        a chat's tokenization, one base-model prefill and decode on the forward thread, and
        the LoRA kernels' import. Nothing is counted. Returns the seconds it took (also
        ``warm_up_s``)."""
        t0 = time.perf_counter()
        self.tokenizer.compile_template()
        try:
            prompt = self.tokenizer.encode_chat([{"role": "user", "content": "warm up"}])
        except ValueError:  # no chat template: a plain completion prompt
            prompt = self.tokenizer.encode("warm up")
        self.batcher.warm_up(prompt[:16] or [0])
        import gpu_agent.engine.lora_ops  # noqa: F401  (the first LoRA batch would import it)

        self.warm_up_s = time.perf_counter() - t0
        log.info("warmed up in %.0f ms (chat template, tokenizer, one forward)", self.warm_up_s * 1e3)
        return self.warm_up_s

    @property
    def max_model_len(self) -> int:
        return self.batcher.max_model_len

    def adapter_for(self, model: str) -> str | None:
        """The adapter a request's ``model`` selects (None: the base model)."""
        if model == self.model_name:
            return None
        if not isinstance(model, str) or not self.adapters.knows(model):
            raise ModelNotFound(str(model))
        return model

    def generate(self, adapter: str | None, prompt: Sequence[int], *, max_tokens: int,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 ignore_eos: bool = False) -> AsyncIterator[TokenEvent]:
        """Tokens for ``prompt`` through ``adapter`` (an async generator; close it with
        ``contextlib.aclosing`` to drop the sequence early). The adapter must be held
        resident: ``await adapters.ensure_resident(adapter, hold=True)``, then ``release``."""
        if len(prompt) + max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"This model's maximum context length is {self.max_model_len} tokens; the request "
                f"has {len(prompt)} prompt tokens and max_tokens={max_tokens}.", param="max_tokens")
        req = GenerationRequest(prompt=list(prompt), adapter=adapter, max_tokens=max_tokens,
                                temperature=temperature, top_p=top_p, seed=seed,
                                stop_ids=() if ignore_eos else self.stop_ids)
        return self.batcher.generate(req)

    async def close(self) -> None:
        await self.batcher.stop()
        self.adapters.close()

    def memory(self, n_instances: int | None = None):
        from gpu_agent.engine.memory import account

        sizes = {n: e.size_bytes for n, e in self.adapters._entries.items()}
        return account(self.model.nbytes, self.pool.stats()["pool_bytes"], sizes, n_instances)
