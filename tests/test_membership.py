"""Servers joining and leaving a running cluster (decision 0098): four worker processes train the
matrix-factorisation model of tests/test_distributed.py, connected to two servers, while a third
joins (`RemoteStore.add_server`) and one of the first two leaves (`remove_server`). The workers
follow the new list without restarting; every row ends with exactly the pushes sent for it, the
test RMSE is the one of a run without changes (the tolerance of test_distributed.py), and the
server that left holds no row. Then: a dense table larger than one message whose home moves,
the table definitions a joining server gets, the new list kept by durable servers across a
restart, the CLI, and bad input (refused, nothing changed). Last, tables created while a
server joins reach it (decision 0110)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from _netutil import ServerProcess, free_port, start_servers, stop_all
from test_distributed import embedded_rmse  # noqa: F401
from test_failover import _field, _get_routing, _group, _meta, _varint
from test_replication import _wait_caught_up
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


# --- Replica groups joining and leaving (decision 0109) ---------------------------------------

GIDS = np.arange(1, 3001, dtype=np.int64)


def _pusher(store: pstore.RemoteStore) -> tuple[threading.Thread, threading.Event, list[Any]]:
    """A worker pushing gradient 1 to every id of GIDS (SGD lr 1 from zeros: each row is minus
    the pushes acknowledged) until the event is set; the list holds the pushes acknowledged and
    any error. Started."""
    t = store.sparse_table("t")
    stop = threading.Event()
    done: list[Any] = [0]

    def run() -> None:
        try:
            while not stop.is_set() or done[0] < 3:
                t.push(GIDS, np.ones((len(GIDS), 2), np.float32))
                done[0] += 1
        except Exception as e:  # reported by the test
            done.append(e)

    th = threading.Thread(target=run)
    th.start()
    return th, stop, done


def _stop_pusher(th: threading.Thread, stop: threading.Event, done: list[Any]) -> int:
    stop.set()
    th.join(120)
    assert not th.is_alive()
    assert len(done) == 1, done[1:]
    return int(done[0])


def _group_table(store: pstore.RemoteStore) -> None:
    store.create_sparse_table(
        "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )


def _routing_groups(address: str) -> list[list[str]]:
    """The replica groups of the routing `address` holds (`Routing.groups`, field 4), decoded
    from the raw answer."""
    raw = _get_routing(address)
    out: list[list[str]] = []
    for num, payload in _fields(raw):
        if num == 4:
            out.append([m.decode() for n, m in _fields(payload) if n == 1])
    return out


def _fields(raw: bytes) -> list[tuple[int, bytes]]:
    """The length-delimited fields of a message (others skipped)."""
    out, i = [], 0
    while i < len(raw):
        key, i = _read_varint(raw, i)
        num, wire = key >> 3, key & 7
        if wire == 0:
            _, i = _read_varint(raw, i)
        elif wire == 2:
            n, i = _read_varint(raw, i)
            out.append((num, raw[i : i + n]))
            i += n
        else:
            raise AssertionError(f"wire type {wire}")
    return out


def _read_varint(raw: bytes, i: int) -> tuple[int, int]:
    n = shift = 0
    while True:
        b = raw[i]
        i += 1
        n |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return n, i


def test_a_group_joins_while_a_worker_pushes_and_fails_over_after(tmp_path: Path) -> None:
    """A cluster of one group of 2 grows by a second group of 2 while a worker connected before
    the change pushes with ack="all": every row ends with exactly the pushes acknowledged, the
    new group's follower holds what its primary holds, and after the new group's primary is
    killed (SIGKILL) and its follower promoted, the same worker goes on, through the group the
    routing named, without reconnecting."""
    a0, a1 = _group(tmp_path, "a")
    b0, b1 = _group(tmp_path, "b")
    procs = [a0, a1, b0, b1]
    try:
        first = [[a0.address, a1.address]]
        worker = pstore.connect(first, ack="all", timeout=10.0)  # type: ignore[arg-type]
        _group_table(worker)
        idle = pstore.connect(first, timeout=10.0)  # type: ignore[arg-type]
        th, stop, done = _pusher(worker)
        while done[0] < 3 and len(done) == 1:
            time.sleep(0.01)
        admin = pstore.connect(first)  # type: ignore[arg-type]
        at_start = done[0]
        r = admin.add_server([b0.address, b1.address])
        assert r["slots"] == SLOTS // 2 and r["rows"] > 0, r
        assert done[0] > at_start, "the worker did not push during the change"
        n = _stop_pusher(th, stop, done)
        assert admin.servers == [a0.address, b0.address]
        assert worker.servers == [a0.address, b0.address]
        # Every member holds the routing with both groups; the joining follower got it from
        # its primary's log.
        both = [[a0.address, a1.address], [b0.address, b1.address]]
        for m in (a0, a1, b0, b1):
            assert _routing_groups(m.address) == both, m.address
        assert np.all(worker.sparse_table("t").pull(GIDS) == -n)
        # A client connected before the change, idle through it, follows it at its first call.
        assert np.all(idle.sparse_table("t").pull(GIDS) == -n)
        assert idle.servers == [a0.address, b0.address]
        # The new group's follower holds what its primary holds: reads from the followers.
        _wait_caught_up(pstore.connect([b0.address]), pstore.connect([b1.address], retries=0))
        reader = pstore.connect(both, read_from="follower")  # type: ignore[arg-type]
        assert reader.replica_groups()[1]["reads_from"] == b1.address
        assert np.all(reader.sparse_table("t").pull(GIDS) == -n)
        assert rows_on(b1.address, "t") == rows_on(b0.address, "t") > 0
        # Failover in the new group: the worker connected before the change goes on.
        b0.send(signal.SIGKILL)
        b0.proc.wait(30)
        assert pstore.promote(b1.address)["epoch"] == 2
        t = worker.sparse_table("t")
        t.push(GIDS, np.ones((len(GIDS), 2), np.float32))
        assert np.all(t.pull(GIDS) == -(n + 1))
        assert [g["primary"] for g in worker.replica_groups()] == [a0.address, b1.address]
        for p in procs:
            p.stop()
        # The durable servers keep the groups with the list.
        kept = json.loads(_meta(tmp_path / "a-a", b"cluster/routing") or b"{}")
        assert kept["groups"] == both and kept["servers"] == [a0.address, b0.address]
    finally:
        for p in procs:
            p.stop()


def test_a_group_leaves_while_a_worker_pushes_and_bad_group_changes_are_refused(
    tmp_path: Path,
) -> None:
    """Two groups of 2; one leaves (named by its follower's address) while a worker connected
    before pushes with ack="all": every row ends with exactly the pushes acknowledged, the group
    that left holds no row, on its follower neither. Before that, bad group changes are refused
    naming the problem, with nothing changed."""
    a0, a1 = _group(tmp_path, "a")
    b0, b1 = _group(tmp_path, "b")
    # c0 and its follower c1; d, a server of its own.
    c0, c1 = _group(tmp_path, "c")
    d = ServerProcess()
    d.wait_ready()
    procs = [a0, a1, b0, b1, c0, c1, d]
    try:
        both = [[a0.address, a1.address], [b0.address, b1.address]]
        admin = pstore.connect(both, timeout=5.0, retries=0)  # type: ignore[arg-type]
        _group_table(admin)
        admin.sparse_table("t").push(GIDS, np.ones((len(GIDS), 2), np.float32))
        before = admin.slots
        for bad, what in [
            ([a1.address], f"server {a1.address} is already in the list"),
            ([c0.address, a0.address], f"server {a0.address} is already in the list"),
            ([c0.address, c0.address], "given twice"),
            ([b1.address, c0.address], f"server {b1.address} is already in the list"),
            ([c0.address, f"127.0.0.1:{free_port()}"], "did not answer"),
            ([c1.address, c0.address], f"first member {c1.address} is a follower"),
            ([c0.address, d.address], f"member {d.address} is a primary, not the group's"),
        ]:
            with pytest.raises(pstore.InvalidArgumentError, match=what):
                admin.add_server(bad)
        with pytest.raises(pstore.InvalidArgumentError, match="position 2 is not in the list"):
            admin.remove_server(2)
        with pytest.raises(TypeError, match="list of them"):
            admin.add_server([c0.address, 7])  # type: ignore[list-item]
        assert admin.slots == before and admin.servers == [a0.address, b0.address]
        assert sum(rows_per_server(admin, "t")) == len(GIDS)

        worker = pstore.connect(both, ack="all", timeout=10.0)  # type: ignore[arg-type]
        idle = pstore.connect(both, timeout=10.0)  # type: ignore[arg-type]
        th, stop, done = _pusher(worker)
        while done[0] < 3 and len(done) == 1:
            time.sleep(0.01)
        at_start = done[0]
        r = admin.remove_server(b1.address)
        assert r["slots"] == owned(before, 1) > 0 and r["rows"] > 0, r
        assert done[0] > at_start, "the worker did not push during the change"
        n = _stop_pusher(th, stop, done) + 1
        assert admin.servers == [a0.address]
        assert np.all(worker.sparse_table("t").pull(GIDS) == -n)
        # A client idle through the change follows it at its first call on rows: group b
        # answers "moved" (it is past the end of the list), pointing to the list without it.
        assert np.all(idle.sparse_table("t").pull(GIDS) == -n)
        assert idle.servers == [a0.address]
        assert rows_on(b0.address, "t") == 0
        assert _routing_groups(a1.address) == [[a0.address, a1.address]]
        _wait_caught_up(pstore.connect([b0.address]), pstore.connect([b1.address], retries=0))
        assert rows_on(b1.address, "t") == 0
    finally:
        for p in procs:
            p.stop()


def _set_routing_without_groups(address: str, epoch: int, servers: list[str], index: int) -> None:
    """A SetRouting as a version before groups sends it (Routing fields 1-3 only), with plain
    grpcio: every slot to position 0."""
    owners = (
        _varint(1 << 3)
        + _varint(epoch)  # epoch
        + _varint(2 << 3)
        + _varint(len(servers))  # servers
        + _field(3, b"\x00")  # starts [0]
        + _field(4, b"\x00")  # owners [0]
    )
    routing = _field(1, owners) + b"".join(_field(2, s.encode()) for s in servers)
    routing += _varint(3 << 3) + _varint(index)
    with grpc.insecure_channel(address) as ch:
        ch.unary_unary(
            "/pstore.v1.PStore/SetRouting",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )(_field(1, routing), timeout=20)


def test_an_old_routing_without_groups_still_reads(tmp_path: Path) -> None:
    """A routing published by a version before groups were carried (no `groups`): servers hold
    it and keep it in the old form, and a worker connected with replica groups follows it
    keeping its groups (a failover after it still works)."""
    a0, a1 = _group(tmp_path, "a")
    b0, b1 = _group(tmp_path, "b")
    procs = [a0, a1, b0, b1]
    try:
        both = [[a0.address, a1.address], [b0.address, b1.address]]
        worker = pstore.connect(both, ack="all", timeout=10.0)  # type: ignore[arg-type]
        _group_table(worker)
        names = [a0.address, b0.address]
        for i, p in enumerate((a0, b0)):
            _set_routing_without_groups(p.address, 1, names, i)
        assert _get_routing(a1.address) == _get_routing(a0.address) != b""
        assert _routing_groups(a0.address) == []
        # The worker (routing epoch 0) meets "moved" on group b, takes the routing over the
        # same list and keeps its groups.
        t = worker.sparse_table("t")
        t.push(GIDS, np.ones((len(GIDS), 2), np.float32))
        assert worker.slots["epoch"] == 1 and worker.slots["ranges"] == [[0, SLOTS, 0]]
        assert rows_on(a0.address, "t") == len(GIDS) and rows_on(b0.address, "t") == 0
        a0.send(signal.SIGKILL)
        a0.proc.wait(30)
        pstore.promote(a1.address)
        t.push(GIDS, np.ones((len(GIDS), 2), np.float32))
        assert np.all(t.pull(GIDS) == -2.0)
        for p in procs:
            p.stop()
        kept = json.loads(_meta(tmp_path / "a-b", b"cluster/routing") or b"{}")
        assert sorted(kept) == ["index", "servers", "slots"], kept
    finally:
        for p in procs:
            p.stop()


def test_the_cli_adds_and_removes_a_group(tmp_path: Path) -> None:
    a0, a1 = _group(tmp_path, "a")
    b0, b1 = _group(tmp_path, "b")
    procs = [a0, a1, b0, b1]
    try:
        first = [[a0.address, a1.address]]
        store = pstore.connect(first)  # type: ignore[arg-type]
        _group_table(store)
        store.sparse_table("t").push(GIDS, np.ones((len(GIDS), 2), np.float32))
        cmd = [sys.executable, "-m", "pstore", "cluster"]
        group_a = f"{a0.address},{a1.address}"
        out = subprocess.run(
            [*cmd, "add-server", f"{b0.address},{b1.address}", "--servers", group_a, "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["servers"] == [a0.address, b0.address]
        assert rows_on(b0.address, "t") > 0
        # Position 0 (group a) leaves; its slots go to group b.
        out = subprocess.run(
            [*cmd, "remove-server", "0", "--servers", group_a],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert "position 0 left the cluster" in out.stdout and b0.address in out.stdout
        assert rows_on(b0.address, "t") == len(GIDS) and rows_on(a0.address, "t") == 0
        assert np.all(store.sparse_table("t").pull(GIDS) == -1.0)
        assert store.servers == [b0.address]
    finally:
        for p in procs:
            p.stop()


# Table definitions follow the list (decision 0110): a table created while a server joins, by a
# worker of either list, reaches the joining server too.


def definitions(addr: str) -> dict[str, tuple]:
    """Every table server `addr` holds (asked alone): kind, config, learning rate, policy."""
    one = pstore.connect([addr])
    try:
        return {
            t["name"]: (
                t["kind"],
                json.dumps(t["config"], sort_keys=True),
                t["lr"],
                t["stale_policy"],
                t["max_staleness"],
            )
            for t in one.status()[0]["tables"]
        }
    finally:
        one.close()


def counting(store: pstore.RemoteStore, name: str, **policy: Any) -> pstore.SparseTable:
    """A sparse table whose rows count the pushes of -1 they got (SGD, zeros, dim 1)."""
    return store.create_sparse_table(
        name, 1, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros(), **policy
    )


def test_tables_created_in_a_loop_while_a_server_joins_reach_it(cluster):
    a, b = cluster(2)
    admin = pstore.connect([a])
    worker = pstore.connect([a])
    counting(admin, "warm").push(
        np.arange(1, 3001, dtype=np.uint64), -np.ones((3000, 1), np.float32)
    )
    joined = threading.Event()
    first = np.arange(1, 301, dtype=np.uint64)
    made: list[str] = []
    errors: list[BaseException] = []

    def create_in_a_loop() -> None:
        try:
            k = 0
            # Until the join is over, and a few after it (by the worker's list, still [a]).
            after = 0
            while after < 5 and k < 150:
                if joined.is_set():
                    after += 1
                # Rows at once, on the servers of the worker's list: those of a slot that moves
                # later in the join move with it.
                counting(worker, f"s{k}", stale_policy="drop", max_staleness=3).push(
                    first, -np.ones((len(first), 1), np.float32)
                )
                worker.create_dense_table(
                    f"d{k}",
                    (3,),
                    optimizer=pstore.optim.SGD(lr=1.0),
                    initializer=pstore.init.Zeros(),
                )
                made.extend([f"s{k}", f"d{k}"])
                k += 1
                time.sleep(0.005)
        except BaseException as e:  # reported by the test
            errors.append(e)

    th = threading.Thread(target=create_in_a_loop)
    th.start()
    try:
        time.sleep(0.05)
        admin.add_server(b)
    finally:
        joined.set()
        th.join(timeout=60)
    assert not th.is_alive() and not errors, errors
    assert admin.servers == [a, b] and worker.servers == [a, b]
    assert len(made) >= 10
    # Every server of the list holds every table, as the others do.
    defs = [definitions(a), definitions(b)]
    assert set(made) | {"warm"} == set(defs[0]), sorted(set(made) - set(defs[0]))
    assert defs[0] == defs[1], sorted(set(defs[0]) ^ set(defs[1]))
    # Pushes and pulls of ids either server owns work on every table, once each; the rows
    # pushed while the table was new are all there.
    ids = np.arange(1, 501, dtype=np.uint64)
    want = np.ones(len(ids), np.float32) + np.isin(ids, first)
    for name in made:
        t = worker.table(name)
        if name.startswith("s"):
            t.push(ids, -np.ones((len(ids), 1), np.float32))
            np.testing.assert_array_equal(admin.table(name).pull(ids)[:, 0], want, err_msg=name)
        else:
            t.push(-np.ones(3, np.float32))
            np.testing.assert_array_equal(admin.table(name).pull(), np.ones(3, np.float32))
    assert all(r > 0 for r in rows_per_server(admin, made[0]))


def test_a_client_with_the_old_list_creates_a_table_after_the_join(cluster):
    a, b, c = cluster(3)
    admin = pstore.connect([a])
    old = pstore.connect([a])
    admin.add_server(b)
    # `old` routes by [a] until it meets the new list: its create reaches b as well.
    t = counting(old, "late", stale_policy="scale", max_staleness=5)
    assert old.servers == [a, b]
    assert definitions(a) == definitions(b) and "late" in definitions(b)
    ids = np.arange(1, 2001, dtype=np.uint64)
    t.push(ids, -np.ones((len(ids), 1), np.float32))
    np.testing.assert_array_equal(admin.table("late").pull(ids)[:, 0], np.ones(len(ids)))
    assert all(r > 0 for r in rows_per_server(admin, "late"))
    # The same when a server leaves and another joins: a client of [a, b] creates over [b, c].
    mid = pstore.connect([a, b])
    admin.remove_server(a)
    admin.add_server(c)
    d = mid.create_dense_table("later", (4,), initializer=pstore.init.Zeros())
    assert mid.servers == [b, c]
    assert "later" in definitions(c) and definitions(b) == definitions(c)
    d.push(np.ones(4, np.float32))
    assert admin.table("later").pull().shape == (4,)


def test_a_push_to_a_server_lacking_the_table_declares_it_and_applies_once(cluster):
    a, b = cluster(2)
    store = pstore.connect([a])
    store.add_server(b)
    t = counting(store, "count", stale_policy="drop", max_staleness=7)
    t.lr = 0.5
    dense = [
        store.create_dense_table(
            f"d{k}", (2,), optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        for k in range(8)
    ]
    want = definitions(a)
    # b loses every table (a client of b alone drops them there): what a server that joined
    # while they were created would lack.
    alone = pstore.connect([b])
    for name in want:
        alone.drop_table(name)
    assert definitions(b) == {}
    ids = np.arange(1, 2001, dtype=np.uint64)
    for _ in range(3):
        t.push(ids, -np.ones((len(ids), 1), np.float32))
    # Declared on b with a's definition, policy and learning rate (0.5, not the config's 1.0),
    # and each push applied once on each server.
    np.testing.assert_array_equal(t.pull(ids)[:, 0], np.full(len(ids), 1.5, np.float32))
    assert all(r > 0 for r in rows_per_server(store, "count"))
    assert definitions(b)["count"] == want["count"]
    assert t.stats()["pushes"] == 3
    # Dense tables homed on b: pushed once each, declared there on the first refusal.
    for d in dense:
        d.push(-np.ones(2, np.float32))
        np.testing.assert_array_equal(d.pull(), np.ones(2, np.float32))
    on_b = {x["name"]: x["seq"] for x in store.status()[1]["tables"]}
    homed_on_b = [d.name for d in dense if on_b.get(d.name, 0) > 0]
    assert homed_on_b, on_b
    have = definitions(b)
    assert all(have[n] == want[n] for n in homed_on_b), (have, want)
    # Any call that reaches b declares the rest (here: opening them asks every server).
    for name in want:
        store.table(name)
    assert definitions(b) == want
    # A table no server of the list holds stays unknown.
    with pytest.raises(pstore.UnknownTableError):
        store.table("never")


def test_a_client_of_the_old_list_creates_a_table_after_a_leave_and_a_stop():
    procs = start_servers(2)
    try:
        a, b = (p.address for p in procs)
        admin = pstore.connect([a])
        admin.add_server(b)
        mid = pstore.connect([a, b])
        admin.remove_server(a)
        # The server that left is stopped; `mid` still lists it, and its create goes to the
        # list the servers hold, [b], without an error.
        procs[0].stop()
        t = counting(mid, "after")
        assert mid.servers == [b]
        assert "after" in definitions(b)
        ids = np.arange(1, 1001, dtype=np.uint64)
        t.push(ids, -np.ones((len(ids), 1), np.float32))
        np.testing.assert_array_equal(admin.table("after").pull(ids)[:, 0], np.ones(len(ids)))
    finally:
        stop_all(procs)


# --- A client whose server is gone asks the others (decision 0112) -----------------------------


def test_an_idle_worker_follows_the_list_after_the_removed_server_stopped():
    procs = start_servers(3)
    try:
        a, b, c = (p.address for p in procs)
        worker = pstore.connect([a, b, c])
        reader = pstore.connect([a, b, c])
        t = worker.create_sparse_table(
            "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        # Ids of (nearly) every slot, on every server.
        ids = np.arange(1, 60001, dtype=np.uint64)
        t.push(ids, np.ones((len(ids), 2), np.float32))
        before = reader.table("t").pull(ids)
        admin = pstore.connect([a, b, c])
        admin.remove_server(b)
        assert admin.servers == [a, c]
        # The server that left stops; the worker and the reader made no call meanwhile: they
        # still route some slots to it, and nothing answers there.
        assert procs[1].stop() is not None
        assert worker.servers == [a, b, c]
        t.push(ids, np.ones((len(ids), 2), np.float32))
        assert worker.servers == [a, c]
        # Each push applied once: every row is minus the two pushes.
        np.testing.assert_array_equal(
            admin.table("t").pull(ids), np.full((len(ids), 2), -2.0, np.float32)
        )
        np.testing.assert_array_equal(before, np.full((len(ids), 2), -1.0, np.float32))
        # A read follows the same way (its part for the stopped server is read again).
        np.testing.assert_array_equal(
            reader.table("t").pull(ids), np.full((len(ids), 2), -2.0, np.float32)
        )
        assert reader.servers == [a, c]
    finally:
        stop_all(procs)
