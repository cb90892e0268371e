"""Does loading adapters slow the forward steps of adapters already resident?

    python -m bench.load_interference --out reports/load_interference.json [--device cuda]

Two measurements, each first with no load running (``idle``), then while loads stream in
(``loading``), on the same machine in the same run:

- ``pool``: a forward step over a Llama-7B-shaped adapter slice (hidden 4096, ``--layers``
  layers, q/k/v/o, fp32: per module the batched LoRA op through ``AdapterPool.batch`` on
  8 rows of a resident rank-16 adapter, plus an [8, 256] x [256, 256] matmul standing
  in for the base model's share), on its own thread, while another
  thread loads rank-128 adapters from disk (safetensors files in the page cache, parsed
  each time, copied as a prefetch copies: chunked, with evictions). Reported: the step's
  wall time and the time to enter ``batch()`` (its set-up: the pool's lock), p50/p99/max,
  and ``steps_lock_held``: the steps that started while another thread held the pool's
  lock (their set-up waited for it), a count that does not depend on how busy the CPU is.
  Phases while loading: ``loading`` (each load reads the file again: a disk-tier load),
  ``loading_copy_only`` (host copies read before the phase: a host-tier hit) and, on
  CUDA, ``loading_pinned_reads`` (each read pins a fresh host copy, the host tier's old
  default). ``slow_steps`` counts the steps over ``slow_step_ms`` (3x the idle median
  + 1 ms) and which loader activity (``read``, ``copy``) each overlapped. The forward
  waits for its own stream only (not the pool's copy stream).
- ``engine``: the builtin engine on the fixtures (``make fixtures``), two closed-loop
  clients on a resident adapter (8 tokens each) while the agent-style prefetch/evict cycle
  runs on the other adapters from disk (no host copies, as ``make bench`` runs). Reported:
  the batcher's forward-step wall time (and ``steps_lock_held``), each request's time to
  its first token, and the event loop's lag (a 1 ms ticker's lateness), p50/p99/max.
  With ``--device cuda`` the engine's model and pool are on the device.

Shared CPUs make wall times noisy: compare ``idle`` and ``loading`` of one run, and the
counts (loads done, steps) beside them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from gpu_agent.engine.lora_ops import apply_lora
from gpu_agent.engine.peft import BaseModelSpec, LoraAdapter, load_peft_dir
from gpu_agent.engine.pool import AdapterPool

H = 4096
BASE_H = 256
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def _pct(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "p50": round(statistics.median(s), 3), "p99": round(s[min(len(s) - 1, int(0.99 * len(s)))], 3),
            "max": round(s[-1], 3)}


def _adapter(name: str, rank: int, spec: BaseModelSpec, dtype: Any, seed: int) -> LoraAdapter:
    g = torch.Generator().manual_seed(seed)
    weights = {(layer, m): ((torch.randn(rank, H, generator=g) * 0.01).to(dtype),
                            (torch.randn(H, rank, generator=g) * 0.01).to(dtype))
               for layer in range(spec.num_layers) for m in ATTN}
    return LoraAdapter(name=name, rank=rank, alpha=2.0 * rank, target_modules=ATTN, base_model=spec.name,
                       weights=weights)


def _write(root: Path, ad: LoraAdapter) -> Path:
    from safetensors.torch import save_file

    path = root / ad.name
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": ad.rank, "lora_alpha": ad.alpha, "target_modules": list(ATTN),
        "base_model_name_or_path": ad.base_model, "bias": "none"}))
    save_file({f"base_model.model.model.layers.{l}.self_attn.{m}.lora_{h}.weight": t.contiguous()
               for (l, m), (a, b) in ad.weights.items() for h, t in (("A", a), ("B", b))},
              str(path / "adapter_model.safetensors"))
    return path


def bench_pool(device: torch.device, layers: int, steps: int) -> dict[str, Any]:
    dtype = torch.float32
    spec = BaseModelSpec("bench-base", layers, H, {m: (H, H) for m in ATTN})
    big = [_adapter(f"big{i}", 128, spec, dtype, seed=i) for i in range(3)]
    pool = AdapterPool(spec, 2 * big[0].nbytes + (8 << 20), dtype=dtype, device=device)
    pool.load(_adapter("resident", 16, spec, dtype, seed=99), pin=True)
    # the base model's share of the step: one [8, BASE_H] x [BASE_H, BASE_H] matmul per module
    base = [torch.randn(BASE_H, BASE_H, dtype=dtype, device=device) * 0.01 for _ in ATTN]
    x = torch.randn(8, H, dtype=dtype, device=device)
    xb = torch.randn(8, BASE_H, dtype=dtype, device=device)
    # The forward waits for its own stream (as an engine reading its sampled tokens does),
    # not for the whole device: a prefetch's copy on the pool's side stream is not its work.
    sync = (lambda: torch.cuda.current_stream(device).synchronize()) if device.type == "cuda" else (lambda: None)
    spans: list[tuple[float, float]] = []

    def step() -> tuple[float, float]:
        busy[0] += _lock_held_elsewhere(pool)
        t0 = time.perf_counter()
        with pool.batch(["resident"] * 8) as lb:
            t1 = time.perf_counter()
            for layer in range(layers):
                for w, m in zip(base, ATTN):
                    xb @ w
                    y = torch.zeros_like(x)
                    apply_lora(y, x, pool, lb, layer, m)
        sync()
        t2 = time.perf_counter()
        spans.append((t0, t2))
        return (t2 - t0) * 1e3, (t1 - t0) * 1e3

    busy = [0]

    def run(n: int) -> tuple[list[float], list[float]]:
        busy[0] = 0
        spans.clear()
        out = [step() for _ in range(n)]
        return [a for a, _ in out], [b for _, b in out]

    def phase(read_each_time: bool, slow_ms: float, pin: bool = False) -> dict[str, Any]:
        """Steps while a loader thread loads the big adapters in turn: read from disk each
        time (``read_each_time``), or from host copies read before the phase (a host-tier
        hit: the copy alone). ``pin`` (CUDA): each read copies the file into freshly pinned
        memory and the pool copies from it (the host tier's old default); else the host
        copy stays pageable and goes through the pool's pinned staging buffers."""
        stop, loads = threading.Event(), [0]
        acts: list[tuple[str, float, float]] = []   # (read | copy, start, end) on the loader thread
        held = [load_peft_dir(d, spec, pin_memory=pin) for d in dirs] if not read_each_time else []

        def loader() -> None:
            i = 0
            while not stop.is_set():
                t0 = time.perf_counter()
                ad = (load_peft_dir(dirs[i % len(dirs)], spec, pin_memory=pin)
                      if read_each_time else held[i % len(held)])
                t1 = time.perf_counter()
                pool.load(ad, should_yield=lambda stage: False)   # a prefetch's copy: chunked
                if not read_each_time:
                    pool.evict(ad.name)                           # so the next turn copies again
                acts.append(("read", t0, t1))
                acts.append(("copy", t1, time.perf_counter()))
                del ad
                loads[0] += 1
                i += 1
        t = threading.Thread(target=loader, name="bench-loader", daemon=True)
        t.start()
        try:
            step_ms, enter_ms = run(steps)
            lock_held = busy[0]
        finally:
            stop.set()
            t.join()
        for name in [e for e in pool.resident() if e.startswith("big")]:
            pool.evict(name)
        # Which loader activity each slow step overlapped: names a stall's cause.
        slow = {"steps": 0, "during_read": 0, "during_copy": 0}
        for (s0, s1), ms in zip(spans, step_ms):
            if ms <= slow_ms:
                continue
            slow["steps"] += 1
            for kind, a0, a1 in acts:
                if a0 < s1 and s0 < a1:
                    slow[f"during_{kind}"] += 1
        return {"step_ms": _pct(step_ms), "batch_enter_ms": _pct(enter_ms), "steps_lock_held": lock_held,
                "loads_during": loads[0], "slow_steps": slow}

    with tempfile.TemporaryDirectory() as tmp:
        dirs = [_write(Path(tmp), ad) for ad in big]
        del big
        for _ in range(5):
            step()
        idle_step, idle_enter = run(steps)
        idle_busy = busy[0]
        slow_ms = 3 * statistics.median(idle_step) + 1.0
        loading = phase(True, slow_ms)
        copy_only = phase(False, slow_ms)
        pinned = phase(True, slow_ms, pin=True) if device.type == "cuda" else None
    mb = round(spec.num_layers * len(ATTN) * 2 * 128 * H * 4 / 2 ** 20, 1)
    rep = {"layers": layers, "steps": steps, "adapter_mb_loaded": mb, "loads_during": loading["loads_during"],
           "slow_step_ms": round(slow_ms, 3),
           "idle": {"step_ms": _pct(idle_step), "batch_enter_ms": _pct(idle_enter), "steps_lock_held": idle_busy},
           "loading": loading, "loading_copy_only": copy_only}
    if pinned is not None:
        rep["loading_pinned_reads"] = pinned
    if pool.staging is not None:
        rep["staging_pieces"] = pool.staging.pieces
    return rep


def _lock_held_elsewhere(pool: AdapterPool) -> int:
    """1 when another thread holds the pool's lock as a step starts (the step's set-up
    would wait for it): a count that does not depend on how busy the CPU is."""
    if pool._lock.acquire(blocking=False):
        pool._lock.release()
        return 0
    return 1


async def _engine_phase(engine: Any, resident: str, others: list[str], requests: int, loading: bool) -> dict[str, Any]:
    res = engine.adapters
    batcher = engine.batcher
    steps: list[float] = []
    real_step = batcher._step

    busy = [0]

    def timed(seqs):
        busy[0] += _lock_held_elsewhere(engine.pool)
        t0 = time.perf_counter()
        try:
            return real_step(seqs)
        finally:
            steps.append((time.perf_counter() - t0) * 1e3)
    batcher._step = timed
    lags: list[float] = []
    stop = asyncio.Event()
    loads = [0]

    async def ticker() -> None:
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(max(0.0, (time.perf_counter() - t0) * 1e3 - 1.0))

    async def cycle() -> None:
        i = 0
        while not stop.is_set():
            name = others[i % len(others)]
            i += 1
            try:
                await res.prefetch(name)
                loads[0] += 1
                res.evict(name)
            except Exception:  # noqa: BLE001 - a prefetch given up (no room): the next one
                await asyncio.sleep(0)

    ttft: list[float] = []

    async def client(k: int) -> None:
        for j in range(requests):
            t0 = time.perf_counter()
            first = True
            async for _ev in engine.generate(resident, [5 + k, 6 + j % 50, 7, 8], max_tokens=8, ignore_eos=True):
                if first:
                    ttft.append((time.perf_counter() - t0) * 1e3)
                    first = False

    tasks = [asyncio.ensure_future(ticker())]
    if loading:
        tasks.append(asyncio.ensure_future(cycle()))
    try:
        await asyncio.gather(client(0), client(1))
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        batcher._step = real_step
    return {"forward_step_ms": _pct(steps), "steps_lock_held": busy[0], "ttft_ms": _pct(ttft),
            "loop_lag_ms": _pct(lags), "loads_during": loads[0]}


def bench_engine(fixtures: Path, requests: int, prefetch_nice: int | None = None,
                 device: str = "cpu") -> dict[str, Any]:
    from gpu_agent.engine import Engine, EngineSettings

    extra = {} if prefetch_nice is None else {"prefetch_load_nice": prefetch_nice}

    async def main() -> dict[str, Any]:
        engine = Engine.create(EngineSettings(catalog=fixtures / "catalog.yaml", host_cache_bytes=0,
                                              pool_bytes=16 << 20, device=device, **extra))
        try:
            names = sorted(engine.adapters.names(), key=lambda n: -engine.adapters.entry(n).size_bytes)
            resident, others = names[-1], names[:4]
            await engine.adapters.ensure_resident(resident, hold=True)
            # one request first: a device's first kernels (library handles, autotuning)
            # took 185 ms on an H200, which no later step pays
            async for _ev in engine.generate(resident, [5, 6, 7, 8], max_tokens=2, ignore_eos=True):
                pass
            idle = await _engine_phase(engine, resident, others, requests, loading=False)
            loading = await _engine_phase(engine, resident, others, requests, loading=True)
            engine.adapters.release(resident)
            return {"resident": resident, "loaded": others, "requests": 2 * requests,
                    "idle": idle, "loading": loading}
        finally:
            await engine.close()
    return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="reports/load_interference.json")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the pool measurement)")
    ap.add_argument("--layers", type=int, default=2, help="layers of the pool measurement's model slice")
    ap.add_argument("--steps", type=int, default=100, help="forward steps per phase (pool)")
    ap.add_argument("--requests", type=int, default=30, help="requests per client per phase (engine)")
    ap.add_argument("--fixtures", default=".fixtures")
    ap.add_argument("--only", choices=("pool", "engine"), default=None)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: a shared CPU makes OpenMP's spinning workers "
                         "stall every op; measured 0.9-1.5 s vs 8-55 ms per pool step with 2 on 2 busy cores)")
    ap.add_argument("--prefetch-nice", type=int, default=None,
                    help="the engine's prefetch_load_nice (default: the engine's default)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device", file=sys.stderr)
        return 2
    rep: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
                           "prefetch_nice": args.prefetch_nice}
    t0 = time.perf_counter()
    if args.only in (None, "pool"):
        rep["pool"] = bench_pool(device, args.layers, args.steps)
        print("pool:", json.dumps(rep["pool"]))
    if args.only in (None, "engine"):
        rep["engine"] = bench_engine(Path(args.fixtures), args.requests, args.prefetch_nice, device.type)
        print("engine:", json.dumps(rep["engine"]))
    rep["bench_seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rep, indent=2) + "\n")
    print(f"wrote {out} in {rep['bench_seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
