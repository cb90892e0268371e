"""Every thread's Python stack on demand, for a server that has stopped answering.

``kill -USR1 <pid>`` makes the gateway's ext_proc or an agent write the current stack of
each of its threads to stderr (its log), and go on serving. The dump is written by
``faulthandler`` from a C signal handler, so it works while the event loop, or every
thread, is stuck: a loop blocked on a lock, a copy that holds the GIL, a gRPC call that
never returns. Without it, the only way to see where a hung process waits is a debugger
attached from outside (``py-spy dump``), which a container rarely has.
"""
from __future__ import annotations

import faulthandler
import signal
import sys

#: the signal that asks for the dump (SIGTERM and SIGINT stop, SIGHUP reloads the state file)
DUMP_SIGNAL = signal.SIGUSR1
#: a line of every dump (faulthandler's heading of each thread's frames), to find one in a log
DUMP_MARKER = "most recent call first"


def install_stack_dump() -> None:
    """Dump every thread's stack to stderr on ``DUMP_SIGNAL``; the process keeps running."""
    faulthandler.register(DUMP_SIGNAL, file=sys.stderr, all_threads=True, chain=False)
