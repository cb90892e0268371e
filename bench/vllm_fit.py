"""How many real vLLM hosts fit this machine: start-up time and memory of each process.

    python -m bench.vllm_fit [--hosts 1,2] [--vllm-python .venv-vllm/bin/python] --out reports/vllm_fit.json

For each fleet size, that many vLLM processes (``tools.vllm_fleet.vllm_hosts``, the
flags a ``make bench ENGINE=vllm`` host uses) are started together; the report has each
one's start-up time (process start to ``/v1/models`` answering), its peak and current
RSS after start-up, and again after it served one 8-token completion per fixture
adapter (every one loaded on demand by the filesystem resolver, so its CPU LoRA cache
is full), with the time those completions took and the machine's load average, which
says how shared the cores were.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

from ace_common.catalog_schema import read_catalog_file
from tools.vllm_fleet import BASE_MODEL, VLLMFlags, peak_rss_mb, vllm_hosts
from tools.localstack import run_until_stopped

ROOT = Path(__file__).resolve().parents[1]


def measure(args, hosts: int, work: Path) -> dict:
    catalog = read_catalog_file(args.fixtures / "catalog.yaml")
    names = [a.name for a in catalog.adapters if a.rank <= args.max_lora_rank]
    flags = VLLMFlags(max_loras=2, max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank)
    t0 = time.monotonic()
    with vllm_hosts(args.vllm_python, args.fixtures / "model", args.fixtures / "adapters", work / f"fit-{hosts}",
                    hosts, flags) as engines:
        all_ready = time.monotonic() - t0
        rows = []
        for e in engines:
            peak, rss = peak_rss_mb(e.proc.pid)
            rows.append({"name": e.name, "startup_s": round(e.startup_s, 1), "peak_rss_mb_started": round(peak),
                         "rss_mb_started": round(rss)})
        for e, row in zip(engines, rows):
            t1 = time.monotonic()
            for name in [BASE_MODEL, *names]:
                r = httpx.post(e.url + "/v1/completions", timeout=120, json={
                    "model": name, "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0})
                r.raise_for_status()
            peak, rss = peak_rss_mb(e.proc.pid)
            row.update(completions=1 + len(names), completions_s=round(time.monotonic() - t1, 2),
                       peak_rss_mb_served=round(peak), rss_mb_served=round(rss), resolver_loads=e.resolver_loads())
    return {"hosts": hosts, "all_ready_s": round(all_ready, 1), "engines": rows,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", default="1,2", help="fleet sizes to measure, comma-separated")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--fixtures", type=Path, default=ROOT / ".fixtures")
    p.add_argument("--max-cpu-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=16)
    p.add_argument("--work", type=Path, default=ROOT / "var" / "vllm_fit")
    p.add_argument("--out", type=Path, default=ROOT / "reports" / "vllm_fit.json")
    args = p.parse_args(argv)
    runs = []
    for n in [int(x) for x in args.hosts.split(",") if x]:
        run = measure(args, n, args.work)
        print(json.dumps(run), file=sys.stderr, flush=True)
        runs.append(run)
    report = {"cpus": os.cpu_count(), "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
              "flags": VLLMFlags(2, args.max_cpu_loras, args.max_lora_rank).args(), "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(run_until_stopped(main))
