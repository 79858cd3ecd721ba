"""The rows protocol (docs/PROTOCOL.md, "Rows port") spoken from plain sockets, for the tests of
model servers' and store servers' rows ports."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np


def rows_port_clients(port: int) -> int:
    """Established TCP connections of this machine to `port` (a rows port: the client's
    connections to it, the server's own side not counted)."""
    n = 0
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "01" and int(f[2].rsplit(":", 1)[1], 16) == port:
                n += 1
    return n


RQ_HEAD = struct.Struct("<4sIIIQ")
ANS_HEAD = struct.Struct("<4sIIIQQ")


def rows_request(table: str, ids, token: str = "", dtype: int = 0, magic: bytes = b"PSq1"):
    t, k = table.encode(), token.encode()
    ids = np.asarray(ids, dtype="<u8")
    return RQ_HEAD.pack(magic, dtype, len(t), len(k), len(ids)) + t + k + ids.tobytes()


def recv_exactly(sock, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = sock.recv(n - len(out))
        if not b:
            raise ConnectionError(f"closed after {len(out)} of {n} bytes")
        out += b
    return bytes(out)


def rows_answer(sock) -> tuple[int, int, int, int, bytes]:
    """(code, dtype, dim, generation, body) of the next answer on `sock`."""
    magic, code, dtype, dim, gen, n = ANS_HEAD.unpack(recv_exactly(sock, ANS_HEAD.size))
    assert magic == b"PSa1"
    return code, dtype, dim, gen, recv_exactly(sock, n)


def error_text(body: bytes) -> list[str]:
    out, at = [], 0
    while at < len(body):
        (n,) = struct.unpack_from("<I", body, at)
        out.append(body[at + 4 : at + 4 + n].decode())
        at += 4 + n
    return out


def closed(sock) -> bool:
    sock.settimeout(10)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
