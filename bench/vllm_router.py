"""The ``vllm_router`` arms: vLLM's own router (``vllm-router`` from PyPI) in front of the hosts.

``vllm-router`` 0.1.17 is a Rust binary a vLLM user installs with pip; ``make`` puts it
in its own venv (``.venv-router``). The arms run it as a user would configure it, over
the same engine hosts the gateway's arms use, and the client sends what it sends in
every arm (the adapter as ``model``, its session as ``x-ace-session-id`` and ``user``):

- ``vllm_router``: the default policy, ``cache_aware`` (prefix-cache affinity by
  request text, load balanced);
- ``vllm_router_session``: ``consistent_hash``, which keys on ``X-Session-ID`` and the
  like, else on the body's ``user`` field: here the session the client already sends.

No policy of the router reads the request's ``model``.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Sequence

from tools.localstack import free_port, running, wait_http

__all__ = ["ROUTER_ARMS", "ROUTER_BIN", "vllm_router"]

ROUTER_ARMS = {"vllm_router": "cache_aware", "vllm_router_session": "consistent_hash"}
ROUTER_BIN = Path(__file__).resolve().parents[1] / ".venv-router" / "bin" / "vllm-router"


@contextlib.contextmanager
def vllm_router(worker_urls: Sequence[str], policy: str, work: Path, binary: Path = ROUTER_BIN) -> Iterator[str]:
    """``vllm-router`` with ``policy`` over ``worker_urls`` on a loopback port; yields its
    URL once ``/health`` answers, stops it on exit (log ``work/vllm-router-<policy>.log``)."""
    if not Path(binary).is_file():
        raise FileNotFoundError(f"{binary} is missing: make installs vllm-router into .venv-router "
                                f"(or pip install vllm-router==0.1.17 into a venv of your own)")
    port = free_port()
    log = work / f"vllm-router-{policy}.log"
    cmd = [str(binary), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
           "--policy", policy, "--prometheus-port", str(free_port())]
    with running(cmd, log) as proc:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=120, proc=proc, log=log)
        yield f"http://127.0.0.1:{port}"
