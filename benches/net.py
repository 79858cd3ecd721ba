"""W6's servers on loopback: a pstore server process, redis-server and the bare-TCP floor
(``tcp_floor.py``), started on free ports and stopped by their pids.

Both run as child processes of the benchmark, logging to files in a temporary directory; a
server that exits early has its log's last lines put in the error.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

REDIS_SERVER = "/usr/bin/redis-server"  # Debian's package; else the first on PATH
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (bound to port 0, read back, closed)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_server_path() -> str | None:
    if os.access(REDIS_SERVER, os.X_OK):
        return REDIS_SERVER
    return shutil.which("redis-server")


class ServerProcess:
    """A server child process whose stdout and stderr go to a log file."""

    def __init__(
        self, name: str, argv: list[str], cwd: Path, address: str, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.argv = argv
        self.address = address
        self.log_path = cwd / f"{name}.log"
        with open(self.log_path, "wb") as logf:
            self.proc = subprocess.Popen(
                argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf
            )
        self.pid = self.proc.pid
        self.returncode: int | None = None

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def log_errors(self) -> list[str]:
        """Log lines that report an error (logfmt level=error or warn; Redis errors)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        keys = ("level=error", "level=warn", "# Error", "# Fatal", "# FATAL")
        return [line for line in text.splitlines() if any(k in line for k in keys)]

    def wait_ready(self, check: Callable[[], Any], timeout: float = START_TIMEOUT_S) -> Any:
        """Call `check` until it returns without raising; fails if the process exits first."""
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if not self.running():
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode} while starting: "
                    f"{self.log_tail()}"
                )
            try:
                return check()
            except Exception as exc:
                last = exc
                time.sleep(0.05)
        raise TimeoutError(f"{self.name} not ready after {timeout:g} s: {last!r}")

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM by pid, wait; SIGKILL by pid if it has not exited after `timeout` seconds."""
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode


def start_pstore_server(
    pstore: ModuleType, search_dir: str, workdir: Path, *, rows_port: bool = False
) -> ServerProcess:
    """`python -m pstore serve` in memory on a free port, importing the benchmarked pstore;
    with `rows_port`, also on a rows port (`--rows-port 0`, decision 0128).

    The child runs in `workdir` (not the repository: `python -m` puts the working directory
    first on sys.path) with `search_dir` first on PYTHONPATH.
    """
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (search_dir, env.get("PYTHONPATH")) if p)
    argv = [sys.executable, "-m", "pstore", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--log-interval", "0"] + (["--rows-port", "0"] if rows_port else [])
    server = ServerProcess("pstore-server", argv, workdir, f"127.0.0.1:{port}", env)
    wait_serving(pstore, server)
    return server


def wait_serving(pstore: ModuleType, server: ServerProcess) -> None:
    """Wait until `server` answers SERVING to a health check; stop it if it never does."""

    def check() -> None:
        probe = pstore.connect([server.address], timeout=2.0, retries=0)
        try:
            health = probe.health()
            if health != ["SERVING"]:
                raise RuntimeError(f"health {health}")
        finally:
            probe.close()

    try:
        server.wait_ready(check)
    except BaseException:
        server.stop()
        raise


def start_tcp_floor(workdir: Path) -> ServerProcess:
    """``tcp_floor.py`` on a free 127.0.0.1 port (see that module)."""
    port = free_port()
    script = str(Path(__file__).resolve().parent / "tcp_floor.py")
    server = ServerProcess(
        "tcp-floor", [sys.executable, script, str(port)], workdir, f"127.0.0.1:{port}"
    )

    def check() -> None:
        socket.create_connection(("127.0.0.1", port), timeout=2.0).close()

    try:
        server.wait_ready(check)
    except BaseException:
        server.stop()
        raise
    return server


def start_redis(redis: ModuleType, path: str, workdir: Path) -> tuple[ServerProcess, Any]:
    """redis-server on a free 127.0.0.1 port, nothing persisted; returns it and a redis-py
    client (thread-safe: each call takes a connection from the client's pool)."""
    port = free_port()
    argv = [path, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(workdir)]
    server = ServerProcess("redis-server", argv, workdir, f"127.0.0.1:{port}")
    client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=120)
    try:
        server.wait_ready(client.ping)
    except BaseException:
        server.stop()
        raise
    return server, client
