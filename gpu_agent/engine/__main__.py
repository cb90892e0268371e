"""``python -m gpu_agent.engine --model DIR --catalog catalog.yaml --host 127.0.0.1 --port N``."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from dataclasses import fields
from pathlib import Path
from typing import Sequence

from gpu_agent.engine.core import EngineSettings


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineSettings, str, int]:
    ap = argparse.ArgumentParser(prog="python -m gpu_agent.engine",
                                 description="OpenAI-compatible multi-LoRA engine (builtin)")
    h = EngineSettings.help
    ap.add_argument("--model", type=Path, help=h("model"))
    ap.add_argument("--catalog", type=Path, help=h("catalog"))
    ap.add_argument("--model-name", help=h("model_name"))
    ap.add_argument("--pool-bytes", type=int, default=EngineSettings.pool_bytes, help=h("pool_bytes"))
    ap.add_argument("--host-cache-bytes", type=int, default=EngineSettings.host_cache_bytes,
                    help=h("host_cache_bytes"))
    ap.add_argument("--device", default=EngineSettings.device, help=h("device"))
    ap.add_argument("--staging-bytes", type=int, default=EngineSettings.staging_bytes, help=h("staging_bytes"))
    ap.add_argument("--dtype", default=EngineSettings.dtype, help=h("dtype"))
    ap.add_argument("--max-batch-sequences", type=int, default=EngineSettings.max_batch_sequences,
                    help=h("max_batch_sequences"))
    ap.add_argument("--max-batch-tokens", type=int, default=EngineSettings.max_batch_tokens,
                    help=h("max_batch_tokens"))
    ap.add_argument("--batch-window-ms", type=float, default=EngineSettings.batch_window_ms,
                    help=h("batch_window_ms"))
    ap.add_argument("--max-model-len", type=int, default=None, help=h("max_model_len"))
    ap.add_argument("--max-adapters", type=int, default=None, help=h("max_adapters"))
    ap.add_argument("--prefetch-compute-defer-ms", type=float, default=EngineSettings.prefetch_compute_defer_ms,
                    help=h("prefetch_compute_defer_ms"))
    ap.add_argument("--prefetch-node-cpu", action=argparse.BooleanOptionalAction,
                    default=EngineSettings.prefetch_node_cpu, help=h("prefetch_node_cpu"))
    ap.add_argument("--prefetch-load-nice", type=int, default=EngineSettings.prefetch_load_nice,
                    help=h("prefetch_load_nice"))
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind")
    ap.add_argument("--port", type=int, default=8000, help="port to bind (0: any free port)")
    a = ap.parse_args(argv)
    names = {f.name for f in fields(EngineSettings)}
    settings = EngineSettings(**{k: v for k, v in vars(a).items() if k in names})
    try:
        settings.validate()
    except ValueError as exc:
        ap.error(str(exc))
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    return settings, a.host, a.port


async def _main(settings: EngineSettings, host: str, port: int) -> None:
    from ace_common.gc_pauses import GcPauses, freeze_startup_heap
    from ace_common.loop_lag import LoopLag
    from gpu_agent.engine.core import Engine
    from gpu_agent.engine.server import serve

    engine = Engine.create(settings)
    runner, bound = await serve(engine, host, port)
    gc_pauses = GcPauses().install()
    freeze_startup_heap(logging.getLogger("gpu_agent.engine"))   # the model's weights and the modules
    loop_lag = LoopLag().start()   # each streamed request's ace_timing.loop_lag_ms
    logging.getLogger("gpu_agent.engine").info(
        "serving %s with %d adapters on http://%s:%d", engine.model_name,
        len(engine.adapters.names()), host, bound)
    print(f"ace engine listening on http://{host}:{bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await loop_lag.close()
    gc_pauses.close(logging.getLogger("gpu_agent.engine"))


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings, host, port = parse_args(argv)
    asyncio.run(_main(settings, host, port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
