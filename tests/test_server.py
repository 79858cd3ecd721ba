"""Store servers and the distributed client: the same API as the embedded store, over loopback.

Servers run in this process (`pstore.server.Server`) where a test looks at the client, and as
real `pstore serve` processes where it looks at the server's life: signals, crashes, restarts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from _netutil import ServerProcess, free_port, start_servers, stop_all

import pstore
from pstore import init, optim
from pstore.server import Server


@pytest.fixture
def cluster():
    """Three in-process servers (in memory) and a client of all three."""
    servers = [Server(pstore.Store(num_shards=4, threads=2)) for _ in range(3)]
    remote = pstore.connect([s.address for s in servers], timeout=10.0)
    yield remote, servers
    for s in servers:
        s.stop(grace=1.0)


def _embedded_twin(remote_table, store: pstore.Store):
    """The same table in an embedded store."""
    t = remote_table
    return store.create_sparse_table(
        t.name, t.dim, optimizer=t.optimizer, initializer=t.initializer, seed=t.seed
    )


def test_remote_tables_match_the_embedded_store_bit_for_bit(cluster, rng):
    remote, _servers = cluster
    local = pstore.Store()
    for opt in (optim.SGD(lr=0.3, momentum=0.9), optim.Adagrad(lr=0.1), optim.Adam(lr=0.01)):
        name = type(opt).__name__.lower()
        rt = remote.create_sparse_table(
            name, 8, optimizer=opt, initializer=init.Normal(0.0, 0.1), seed=11
        )
        lt = _embedded_twin(rt, local)
        for _ in range(5):
            ids = rng.integers(-(2**62), 2**62, size=300, dtype=np.int64)
            ids[:50] = ids[50:100]  # duplicates are coalesced the same way
            grads = rng.standard_normal((300, 8), dtype=np.float32)
            np.testing.assert_array_equal(rt.pull(ids), lt.pull(ids))
            rt.push(ids, grads)
            lt.push(ids, grads)
        np.testing.assert_array_equal(rt.pull(ids), lt.pull(ids))
        assert len(rt) == len(lt)
        mask = rt.contains(np.concatenate([ids, [12345]]))
        assert mask[:-1].all() and not mask[-1]
    # Every server holds part of the rows.
    per = [s["rows"] for s in remote.table("sgd").stats()["servers"]]
    assert all(p > 0 for p in per) and sum(per) == len(remote.table("sgd"))


def test_remote_stats_sum_the_servers_huge_page_bytes(cluster):
    """Each server reports the bytes of its rows on huge pages; the client sums them."""
    remote, _ = cluster
    t = remote.create_sparse_table("big", 64)
    # About 10,000 rows of 288 bytes in each of the 12 shards: a full 2 MiB chunk each.
    t.pull(np.arange(120_000, dtype=np.int64))
    s = t.stats()
    per = [x["stats"]["huge_page_bytes"] for x in s["servers"]]
    assert len(per) == 3 and s["huge_page_bytes"] == sum(per)
    if os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"):
        assert all(p >= 4 * (2 << 20) for p in per), per
        assert s["huge_page_bytes"] <= s["bytes_used"]


def test_local_and_remote_tables_are_one_class(cluster):
    remote, _ = cluster
    local = pstore.Store()
    assert isinstance(remote, pstore.store.BaseStore) and isinstance(local, pstore.store.BaseStore)
    for store in (local, remote):
        t = store.create_sparse_table("s", 2, optimizer=optim.SGD(lr=1.0), seed=1)
        d = store.create_dense_table("d", 3, optimizer=optim.SGD(lr=1.0))
        assert type(t) is pstore.SparseTable and type(store.table("s")) is pstore.SparseTable
        assert type(d) is pstore.DenseTable and type(store["d"]) is pstore.DenseTable
        t.push([1, 2], np.ones((2, 2), np.float32))
        t.push([1], np.ones((1, 2), np.float32))
        # Row 2 was not updated by the last push (on the servers: by its server's last push,
        # and ids 1 and 2 may live on different servers, so only the sum is the same).
        assert t.evict(not_updated_for_steps=1) <= 1
        assert t.stats()["ids_pushed"] == 3 and store.tables() == ["d", "s"]
        store.flush()
    # Only store servers know stale pushes.
    with pytest.raises(pstore.InvalidArgumentError, match="store servers"):
        local.create_sparse_table("x", 2, stale_policy="drop", max_staleness=1)
    assert "x" not in local
    assert "staleness" in remote.table("s").stats() and "staleness" not in local["s"].stats()


def test_remote_store_has_the_store_api(cluster):
    remote, _ = cluster
    t = remote.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=1.0), seed=3)
    assert isinstance(t, pstore.SparseTable)
    # Creating the same table again (another worker) returns it; another config is refused.
    again = remote.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=1.0), seed=3)
    assert again.name == "emb" and again.dim == 4
    with pytest.raises(pstore.TableExistsError):
        remote.create_sparse_table("emb", 5, optimizer=optim.SGD(lr=1.0), seed=3)
    d = remote.create_dense_table("w", (2, 3), optimizer=optim.SGD(lr=0.5))
    assert isinstance(d, pstore.DenseTable)
    d.push(np.ones((2, 3), np.float32))
    np.testing.assert_allclose(d.pull(), -0.5)
    d.push_async(np.ones((2, 3), np.float32)).wait()
    assert d.step == 2
    assert remote.tables() == ["emb", "w"] and "emb" in remote and set(remote) == {"emb", "w"}
    assert isinstance(remote["w"], pstore.DenseTable)
    with pytest.raises(pstore.WrongTableKindError):
        remote.sparse_table("w")
    with pytest.raises(pstore.UnknownTableError):
        remote.table("nope")
    t.lr = 0.25
    assert remote.table("emb").lr == 0.25
    ids = np.arange(10, dtype=np.uint64)
    t.push(ids, np.ones((10, 4), np.float32))
    np.testing.assert_allclose(t.pull(ids), t.initial_rows(ids) - 0.25, atol=1e-6)
    assert t.remove(ids[:4]) == 4 and not t.contains(ids[:4]).any()
    handles = [t.push_async(ids, np.ones((10, 4), np.float32)) for _ in range(5)]
    for h in handles:
        h.wait()
    assert all(h.done() for h in handles)
    np.testing.assert_allclose(t.pull(ids[4:]), t.initial_rows(ids[4:]) - 0.25 * 6, atol=1e-6)
    remote.flush()
    remote.drop_table("w")
    assert remote.tables() == ["emb"]


def test_bad_input_is_refused_and_changes_nothing(cluster, rng):
    remote, _ = cluster
    t = remote.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=1.0))
    ids = rng.integers(0, 2**63, size=1000, dtype=np.int64)
    before = t.pull(ids)
    grads = np.ones((1000, 4), np.float32)
    grads[999, 3] = np.nan  # on one server only: no server may apply its part
    with pytest.raises(pstore.NonFiniteError, match="NaN"):
        t.push(ids, grads)
    with pytest.raises(pstore.NonFiniteError):
        t.push_async(ids, grads)
    with pytest.raises(pstore.ShapeError):
        t.push(ids, np.ones((1000, 5), np.float32))
    with pytest.raises(pstore.ShapeError):
        t.push(ids[:10], np.ones((11, 4), np.float32))
    with pytest.raises(pstore.DtypeError):
        t.push(ids, np.ones((1000, 4), np.float64))
    np.testing.assert_array_equal(t.pull(ids), before)
    assert t.stats()["pushes"] == 0


def test_wire_dtypes_round_within_their_bound():
    with Server(pstore.Store()) as srv:
        exact = pstore.connect([srv.address])
        table = exact.create_sparse_table(
            "emb", 64, optimizer=optim.SGD(lr=1.0), initializer=init.Uniform(-3.0, 3.0)
        )
        ids = np.arange(5000, dtype=np.uint64)
        truth = table.pull(ids)
        for dtype, rel in (("float16", 2.0**-11), ("bfloat16", 2.0**-8)):
            c = pstore.connect([srv.address], wire_dtype=dtype)
            assert c.wire_dtype == dtype
            got = c.table("emb").pull(ids)
            err = np.abs(got - truth)
            assert (err <= rel * np.abs(truth) + 1e-7).all()
            assert err.max() > 0  # it really went as 16 bits
        # A gradient a 16-bit wire cannot carry is refused before any server sees it.
        half = pstore.connect([srv.address], wire_dtype="float16")
        with pytest.raises(pstore.NonFiniteError, match="float16"):
            half.table("emb").push(ids[:2], np.full((2, 64), 1e6, np.float32))
        np.testing.assert_array_equal(table.pull(ids), truth)
        with pytest.raises(pstore.InvalidArgumentError):
            pstore.connect([srv.address], wire_dtype="int8")  # type: ignore[arg-type]


def test_batches_over_the_message_limit_are_split():
    with Server(pstore.Store(), max_message=64 * 1024) as srv:
        remote = pstore.connect([srv.address], max_message=48 * 1024)
        local = pstore.Store()
        t = remote.create_sparse_table("emb", 16, optimizer=optim.Adagrad(lr=0.1), seed=1)
        lt = _embedded_twin(t, local)
        ids = np.arange(200_000, dtype=np.uint64)  # 13 MB of rows: ~300 requests
        grads = np.ones((ids.size, 16), np.float32)
        t.push(ids, grads)
        lt.push(ids, grads)
        np.testing.assert_array_equal(t.pull(ids), lt.pull(ids))
        # A client that does not split gets a clear error, and the server goes on.
        big = pstore.connect([srv.address], max_message=1 << 20)
        with pytest.raises(pstore.ServerError):
            big.table("emb").pull(ids)
        assert remote.health() == ["SERVING"]


def test_tokens(tmp_path):
    with Server(pstore.Store(), token="rw-secret", read_token="ro-secret") as srv:
        rw = pstore.connect([srv.address], token="rw-secret")
        rw.create_sparse_table("emb", 4)
        ro = pstore.connect([srv.address], token="ro-secret")
        assert ro.table("emb").pull([1, 2]).shape == (2, 4)
        with pytest.raises(pstore.AuthenticationError) as e:
            ro.table("emb").push([1], np.ones((1, 4), np.float32))
        assert e.value.code == 7  # PERMISSION_DENIED
        with pytest.raises(pstore.AuthenticationError):
            ro.create_sparse_table("other", 4)
        with pytest.raises(pstore.AuthenticationError) as e:
            pstore.connect([srv.address], token="rw-secreT")
        assert e.value.code == 16  # UNAUTHENTICATED
        with pytest.raises(pstore.AuthenticationError):
            pstore.connect([srv.address])
        f = tmp_path / "token"
        f.write_text("rw-secret\n")
        assert pstore.connect([srv.address], token_file=f).tables() == ["emb"]
    with pytest.raises(pstore.InvalidArgumentError):
        Server(pstore.Store(), read_token="only-read")


def test_stale_pushes_are_applied_dropped_or_scaled():
    with Server(pstore.Store()) as srv:
        a = pstore.connect([srv.address])
        b = pstore.connect([srv.address])
        ids = np.array([7], np.uint64)
        one = np.ones((1, 1), np.float32)
        for policy, expected in (("apply", -4.0), ("drop", -3.0), ("scale", -3.0 - 1.0 / 3)):
            ta = a.create_sparse_table(
                policy,
                1,
                optimizer=optim.SGD(lr=1.0),
                initializer=init.Zeros(),
                stale_policy=policy,
                max_staleness=2,
            )
            tb = b.table(policy)
            ta.pull(ids)  # worker a reads at seq 0
            for _ in range(3):
                tb.pull(ids)
                tb.push(ids, one)  # worker b pushes three fresh gradients
            ta.push(ids, one)  # staleness 3
            assert tb.pull(ids)[0, 0] == pytest.approx(expected, abs=1e-6)
            st = ta.stats()["staleness"]
            assert st["max"] == 3 and st["pushes"] == 4
            assert st["dropped"] == (policy == "drop")
            assert st["scaled"] == (policy == "scale")


def test_training_clocks_bsp_and_ssp():
    with Server(pstore.Store()) as srv:
        w0 = pstore.connect([srv.address], mode="bsp", worker=0, num_workers=2)
        w1 = pstore.connect([srv.address], mode="bsp", worker=1, num_workers=2)
        done = threading.Event()

        def step0() -> None:
            w0.end_step()
            done.set()

        th = threading.Thread(target=step0)
        th.start()
        assert not done.wait(0.5), "BSP: worker 0 went on before worker 1 ended the step"
        w1.end_step()
        assert done.wait(10)
        th.join()
    # SSP(1): a worker may run one step ahead of the slowest, not two.
    with Server(pstore.Store()) as srv:
        s0 = pstore.connect(
            [srv.address], mode="ssp", staleness=1, worker=0, num_workers=2, barrier_timeout=0.5
        )
        s1 = pstore.connect([srv.address], mode="ssp", staleness=1, worker=1, num_workers=2)
        assert s0.end_step() == 1  # needs the slowest at >= 0
        with pytest.raises(pstore.ServerTimeoutError, match="slowest worker"):
            s0.end_step()  # clock 2 needs the slowest at >= 1: worker 1 is at 0
        s1.end_step()
        s1.end_step()
        assert s0.status()[0]["clocks"] == [2, 2]
    with pytest.raises(pstore.InvalidArgumentError):
        pstore.connect(["127.0.0.1:1"], mode="bsp")


def test_metrics_endpoint():
    with Server(pstore.Store(), metrics_port=0) as srv:
        assert srv.metrics_port
        remote = pstore.connect([srv.address])
        t = remote.create_sparse_table("emb", 4)
        t.pull(np.arange(100))
        with pytest.raises(pstore.UnknownTableError):
            remote.table("missing")
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.status == 200
            text = r.read().decode()
        assert 'pstore_requests_total{method="Pull"} 1' in text
        assert 'pstore_request_errors_total{method="GetTable",code="NOT_FOUND"} 1' in text
        assert 'pstore_request_seconds_count{method="Pull"} 1' in text
        assert 'pstore_table_rows{table="emb",kind="sparse"} 100' in text
        assert "pstore_table_staleness_mean" in text and "pstore_uptime_seconds" in text
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics_port}/nope", timeout=10)


def test_in_memory_servers_have_no_replica_metrics():
    with Server(pstore.Store(), metrics_port=0) as srv:
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    assert "pstore_uptime_seconds" in text
    assert "pstore_flush_" not in text and "pstore_replica_" not in text


# A durable server whose disk fills up (RLIMIT_FSIZE, as in test_durable's full-disk test) and
# is freed again, its metrics scraped at each step; run in a process of its own for the limit.
REPLICA_METRICS = """
import resource, signal, sys, urllib.request
import numpy as np
import pstore
from pstore.server import Server

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
store = pstore.Store(sys.argv[1], durability="sync")
t = store.create_sparse_table("t", 64)
ids = np.arange(1000, dtype=np.uint64)
with Server(store, metrics_port=0) as srv:
    def scrape(step):
        url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(("pstore_flush", "pstore_replica", "pstore_idle",
                                    "pstore_superseded")):
                    print(step, line)
    t.push(ids, np.ones((1000, 64), np.float32))
    scrape("ok")
    size = store.storage_info()["file_bytes"]
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + (2 << 20), hard))
    big = np.arange(1000, 200000, dtype=np.uint64)
    try:
        t.push(big, np.ones((len(big), 64), np.float32))
    except pstore.StorageError:
        pass
    scrape("full")
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    t.push(big, np.ones((len(big), 64), np.float32))  # the refused push (undone), retried
    store.flush()
    scrape("freed")
    print("info idle_writes", int(store.storage_info()["idle_writes"]))
store.close()
"""


def test_durable_server_metrics_show_the_replica_failing_and_recovering(tmp_path):
    r = subprocess.run(
        [sys.executable, "-c", REPLICA_METRICS, str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    m: dict[str, dict[str, float]] = {}
    for line in r.stdout.splitlines():
        step, name, value = line.split()
        m.setdefault(step, {})[name] = float(value)
    ok, full, freed = m["ok"], m["full"], m["freed"]
    assert ok["pstore_flush_failing"] == 0 and full["pstore_flush_failing"] == 1
    assert freed["pstore_flush_failing"] == 0
    # A sync push commits a cycle; the failed one commits none; the recovery commits more.
    assert ok["pstore_flush_cycles_total"] >= 1
    assert full["pstore_flush_cycles_total"] == ok["pstore_flush_cycles_total"]
    assert freed["pstore_flush_cycles_total"] > full["pstore_flush_cycles_total"]
    # All 200,000 rows are on disk after the recovery: the file grew past the limit.
    assert freed["pstore_replica_file_bytes"] > ok["pstore_replica_file_bytes"] + (2 << 20)
    assert 0 <= ok["pstore_flush_lag_seconds"] < 60
    assert ok["pstore_idle_writes"] == m["info"]["idle_writes"]
    assert ok["pstore_flush_interval_seconds"] == 0  # sync mode has no timed cycles
    for step in (ok, full, freed):  # sync mode: every write is waited for, none superseded
        assert step["pstore_superseded_writes_total"] == 0


def test_pulls_retry_until_a_restarted_server_answers(tmp_path):
    path = tmp_path / "store"
    port = free_port()
    srv = Server(pstore.Store(path=path, durability="sync"), port=port)
    remote = pstore.connect([srv.address], timeout=5.0, retries=8)
    t = remote.create_sparse_table("emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    t.push([1], np.ones((1, 4), np.float32))
    srv.stop()
    srv.store.close()

    def restart() -> None:
        time.sleep(0.3)
        restarted.append(Server(pstore.Store(path=path, durability="sync"), port=port))

    restarted: list[Server] = []
    th = threading.Thread(target=restart)
    th.start()
    try:
        np.testing.assert_array_equal(t.pull([1]), -np.ones((1, 4), np.float32))
    finally:
        th.join()
        for s in restarted:
            s.stop()


def test_unreachable_server_fails_within_the_timeout():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(pstore.ServerError) as e:
        pstore.connect([f"127.0.0.1:{port}"], timeout=1.0, retries=1)
    assert time.monotonic() - t0 < 10
    assert f"127.0.0.1:{port}" in str(e.value)


def test_serve_process_stops_cleanly_on_sigterm_and_sigint(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGINT):
        log = tmp_path / f"log-{sig}"
        p = ServerProcess("--path", str(tmp_path / f"s{sig}"), "--durability", "async", log=log)
        remote = p.wait_ready()
        t = remote.create_sparse_table(
            "emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
        )
        t.push(np.arange(100), np.ones((100, 4), np.float32))
        t0 = time.monotonic()
        assert p.stop(sig) == 0
        # The client's idle connection does not hold the stop for the grace period (30 s).
        assert time.monotonic() - t0 < 10
        lines = log.read_text().splitlines()
        assert any("event=serving" in x and f"address={p.address}" in x for x in lines)
        assert any("event=stopping" in x and signal.Signals(sig).name in x for x in lines)
        assert lines[-1].split()[2] == "event=stopped"
        # The store was flushed on the way out: async durability lost nothing.
        with pstore.Store(path=tmp_path / f"s{sig}") as s:
            np.testing.assert_array_equal(s.sparse_table("emb").pull(np.arange(100)), -1.0)


def test_killed_server_keeps_every_acknowledged_sync_push(tmp_path):
    path = str(tmp_path / "store")
    token = "t0ken"
    p = ServerProcess("--path", path, "--durability", "sync", env={"PSTORE_TOKEN": token})
    remote = p.wait_ready(token)
    remote = pstore.connect([p.address], token, timeout=2.0, retries=0)
    t = remote.create_sparse_table("emb", 8, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    acked = 0
    stop = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        nonlocal acked
        try:
            while not stop.is_set():
                t.push([acked % 50], np.ones((1, 8), np.float32))
                acked += 1
        except pstore.ServerError as e:
            errors.append(e)

    th = threading.Thread(target=train)
    th.start()
    time.sleep(1.0)
    p.proc.kill()  # SIGKILL: no flush, no goodbye
    t0 = time.monotonic()
    th.join(30)
    stop.set()
    assert errors, "the client did not notice the dead server"
    assert time.monotonic() - t0 < 10  # within its timeout (2 s) and retries
    assert acked > 10
    p.stop()
    # On its own address: a durable server keeps the hash of its cluster's server list.
    p2 = ServerProcess(
        "--path", path, "--durability", "sync", env={"PSTORE_TOKEN": token}, port=p.port
    )
    try:
        r2 = p2.wait_ready(token)
        rows = r2.table("emb").pull(np.arange(50))
        # Every acknowledged push is there; the one in flight at the kill may be too.
        applied = -rows[:, 0]
        want = np.bincount(np.arange(acked) % 50, minlength=50)
        assert (applied >= want).all() and (applied <= want + 1).all()
        assert (rows == rows[:, :1]).all()  # no torn row
    finally:
        assert p2.stop() == 0


def test_status_command(tmp_path):
    procs = start_servers(2, token="s3cret")
    try:
        remote = pstore.connect([p.address for p in procs], token="s3cret")
        remote.create_sparse_table("user", 8).pull(np.arange(1000))
        tf = tmp_path / "tok"
        tf.write_text("s3cret")
        cmd = [
            sys.executable,
            "-m",
            "pstore",
            "status",
            *[p.address for p in procs],
            "--token-file",
            str(tf),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.count("SERVING") == 2 and "user" in out.stdout
        js = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
        status = json.loads(js.stdout)
        assert [s["health"] for s in status] == ["SERVING", "SERVING"]
        assert sum(s["tables"][0]["rows"] for s in status) == 1000
        env = {k: v for k, v in os.environ.items() if k != "PSTORE_TOKEN"}
        bad = subprocess.run(cmd[:-2], capture_output=True, text=True, timeout=60, env=env)
        assert bad.returncode == 2 and "token" in bad.stderr.lower()
    finally:
        assert stop_all(procs) == [0, 0]


def _certs(d) -> tuple[str, str, str]:
    """A throwaway CA and a server certificate for localhost and 127.0.0.1, made by openssl."""
    run = lambda *a: subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)  # noqa: E731
    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=pstore test CA",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "srv.key",
        "-out",
        "srv.csr",
        "-subj",
        "/CN=localhost",
    )
    (d / "ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "srv.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "srv.pem",
        "-days",
        "2",
        "-extfile",
        "ext",
    )
    return str(d / "ca.pem"), str(d / "srv.pem"), str(d / "srv.key")


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls(tmp_path):
    ca, cert, key = _certs(tmp_path)
    with Server(pstore.Store(), tls_cert=cert, tls_key=key, token="tls-tok") as srv:
        remote = pstore.connect([srv.address], "tls-tok", tls_ca=ca, tls_domain="localhost")
        t = remote.create_sparse_table("emb", 4, initializer=init.Constant(2.0))
        np.testing.assert_array_equal(t.pull([1, 2]), 2.0)
        with pytest.raises(pstore.ServerError):
            pstore.connect([srv.address], "tls-tok", timeout=2.0, retries=0)  # plaintext
        with pytest.raises(pstore.ServerError):  # a certificate for another name
            pstore.connect(
                [srv.address],
                "tls-tok",
                tls_ca=ca,
                tls_domain="example.org",
                timeout=2.0,
                retries=0,
            )
    with pytest.raises(pstore.InvalidArgumentError, match="TLS"):
        Server(pstore.Store(), tls_cert=cert)


def test_cluster_file(tmp_path):
    ports = [free_port(), free_port()]
    (tmp_path / "token").write_text("c-tok\n")
    cluster = tmp_path / "cluster.json"
    cluster.write_text(
        json.dumps({"servers": [f"127.0.0.1:{p}" for p in ports], "token_file": "token"})
    )
    procs = [
        ServerProcess("--cluster", str(cluster), "--index", str(i), port=ports[i]) for i in range(2)
    ]
    try:
        for p in procs:
            p.wait_ready("c-tok")
        remote = pstore.connect(cluster)
        assert remote.servers == [p.address for p in procs]
        remote.create_sparse_table("emb", 4).pull(np.arange(100))
        assert [s["rows"] > 0 for s in remote.status()[0]["tables"]] == [True]
        out = subprocess.run(
            [sys.executable, "-m", "pstore", "status", "--cluster", str(cluster)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and out.stdout.count("SERVING") == 2, out.stderr
    finally:
        assert stop_all(procs) == [0, 0]
    bad = tmp_path / "bad.json"
    bad.write_text('{"servers": ["nohostport"]}')
    with pytest.raises(pstore.InvalidArgumentError, match="host:port"):
        pstore.connect(bad)


class _FrameCounter:
    """A loopback TCP relay between one client and a server that reads the server's HTTP/2
    frame headers as they pass (9 bytes: length, type, flags, stream) and keeps the lengths of
    the DATA frames (type 0)."""

    def __init__(self, target: str):
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.data_frames: list[int] = []
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        server = socket.create_connection(self.target)
        self.sockets += [client, server]
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        up = threading.Thread(target=self._pump, args=(client, server, False), daemon=True)
        down = threading.Thread(target=self._pump, args=(server, client, True), daemon=True)
        self.threads += [up, down]
        up.start()
        down.start()

    def _pump(self, src, dst, parse: bool) -> None:
        pending = b""
        skip = 0
        try:
            while chunk := src.recv(1 << 20):
                if not parse:
                    dst.sendall(chunk)
                    continue
                # Headers are recorded before their bytes go on: once the client has read a
                # frame, the relay has counted it.
                pending += chunk
                while True:
                    if skip:
                        n = min(skip, len(pending))
                        pending, skip = pending[n:], skip - n
                        if skip:
                            break
                    if len(pending) < 9:
                        break
                    length = int.from_bytes(pending[:3], "big")
                    if pending[3] == 0:
                        with self.lock:
                            self.data_frames.append(length)
                    pending, skip = pending[9:], length
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def take(self) -> list[int]:
        with self.lock:
            out, self.data_frames = self.data_frames, []
        return out

    def close(self) -> None:
        self.listener.close()
        for s in self.sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self.threads:
            t.join(timeout=10.0)
        for s in self.sockets:
            s.close()


def test_a_large_pull_answer_comes_in_large_http2_frames(rng):
    """A client accepts DATA frames of up to 1 MiB (decision 0118): a 16384 x 64 pull (4 MiB of
    rows) arrives in a few frames, not hundreds of HTTP/2's default 16 KiB, rows unchanged."""
    store = pstore.Store(num_shards=4, threads=2)
    server = Server(store)
    relay = _FrameCounter(server.address)
    try:
        remote = pstore.connect([relay.address], timeout=10.0)
        t = remote.create_sparse_table("big", 64, initializer=init.Normal(0.0, 0.1), seed=3)
        ids = rng.integers(0, 2**62, size=16384, dtype=np.int64)
        t.pull(ids)  # creates the rows
        relay.take()
        rows = t.pull(ids)
        frames = relay.take()
        assert rows.shape == (16384, 64)
        np.testing.assert_array_equal(rows, store.table("big").pull(ids))
        big = [n for n in frames if n > 0]
        assert sum(big) >= rows.nbytes
        assert max(big) > 16384, f"DATA frames of at most {max(big)} bytes"
        assert len(big) <= 32, f"{len(big)} DATA frames for one 4 MiB answer"
        # A push through the same connection applies as an in-process one does.
        grads = rng.standard_normal((16384, 64), dtype=np.float32)
        twin = _embedded_twin(t, pstore.Store())
        twin.pull(ids)
        t.push(ids, grads)
        twin.push(ids, grads)
        np.testing.assert_array_equal(t.pull(ids), twin.pull(ids))
        remote.close()
    finally:
        relay.close()
        server.stop(grace=1.0)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_server_process_keeps_its_receive_buffers_between_large_pushes(rng):
    """`pstore serve` keeps freed buffers (decision 0118): after a warm-up, a 65536 x 64 push
    (16 MiB of gradients, received into fresh HTTP/2 frame buffers) no longer faults in the
    pages of those buffers again each time (4096 pages per push with glibc's defaults)."""
    (proc,) = start_servers(1)
    try:
        client = pstore.connect([proc.address], timeout=30.0)
        t = client.create_sparse_table("w", 64, optimizer=optim.SGD(lr=0.01))
        twin = _embedded_twin(t, pstore.Store())
        ids = rng.integers(0, 2**62, size=65536, dtype=np.int64)
        grads = rng.standard_normal((65536, 64), dtype=np.float32)
        t.pull(ids)
        twin.pull(ids)
        for _ in range(3):
            t.push(ids, grads)
            twin.push(ids, grads)
        before = _minor_faults(proc.proc.pid)
        for _ in range(5):
            t.push(ids, grads)
            twin.push(ids, grads)
        per_push = (_minor_faults(proc.proc.pid) - before) / 5
        np.testing.assert_array_equal(t.pull(ids), twin.pull(ids))
        assert per_push < 1024, f"{per_push:.0f} page faults per 16 MiB push"
        client.close()
    finally:
        stop_all([proc])
