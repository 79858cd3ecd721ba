"""Moving slots between the servers of a running cluster while workers train (decision 0103):
four worker processes train the matrix-factorisation model of tests/test_distributed.py while a
server is given its share of the slots (as when it joins) and another gives all of its slots
away (as when it leaves). Every row ends with exactly the pushes sent for it, the test RMSE is
the one of a run without moves (the tolerance of test_distributed.py), the moved dense table
keeps its value (with its optimizer state), and the server that gave everything away holds no
row."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np
import pytest
from _mf_worker import ITEM_ID0, data, expected_counts, model
from _netutil import start_servers, start_workers, stop_all
from test_distributed import EPOCHS, TOLERANCE, WORKERS, _rmse, embedded_rmse  # noqa: F401

import pstore

SLOTS = 16384
T = TypeVar("T")


def owned(table: dict, i: int) -> int:
    return sum(e - s for s, e, o in table["ranges"] if o == i)


def uniform_over(positions: list[int], servers: int, epoch: int) -> dict:
    """A table giving the slots to `positions` in turn, runs of 64 (so each owns a share of
    every part of the hash range)."""
    ranges = [[s, s + 64, positions[(s // 64) % len(positions)]] for s in range(0, SLOTS, 64)]
    return {"epoch": epoch, "servers": servers, "ranges": ranges}


def rows_per_server(store: pstore.RemoteStore, name: str) -> list[int]:
    return [sum(int(t["rows"]) for t in s["tables"] if t["name"] == name) for s in store.status()]


def train_while(
    servers: list[str], admin: pstore.RemoteStore, rmse0: float, change: Callable[[], T]
) -> T:
    """Runs the 4 matrix-factorisation workers of test_distributed.py on `servers` and, once
    they train (rows on the servers), `change()` while they go on; checks that the change ended
    while they still ran (else a test would prove nothing), that they all finished well, every
    row of table `count` ends with exactly the pushes sent for it and the test RMSE is the one
    of a run without changes (`rmse0`). Returns what `change` returned."""
    admin.create_sparse_table(
        "count", 1, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )
    procs = start_workers(
        "_mf_worker.py", ",".join(servers), WORKERS, "--epochs", str(EPOCHS), "--count"
    )
    try:
        deadline = time.monotonic() + 120
        while sum(rows_per_server(admin, "count")) < 500:
            assert time.monotonic() < deadline, "the workers did not start training"
            assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
            time.sleep(0.05)
        out = change()
        running = sum(p.poll() is None for p in procs)
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert running > 0, out

    # Every row got exactly the pushes sent for it: none lost, none applied twice.
    train, test = data()
    expected = expected_counts(train, EPOCHS, WORKERS)
    ids = np.array(sorted(expected), dtype=np.uint64)
    got = admin.table("count").pull(ids)[:, 0]
    want = np.array([expected[i] for i in ids.tolist()], dtype=np.float32)
    wrong = np.flatnonzero(got != want)
    assert wrong.size == 0, [(int(ids[i]), float(got[i]), float(want[i])) for i in wrong[:10]]
    assert (ids >= ITEM_ID0).any() and (ids < ITEM_ID0).any()

    # The model trained as well as without changes.
    steps = [json.loads(out)["steps"] for out, _ in outs]
    assert len(set(steps)) == 1 and steps[0] > 0
    rmse = _rmse(model(admin, train), test)
    assert abs(rmse - rmse0) <= TOLERANCE, (rmse, rmse0)
    return out


def test_workers_train_through_a_join_and_a_leave(cluster, embedded_rmse):  # noqa: F811
    addrs = cluster(3)
    admin = pstore.connect(addrs)
    # Server 2 starts with no slot (it "joins" below); server 0 gives all away later ("leaves").
    admin.publish_routing(uniform_over([0, 1], 3, 1))
    join, leave = train_while(
        addrs,
        admin,
        embedded_rmse,
        lambda: (
            admin.move_slots(uniform_over([0, 1, 2], 3, 0)),
            admin.move_slots(uniform_over([1, 2], 3, 0)),
        ),
    )
    assert join["slots"] >= owned(uniform_over([0, 1, 2], 3, 0), 2) and join["rows"] > 0, join
    assert leave["rows"] > 0 and leave["epoch"] > join["epoch"], leave
    final = admin.slots
    assert owned(final, 0) == 0 and final["epoch"] == leave["epoch"]
    # Server 0 gave everything away and holds no row of any sparse table.
    for name in ("count", "user_emb", "item_emb"):
        rows = rows_per_server(admin, name)
        assert rows[0] == 0 and rows[2] > 0, (name, rows)


def test_a_moved_dense_table_keeps_its_value(cluster):
    addrs = cluster(2)
    store = pstore.connect(addrs)
    d = store.create_dense_table(
        "d", (1000,), optimizer=pstore.optim.Adam(lr=0.1), initializer=pstore.init.Zeros()
    )
    t = store.create_sparse_table("t", 8, optimizer=pstore.optim.Adagrad(lr=0.1))
    ids = np.arange(1, 3001, dtype=np.uint64)
    rng = np.random.default_rng(0)
    for _ in range(3):
        d.push(rng.normal(size=1000).astype(np.float32))
        t.push(ids, rng.normal(size=(len(ids), 8)).astype(np.float32))
    dense_before, rows_before = d.pull(), t.pull(ids)
    # Every slot to one server, then every slot to the other: the dense table's home moves
    # in one of the two, every sparse row in both.
    a = store.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 0]]})
    b = store.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]})
    assert a["rows"] + b["rows"] >= len(ids) + 1, (a, b)
    assert rows_per_server(store, "t") == [0, len(ids)]
    np.testing.assert_array_equal(d.pull(), dense_before)
    np.testing.assert_array_equal(t.pull(ids), rows_before)
    # Optimizer state moved too: the next step is the one the unmoved table would take.
    ref = pstore.Store()
    rd = ref.create_dense_table(
        "d", (1000,), optimizer=pstore.optim.Adam(lr=0.1), initializer=pstore.init.Zeros()
    )
    rng = np.random.default_rng(0)
    for _ in range(3):
        rd.push(rng.normal(size=1000).astype(np.float32))
        rng.normal(size=(len(ids), 8))
    g = np.ones(1000, np.float32)
    rd.push(g)
    d.push(g)
    np.testing.assert_allclose(d.pull(), rd.pull(), rtol=1e-6, atol=1e-7)
    # A client connected before the moves follows them.
    late = pstore.connect(addrs)
    np.testing.assert_array_equal(late.table("t").pull(ids), t.pull(ids))


def test_bad_moves_are_refused_and_change_nothing(cluster):
    addrs = cluster(2)
    store = pstore.connect(addrs)
    t = store.create_sparse_table("t", 2, initializer=pstore.init.Zeros())
    ids = np.arange(1, 501, dtype=np.uint64)
    t.pull(ids)
    before = store.slots
    with pytest.raises(pstore.InvalidArgumentError, match="addresses 3 servers, the cluster has 2"):
        store.move_slots({"epoch": 0, "servers": 3, "ranges": [[0, SLOTS, 2]]})
    with pytest.raises(pstore.InvalidArgumentError, match="reach 16384"):
        store.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, 100, 0]]})
    with pytest.raises(TypeError, match="slots must be a dict"):
        store.move_slots([1, 2])  # type: ignore[arg-type]
    everything = {"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]}
    for bad in (0, -5.0, float("nan"), float("inf")):
        with pytest.raises(pstore.InvalidArgumentError, match="max_rows_per_second must be"):
            store.move_slots(everything, max_rows_per_second=bad)
        with pytest.raises(pstore.InvalidArgumentError, match="max_rows_per_second must be"):
            store.remove_server(0, max_rows_per_second=bad)
    with pytest.raises(TypeError, match="max_rows_per_second must be a number"):
        store.move_slots(everything, max_rows_per_second="fast")  # type: ignore[arg-type]
    assert store.slots == before
    assert sum(rows_per_server(store, "t")) == len(ids)
    # Moving to the table in force moves nothing.
    r = store.move_slots(before)
    assert (r["slots"], r["rows"], r["batches"]) == (0, 0, 0)


def test_a_paced_move_keeps_to_its_rate_and_moves_every_row(cluster):
    addrs = cluster(2)
    store = pstore.connect(addrs)
    t = store.create_sparse_table("t", 8, optimizer=pstore.optim.Adagrad(lr=0.1))
    ids = np.arange(1, 6001, dtype=np.uint64)
    t.push(ids, np.ones((len(ids), 8), np.float32))
    rows = t.pull(ids)
    # Every slot to server 1: about half the rows move (the other half are there already).
    rate = 2500.0
    t0 = time.monotonic()
    r = store.move_slots(
        {"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]}, max_rows_per_second=rate
    )
    took = time.monotonic() - t0
    assert r["rows"] >= 2000 and r["batches"] >= 8, r
    # It waits after each batch until the average is back at the rate: at least rows / rate.
    assert took >= r["seconds"] >= r["rows"] / rate, (took, r)
    assert rows_per_server(store, "t") == [0, len(ids)]
    np.testing.assert_array_equal(t.pull(ids), rows)
    # Unpaced, twice as many rows move back in less time than the pace would allow them.
    back = store.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 0]]})
    assert back["rows"] == len(ids)
    assert back["seconds"] < len(ids) / rate, back


def test_a_move_to_an_unreachable_server_is_refused_and_changes_nothing():
    procs = start_servers(3)
    try:
        addrs = [p.address for p in procs]
        store = pstore.connect(addrs, timeout=3.0, retries=0)
        store.publish_routing(uniform_over([0, 1], 3, 1))
        t = store.create_sparse_table(
            "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        ids = np.arange(1, 1001, dtype=np.uint64)
        t.push(ids, np.ones((len(ids), 2), np.float32))
        procs[2].stop()
        with pytest.raises(pstore.ServerError, match=addrs[2]):
            store.move_slots(uniform_over([0, 1, 2], 3, 0))
        # Nothing moved, nothing frozen: the rows are where they were and take pushes.
        assert store.slots == uniform_over([0, 1], 3, 1)
        t.push(ids, np.ones((len(ids), 2), np.float32))
        np.testing.assert_array_equal(t.pull(ids), np.full((len(ids), 2), -2.0, np.float32))
    finally:
        stop_all(procs)
