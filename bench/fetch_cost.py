"""What one remote-tier fetch costs: wall time and the client's CPU per adapter.

Serves a fixtures folder (``make fixtures`` or the bench's ``var/bench-fixtures/<id>``) with
``python -m http.server``, the benchmark's artifact store, and fetches its adapters one
after another, twice over:

- ``httpx`` and ``aiohttp``: the two GETs per adapter, streamed and hashed, with
  ``httpx.AsyncClient`` (the client the store used before 2026-12-02) and with
  ``aiohttp.ClientSession`` (the one it uses now): the clients alone;
- ``store``: :class:`gpu_agent.artifacts.ArtifactStore` as the agent runs it (a
  resident-only disk cache, so every adapter is also written, renamed and dropped).

The fetch runs on the engine host's event loop, so its CPU is the forward's:
docs/agent.md, docs/bench-history.md (2026-12-02).

    python -m bench.fetch_cost --fixtures var/bench-fixtures/<id> --adapters 200
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from gpu_agent.artifacts import CONFIG, WEIGHTS, ArtifactStore, Catalog, DiskCache
from tools.localstack import free_port, python, run_until_stopped, wait_port


def _server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _with_store(catalog: Catalog, cache: Path) -> list[float]:
    store = ArtifactStore(catalog, DiskCache(cache, 0))
    ms = []
    try:
        for spec in catalog:
            t = time.perf_counter()
            await store.ensure_local(spec, set())
            ms.append((time.perf_counter() - t) * 1e3)
    finally:
        await store.aclose()
    return ms


async def _httpx_blocks(client, url: str):
    async with client.stream("GET", url) as resp:
        resp.raise_for_status()
        async for block in resp.aiter_bytes(1 << 20):
            yield block


async def _aiohttp_blocks(session, url: str):
    async with session.get(url) as resp:
        resp.raise_for_status()
        async for block in resp.content.iter_chunked(1 << 20):
            yield block


def _clients() -> dict:
    """Client name -> (a new client, its async context manager; the blocks of one GET)."""
    import aiohttp
    import httpx

    return {"httpx": (httpx.AsyncClient, _httpx_blocks), "aiohttp": (aiohttp.ClientSession, _aiohttp_blocks)}


async def _with_client(name: str, catalog: Catalog) -> list[float]:
    """The two GETs per adapter, streamed and hashed, with one pooled client."""
    make, blocks = _clients()[name]
    ms = []
    async with make() as client:
        for spec in catalog:
            t = time.perf_counter()
            for file in (CONFIG, WEIGHTS):
                h = hashlib.sha256()
                async for block in blocks(client, spec.uri.rstrip("/") + "/" + file):
                    h.update(block)
            ms.append((time.perf_counter() - t) * 1e3)
    return ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fixtures", required=True, help="a folder with catalog.yaml and adapters/")
    ap.add_argument("--adapters", type=int, default=200, help="how many of its adapters to fetch")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    fixtures = Path(args.fixtures)
    doc = yaml.safe_load((fixtures / "catalog.yaml").read_text())
    port = free_port()
    server = subprocess.Popen([python(), "-m", "http.server", str(port), "--bind", "127.0.0.1",
                               "--directory", str(fixtures)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict = {"adapters": 0, "runs": []}
    try:
        wait_port(port, timeout=30, proc=server)
        with tempfile.TemporaryDirectory(prefix="ace-fetch-cost-") as tmp:
            doc["adapters"] = [{**a, "uri": f"http://127.0.0.1:{port}/{a['uri']}"}
                               for a in doc["adapters"][:args.adapters]]
            (Path(tmp) / "catalog.yaml").write_text(yaml.safe_dump(doc))
            catalog = Catalog.from_yaml(Path(tmp) / "catalog.yaml")
            out["adapters"] = n = len(catalog)
            out["mean_bytes"] = round(statistics.mean(s.size_bytes for s in catalog))
            for r in range(args.rounds):
                for client in ("httpx", "aiohttp", "store"):
                    cpu, srv = time.process_time(), _server_cpu_s(server.pid)
                    if client == "store":
                        ms = asyncio.run(_with_store(catalog, Path(tmp) / f"cache-{r}"))
                    else:
                        ms = asyncio.run(_with_client(client, catalog))
                    run = {"client": client, "round": r, "wall_ms_p50": round(statistics.median(ms), 2),
                           "client_cpu_ms_per_fetch": round((time.process_time() - cpu) * 1e3 / n, 2),
                           "store_cpu_ms_per_fetch": round((_server_cpu_s(server.pid) - srv) * 1e3 / n, 2)}
                    out["runs"].append(run)
                    print(json.dumps(run), file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
