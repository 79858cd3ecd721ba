"""Servers joining and leaving a running cluster (decision 0098): four worker processes train the
matrix-factorisation model of tests/test_distributed.py, connected to two servers, while a third
joins (`RemoteStore.add_server`) and one of the first two leaves (`remove_server`). The workers
follow the new list without restarting; every row ends with exactly the pushes sent for it, the
test RMSE is the one of a run without changes (the tolerance of test_distributed.py), and the
server that left holds no row. Then: a dense table larger than one message whose home moves,
the table definitions a joining server gets, the new list kept by durable servers across a
restart, the CLI, and bad input (refused, nothing changed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, free_port, start_servers, stop_all
from test_distributed import embedded_rmse  # noqa: F401
from test_reshard_online import owned, rows_per_server, train_while

import pstore

SLOTS = 16384


def rows_on(addr: str, name: str) -> int:
    """Rows of table `name` on the one server `addr` (asked alone: it may have left the list)."""
    one = pstore.connect([addr])
    try:
        return rows_per_server(one, name)[0]
    finally:
        one.close()


def test_workers_train_while_a_server_joins_and_another_leaves(cluster, embedded_rmse):  # noqa: F811
    addrs = cluster(3)
    first = addrs[:2]
    admin = pstore.connect(first)

    def change() -> tuple[dict, dict]:
        join = admin.add_server(addrs[2])
        assert admin.servers == addrs
        return join, admin.remove_server(addrs[0])

    join, leave = train_while(first, admin, embedded_rmse, change)
    assert join["slots"] == SLOTS // 3 and join["rows"] > 0, join
    assert leave["rows"] > 0 and leave["epoch"] > join["epoch"], leave
    # The list is the two that stayed; the one that left holds no row and no slot.
    assert admin.servers == [addrs[1], addrs[2]]
    final = admin.slots
    assert final["servers"] == 2 and owned(final, 0) + owned(final, 1) == SLOTS
    for name in ("count", "user_emb", "item_emb"):
        assert rows_on(addrs[0], name) == 0, name
        assert all(r > 0 for r in rows_per_server(admin, name)), name
    # A worker started later with the first list follows the servers' list at its first call.
    late = pstore.connect(first)
    ids = np.arange(1, 200, dtype=np.uint64)
    np.testing.assert_array_equal(late.table("count").pull(ids), admin.table("count").pull(ids))
    assert late.servers == [addrs[1], addrs[2]]


def test_a_dense_table_larger_than_a_message_keeps_its_value_and_tables_travel():
    # 17M floats: 68 MB, more than the default message (64 MiB); the servers and the client
    # take larger messages so the table can be pushed and pulled at all.
    big = 160 << 20
    procs = start_servers(2, "--max-message", str(big))
    try:
        a, b = (p.address for p in procs)
        store = pstore.connect([a], max_message=big)
        n = 17_000_000
        d = store.create_dense_table(
            "d", (n,), optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        g = np.random.default_rng(0).normal(size=n).astype(np.float32)
        d.push(g)
        t = store.create_sparse_table(
            "t",
            4,
            optimizer=pstore.optim.Adagrad(lr=0.5),
            stale_policy="drop",
            max_staleness=7,
        )
        t.lr = 0.25
        ids = np.arange(1, 2001, dtype=np.uint64)
        t.push(ids, np.ones((len(ids), 4), np.float32))
        rows = t.pull(ids)
        store.add_server(b)
        # The joining server knows every table as the cluster has it (not only those it got
        # rows of): definition, stale policy, learning rate.
        theirs = {x["name"]: x for x in pstore.connect([b]).status()[0]["tables"]}
        assert sorted(theirs) == ["d", "t"]
        info = pstore.connect([b]).table("t")
        assert (info.dim, info.lr) == (4, 0.25)
        # Everything to b: the dense table's home moves whatever its slot.
        r = store.remove_server(a)
        assert store.servers == [b]
        assert r["rows"] >= 1
        np.testing.assert_array_equal(store.table("d").pull(), -g)
        np.testing.assert_array_equal(store.table("t").pull(ids), rows)
        assert rows_on(a, "t") == 0
    finally:
        stop_all(procs)


def durable(path: Path, port: int | None = None) -> ServerProcess:
    """A durable server on `path`, ready."""
    p = ServerProcess("--path", str(path), port=port)
    p.wait_ready()
    return p


def sgd_rows(store: pstore.RemoteStore, n: int) -> tuple[pstore.SparseTable, np.ndarray]:
    """Table `t` (SGD, lr 1, zeros) with rows 1..n pushed once with ones: each row is -1."""
    t = store.create_sparse_table(
        "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )
    ids = np.arange(1, n + 1, dtype=np.uint64)
    t.push(ids, np.ones((len(ids), 2), np.float32))
    return t, ids


def test_durable_servers_keep_the_new_list_across_a_restart(tmp_path):
    procs: list[ServerProcess] = []
    try:
        procs += [durable(tmp_path / f"s{i}") for i in range(3)]
        addrs = [p.address for p in procs]
        store = pstore.connect(addrs[:2])
        _, ids = sgd_rows(store, 3000)
        store.add_server(addrs[2])
        store.remove_server(addrs[0])
        store.close()
        # Restart all three on their data (the one that left too); a worker with the first
        # list follows the new one, also from the server that left: it still knows it left.
        for i in range(3):
            procs[i].stop()
            procs[i] = durable(tmp_path / f"s{i}", procs[i].port)
        for start in (addrs[:2], addrs[:1]):
            again = pstore.connect(start)
            np.testing.assert_array_equal(
                again.table("t").pull(ids), np.full((len(ids), 2), -1.0, np.float32)
            )
            assert again.servers == addrs[1:]
        assert rows_on(addrs[0], "t") == 0
    finally:
        stop_all(procs)


def test_the_cli_adds_and_removes_servers(cluster):
    addrs = cluster(2)
    store = pstore.connect(addrs[:1])
    t = store.create_sparse_table("t", 2, initializer=pstore.init.Zeros())
    ids = np.arange(1, 1001, dtype=np.uint64)
    t.pull(ids)
    cmd = [sys.executable, "-m", "pstore", "cluster"]
    out = subprocess.run(
        [*cmd, "add-server", addrs[1], "--servers", addrs[0]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert f"{addrs[1]} joined the cluster" in out.stdout and "rows moved" in out.stdout
    out = subprocess.run(
        [*cmd, "remove-server", addrs[0], "--servers", addrs[0], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["servers"] == [addrs[1]]
    assert rows_on(addrs[1], "t") == len(ids) and rows_on(addrs[0], "t") == 0
    # Bad input is reported on stderr with status 2.
    out = subprocess.run(
        [*cmd, "remove-server", addrs[1], "--servers", addrs[1]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "last server" in out.stderr, out.stderr


def test_bad_list_changes_are_refused_and_change_nothing(cluster):
    addrs = cluster(3)
    store = pstore.connect(addrs[:2], timeout=3.0, retries=0)
    t = store.create_sparse_table(
        "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )
    ids = np.arange(1, 1001, dtype=np.uint64)
    t.push(ids, np.ones((len(ids), 2), np.float32))
    before = store.slots

    def unchanged() -> None:
        assert store.servers == addrs[:2] and store.slots == before
        assert rows_per_server(store, "t") == rows_per_server(pstore.connect(addrs[:2]), "t")
        assert sum(rows_per_server(store, "t")) == len(ids)
        assert rows_on(addrs[2], "t") == 0

    with pytest.raises(pstore.InvalidArgumentError, match="already in the list"):
        store.add_server(addrs[1])
    with pytest.raises(pstore.InvalidArgumentError, match="is not in the list"):
        store.remove_server(addrs[2])
    # A port nothing listens on.
    nobody = f"127.0.0.1:{free_port()}"
    with pytest.raises(pstore.InvalidArgumentError, match=f"cannot add server {nobody}.*did not"):
        store.add_server(nobody)
    with pytest.raises(TypeError, match="address must be a str"):
        store.add_server(7)  # type: ignore[arg-type]
    unchanged()
    # A server of another cluster (holding its tables) is refused.
    other = pstore.connect([addrs[2]])
    other.create_sparse_table("x", 2).pull(np.arange(1, 11, dtype=np.uint64))
    with pytest.raises(
        pstore.InvalidArgumentError,
        match=f"cannot add server {addrs[2]}: .*holds tables of the cluster",
    ):
        store.add_server(addrs[2])
    unchanged()
    # The last server cannot leave.
    single = pstore.connect([addrs[2]])
    with pytest.raises(pstore.InvalidArgumentError, match="last server"):
        single.remove_server(addrs[2])


def test_a_server_that_dies_during_a_leave_stops_it_and_a_rerun_finishes(tmp_path):
    procs: list[ServerProcess] = []
    try:
        procs += [durable(tmp_path / f"s{i}") for i in range(3)]
        addrs = [p.address for p in procs]
        store = pstore.connect(addrs, timeout=3.0, retries=0)
        t, ids = sgd_rows(store, 6000)
        store.flush()  # on disk: the kill below loses nothing of it
        # Server 2 (a receiver of the leaving server's slots, after server 1) dies once the
        # first rows reached server 1: the leave stops with an error naming it; the list is
        # unchanged, and running it again once the server is back finishes it.
        start = rows_on(addrs[1], "t")

        def kill_once_moving() -> None:
            while rows_on(addrs[1], "t") == start:
                time.sleep(0.001)
            procs[2].stop(signal.SIGKILL)

        killer = threading.Thread(target=kill_once_moving)
        killer.start()
        with pytest.raises(pstore.ServerError, match=addrs[2]):
            store.remove_server(addrs[0])
        killer.join()
        assert store.servers == addrs
        procs[2] = durable(tmp_path / "s2", procs[2].port)
        store.remove_server(addrs[0])
        assert store.servers == addrs[1:]
        np.testing.assert_array_equal(t.pull(ids), np.full((len(ids), 2), -1.0, np.float32))
        assert rows_on(addrs[0], "t") == 0
    finally:
        stop_all(procs)
