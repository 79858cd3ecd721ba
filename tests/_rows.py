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


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, data: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(num << 3 | 2) + _varint(len(data)) + data


def push_message(table: str, ids, grads, client: int = 0, seq: int = 0) -> bytes:
    """A `pstore.v1.PushRequest` (float32), with a request id when `client` is given."""
    msg = (
        _field(1, table.encode())
        + _field(2, np.asarray(ids, "<u8").tobytes())
        + _field(3, np.asarray(grads, "<f4").tobytes())
    )
    if client:
        msg += _field(5, struct.pack("<BQBQ", 1 << 3 | 1, client, 2 << 3 | 1, seq))
    return msg


def call_request(body: bytes, token: str = "", meta: bytes = b"", method: int = 1) -> bytes:
    """A call (`PSc1`) on the rows port: method 1 is Push."""
    t = token.encode()
    return RQ_HEAD.pack(b"PSc1", method, len(t), len(meta), len(body)) + t + meta + body
