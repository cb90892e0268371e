"""Restarts without loss: a replica sent SIGTERM keeps serving until its successor listens.

A restart is SIGTERM to the old process, then a new one on the same address. If the old
one closed its listener at once, every stream Envoy opens until the new one listens (its
start-up, ~2 s here) would fail to connect and, fail-closed, be answered 503. So every
server flavour binds with ``SO_REUSEPORT`` (the new process can bind beside the old one),
and on SIGTERM, with its health already NOT_SERVING, the old one goes on serving until
one of:

- a successor listens on its port (another process's listening socket on that port),
- no client connection to its port is left (nothing to hand over: e.g. no Envoy),
- ``handover_s`` has passed (no successor is coming: a scale-down),

then it stops accepting, sends GOAWAY and drains its open streams (the server's grace).
What happens to a connection caught in the old listener's accept queue as it closes is
Envoy's ``retry_policy`` (connect-failure, reset) to cover.

The checks read Linux's socket tables (``/proc/net/tcp``, ``/proc/net/tcp6``) and this
process's descriptors (``/proc/self/fd``); where those do not exist the replica hands over
after ``handover_s``. ``handover_done`` is the pure decision over one reading.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from extproc.transport.health_port import ServerLifecycle

__all__ = ["HandoverEnd", "PortSocket", "await_handover", "serve_until_signal", "handover_done", "read_port_sockets",
           "own_socket_inodes"]

log = logging.getLogger(__name__)

POLL_S = 0.05
_LISTEN, _ESTABLISHED = "0A", "01"   # the kernel's TCP states, as /proc/net/tcp writes them
_TABLES = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))


class HandoverEnd(StrEnum):
    SUCCESSOR = "a successor listens on the port"
    NO_CONNECTIONS = "no client connection is open"
    TIMEOUT = "no successor within the handover time"
    OFF = "handover off"


@dataclass(frozen=True, slots=True)
class PortSocket:
    """One TCP socket of the host's tables whose local port is ours."""
    listening: bool
    established: bool
    inode: int


def read_port_sockets(port: int, tables=_TABLES) -> list[PortSocket] | None:
    """The sockets on local ``port`` (IPv4 and IPv6); None when there is no table to read."""
    found: list[PortSocket] = []
    readable = False
    want = f":{port:04X}"
    for table in tables:
        try:
            lines = table.read_text().splitlines()[1:]
        except OSError:
            continue
        readable = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or not fields[1].endswith(want):
                continue
            found.append(PortSocket(fields[3] == _LISTEN, fields[3] == _ESTABLISHED, int(fields[9])))
    return found if readable else None


def own_socket_inodes() -> set[int] | None:
    """The inodes of this process's sockets; None where /proc/self/fd does not exist."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    inodes = set()
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue   # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def handover_done(sockets: list[PortSocket] | None, own: set[int] | None) -> HandoverEnd | None:
    """Whether the handover is over for one reading of the tables; None: keep serving."""
    if sockets is None or own is None:
        return None   # cannot tell: the time limit decides
    if any(s.listening and s.inode not in own for s in sockets):
        return HandoverEnd.SUCCESSOR
    if not any(s.established and s.inode in own for s in sockets):
        return HandoverEnd.NO_CONNECTIONS
    return None


async def await_handover(listen: str, handover_s: float) -> HandoverEnd:
    """Serve on (the event loop runs; the thread-pool server's threads serve meanwhile under
    ``asyncio.run``) until the handover of ``listen`` is over; how it ended."""
    port, started = int(listen.rpartition(":")[2]), time.monotonic()
    if handover_s <= 0 or port == 0:
        return HandoverEnd.OFF
    deadline = started + handover_s
    while (end := handover_done(read_port_sockets(port), own_socket_inodes())) is None:
        if time.monotonic() >= deadline:
            end = HandoverEnd.TIMEOUT
            break
        await asyncio.sleep(POLL_S)
    log.info("handover of %s over after %.2fs: %s", listen, time.monotonic() - started, end.value)
    return end


async def serve_until_signal(lifecycle: "ServerLifecycle | None") -> None:
    """Tell ``lifecycle`` the server listens, wait for SIGTERM or SIGINT, then tell it the
    drain starts: every server flavour's life between listening and its handover."""
    if lifecycle is not None:
        lifecycle.serving()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    if lifecycle is not None:
        lifecycle.draining()
