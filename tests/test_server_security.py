"""Store servers under hostile or careless use: read-only principals, idle-socket floods and
descriptor exhaustion, the connection cap, the metrics port's address, token and TLS, the
client's TLS errors, and the warnings `pstore serve` logs (issue 32). Real servers on loopback
ports, real sockets, real certificates made by openssl."""

from __future__ import annotations

import http.client
import os
import re
import resource
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, free_port

import pstore
from pstore import init, optim
from pstore.server import Server

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
DOCS = Path(__file__).resolve().parent.parent / "docs"


def _metric(text: str, name: str, port: str) -> float:
    m = re.search(rf'^{name}{{port="{port}"}} (\S+)$', text, re.M)
    assert m, f"{name}{{port={port!r}}} not in the metrics"
    return float(m.group(1))


def _scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


def _until(cond, timeout: float = 20.0, what: str = "condition"):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --- read-only principals ------------------------------------------------------------------


def test_read_only_pulls_create_nothing():
    srv = ServerProcess(env={"PSTORE_TOKEN": "rw-tok", "PSTORE_READ_TOKEN": "ro-tok"})
    try:
        rw = srv.wait_ready("rw-tok")
        t = rw.create_sparse_table(
            "emb",
            16,
            optimizer=optim.Adam(lr=0.1),
            initializer=init.Normal(std=0.5),
            seed=11,
            admit_after=0,
        )
        known = np.arange(10, dtype=np.uint64)
        t.push(known, np.ones((10, 16), np.float32))
        trained = t.pull(known)
        before = rw.status()[0]["tables"]
        stats0 = t.stats()

        ro = pstore.connect([srv.address], token="ro-tok")
        rt = ro.table("emb")
        unknown = np.arange(1_000, 201_000, dtype=np.uint64)
        got = np.concatenate([rt.pull(unknown[i : i + 50_000]) for i in range(0, 200_000, 50_000)])
        # Unknown ids read as the table's initial value, known ones as their trained row.
        local = pstore.Store().create_sparse_table(
            "emb", 16, optimizer=optim.Adam(lr=0.1), initializer=init.Normal(std=0.5), seed=11
        )
        np.testing.assert_array_equal(got, local.initial_rows(unknown))
        np.testing.assert_array_equal(rt.pull(known), trained)
        assert not rt.contains(unknown[:1000]).any()

        stats1 = t.stats()
        traffic = {"pulls", "ids_pulled", "servers"}
        assert {k: v for k, v in stats1.items() if k not in traffic} == {
            k: v for k, v in stats0.items() if k not in traffic
        }
        assert stats1["rows"] == 10 and stats1["rows_created"] == stats0["rows_created"]
        assert stats1["ids_pulled"] == stats0["ids_pulled"] + 200_000 + 10
        after = rw.status()[0]["tables"]
        for a, b in zip(before, after, strict=True):
            sa, sb = a.pop("stats"), b.pop("stats")
            assert a == b
            assert {k: v for k, v in sa.items() if k not in traffic} == {
                k: v for k, v in sb.items() if k not in traffic
            }
            assert (sb["rows"], sb["version"]) == (10, sa["version"])

        # A writer's pull still creates the rows (and reads the same values).
        np.testing.assert_array_equal(t.pull(unknown[:100]), got[:100])
        assert t.stats()["rows"] == 110
    finally:
        assert srv.stop() == 0


# --- connections: descriptor exhaustion, idle floods, the cap, the handshake timeout ------


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # Fields 14 and 15 of the file (utime, stime), counted from the state (field 3).
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _limit_files(n: int):  # type: ignore[no-untyped-def]
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))

    return lower


def test_idle_flood_with_few_descriptors_neither_spins_nor_locks_clients_out():
    mport = free_port()
    srv = ServerProcess(
        "--handshake-timeout",
        "2",
        "--max-connections",
        "100000",  # above the descriptor limit: accepting fails with EMFILE
        "--metrics-port",
        str(mport),
        preexec_fn=_limit_files(128),
    )
    flood: list[socket.socket] = []
    try:
        srv.wait_ready()
        for _ in range(250):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", srv.port))
            flood.append(s)
        time.sleep(0.5)
        # Out of descriptors, with connections pending: the accept loop pauses, it does not spin.
        cpu0, t0 = _cpu_seconds(srv.proc.pid), time.monotonic()
        time.sleep(1.5)
        cpu = _cpu_seconds(srv.proc.pid) - cpu0
        wall = time.monotonic() - t0
        assert cpu < 0.1 * wall, f"the server used {cpu:.2f} s of CPU in {wall:.2f} s"

        # Idle sockets are closed after the handshake timeout; a real client then gets in.
        def answers() -> bool:
            try:
                c = pstore.connect([srv.address], timeout=3.0, retries=0)
                return c.health() == ["SERVING"]
            except pstore.ServerError:
                return False

        _until(answers, timeout=60.0, what="a real client to be served")
        for s in flood:
            s.close()
        flood.clear()
        text = _until(lambda: _try_scrape(mport), what="the metrics")
        assert _metric(text, "pstore_accept_errors_total", "grpc") > 0
        assert _metric(text, "pstore_connections_timed_out_total", "grpc") >= 50
        assert srv.proc.poll() is None
    finally:
        for s in flood:
            s.close()
        assert srv.stop() == 0


def _try_scrape(port: int) -> str | None:
    try:
        return _scrape(port)
    except OSError:
        return None


def _closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """True when the server closes `s` within `timeout` seconds (what it sent first, such as
    its HTTP/2 settings, is read and dropped)."""
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            s.settimeout(left)
            if s.recv(4096) == b"":
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def test_connection_cap_refuses_extra_connections_cleanly():
    with Server(pstore.Store(), max_connections=3, handshake_timeout=60, metrics_port=0) as srv:
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(3)]
        try:
            _until(
                lambda: _metric(_scrape(srv.metrics_port), "pstore_connections_open", "grpc") == 3,
                what="3 open connections",
            )
            extra = socket.create_connection(("127.0.0.1", srv.port))
            assert _closed_by_peer(extra, 10.0), "a connection over the cap was kept open"
            extra.close()
            with pytest.raises(pstore.ServerError):
                pstore.connect([srv.address], timeout=3.0, retries=0)
            text = _scrape(srv.metrics_port)
            assert _metric(text, "pstore_connections_refused_total", "grpc") >= 2
            assert _metric(text, "pstore_connections_open", "grpc") == 3
            assert _metric(text, "pstore_connections_accepted_total", "grpc") == 3
            # The held ones are untouched: still open.
            assert not _closed_by_peer(idle[0], 0.2)
        finally:
            for s in idle:
                s.close()
        _until(
            lambda: _metric(_scrape(srv.metrics_port), "pstore_connections_open", "grpc") == 0,
            what="the connections to close",
        )
        assert pstore.connect([srv.address]).health() == ["SERVING"]


def test_handshake_timeout_closes_silent_connections_only():
    with Server(pstore.Store(), handshake_timeout=1.0, metrics_port=0) as srv:
        remote = pstore.connect([srv.address])
        t = remote.create_sparse_table("emb", 4)
        silent = socket.create_connection(("127.0.0.1", srv.port))
        t0 = time.monotonic()
        assert _closed_by_peer(silent, 10.0), "a silent connection stayed open"
        assert 0.8 < time.monotonic() - t0 < 8.0
        silent.close()
        time.sleep(1.5)
        # The client's connection made requests: it was not closed (no second timeout).
        assert t.pull([1]).shape == (1, 4)
        text = _scrape(srv.metrics_port)
        assert _metric(text, "pstore_connections_timed_out_total", "grpc") == 1
        assert _metric(text, "pstore_connections_accepted_total", "grpc") == 2
    for bad in ({"max_connections": 0}, {"handshake_timeout": 0.0}, {"handshake_timeout": -1.0}):
        with pytest.raises(pstore.InvalidArgumentError):
            Server(pstore.Store(), **bad)  # type: ignore[arg-type]


# --- the metrics port: its own address, token and TLS ---------------------------------------


def test_metrics_on_their_own_address_with_a_token():
    with Server(
        pstore.Store(),
        host="127.0.0.1",
        metrics_port=0,
        metrics_host="127.0.0.2",
        metrics_token="m-tok",
    ) as srv:
        port = srv.metrics_port
        assert port
        with pytest.raises(OSError):  # not on the gRPC host
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        url = f"http://127.0.0.2:{port}/metrics"
        assert _get(url)[:2] == (401, "Bearer")
        assert _get(url, "Bearer m-toK")[0] == 401
        status, _, body = _get(url, "Bearer m-tok")
        assert status == 200 and "pstore_uptime_seconds" in body


def _get(url: str, authorization: str | None = None) -> tuple[int, str | None, str]:
    """Status, WWW-Authenticate header and body of a GET."""
    headers = {"Authorization": authorization} if authorization else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return r.status, r.headers["WWW-Authenticate"], r.read().decode()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers["WWW-Authenticate"], e.read().decode()


def _self_signed(d: Path, ca_true: bool) -> tuple[str, str]:
    """`openssl req -x509` as people type it (CA:TRUE), or with CA:FALSE."""
    ext = [] if ca_true else ["-addext", "basicConstraints=critical,CA:FALSE"]
    cmd = "openssl req -x509 -newkey rsa:2048 -nodes -keyout k.pem -out c.pem -days 2"
    san = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    subprocess.run(
        [*cmd.split(), "-subj", "/CN=localhost", "-addext", san, *ext],
        cwd=d,
        check=True,
        capture_output=True,
    )
    return str(d / "c.pem"), str(d / "k.pem")


@needs_openssl
def test_metrics_over_tls(tmp_path):
    cert, key = _self_signed(tmp_path, ca_true=False)
    with Server(
        pstore.Store(), tls_cert=cert, tls_key=key, metrics_port=0, metrics_tls=True
    ) as srv:
        port = srv.metrics_port
        assert port
        with pytest.raises((http.client.HTTPException, OSError)):  # plain HTTP gets nothing
            _scrape(port)
        ctx = ssl.create_default_context(cafile=cert)
        with urllib.request.urlopen(
            f"https://localhost:{port}/metrics", context=ctx, timeout=10
        ) as r:
            assert "pstore_connections_open" in r.read().decode()
    with pytest.raises(pstore.InvalidArgumentError, match="certificate"):
        Server(pstore.Store(), metrics_port=0, metrics_tls=True)


# --- the client's TLS: the common self-signed recipe, and the documented ones ---------------


@needs_openssl
def test_ca_true_self_signed_certificate_gets_an_error_that_names_the_fix(tmp_path):
    cert, key = _self_signed(tmp_path, ca_true=True)
    with Server(pstore.Store(), tls_cert=cert, tls_key=key) as srv:
        t0 = time.monotonic()
        with pytest.raises(pstore.ServerError) as e:
            pstore.connect([srv.address], tls_ca=cert, tls_domain="localhost", retries=3)
        msg = str(e.value)
        assert "CA:TRUE" in msg and "basicConstraints=critical,CA:FALSE" in msg, msg
        assert "docs/CLUSTER.md" in msg
        # Not retried: the same certificate fails the same way.
        assert time.monotonic() - t0 < 5.0


def _recipes() -> list[str]:
    text = (DOCS / "CLUSTER.md").read_text()
    section = text.split("### TLS certificates", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", section, re.S)
    assert len(blocks) == 2, "docs/CLUSTER.md should give two certificate recipes"
    return blocks


@needs_openssl
@pytest.mark.parametrize("which", [0, 1], ids=["self-signed", "own-ca"])
def test_the_documented_certificate_recipes_work(tmp_path, which):
    block = _recipes()[which]
    subprocess.run(["sh", "-ec", block], cwd=tmp_path, check=True, capture_output=True)
    ca = tmp_path / ("server.pem" if which == 0 else "ca.pem")
    srv_cert, srv_key = tmp_path / "server.pem", tmp_path / "server.key"
    with Server(pstore.Store(), tls_cert=srv_cert, tls_key=srv_key, token="t") as srv:
        for domain in ("localhost", None):  # by name, and by the address 127.0.0.1
            remote = pstore.connect(
                [srv.address], "t", tls_ca=ca, tls_domain=domain, timeout=5.0, retries=0
            )
            assert remote.health() == ["SERVING"]


# --- warnings of `pstore serve` ---------------------------------------------------------------


def test_serve_warns_about_tokens_without_tls_off_loopback(tmp_path):
    # 192.0.2.1 (TEST-NET-1) is on no interface of this machine: the bind fails after the
    # warnings, and nothing listens beyond loopback.
    env = child_env(PSTORE_TOKEN="tok")
    r = subprocess.run(
        [sys.executable, *"-m pstore serve --host 192.0.2.1 --port 0 --metrics-port 0".split()],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode != 0
    warnings = [ln for ln in r.stderr.splitlines() if "event=insecure" in ln]
    assert any("what=token_without_tls" in w and "level=warning" in w for w in warnings), r.stderr
    assert any("what=metrics_without_token" in w for w in warnings), r.stderr
    assert "cannot listen" in r.stderr

    # On loopback, no warning; a real server starts.
    log = tmp_path / "serve.log"
    srv = ServerProcess("--metrics-port", "0", env={"PSTORE_TOKEN": "tok"}, log=log)
    try:
        srv.wait_ready("tok")
    finally:
        assert srv.stop() == 0
    text = log.read_text()
    assert "event=serving" in text and "event=insecure" not in text
