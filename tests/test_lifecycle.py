"""Admission, eviction and the row budget of sparse tables."""

from __future__ import annotations

import time

import numpy as np
import pytest

import pstore
from pstore import init, optim


def ids_of(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.uint64)


def ones(n: int, dim: int) -> np.ndarray:
    return np.ones((n, dim), dtype=np.float32)


@pytest.mark.parametrize("path", [False, True])
def test_admission_counts_pushes_before_a_row_exists(tmp_path, path):
    store = pstore.Store(tmp_path / "s" if path else None)
    t = store.create_sparse_table(
        "t", 4, optimizer=optim.SGD(lr=0.5), initializer=init.Constant(1.0), admit_after=3
    )
    assert t.admit_after == 3
    ids = ids_of(7)
    # Pulls of an id not admitted give its initial value and create nothing.
    np.testing.assert_array_equal(t.pull(ids), np.ones((1, 4), np.float32))
    assert len(t) == 0 and not t.contains(ids)[0]
    t.push(ids, ones(1, 4))
    t.push(ids, ones(1, 4))
    assert len(t) == 0, "two pushes of three: still only counted"
    np.testing.assert_array_equal(t.pull(ids), np.ones((1, 4), np.float32))
    t.push(ids, ones(1, 4))  # the third sighting admits and trains
    assert len(t) == 1
    np.testing.assert_array_equal(t.pull(ids), np.full((1, 4), 0.5, np.float32))
    # Duplicates in one push count each: id 9 is admitted by a push holding it three times.
    t.push(ids_of(9, 9, 9), ones(3, 4))
    np.testing.assert_array_equal(t.pull(ids_of(9)), np.full((1, 4), 1.0 - 0.5 * 3, np.float32))
    assert t.stats()["rows_created"] == 2
    # Removing an id forgets its count.
    t.push(ids_of(11, 11), ones(2, 4))
    t.remove(ids_of(11))
    t.push(ids_of(11), ones(1, 4))
    assert not t.contains(ids_of(11))[0]
    store.close()


def test_admission_of_zero_or_one_admits_at_once():
    store = pstore.Store()
    for n in (0, 1):
        t = store.create_sparse_table(f"t{n}", 2, admit_after=n)
        t.push(ids_of(1), ones(1, 2))
        assert len(t) == 1
    with pytest.raises(pstore.DtypeError):
        store.create_sparse_table("bad", 2, admit_after=1.5)  # type: ignore[arg-type]


def test_evict_by_steps_removes_rows_not_updated_lately():
    store = pstore.Store(num_shards=4)
    t = store.create_sparse_table("t", 2, optimizer=optim.SGD(lr=0.1))
    for i in range(10):
        t.push(ids_of(i), ones(1, 2))  # row i has version i + 1
    assert t.seq == 10
    # Not updated during the last 4 pushes: versions 1..6.
    assert t.evict(not_updated_for_steps=4) == 6
    assert t.contains(np.arange(10, dtype=np.uint64)).tolist() == [False] * 6 + [True] * 4
    assert t.stats()["rows_evicted"] == 6
    assert t.evict(not_updated_for_steps=4) == 0
    with pytest.raises(pstore.InvalidArgumentError):
        t.evict()


def test_evict_by_seconds_uses_the_update_time():
    store = pstore.Store()
    t = store.create_sparse_table("t", 2)
    t.push(ids_of(1, 2), ones(2, 2))
    assert t.evict(not_updated_for_seconds=3600) == 0
    time.sleep(2.1)  # update times are kept to the second
    t.push(ids_of(2), ones(1, 2))
    assert t.evict(not_updated_for_seconds=1) == 1
    assert t.contains(ids_of(1, 2)).tolist() == [False, True]
    with pytest.raises(pstore.InvalidArgumentError):
        t.evict(not_updated_for_seconds=-1)


def test_max_rows_lru_keeps_the_recently_updated():
    store = pstore.Store(num_shards=8)
    t = store.create_sparse_table("t", 2, max_rows=1000)
    assert t.max_rows == 1000 and t.evict_policy == "lru"
    for start in range(0, 3000, 100):
        t.push(np.arange(start, start + 100, dtype=np.uint64), ones(100, 2))
        assert len(t) <= 1000
    # Evicts down to 99% when the budget is passed: the newest rows stay.
    assert 990 <= len(t) <= 1000
    assert t.contains(np.arange(2900, 3000, dtype=np.uint64)).all()
    assert not t.contains(np.arange(0, 1000, dtype=np.uint64)).any()
    assert t.stats()["rows_evicted"] == 3000 - len(t)


def test_max_rows_lfu_keeps_the_frequent():
    store = pstore.Store(num_shards=8)
    t = store.create_sparse_table("t", 2, max_rows=200, evict_policy="lfu")
    hot = np.arange(50, dtype=np.uint64)
    for _ in range(5):
        t.push(hot, ones(50, 2))
    for start in range(1000, 3000, 50):
        t.push(np.arange(start, start + 50, dtype=np.uint64), ones(50, 2))
    assert len(t) <= 200
    assert t.contains(hot).all(), "pushed five times: never the least frequent"
    with pytest.raises(pstore.InvalidArgumentError):
        store.create_sparse_table("x", 2, evict_policy="fifo")  # type: ignore[arg-type]
    with pytest.raises(pstore.InvalidArgumentError):
        store.create_sparse_table("y", 2, max_rows=0)


def test_max_rows_counts_rows_created_by_pulls():
    store = pstore.Store(num_shards=2)
    t = store.create_sparse_table("t", 2, max_rows=100)
    t.pull(np.arange(500, dtype=np.uint64))
    assert len(t) <= 100


def test_row_metadata_travels_in_snapshots(tmp_path):
    pa = pytest.importorskip("pyarrow")
    store = pstore.Store(num_shards=2)
    t = store.create_sparse_table("t", 3, optimizer=optim.Adagrad(lr=0.1))
    t.push(ids_of(5, 5, 6), ones(3, 3))
    t.push(ids_of(5), ones(1, 3))
    before = int(time.time())
    m = store.snapshot(tmp_path / "snap")
    cols: dict[int, dict] = {}
    for f in m["tables"][0]["files"]:
        tab = pa.ipc.open_file(str(tmp_path / "snap" / f["name"])).read_all()
        for row in tab.to_pylist():
            cols[row["id"]] = row
    assert cols[5]["freq"] == 3 and cols[6]["freq"] == 1
    assert cols[5]["version"] == 2 and cols[6]["version"] == 1
    assert cols[5]["step"] == 2 and cols[6]["step"] == 1
    assert abs(cols[5]["updated_at"] - before) <= 2
    restored = pstore.Store.restore(tmp_path / "snap")
    r = restored.table("t")
    assert isinstance(r, pstore.SparseTable)
    # The budget's and eviction's inputs came back too: evicting by steps sees the versions.
    assert r.seq == 2
    assert r.evict(not_updated_for_steps=1) == 1  # id 6: the last push did not update it
    assert r.contains(ids_of(5, 6)).tolist() == [True, False]


def test_evicted_ids_become_tombstones_of_the_next_increment(tmp_path):
    store = pstore.Store(num_shards=4)
    t = store.create_sparse_table("t", 2)
    t.push(np.arange(100, dtype=np.uint64), ones(100, 2))
    store.snapshot(tmp_path / "full")
    t.push(np.arange(50, dtype=np.uint64), ones(50, 2))
    assert t.evict(not_updated_for_steps=1) == 50
    m = store.snapshot(tmp_path / "inc", incremental=True)
    entry = m["tables"][0]
    assert entry["tombstones"]["rows"] == 50 and entry["total_rows"] == 50
    r = pstore.Store.restore(tmp_path / "inc").table("t")
    assert isinstance(r, pstore.SparseTable)
    assert len(r) == 50
    assert r.contains(np.arange(100, dtype=np.uint64)).tolist() == [True] * 50 + [False] * 50
