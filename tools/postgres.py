"""A throw-away PostgreSQL server for the tests and ``make demo REPLICAS=2``.

The Debian server package's binaries (``/usr/lib/postgresql/<v>/bin``); as root they
run as the ``postgres`` user (the server refuses root). The cluster lives in a fresh
temp dir, listens on 127.0.0.1 on an ephemeral port with its socket in that dir, trusts
loopback connections, and is stopped and deleted on exit, whatever happened.
"""
from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterator

from tools.localstack import free_port

__all__ = ["PostgresServer", "find_bin_dir", "postgres_server"]


def find_bin_dir() -> Path | None:
    """The newest installed server's bin dir (``ACE_PG_BIN`` overrides), or None."""
    if os.environ.get("ACE_PG_BIN"):
        return Path(os.environ["ACE_PG_BIN"])
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                   key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return found[-1].parent if found else None


class PostgresServer:
    def __init__(self, bin_dir: Path, home: Path, port: int) -> None:
        self.bin_dir, self.home, self.port = bin_dir, home, port
        self.data, self.log = home / "data", home / "postgres.log"
        self.url = f"postgresql://postgres@127.0.0.1:{port}/postgres"

    def _run(self, *args: str, timeout: float = 120) -> None:
        cmd = [str(self.bin_dir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            log = self.log.read_text()[-3000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr or done.stdout}\n{log}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        opts = (f"-p {self.port} -k {self.home} -c listen_addresses=127.0.0.1 -c fsync=off "
                "-c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "120", "start")

    def stop(self) -> None:
        """Fast shutdown: open connections are terminated, as in an outage."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "120", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


@contextlib.contextmanager
def postgres_server(bin_dir: Path | None = None) -> Iterator[PostgresServer]:
    """Start a fresh cluster; yields it (``stop()`` / ``start()`` for an outage); always
    stops and deletes it."""
    bin_dir = bin_dir or find_bin_dir()
    if bin_dir is None or not (bin_dir / "pg_ctl").exists():
        raise FileNotFoundError("PostgreSQL server binaries not found (apt-get install postgresql)")
    home = Path(tempfile.mkdtemp(prefix="ace-pg-"))   # not under a root-only tmp dir: postgres must reach it
    try:
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(home, user.pw_uid, user.pw_gid)
        server = PostgresServer(bin_dir, home, free_port())
        server.init()
        server.start()
        try:
            yield server
        finally:
            if server.running():
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    server.stop()
    finally:
        shutil.rmtree(home, ignore_errors=True)
