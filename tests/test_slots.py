"""Routing through the slot table: a cluster file's table decides where every row lives, bad
tables are refused with the reason, and snapshots carry the table."""

from __future__ import annotations

import json

import numpy as np
import pytest

import pstore

SLOTS = 16384
IDS = np.arange(1, 2001, dtype=np.uint64) * 104729


def rows_per_server(store: pstore.RemoteStore, name: str) -> list[int]:
    out = []
    for s in store.status():
        out.append(sum(int(t["rows"]) for t in s["tables"] if t["name"] == name))
    return out


def test_the_default_table_splits_slots_evenly_by_position(cluster):
    addrs = cluster(3)
    store = pstore.connect(addrs)
    table = store.slots
    assert (table["epoch"], table["servers"]) == (0, 3)
    # One run per server in each of 64 stripes of 256 slots, covering every slot once.
    ranges = table["ranges"]
    assert len(ranges) == 3 * 64
    assert [r[0] for r in ranges] == [0] + [r[1] for r in ranges[:-1]] and ranges[-1][1] == SLOTS
    owned = [sum(e - s for s, e, o in ranges if o == i) for i in range(3)]
    assert max(owned) - min(owned) <= 1, owned
    for stripe in range(64):
        lo, hi = stripe * 256, (stripe + 1) * 256
        assert {o for s, e, o in ranges if s < hi and e > lo} == {0, 1, 2}, stripe
    t = store.create_sparse_table("t", 4)
    t.pull(IDS)
    rows = rows_per_server(store, "t")
    assert sum(rows) == len(IDS)
    assert all(abs(r - len(IDS) / 3) < 150 for r in rows), rows


def test_a_cluster_file_table_decides_where_rows_live(cluster, tmp_path):
    addrs = cluster(3)
    # Server 1 owns nothing; server 2 owns the upper three quarters.
    table = {"epoch": 4, "servers": 3, "ranges": [[0, 4096, 0], [4096, SLOTS, 2]]}
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"servers": addrs, "slots": table}))
    store = pstore.connect(f)
    assert store.slots == table
    t = store.create_sparse_table(
        "t", 4, optimizer=pstore.optim.SGD(lr=0.5), initializer=pstore.init.Zeros()
    )
    t.push(IDS, np.ones((len(IDS), 4), np.float32))
    rows = rows_per_server(store, "t")
    assert rows[1] == 0 and rows[0] + rows[2] == len(IDS)
    assert abs(rows[0] - len(IDS) / 4) < 100, rows
    # A dense table lives on the owner of its name's slot.
    d = store.create_dense_table("d", (3,), optimizer=pstore.optim.SGD(lr=1.0))
    before = d.pull()
    d.push(np.ones(3, np.float32))
    np.testing.assert_array_equal(d.pull(), before - 1)
    # A worker on the uniform table of the same list routes otherwise: refused.
    other = pstore.connect(addrs)
    with pytest.raises(pstore.InvalidArgumentError, match="same list of servers"):
        other.table("t").pull(IDS[:5])
    np.testing.assert_array_equal(t.pull(IDS), np.full((len(IDS), 4), -0.5, np.float32))


@pytest.mark.parametrize(
    ("slots", "match"),
    [
        ({"epoch": 0, "servers": 2, "ranges": [[0, 100, 0]]}, "reach 16384"),
        ({"epoch": 0, "servers": 2, "ranges": [[0, 100, 0], [99, SLOTS, 1]]}, "continue at"),
        ({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 5]]}, "owned by server 5"),
        ({"epoch": 0, "servers": 3, "ranges": [[0, SLOTS, 0]]}, "addresses 3 servers"),
        ({"epoch": 0, "ranges": [[0, SLOTS, 0]]}, "servers"),
        ([0, 1], '"slots" must be an object'),
    ],
)
def test_bad_slot_tables_are_refused_with_the_reason(cluster, tmp_path, slots, match):
    addrs = cluster(2)
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"servers": addrs, "slots": slots}))
    with pytest.raises(pstore.InvalidArgumentError, match=match):
        pstore.connect(f)


def test_a_snapshot_carries_the_table_and_restores_by_the_targets(cluster, tmp_path):
    addrs = cluster(2)
    table = {"epoch": 2, "servers": 2, "ranges": [[0, 1000, 1], [1000, SLOTS, 0]]}
    f = tmp_path / "src.json"
    f.write_text(json.dumps({"servers": addrs, "slots": table}))
    src = pstore.connect(f)
    t = src.create_sparse_table("t", 4, optimizer=pstore.optim.Adagrad(lr=0.1))
    t.push(IDS, np.ones((len(IDS), 4), np.float32))
    d = src.create_dense_table("d", (3,), optimizer=pstore.optim.SGD(lr=1.0))
    d.push(np.full(3, 2.0, np.float32))
    m = src.snapshot(tmp_path / "snap")
    assert m["version"] == 3
    assert m["layout"]["routing"] == "slots-16384-mix64"
    assert m["layout"]["slots"] == table
    # Onto three servers whose table gives server 0 nothing.
    dst_addrs = cluster(3)
    dst_table = {"epoch": 0, "servers": 3, "ranges": [[0, 8192, 1], [8192, SLOTS, 2]]}
    g = tmp_path / "dst.json"
    g.write_text(json.dumps({"servers": dst_addrs, "slots": dst_table}))
    for via in ("servers", "client"):
        dst = pstore.connect(g)
        for name in dst.tables():
            dst.drop_table(name)
        dst = pstore.connect(g)
        dst.restore_cluster(tmp_path / "snap", via=via)
        rows = rows_per_server(dst, "t")
        assert rows[0] == 0 and sum(rows) == len(IDS), (via, rows)
        np.testing.assert_array_equal(dst.table("t").pull(IDS), t.pull(IDS))
        np.testing.assert_array_equal(dst.table("d").pull(), d.pull())
