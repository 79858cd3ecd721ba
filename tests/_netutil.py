"""Starting real store-server processes for the network tests (loopback only)."""

from __future__ import annotations

import contextlib
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pstore


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child that imports the pstore these tests import."""
    env = dict(os.environ)
    root = str(Path(pstore.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


CAN_UNSHARE_NET = os.geteuid() == 0 and all(shutil.which(c) for c in ("unshare", "ip"))
"""Whether this process may run a command in a network namespace of its own."""
UNSHARE_REASON = "a network namespace of its own (unshare --net) needs root, unshare and ip"


def run_in_loopback_namespace(
    argv: Sequence[str],
    *,
    timeout: float,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Runs `argv` in a new network namespace whose only interface is its own loopback, up.

    For what may try other addresses (Ray's dashboard asks cloud metadata addresses, torch's
    rendezvous the system resolver): there every address but 127.0.0.1 fails at once with no
    route, and the namespace goes away with its processes."""
    script = "ip link set lo up && exec " + " ".join(shlex.quote(a) for a in argv)
    return subprocess.run(
        ["unshare", "--net", "sh", "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ephemeral_low() -> int:
    """The lowest port the kernel gives to outgoing connections (Linux: 32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_PORTS = random.Random()
"""Draws the servers' ports (seeded from the OS: two test processes draw differently)."""


def free_port() -> int:
    """A port that was free a moment ago on 127.0.0.1.

    Drawn below the kernel's ephemeral range: a port taken from that range (by binding port 0)
    could be given to an outgoing connection (of a client, or of the servers among themselves)
    before the server meant for it binds it, and the server would fail with "Address already in
    use". A port below it is taken only by a server binding it on purpose."""
    low = _ephemeral_low()
    if low > 20_000:
        for _ in range(200):
            port = _PORTS.randrange(20_000, low)
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """`python -m pstore serve` on 127.0.0.1, started the way a user starts it."""

    def __init__(
        self,
        *args: str,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log: str | os.PathLike[str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
        prefix: Sequence[str] = (),
    ) -> None:
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        cmd = [
            *prefix,
            sys.executable,
            "-m",
            "pstore",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-interval",
            "0",
            *args,
        ]
        # Without `log`, stderr goes to a temporary file, read back when the server fails to
        # start (`wait_ready`) or by `stderr_tail()`, and deleted with this object.
        if log is None:
            fd, name = tempfile.mkstemp(prefix="pstore-serve-", suffix=".stderr")
            self.stderr_path: Path | None = Path(name)
            weakref.finalize(self, _unlink, name)
            self.log = os.fdopen(fd, "ab")
        else:
            self.stderr_path = None
            self.log = open(log, "ab")
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.DEVNULL,
            stderr=self.log,
            env={**os.environ, **(env or {})},
            preexec_fn=preexec_fn,
        )
        # The child holds its own descriptor.
        self.log.close()

    def wait_ready(self, token: str | None = None, timeout: float = 30.0) -> pstore.RemoteStore:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}; its stderr ends:\n"
                    + self.stderr_tail()
                )
            try:
                return pstore.connect([self.address], token, timeout=2.0, retries=0)
            except pstore.ServerError as e:
                if time.monotonic() > deadline:
                    # Stopped, so that the failed test leaves no server behind.
                    self.stop(signal.SIGKILL)
                    raise RuntimeError(
                        f"server {self.address} (pid {self.proc.pid}) did not answer within "
                        f"{timeout}s; its stderr ends:\n{self.stderr_tail()}"
                    ) from e
                time.sleep(0.05)

    def stderr_tail(self, limit: int = 4000) -> str:
        """The last `limit` bytes the server wrote to stderr (when no `log` file was given)."""
        if self.stderr_path is None:
            return "(in the log file given)"
        try:
            data = self.stderr_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode(errors="replace")

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        self.send(sig)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def _unlink(name: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(name)


def start_servers(n: int, *args: str, token: str | None = None) -> list[ServerProcess]:
    """`n` servers, ready. A server whose port was taken before it bound it is started again on
    another (at most 3 times); if one still fails, every server started here is stopped before
    the error is raised, so that the failed test leaves none behind."""
    env = {"PSTORE_TOKEN": token} if token else None
    procs = [ServerProcess(*args, env=env) for _ in range(n)]
    try:
        for i in range(n):
            for attempt in range(3):
                try:
                    procs[i].wait_ready(token)
                    break
                except RuntimeError:
                    taken = "Address already in use" in procs[i].stderr_tail()
                    if not taken or attempt == 2:
                        raise
                    procs[i].stop(signal.SIGKILL)
                    procs[i] = ServerProcess(*args, env=env)
    except BaseException:
        for p in procs:
            p.stop(signal.SIGKILL)
        raise
    return procs


def stop_all(procs: Sequence[ServerProcess]) -> list[int]:
    for p in procs:
        p.send(signal.SIGTERM)
    return [p.stop() for p in procs]


def run_threads(n: int, body: Callable[[int], Any], wait: float = 120.0) -> list[Any]:
    """`body(w)` for w in 0..n, each on a thread of its own (workers of one job in one process);
    their results in order. A worker's exception is raised here; a worker still running after
    `wait` seconds fails the test."""
    out: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(w: int) -> None:
        try:
            out[w] = body(w)
        except BaseException as e:  # re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(wait)
    assert not any(t.is_alive() for t in threads), "a worker did not finish in time"
    if errors:
        raise errors[0]
    return out


def start_workers(script: str, servers: str, n: int, *args: str) -> list[subprocess.Popen[str]]:
    """Worker processes 0..n-1 of one job: `python tests/SCRIPT --servers S --worker k
    --workers n ARGS...`, their output captured as text."""
    path = str(Path(__file__).with_name(script))
    head = [sys.executable, path, "--servers", servers]
    return [
        subprocess.Popen(
            [*head, "--worker", str(k), "--workers", str(n), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(n)
    ]
