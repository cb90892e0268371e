"""Real vLLM engine hosts (CPU build, its own venv) behind the gateway: benchmarks and tests.

Every host is what a user deploys: one vLLM process started with
``--enable-lora --max-loras N --max-cpu-loras S --max-lora-rank R``, runtime LoRA
updating on (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) and the filesystem resolver
(``VLLM_PLUGINS=lora_filesystem_resolver``) for on-demand loads, with ace's plugins
(``VLLM_PLUGINS``: the evicting unload, ``tools/vllm_evict``, and the measuring one), plus
one GPU agent with the vLLM connector (``--engine vllm --max-cpu-loras S --vllm-resolver
--vllm-unload-evicts``) driving it. One ext_proc and one Envoy sit in front (``tools.localstack.gateway_front``). Flags and environment
follow /work/shared/ENGINES.md ("Running a real vLLM here"); the numbers that size a
fleet on this machine are in docs/engine.md ("Real vLLM hosts").

The resolver only accepts adapters whose ``base_model_name_or_path`` equals vLLM's
``--model`` string, so the model is passed as a relative directory named like the base
model: a symlink in the host's home, which is vLLM's cwd.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from tools.localstack import free_port, gateway_front, python, running, wait_port

__all__ = ["VLLMFlags", "VLLMHost", "cpu_seconds", "peak_rss_mb", "process_tree", "vllm_fleet", "vllm_hosts"]

BASE_MODEL = "ace-tiny-llama"


@dataclass(frozen=True)
class VLLMFlags:
    """The LoRA flags one vLLM host is started with (``--max-loras`` = GPU slots,
    ``--max-cpu-loras`` = its CPU LRU cache, every slot sized for ``--max-lora-rank``)."""
    max_loras: int = 2
    max_cpu_loras: int = 2
    max_lora_rank: int = 16

    def args(self) -> list[str]:
        return ["--enable-lora", "--max-loras", str(self.max_loras), "--max-cpu-loras", str(self.max_cpu_loras),
                "--max-lora-rank", str(self.max_lora_rank)]


@dataclass
class VLLMHost:
    name: str
    home: Path
    port: int
    proc: subprocess.Popen
    started_at: float
    startup_s: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.home / "vllm.log"

    def adapters(self) -> set[str]:
        """The adapters vLLM lists in ``/v1/models`` (entries with a ``parent``)."""
        data = httpx.get(self.url + "/v1/models", timeout=10).json()["data"]
        return {m["id"] for m in data if m.get("parent")}

    def unload_all(self) -> list[str]:
        """Unregister every adapter (a fresh start for the next run on this process)."""
        names = sorted(self.adapters())
        for name in names:
            httpx.post(self.url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=30).raise_for_status()
        return names

    def resolver_loads(self) -> int:
        """vLLM's own on-demand loads: the filesystem resolver's lines in its log."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return 0
        return sum(1 for line in text.splitlines() if RESOLVED_MARK in line)


#: vLLM logs this line each time a request names an adapter it has not registered and a
#: resolver (here the filesystem one) found it: one on-demand load
#: (vllm/entrypoints/openai/serving_models.py, ``resolve_lora``).
RESOLVED_MARK = "Resolved and loaded LoRA adapter"


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (vLLM's CPU build runs its engine core in a child)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def peak_rss_mb(pid: int) -> tuple[float, float]:
    """(peak RSS, current RSS) in MiB of a process and its descendants, from /proc
    (VmHWM, VmRSS summed over the processes: the peak is an upper bound)."""
    peak = cur = 0.0
    for p in process_tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            key, _, value = line.partition(":")
            if key == "VmHWM":
                peak += int(value.split()[0]) / 1024
            elif key == "VmRSS":
                cur += int(value.split()[0]) / 1024
    return peak, cur


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its descendants so far."""
    total = 0.0
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


#: the plugins every vLLM host loads: the filesystem resolver (on-demand loads), ace's
#: evicting unload (tools/vllm_evict: an unload drops the weights from vLLM's CPU cache, so
#: the agents' victims leave it, not its LRU) and ace's measuring one (tools/vllm_measure)
VLLM_PLUGINS = ("lora_filesystem_resolver", "ace_evict", "ace_measure")


def _vllm_env(resolver_dir: Path, threads: int | None) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_NO_USAGE_STATS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1", VLLM_PLUGINS=",".join(VLLM_PLUGINS),
               VLLM_LORA_RESOLVER_CACHE_DIR=str(resolver_dir.resolve()))
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), VLLM_CPU_OMP_THREADS_BIND="nobind")
    return env


def _ready(host: VLLMHost) -> bool:
    if host.proc.poll() is not None:
        raise RuntimeError(f"vLLM {host.name} exited with {host.proc.returncode}:\n"
                           + host.log.read_text(errors="replace")[-4000:])
    try:
        return httpx.get(host.url + "/v1/models", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def vllm_hosts(vllm_python: str, model_dir: Path, resolver_dir: Path, work: Path, hosts: int, flags: VLLMFlags,
               *, timeout_s: float = 600.0, lora_modules: Sequence[tuple[str, Path]] = ()) -> Iterator[list[VLLMHost]]:
    """``hosts`` vLLM processes, all started before any is waited on (start-up is mostly
    import and model set-up: they overlap), each under ``work/vllm-<i>``; yields them
    ready (``/v1/models`` answers), each with its measured ``startup_s``; stops them all.
    ``lora_modules``: (name, directory) pairs registered at start-up (``--lora-modules
    name=path``, what a deployment without runtime loading lists), on every host."""
    threads = max(1, (os.cpu_count() or 1) // hosts)
    started: list[VLLMHost] = []
    try:
        for i in range(1, hosts + 1):
            home = work / f"vllm-{i}"
            home.mkdir(parents=True, exist_ok=True)
            link = home / BASE_MODEL
            if not link.exists():
                link.symlink_to(model_dir.resolve(), target_is_directory=True)
            port = free_port()
            cmd = [vllm_python, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model", BASE_MODEL,
                   "--served-model-name", BASE_MODEL, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "float32", "--max-model-len", "256", "--enforce-eager",
                   "--kv-cache-memory-bytes", "67108864", "--max-num-seqs", "8", *flags.args()]
            if lora_modules:
                cmd += ["--lora-modules", *(f"{name}={Path(path).resolve()}" for name, path in lora_modules)]
            with open(home / "vllm.log", "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(home),
                                        env=_vllm_env(resolver_dir, threads), start_new_session=True)
            started.append(VLLMHost(f"vllm-{i}", home, port, proc, time.monotonic()))
        deadline = time.monotonic() + timeout_s
        waiting = list(started)
        while waiting:
            for host in list(waiting):
                if _ready(host):
                    host.startup_s = time.monotonic() - host.started_at
                    waiting.remove(host)
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"vLLM {waiting[0].name} not ready in {timeout_s:.0f}s:\n"
                                   + waiting[0].log.read_text(errors="replace")[-4000:])
            time.sleep(0.25)
        yield started
    finally:
        for host in started:
            if host.proc.poll() is None:
                host.proc.terminate()
        for host in started:
            try:
                host.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                host.proc.kill()
                host.proc.wait(timeout=10)


@contextlib.contextmanager
def vllm_fleet(work: Path, catalog: Path, model_dir: Path, resolver_dir: Path, vllm_python: str, hosts: int,
               flags: VLLMFlags, write_state, *, token: str, agent_args: Sequence[str] = (),
               extproc_args: Sequence[str] = (), message_timeout: str = "30s",
               engines: list[VLLMHost] | None = None) -> Iterator[dict]:
    """``vllm_hosts`` plus one agent per host (vLLM connector, its device tier sized like
    vLLM's CPU cache) and the gateway in front. ``write_state(path, hosts)`` writes the
    gateway's state (``hosts``: ``{"name", "engine", "agent"}`` each) and its return is
    yielded as ``state``. Yields ``gateway`` (Envoy's URL), ``hosts`` (each also with
    ``vllm`` (a ``VLLMHost``), ``engine_url``, ``metrics``) and ``state``. ``engines``:
    vLLM processes already running (``vllm_hosts``) to put the agents beside, instead of
    starting ``hosts`` new ones; they are left running."""
    env = {"ACE_AGENT_TOKEN": token}
    with contextlib.ExitStack() as stack:
        if engines is None:
            engines = stack.enter_context(vllm_hosts(vllm_python, model_dir, resolver_dir, work, hosts, flags))
        started = []
        for i, engine in enumerate(engines, 1):
            home = work / f"host-{i}"
            grpc_port, metrics_port = free_port(), free_port()
            cmd = [python(), "-m", "gpu_agent", "serve", "--catalog", str(catalog), "--engine", "vllm",
                   "--engine-url", engine.url, "--max-cpu-loras", str(flags.max_cpu_loras), "--vllm-resolver",
                   "--vllm-unload-evicts",
                   "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port),
                   "--cache-dir", str(home / "agent-cache"), "--auth", "token", *agent_args]
            proc = stack.enter_context(running(cmd, home / "agent.log", env=env))
            started.append((proc, home / "agent.log", {
                "name": f"engine-{i}", "engine": f"127.0.0.1:{engine.port}", "agent": f"127.0.0.1:{grpc_port}",
                "engine_url": engine.url, "vllm": engine, "grpc_port": grpc_port,
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}))
        for proc, log, host in started:
            wait_port(host["grpc_port"], timeout=120, proc=proc, log=log)
            wait_port(int(host["metrics"].rsplit(":", 1)[1].split("/")[0]), timeout=120, proc=proc, log=log)
        fleet = [host for _, _, host in started]
        state = write_state(work / "state.yaml", [{k: h[k] for k in ("name", "engine", "agent")} for h in fleet])
        port = stack.enter_context(gateway_front(work, work / "state.yaml", fleet[0]["engine"], env=env,
                                                 extproc_args=extproc_args, message_timeout=message_timeout))
        yield {"gateway": f"http://127.0.0.1:{port}", "hosts": fleet, "state": state}
