"""Continuous batching: every step is one forward pass over all running sequences.

Requests with different adapters (or none) share a step: newly admitted sequences bring
their whole prompt (prefill), running ones one token (decode); the rows go through the
model as one ragged batch, and each q/k/v/o projection adds the per-row LoRA delta with
``lora_ops.apply_lora`` reading the adapters straight from the pool. A sequence joins at
the next step boundary and leaves as soon as it finishes, so a long request never holds
a short one back.

The forward runs on one worker thread (torch releases the GIL), so the event loop keeps
accepting requests and streaming tokens while a step is computed.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Sequence

from gpu_agent.engine.model import LlamaModel, SequenceStep

__all__ = ["GenerationRequest", "TokenEvent", "Batcher", "BatcherStats"]


@dataclass
class GenerationRequest:
    prompt: Sequence[int]
    adapter: str | None = None   # must be resident (held) while the sequence runs
    max_tokens: int = 16
    temperature: float = 0.0     # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: Sequence[int] = ()


@dataclass(frozen=True)
class TokenEvent:
    token_id: int | None          # None on a terminal event without a token
    finish_reason: str | None     # "stop" | "length" | "abort" when the sequence ends
    # perf_counter() at the start and the end of the forward pass that produced the token
    # (a request's TTFT split: queued until the first start, computing until its end)
    pass_start: float | None = None
    pass_end: float | None = None


@dataclass
class BatcherStats:
    forward_passes: int = 0
    rows: int = 0                  # token rows over all passes
    sequences_in_passes: int = 0   # sequence-steps over all passes
    max_sequences_in_pass: int = 0
    max_adapters_in_pass: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    forward_seconds: float = 0.0
    last_pass_adapters: tuple[str, ...] = ()


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    out: asyncio.Queue
    next_tokens: list[int]
    cache: Any = None
    generated: int = 0
    done: bool = False
    generator: Any = None


class Batcher:
    def __init__(self, model: LlamaModel, pool: Any = None, *, max_batch_sequences: int = 32,
                 max_batch_tokens: int = 4096, batch_window_ms: float = 2.0,
                 max_model_len: int | None = None):
        self.model = model
        self.pool = pool
        self.max_batch_sequences = max_batch_sequences
        self.max_batch_tokens = max_batch_tokens
        self.batch_window_s = batch_window_ms / 1e3
        self.max_model_len = max_model_len or model.cfg.max_position_embeddings
        self.stats = BatcherStats()
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []
        self._wake = asyncio.Event()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ace-forward")
        self._task: asyncio.Task | None = None
        # called on the event loop each time the loop runs out of sequences (the engine's
        # load order lets deferred prefetches go then)
        self.idle_listeners: list[Callable[[], None]] = []

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop(), name="ace-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for s in list(self._waiting) + self._running:
            self._finish(s, "abort")
        self._waiting.clear()
        self._running.clear()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def busy(self) -> bool:
        """A sequence is queued or running (thread-safe read)."""
        return bool(self._running) or bool(self._waiting)

    def running_adapters(self) -> set[str]:
        return {s.req.adapter for s in self._running if s.req.adapter}

    def waiting_adapters(self) -> set[str]:
        return {s.req.adapter for s in self._waiting if s.req.adapter}

    def warm_up(self, prompt: Sequence[int]) -> None:
        """One prefill and one decode step of the base model on the forward thread, outside
        the counts: the first step's one-off costs (torch's kernels, the thread's start) are
        paid before the engine serves, not by its first request."""
        if not prompt:
            raise ValueError("empty prompt")

        def run() -> None:
            cache = self.model.new_cache(len(prompt) + 1)
            logits = self.model.forward([SequenceStep(list(prompt), cache)])
            self.model.forward([SequenceStep([int(logits[0].argmax())], cache)])

        self._executor.submit(run).result()

    # -- requests ----------------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Tokens of ``req`` as they are produced; the last event carries finish_reason."""
        if not req.prompt:
            raise ValueError("empty prompt")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if len(req.prompt) + req.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(req.prompt)}) + max_tokens ({req.max_tokens}) "
                             f"exceeds the context length {self.max_model_len}")
        self.start()
        seq = _Seq(req=req, out=asyncio.Queue(), next_tokens=list(req.prompt))
        if req.temperature > 0:
            import torch

            seq.generator = torch.Generator(device="cpu")
            seq.generator.manual_seed(req.seed if req.seed is not None else int(time.time_ns() & 0xFFFFFFFF))
        self._waiting.append(seq)
        self._wake.set()
        try:
            while True:
                ev: TokenEvent = await seq.out.get()
                yield ev
                if ev.finish_reason is not None:
                    return
        finally:
            seq.done = True  # client gone or finished: the loop drops it at the next step

    # -- the loop ----------------------------------------------------------------------

    def _admit(self) -> None:
        budget = self.max_batch_tokens - len(self._running)
        while self._waiting and len(self._running) < self.max_batch_sequences:
            s = self._waiting[0]
            if s.done:
                self._waiting.popleft()
                continue
            n = len(s.next_tokens)
            if n > budget and self._running:
                break  # this prompt joins at a later step; one always fits an empty batch
            self._waiting.popleft()
            s.cache = self.model.new_cache(len(s.req.prompt) + s.req.max_tokens)
            self._running.append(s)
            budget -= n
            self.stats.prompt_tokens += n

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._running = [s for s in self._running if not s.done]
            if not self._running and not self._waiting:
                for listener in self.idle_listeners:
                    listener()
                self._wake.clear()
                await self._wake.wait()
                if self.batch_window_s > 0:  # let requests that arrive together share a step
                    await asyncio.sleep(self.batch_window_s)
            self._admit()
            if self.pool is not None:
                # A sequence whose adapter is not resident (not held by its caller) must
                # not fail the whole batch: it alone ends, with "abort".
                for s in self._running:
                    if s.req.adapter is not None and not self.pool.contains(s.req.adapter):
                        self._finish(s, "abort")
                self._running = [s for s in self._running if not s.done]
            seqs = list(self._running)
            if not seqs:
                continue
            t0 = time.perf_counter()
            try:
                tokens = await loop.run_in_executor(self._executor, self._step, seqs)
            except Exception as exc:  # a failed step ends its sequences, not the server
                for s in seqs:
                    self._finish(s, "abort", error=exc)
                continue
            t1 = time.perf_counter()
            st = self.stats
            st.forward_seconds += t1 - t0
            st.forward_passes += 1
            st.sequences_in_passes += len(seqs)
            st.rows += sum(len(s.next_tokens) for s in seqs)
            st.max_sequences_in_pass = max(st.max_sequences_in_pass, len(seqs))
            adapters = tuple(sorted({s.req.adapter for s in seqs if s.req.adapter}))
            st.max_adapters_in_pass = max(st.max_adapters_in_pass, len(adapters))
            st.last_pass_adapters = adapters
            for s, tok in zip(seqs, tokens):
                s.generated += 1
                st.generated_tokens += 1
                if tok in s.req.stop_ids:
                    self._finish(s, "stop", tok, span=(t0, t1))
                elif s.generated >= s.req.max_tokens:
                    self._finish(s, "length", tok, span=(t0, t1))
                else:
                    s.next_tokens = [tok]
                    if not s.done:
                        s.out.put_nowait(TokenEvent(tok, None, t0, t1))

    def _finish(self, s: _Seq, reason: str, tok: int | None = None, error: Exception | None = None,
                span: tuple[float, float] | tuple[None, None] = (None, None)) -> None:
        if not s.done:
            s.out.put_nowait(TokenEvent(tok, reason, *span))
        s.done = True
        s.cache = None
        self.stats.finished += 1

    # -- on the worker thread -----------------------------------------------------------

    def _step(self, seqs: list[_Seq]) -> list[int]:
        steps = [SequenceStep(s.next_tokens, s.cache) for s in seqs]
        row_adapters = [s.req.adapter for s in seqs for _ in s.next_tokens]
        if self.pool is None or not any(row_adapters):
            logits = self.model.forward(steps)
        else:
            from gpu_agent.engine.lora_ops import apply_lora

            pool = self.pool
            with pool.batch(row_adapters) as lb:
                def hook(y, x, layer, module):
                    apply_lora(y, x, pool, lb, layer, module)
                logits = self.model.forward(steps, hook)
        return [_sample(logits[i], s) for i, s in enumerate(seqs)]


def _sample(logits: Any, s: _Seq) -> int:
    import torch

    r = s.req
    if r.temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / r.temperature, dim=-1)
    if r.top_p < 1.0:
        sp, si = probs.sort(descending=True)
        keep = sp.cumsum(0) - sp < r.top_p
        probs = torch.zeros_like(probs).scatter_(0, si[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=s.generator))
