"""Reload the state file without a restart: when it changes, or on SIGHUP.

A background thread compares the files the state came from (the state file and the
catalogs it includes) every ``poll_s``: their resolved path, device, inode, mtime and size.
So an edit in place, an editor's rename over the file and a Kubernetes ConfigMap update
(the kubelet writes a new timestamped directory and swaps the ``..data`` symlink: the
path resolves elsewhere, the inode changes) are all seen. ``wake()`` (SIGHUP) reloads at
once, changed or not.

A reload is ``Store.reload_file``: the whole file is validated first and swapped in as one
new immutable snapshot, so a bad edit changes nothing (every key, tenant and upstream of
the last good state keeps working). It is logged as ONE line naming the file and the
field (``state.yaml: keys[3].tenant: unknown tenant x``) and counted in
``errors``; the same bad file is not reported again at every poll, only a new change. A
file that changed while it was read (an editor writing in place, caught half-way) is
not an error: it is read again at the next poll.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from extproc.errors import ConfigError

if TYPE_CHECKING:
    from extproc.state.store import Store

__all__ = ["StateFileWatch", "fingerprint"]

log = logging.getLogger(__name__)

Fingerprint = tuple[tuple, ...]


def fingerprint(paths: Iterable[Path]) -> Fingerprint:
    """What tells a change of ``paths``: per file its resolved path, device, inode, mtime
    (ns) and size, or the error that stat gave (a file gone is a change too)."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)     # follows symlinks: a ConfigMap's ..data swap changes the inode
            out.append((os.path.realpath(path), st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError as exc:
            out.append((str(path), exc.errno))
    return tuple(out)


class StateFileWatch:
    """Watches ``store.sources`` and calls ``store.reload_file`` on a change or ``wake()``.

    ``reloads``/``errors``: successful / refused reloads; ``loaded_at``: wall time of the
    last good load (start-up counts), for ``ace_gateway_config_*`` metrics.
    ``poll_s <= 0``: no polling, only ``wake()``."""

    def __init__(self, store: Store, poll_s: float) -> None:
        self.store = store
        self.poll_s = poll_s
        self.reloads = 0
        self.errors = 0
        self.loaded_at = time.time()
        self._seen = fingerprint(store.sources)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ace-state-file-watch", daemon=True)

    def start(self) -> "StateFileWatch":
        self._thread.start()
        return self

    def wake(self) -> None:
        """Reload now (SIGHUP). Safe from a signal handler: it only sets an event."""
        self._wake.set()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            self._wake.wait(self.poll_s if self.poll_s > 0 else None)
            if self._stop.is_set():
                return
            forced = self._wake.is_set()
            self._wake.clear()
            try:
                self.check(forced)
            except Exception:          # a bug must not end the thread: the next change retries
                log.exception("state file reload failed")

    def check(self, forced: bool = False) -> bool | None:
        """One poll: reload if the files changed (or ``forced``). True: reloaded; False:
        refused; None: nothing to do (or the file changed while read: the next poll)."""
        sources = self.store.sources
        before = fingerprint(sources)
        if not forced and before == self._seen:
            return None
        try:
            self.store.reload_file()
        except ConfigError as exc:
            if fingerprint(sources) != before:    # written while we read it
                return None
            self._seen = before
            self.errors += 1
            log.error("state file reload refused, still serving the last good state: %s",
                      " ".join(str(exc).split()))
            return False
        # what was read is what ``before`` saw (or newer: then the next poll reads it again)
        self._seen = before if self.store.sources == sources else fingerprint(self.store.sources)
        self.reloads += 1
        self.loaded_at = time.time()
        log.info("state file reloaded (%s): %d keys, %d tenants, %d upstreams", "SIGHUP" if forced else "changed",
                 len(self.store.snapshot.keys), len(self.store.snapshot.tenants), len(self.store.snapshot.upstreams))
        return True
