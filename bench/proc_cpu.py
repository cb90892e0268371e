"""CPU seconds each process of a bench run used, by role: where a fleet's CPU goes per arm.

Every process the bench starts (agents with their builtin engines, the ext_proc, Envoy,
the artifact store, vLLM's router) is a descendant of the bench process, which is itself
the load generator. ``snapshot`` reads each one's user + system time from Linux's
``/proc/<pid>/stat``; ``account`` turns two snapshots into seconds per role. The roles
come from the command lines (``role``), so an agent is named by its host's folder; a
process whose own command line names none (vLLM's engine core, a child of its API server)
takes its parent's.

Where ``/proc`` does not exist (not Linux), snapshots are empty and the account is ``{}``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

__all__ = ["account", "role", "snapshot"]

_PROC = Path("/proc")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01
_HOST_DIR = re.compile(r"/(host-\d+)/")


def role(cmdline: list[str]) -> str:
    """What a process is, from its argv: ``agent:host-<i>``, ``ext_proc``, ``envoy``,
    ``store``, ``vllm_router``, ``vllm`` (an engine's API server), ``pace_probe``
    (``bench.pace``), or ``other:<program>``."""
    text = " ".join(cmdline)
    if "gpu_agent" in text:
        m = _HOST_DIR.search(text)
        return f"agent:{m.group(1)}" if m else "agent"
    if "-m extproc" in text or "extproc.main" in text:
        return "ext_proc"
    if cmdline and os.path.basename(cmdline[0]).startswith("envoy"):
        return "envoy"
    if "http.server" in text:
        return "store"
    if "bench.pace" in text:
        return "pace_probe"
    if "vllm-router" in text or "vllm_router" in text or text.startswith("vllm::router"):  # its own title
        return "vllm_router"
    if "-m vllm." in text or os.path.basename(cmdline[0] if cmdline else "") == "vllm":
        return "vllm"
    return f"other:{os.path.basename(cmdline[0]) if cmdline else '?'}"


def _stat(pid: int) -> tuple[int, float] | None:
    """``(parent pid, user + system seconds)`` of one process, None if it is gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": state is field 0
    return int(fields[1]), (int(fields[11]) + int(fields[12])) * _TICK_S


def _cmdline(pid: int) -> list[str]:
    try:
        raw = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return []
    return [p.decode(errors="replace") for p in raw.split(b"\0") if p]


def snapshot(root: int | None = None) -> dict[int, tuple[str, float]]:
    """``{pid: (role, cpu seconds)}`` for ``root`` (this process, as ``client``) and every
    descendant alive now."""
    root = os.getpid() if root is None else root
    if not _PROC.is_dir():
        return {}
    stats: dict[int, tuple[int, float]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            st = _stat(int(entry.name))
            if st is not None:
                stats[int(entry.name)] = st
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    out: dict[int, tuple[str, float]] = {}
    todo: list[tuple[int, str | None]] = [(root, None)]
    while todo:
        pid, parent = todo.pop()
        if pid not in stats:
            continue
        name = "client" if pid == root else role(_cmdline(pid))
        if name.startswith("other:") and parent not in (None, "client") and not parent.startswith("other:"):
            name = parent
        out[pid] = (name, stats[pid][1])
        todo.extend((child, name) for child in children.get(pid, ()))
    return out


def account(before: Mapping[int, tuple[str, float]], after: Mapping[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds per role between two snapshots, over the processes alive at both
    (a process that started in between counts from 0), rounded to 10 ms, sorted by role."""
    out: dict[str, float] = {}
    for pid, (name, secs) in after.items():
        prev = before.get(pid)
        used = secs - (prev[1] if prev is not None and prev[0] == name else 0.0)
        out[name] = out.get(name, 0.0) + used
    return {k: round(v, 2) for k, v in sorted(out.items())}
