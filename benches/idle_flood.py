"""A store server with few file descriptors flooded with idle sockets (issue 32): the server's
CPU time while accepts fail, and how long until a new client is served.

    python benches/idle_flood.py [--fds 128] [--sockets 250] [--seconds 3] [-- SERVE_ARGS...]

Starts `python -m pstore serve` on 127.0.0.1 with RLIMIT_NOFILE lowered to --fds, opens
--sockets connections that never send a byte, measures the server's user+system CPU time over
--seconds from /proc/PID/stat, then connects a real client until it is served (at most 60 s).
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import time

import pstore


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def served(address: str) -> bool:
    try:
        return pstore.connect([address], timeout=2.0, retries=0).health() == ["SERVING"]
    except pstore.ServerError:
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fds", type=int, default=128)
    p.add_argument("--sockets", type=int, default=250)
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("serve_args", nargs="*")
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pstore", "serve", "--host", "127.0.0.1", "--port", str(port)]
    srv = subprocess.Popen(
        [*cmd, "--log-interval", "0", *a.serve_args],
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (a.fds, a.fds)),
    )
    flood: list[socket.socket] = []
    try:
        while not served(address):
            time.sleep(0.1)
        for _ in range(a.sockets):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            flood.append(s)
        time.sleep(0.5)
        c0, w0 = cpu_seconds(srv.pid), time.monotonic()
        time.sleep(a.seconds)
        cpu, wall = cpu_seconds(srv.pid) - c0, time.monotonic() - w0
        t0 = time.monotonic()
        ok = False
        while not ok and time.monotonic() - t0 < 60:
            ok = served(address)
        waited = time.monotonic() - t0
        print(
            f"server CPU {cpu:.2f} s in {wall:.2f} s; new client served: {ok} after {waited:.1f} s"
        )
    finally:
        for s in flood:
            s.close()
        srv.terminate()
        srv.wait(30)


if __name__ == "__main__":
    main()
