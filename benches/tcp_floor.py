"""W6's floor: the bare loopback transfer of a pull's answer, with no store behind it.

Run as a child process (``python tcp_floor.py PORT``): for every 8-byte request (a little-endian
byte count) on a connection it sends that many bytes from a buffer made once, one thread per
connection. The client (:class:`TcpFloor`) times a request and the receipt of the whole answer
into a buffer it made once. A pull over TCP cannot beat this: it moves the same bytes through the
same kernel, and does the table work, the framing and the decoding on top. It tells how far the
W6 targets are from what this machine's loopback carries.

A push's floor is the same the other way: a request whose count has the top bit set is followed
by that many bytes, which the server receives into a buffer made once and answers with one byte.
"""

from __future__ import annotations

import signal
import socket
import struct
import sys
import threading

MAX_BYTES = 64 << 20
UPLOAD = 1 << 63


def _recv_exactly(conn: socket.socket, buf: memoryview) -> bool:
    """Fills `buf` from `conn`; False if the peer closed first."""
    got = 0
    while got < len(buf):
        n = conn.recv_into(buf[got:], len(buf) - got)
        if n == 0:
            return False
        got += n
    return True


def _serve(conn: socket.socket, payload: memoryview) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = bytearray(8)
        inbox = memoryview(bytearray(MAX_BYTES))
        while True:
            if not _recv_exactly(conn, memoryview(head)):
                return
            (size,) = struct.unpack("<Q", head)
            if size & UPLOAD:
                if not _recv_exactly(conn, inbox[: min(size & ~UPLOAD, MAX_BYTES)]):
                    return
                conn.sendall(b"\x01")
            else:
                conn.sendall(payload[: min(size, MAX_BYTES)])


def main(port: int) -> None:
    # SIGTERM (how the benchmark stops its servers) is a clean exit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    payload = memoryview(bytearray(MAX_BYTES))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", port))
        srv.listen(64)
        while True:
            conn, _ = srv.accept()
            threading.Thread(target=_serve, args=(conn, payload), daemon=True).start()


class TcpFloor:
    """A client of :func:`main`: ``pull(nbytes)`` asks for ``nbytes`` and receives them, on one
    connection per calling thread."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.addr = (host, int(port))
        self.local = threading.local()
        self.socks: list[socket.socket] = []
        self.lock = threading.Lock()

    def _conn(self) -> tuple[socket.socket, memoryview]:
        c = getattr(self.local, "conn", None)
        if c is None:
            s = socket.create_connection(self.addr)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            c = (s, memoryview(bytearray(MAX_BYTES)))
            self.local.conn = c
            with self.lock:
                self.socks.append(s)
        return c

    def pull(self, nbytes: int) -> int:
        s, buf = self._conn()
        s.sendall(struct.pack("<Q", nbytes))
        got = 0
        while got < nbytes:
            n = s.recv_into(buf[got:nbytes], nbytes - got)
            if n == 0:
                raise ConnectionError("the TCP floor server closed the connection")
            got += n
        return got

    def push(self, nbytes: int) -> int:
        """Sends `nbytes` (from a buffer made once) and waits for the one-byte answer."""
        s, buf = self._conn()
        nbytes = min(nbytes, MAX_BYTES)
        s.sendall(struct.pack("<Q", nbytes | UPLOAD))
        s.sendall(buf[:nbytes])
        if s.recv_into(buf[:1], 1) != 1:
            raise ConnectionError("the TCP floor server closed the connection")
        return nbytes

    def close(self) -> None:
        with self.lock:
            for s in self.socks:
                s.close()
            self.socks.clear()


if __name__ == "__main__":
    main(int(sys.argv[1]))
