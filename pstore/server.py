"""Store servers: a :class:`pstore.Store` answering the gRPC contract of
``proto/pstore/v1/pstore.proto`` (what ``pstore serve`` runs).

>>> store = pstore.Store(path="data", durability="sync")  # doctest: +SKIP
>>> with pstore.server.Server(store, port=7070, token="s3cret") as srv:  # doctest: +SKIP
...     srv.wait()  # until srv.stop() from another thread, or a signal in serve()
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from pstore import _native
from pstore.exceptions import InvalidArgumentError
from pstore.store import Store

__all__ = ["Server", "log_event", "run_until_signal", "serve"]


def log_event(event: str, stream: TextIO | None = None, **fields: Any) -> None:
    """One structured log line (logfmt): ``ts=... level=info event=... key=value ...``."""
    level = fields.pop("level", "info")
    ts = _dt.datetime.now(_dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    parts = [f"ts={ts}", f"level={level}", f"event={event}"]
    for k, v in fields.items():
        s = str(v)
        if not s or any(c in s for c in ' "=\n'):
            s = '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
        parts.append(f"{k}={s}")
    print(" ".join(parts), file=stream or sys.stderr, flush=True)


class Server:
    """A running store server: ``store`` served on ``host:port`` (port 0: a free port).

    Parameters
    ----------
    token : str, optional
        Every call must carry it (``authorization: Bearer <token>``). Without a token the
        server is open: bind it to a private address.
    read_token : str, optional
        A second token that may only read (pull, contains, get, list, status): for serving.
    tls_cert, tls_key : path, optional
        PEM certificate chain and key: serve TLS.
    metrics_port : int, optional
        Serve Prometheus text on ``http://metrics_host:metrics_port/metrics``.
    metrics_host : str, optional
        The metrics port's own bind address (default: ``host``), so that scrapes can stay on a
        private network while gRPC listens on a public one.
    metrics_token : str, optional
        A token every scrape must carry (``Authorization: Bearer <token>``); without one the
        metrics are open to whoever reaches the port.
    metrics_tls : bool
        Serve the metrics over HTTPS with ``tls_cert`` and ``tls_key`` (which it needs).
    max_connections : int, optional
        Connections each port keeps open at once; further ones are closed as they come
        (default: the open-file limit less 64, at most 4096).
    handshake_timeout : float, optional
        Seconds a connection may stay open before its first request, TLS handshake included
        (default 10).
    max_message : int, optional
        The largest request accepted, in bytes (default 64 MiB); clients split bigger batches.
    follow : str, optional
        ``"host:port"`` of a primary: this server is its follower. It applies the primary's
        commit log to ``store`` (which must be durable), refuses writes, and answers pulls
        without creating rows (docs/CLUSTER.md, Replication).
    replica_name : str, optional
        With ``follow``: the name this follower gives its primary (default: its address).
    replication_log_bytes, replication_log_age : optional
        A primary's commit log kept for followers: at most this many bytes (default 256 MiB)
        and seconds (default 600). A follower further behind resyncs from a full copy.
    ack_timeout : float, optional
        Seconds a push with ``ack="all"`` waits for a follower before the follower leaves the
        live set (default 5).
    members : sequence of str, optional
        The other members of this server's replica group (``pstore serve --member`` passes
        them from the cluster file). A server that starts as primary asks each of them, before
        it accepts a write, whether it is primary of a newer epoch, and then follows it: a
        primary killed before it recorded its followers cannot come back as a second primary.
    rows_port : int, optional
        Also serve pulls and pushes on this plain TCP port of ``host`` (0: any free port;
        docs/PROTOCOL.md, "Rows port"). :func:`pstore.connect` learns it from the server's status
        and sends its pulls and pushes there when every server of its list serves one (each
        server's part on its own port), answered by the same code as over gRPC (tokens, routing
        and layout checks, request ids included) without HTTP/2; anything the port refuses or
        cannot carry goes over gRPC. Not with TLS (the port is not encrypted).
    """

    def __init__(
        self,
        store: Store,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        metrics_port: int | None = None,
        token: str | None = None,
        read_token: str | None = None,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        max_message: int | None = None,
        metrics_host: str | None = None,
        metrics_token: str | None = None,
        metrics_tls: bool = False,
        max_connections: int | None = None,
        handshake_timeout: float | None = None,
        follow: str | None = None,
        replica_name: str | None = None,
        replication_log_bytes: int | None = None,
        replication_log_age: float | None = None,
        ack_timeout: float | None = None,
        members: Sequence[str] | None = None,
        rows_port: int | None = None,
    ) -> None:
        self.store: Store | None = store
        _check_port(rows_port, "rows_port")
        net = _net(
            metrics_host,
            metrics_token,
            metrics_tls,
            max_connections,
            handshake_timeout,
            follow=follow,
            replica_name=replica_name,
            replication_log_bytes=replication_log_bytes,
            replication_log_age=replication_log_age,
            ack_timeout=ack_timeout,
            members=None if members is None else [str(m) for m in members],
            rows_port=rows_port,
        )
        self._start(
            lambda cert, key: _native.Server(
                store._inner,
                host,
                port,
                metrics_port,
                token,
                read_token,
                cert,
                key,
                max_message,
                net,
            ),
            host,
            port,
            metrics_port,
            tls_cert,
            tls_key,
        )

    def _start(
        self,
        start: Callable[[bytes | None, bytes | None], _native.Server],
        host: str,
        port: int,
        metrics_port: int | None,
        tls_cert: str | os.PathLike[str] | None,
        tls_key: str | os.PathLike[str] | None,
    ) -> None:
        """Check the ports, read the TLS files, and start the native server ``start`` makes
        from the certificate and key (what every kind of server shares)."""
        _check_port(port, "port")
        _check_port(metrics_port, "metrics_port")
        self.host = host
        self._inner = start(_read(tls_cert), _read(tls_key))
        self._stopped = threading.Event()

    @property
    def port(self) -> int:
        """The gRPC port."""
        return self._inner.port

    @property
    def metrics_port(self) -> int | None:
        """The metrics port, if metrics are served."""
        return self._inner.metrics_port

    @property
    def rows_port(self) -> int | None:
        """The rows port, if it serves one."""
        return self._inner.rows_port

    @property
    def address(self) -> str:
        """``host:port``, as clients connect to it."""
        return f"{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        """True until stopped."""
        return self._inner.running

    def stop(self, grace: float = 10.0) -> None:
        """Stop taking calls, let calls in flight finish (at most ``grace`` seconds), then
        flush the store. Calling it again does nothing."""
        try:
            self._inner.stop(grace)
        finally:
            self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until stopped (True) or ``timeout`` seconds pass (False)."""
        return self._stopped.wait(timeout)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<Server {self.address} running={self.running}>"


def _net(
    metrics_host: str | None,
    metrics_token: str | None,
    metrics_tls: bool,
    max_connections: int | None,
    handshake_timeout: float | None,
    **replication: Any,
) -> str:
    """The native server's ``net`` settings (JSON of the ones given)."""
    given = {
        "metrics_host": metrics_host,
        "metrics_token": metrics_token,
        "metrics_tls": metrics_tls,
        "max_connections": max_connections,
        "handshake_timeout": handshake_timeout,
        **replication,
    }
    return json.dumps({k: v for k, v in given.items() if v is not None})


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1);
    a wildcard such as ``0.0.0.0`` is not."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    addrs = {ipaddress.ip_address(str(i[4][0]).split("%")[0]) for i in infos}
    return bool(addrs) and all(a.is_loopback for a in addrs)


def exposure_warnings(
    host: str,
    *,
    auth: bool,
    tls: bool,
    metrics_port: int | None,
    metrics_host: str | None,
    metrics_token: bool,
    metrics_tls: bool,
) -> list[dict[str, str]]:
    """What ``pstore serve`` warns about at start: a token (or a metrics scrape) sent in clear
    text to a non-loopback address, where anyone on the path can read it and replay it."""
    out = []
    if auth and not tls and not is_loopback(host):
        out.append(
            {
                "what": "token_without_tls",
                "address": host,
                "hint": "tokens cross the network in clear text: give --tls-cert and "
                "--tls-key, or listen on 127.0.0.1 (docs/CLUSTER.md)",
            }
        )
    mhost = metrics_host or host
    if metrics_port is not None and not is_loopback(mhost):
        if auth and not metrics_token:
            out.append(
                {
                    "what": "metrics_without_token",
                    "address": mhost,
                    "hint": "the metrics (table names, sizes, request counts) are open to "
                    "anyone who reaches the port: give --metrics-token-file, or "
                    "--metrics-host 127.0.0.1",
                }
            )
        elif metrics_token and not metrics_tls:
            out.append(
                {
                    "what": "metrics_token_without_tls",
                    "address": mhost,
                    "hint": "the metrics token crosses the network in clear text: give "
                    "--metrics-tls",
                }
            )
    return out


def _read(path: str | os.PathLike[str] | None) -> bytes | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return f.read()


def serve(
    store: Store,
    *,
    log_interval: float = 60.0,
    grace: float = 30.0,
    ready: threading.Event | None = None,
    restore_signals: bool = True,
    **server_args: Any,
) -> int:
    """Run a server until SIGTERM or SIGINT, logging in logfmt to stderr; returns 0.

    On the signal it stops taking calls, lets the calls in flight finish (at most ``grace``
    seconds), flushes and closes the store. Every ``log_interval`` seconds it logs the tables'
    rows and pushes. The previous signal handlers are put back on return unless
    ``restore_signals`` is false (``pstore serve``: a second signal while the process exits is
    then ignored instead of killing it).
    """

    def tick() -> None:
        for name in store.tables():
            s = store.table(name).stats()
            log_event(
                "table",
                table=name,
                rows=s["rows"],
                pushes=s["pushes"],
                pulls=s["pulls"],
                bytes=s["bytes_used"],
            )

    return run_until_signal(
        lambda: Server(store, **server_args),
        lambda srv: {
            "path": store.path or "memory",
            "durability": store.durability or "memory",
            "rows_port": srv.rows_port or "",
        },
        tick=tick,
        close=store.close,
        auth=bool(server_args.get("token")),
        tls=bool(server_args.get("tls_cert")),
        warnings=_warnings_of(server_args),
        log_interval=log_interval,
        grace=grace,
        ready=ready,
        restore_signals=restore_signals,
    )


def _warnings_of(server_args: dict[str, Any]) -> list[dict[str, str]]:
    """:func:`exposure_warnings` of the arguments of a :class:`Server`."""
    return exposure_warnings(
        server_args.get("host", "127.0.0.1"),
        auth=bool(server_args.get("token") or server_args.get("read_token")),
        tls=bool(server_args.get("tls_cert")),
        metrics_port=server_args.get("metrics_port"),
        metrics_host=server_args.get("metrics_host"),
        metrics_token=bool(server_args.get("metrics_token")),
        metrics_tls=bool(server_args.get("metrics_tls")),
    )


def run_until_signal(
    make: Callable[[], Server],
    describe: Callable[[Server], dict[str, Any]],
    *,
    tick: Callable[[], None],
    close: Callable[[], None],
    auth: bool,
    tls: bool,
    warnings: list[dict[str, str]] | None = None,
    log_interval: float,
    grace: float,
    ready: threading.Event | None,
    restore_signals: bool,
) -> int:
    """The loop of ``pstore serve`` and ``pstore serve-model``: start the server ``make``
    returns, log ``event=serving`` with ``describe(server)``, call ``tick`` every
    ``log_interval`` seconds, and on SIGTERM or SIGINT stop (at most ``grace`` seconds) and
    ``close``. Each of ``warnings`` is logged first, as ``level=warning event=insecure``.
    Returns 0 after a signal, 1 if the transport stopped by itself."""
    got: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        got.append(signum)

    # Installed before the port opens: a signal that comes as soon as a client got an answer is
    # a graceful stop too.
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        # Logged before the port opens: the settings are unsafe whether or not it opens.
        for w in warnings or []:
            log_event("insecure", None, level="warning", **w)
        srv = make()
        log_event(
            "serving",
            address=srv.address,
            metrics_port=srv.metrics_port or "",
            **describe(srv),
            auth="token" if auth else "none",
            tls="yes" if tls else "no",
            pid=os.getpid(),
        )
        if ready is not None:
            ready.set()
        next_log = time.monotonic() + log_interval
        while not got and srv.running:
            time.sleep(0.1)
            if log_interval > 0 and time.monotonic() >= next_log:
                next_log += log_interval
                tick()
        if got:
            log_event("stopping", signal=signal.Signals(got[0]).name, grace_seconds=grace)
        else:
            log_event("stopping", level="error", reason="the transport stopped")
        srv.stop(grace)
        close()
        log_event("stopped")
        return 0 if got else 1
    finally:
        for sig, handler in old.items():
            # Ignored, not reset: the interpreter resets Python handlers to the default (which
            # kills) while it shuts down, and a second SIGTERM then would end a clean exit.
            signal.signal(sig, handler if restore_signals else signal.SIG_IGN)


def _check_port(p: int | None, what: str) -> None:
    if p is not None and not 0 <= p <= 65535:
        raise InvalidArgumentError(f"{what} must be in 0..65535, got {p}")
