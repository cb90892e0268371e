"""Run the real agent process (`python -m gpu_agent serve`) for integration tests."""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from tests.support.procs import free_port, python, running, wait_port

TOKEN = "agent-test-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class AgentProc:
    grpc_port: int
    metrics_port: int
    log: Path
    engine_url: str | None = None
    pid: int = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text

    def metric(self, series: str) -> float:
        """Value of one series (name plus exact label text), 0 when absent."""
        m = re.search(r"^" + re.escape(series) + r" (\S+)$", self.metrics(), re.M)
        return float(m.group(1)) if m else 0.0


@contextlib.contextmanager
def agent_process(catalog: Path, work: Path, engine: str, extra: Sequence[str] = (),
                  engine_url: str | None = None, timeout: float = 120.0,
                  grpc_port: int | None = None) -> Iterator[AgentProc]:
    grpc_port, metrics_port = grpc_port or free_port(), free_port()
    log = work / f"agent-{grpc_port}.log"
    cmd = [python(), "-m", "gpu_agent", "serve", "--catalog", str(catalog), "--engine", engine,
           "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
           "--cache-dir", str(work / "agent-cache"), "--auth", "token", *extra]
    if engine_url:
        cmd += ["--engine-url", engine_url]
    with running(cmd, log, env={"ACE_AGENT_TOKEN": TOKEN}, dump_stacks_on_error=True) as proc:
        wait_port(grpc_port, timeout=timeout, proc=proc, log=log)
        wait_port(metrics_port, timeout=timeout, proc=proc, log=log)
        yield AgentProc(grpc_port, metrics_port, log, engine_url, proc.pid)
