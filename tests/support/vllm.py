"""Start and stop a real vLLM (CPU build, its own venv) on the test fixtures.

`ACE_VLLM_PYTHON` names that venv's python (`make test-vllm` sets it); without it the
tests that need vLLM are skipped with that reason. Flags as docs/agent.md says vLLM must run (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``):
runtime LoRA updating on, tiny KV cache, eager mode, loopback only.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.support.procs import REPO, free_port
from tests.support.wait import wait_until

SKIP_REASON = ("needs the real vLLM: set ACE_VLLM_PYTHON to .venv-vllm/bin/python "
               "(make test-vllm does)")
BASE_MODEL = "ace-tiny-llama"


def vllm_python() -> str:
    py = os.environ.get("ACE_VLLM_PYTHON", "")
    if not py:
        pytest.skip(SKIP_REASON)
    if not Path(py).is_file():
        pytest.fail(f"ACE_VLLM_PYTHON={py} does not exist")
    return py


class VLLMServer:
    """One vLLM process; `restart()` stops it and starts a fresh one on the same port."""

    def __init__(self, python: str, model_dir: Path, log_dir: Path, *, max_loras: int = 2,
                 max_cpu_loras: int = 2, max_lora_rank: int = 16, startup_timeout: float = 300.0,
                 resolver_dir: Path | None = None, plugins: tuple[str, ...] = ()):
        """`resolver_dir`: turn on vLLM's filesystem LoRA resolver over that directory, so a
        request naming an adapter that is not loaded loads `<dir>/<name>` on demand.
        `plugins`: general plugins vLLM loads besides (ace's: `ace_evict`, `ace_measure`)."""
        self.plugins = plugins
        self.python, self.model_dir, self.log_dir = python, model_dir, log_dir
        self.resolver_dir = resolver_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.max_cpu_loras = max_cpu_loras
        self.args = ["--max-loras", str(max_loras), "--max-cpu-loras", str(max_cpu_loras),
                     "--max-lora-rank", str(max_lora_rank)]
        self.timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.startup_s: list[float] = []

    @property
    def log(self) -> Path:
        return self.log_dir / f"vllm-{self.starts}.log"

    def start(self) -> None:
        self.starts += 1
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True",
                   VLLM_NO_USAGE_STATS="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
        model, cwd = str(self.model_dir), REPO
        if self.resolver_dir is not None:
            # The resolver only accepts adapters whose base_model_name_or_path equals vLLM's
            # --model string, so the model is passed as a relative directory named like
            # the base model (a symlink in the log dir, which becomes the cwd).
            self.log_dir.mkdir(parents=True, exist_ok=True)
            link = self.log_dir / BASE_MODEL
            if not link.exists():
                link.symlink_to(self.model_dir.resolve(), target_is_directory=True)
            model, cwd = BASE_MODEL, self.log_dir
            env.update(VLLM_PLUGINS=",".join(("lora_filesystem_resolver", *self.plugins)),
                       VLLM_LORA_RESOLVER_CACHE_DIR=str(self.resolver_dir.resolve()))
        elif self.plugins:
            env.update(VLLM_PLUGINS=",".join(self.plugins))
        cmd = [self.python, "-m", "vllm.entrypoints.launchers.api_server.entry",
               "--model", model, "--served-model-name", BASE_MODEL,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", "256", "--enforce-eager", "--kv-cache-memory-bytes", "67108864",
               "--max-num-seqs", "8", "--enable-lora", *self.args]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                         cwd=str(cwd), start_new_session=True)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            try:
                return httpx.get(self.url + "/v1/models", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            wait_until(ready, timeout=self.timeout, interval=0.25, what="vLLM ready")
        except TimeoutError as exc:
            self.stop()
            raise TimeoutError(f"{exc}:\n{self.log.read_text()[-4000:]}") from exc
        self.startup_s.append(time.monotonic() - t0)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()

    def adapters(self) -> dict[str, str]:
        """`/v1/models` adapters: name -> root (path)."""
        data = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
        return {m["id"]: m["root"] for m in data if m.get("parent")}

    def complete(self, model: str, prompt: str, max_tokens: int = 8) -> str:
        resp = httpx.post(self.url + "/v1/completions", timeout=60, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        resp.raise_for_status()
        return resp.json()["choices"][0]["text"]
