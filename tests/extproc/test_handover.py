"""The SIGTERM handover (extproc.transport.handover): the pure decision over a reading of the socket
tables, the tables read for real sockets (a successor in another process), and the bound.
The restart under load through Envoy: tests/integration/test_gateway_restart.py."""
from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time

import pytest

from extproc.transport.handover import (HandoverEnd, PortSocket, await_handover, handover_done, own_socket_inodes,
                              read_port_sockets)
from tests.support.wait import scaled, wait_until

OURS, THEIRS = {1, 2, 3}, 99


@pytest.mark.parametrize("sockets, expected", [
    (None, None),                                                          # no tables: the timer decides
    ([PortSocket(True, False, 1), PortSocket(False, True, 2)], None),     # ours, a client connected
    ([PortSocket(True, False, 1), PortSocket(True, False, THEIRS), PortSocket(False, True, 2)],
     HandoverEnd.SUCCESSOR),
    ([PortSocket(True, False, 1)], HandoverEnd.NO_CONNECTIONS),
    ([PortSocket(True, False, 1), PortSocket(False, True, THEIRS)],       # the successor's client only
     HandoverEnd.NO_CONNECTIONS),
    ([PortSocket(True, False, 1), PortSocket(False, False, 0)], HandoverEnd.NO_CONNECTIONS),   # TIME_WAIT
])
def test_handover_decision(sockets, expected):
    assert handover_done(sockets, OURS) == expected


def test_without_own_sockets_known_the_timer_decides():
    assert handover_done([PortSocket(True, False, THEIRS)], None) is None


TABLE = """  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 111 1 0
   1: 0100007F:1F90 0100007F:D431 01 00000000:00000000 00:00000000 00000000  1000        0 222 1 0
   2: 0100007F:1F91 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 333 1 0
   3: 0100007F:D431 0100007F:1F90 01 00000000:00000000 00:00000000 00000000  1000        0 444 1 0
"""


def test_the_table_is_read_by_local_port(tmp_path):
    (tmp_path / "tcp").write_text(TABLE)
    got = read_port_sockets(8080, (tmp_path / "tcp", tmp_path / "absent"))
    # 0x1F90 = 8080: the listener and the accepted connection; not port 8081, not the client side
    assert got == [PortSocket(True, False, 111), PortSocket(False, True, 222)]
    assert read_port_sockets(8080, (tmp_path / "absent",)) is None


def _listener() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


SUCCESSOR = """
import socket, sys, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen()
print("listening", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(read_port_sockets(1) is None, reason="no /proc/net/tcp (Linux only)")
def test_real_sockets_a_connection_holds_the_handover_until_a_successor_listens():
    with _listener() as server, socket.create_connection(server.getsockname()) as client:
        accepted, _ = server.accept()
        with accepted:
            port = server.getsockname()[1]
            assert handover_done(read_port_sockets(port), own_socket_inodes()) is None
            successor = subprocess.Popen([sys.executable, "-c", SUCCESSOR, str(port)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                assert successor.stdout.readline().strip() == "listening"
                assert handover_done(read_port_sockets(port), own_socket_inodes()) is HandoverEnd.SUCCESSOR
            finally:
                successor.stdin.close()
                successor.wait(timeout=scaled(10))
        client.close()
        wait_until(lambda: handover_done(read_port_sockets(port), own_socket_inodes())
                   is HandoverEnd.NO_CONNECTIONS, what="the accepted connection gone")


@pytest.mark.skipif(read_port_sockets(1) is None, reason="no /proc/net/tcp (Linux only)")
def test_with_a_connection_and_no_successor_the_handover_is_bounded():
    with _listener() as server, socket.create_connection(server.getsockname()):
        accepted, _ = server.accept()
        with accepted:
            listen = "127.0.0.1:%d" % server.getsockname()[1]
            started = time.monotonic()
            assert asyncio.run(await_handover(listen, 0.3)) is HandoverEnd.TIMEOUT
            assert time.monotonic() - started >= 0.3
            assert asyncio.run(await_handover(listen, 0)) is HandoverEnd.OFF
            assert asyncio.run(await_handover("127.0.0.1:0", 5)) is HandoverEnd.OFF
