"""Cluster snapshots (one manifest + every server's part) and restores onto any server list,
against real `pstore serve` processes on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, start_servers, stop_all
from test_snapshot import file_rows

import pstore

DIM = 8
IDS = np.arange(1, 401, dtype=np.uint64) * 7919


@pytest.fixture
def cluster() -> Iterator[Callable[[int], list[str]]]:
    """Starts n in-memory servers per call; all are stopped at the end of the test."""
    procs: list[ServerProcess] = []

    def start(n: int) -> list[str]:
        new = start_servers(n)
        procs.extend(new)
        return [p.address for p in new]

    yield start
    stop_all(procs)


def grads(step: int, n: int) -> np.ndarray:
    """A deterministic gradient of step `step`."""
    rng = np.random.default_rng(step)
    return rng.standard_normal((n, DIM)).astype(np.float32)


def batch_ids(step: int) -> np.ndarray:
    return IDS[(step * 37) % 300 : (step * 37) % 300 + 100]


def train(store: pstore.RemoteStore, steps: range) -> None:
    for table in ("adagrad", "sgd"):
        t = store.table(table)
        for step in steps:
            ids = batch_ids(step)
            t.pull(ids)
            t.push(ids, grads(step, len(ids)))
    d = store.table("bias")
    for step in steps:
        d.push(grads(step, 1)[0, :4].reshape(4))


def declare(store: pstore.RemoteStore) -> None:
    store.create_sparse_table("adagrad", DIM, optimizer=pstore.optim.Adagrad(lr=0.1))
    store.create_sparse_table("sgd", DIM, optimizer=pstore.optim.SGD(lr=0.05))
    store.create_dense_table("bias", (4,), optimizer=pstore.optim.Adagrad(lr=0.1))


def cluster_rows(snap: Path) -> dict[str, dict[int, tuple]]:
    """table -> id -> (step, version, updated_at, freq, weights, state) over every full part."""
    m = json.loads((snap / "cluster.json").read_text())
    out: dict[str, dict[int, tuple]] = {}
    for part in m["parts"]:
        pm = json.loads((snap / part["dir"] / "manifest.json").read_text())
        assert pm["kind"] == "full"
        for e in pm["tables"]:
            if e["name"] != "bias":
                rows = file_rows(snap / part["dir"], e)
                assert not set(rows) & set(out.get(e["name"], {})), "an id in two parts"
                out.setdefault(e["name"], {}).update(rows)
    return out


def test_snapshot_on_4_restores_bit_exact_on_8_and_2_and_trains_on(cluster, tmp_path):
    src = pstore.connect(cluster(4))
    declare(src)
    train(src, range(12))
    dest = tmp_path / "snaps" / "0001"  # snaps/ does not exist yet
    m = src.snapshot(dest)
    assert m["format"] == "pstore-cluster-snapshot" and m["kind"] == "full"
    assert m["layout"]["servers"] == src.servers
    assert [p["dir"] for p in m["parts"]] == [f"server-{i}" for i in range(4)]
    assert sorted(t["name"] for t in m["tables"]) == ["adagrad", "bias", "sgd"]
    want = cluster_rows(dest)
    touched = {int(i) for k in range(12) for i in batch_ids(k)}
    assert set(want["adagrad"]) == set(want["sgd"]) == touched

    on8, on2 = cluster(8), cluster(2)
    for addrs in (on8, on2):
        report = pstore.restore_cluster(dest, addrs)
        assert report["tables"] == 3 and report["parts"] == 4
        dst = pstore.connect(addrs)
        assert all(len(dst.table(n)) == len(touched) for n in ("adagrad", "sgd"))
        # Every row bit-exact: weights, optimizer state, step, version, update time, count.
        again = dst.snapshot(tmp_path / f"again-{len(addrs)}")
        got = cluster_rows(tmp_path / f"again-{len(addrs)}")
        for name in ("adagrad", "sgd"):
            assert got[name] == want[name], name
        np.testing.assert_array_equal(dst.table("bias").pull(), src.table("bias").pull())
        assert again["layout"]["servers"] == addrs

    # Training goes on with the same values as on the cluster that was never restored.
    dst = pstore.connect(on8)
    train(src, range(12, 20))
    train(dst, range(12, 20))
    for name in ("adagrad", "sgd"):
        np.testing.assert_array_equal(dst.table(name).pull(IDS), src.table(name).pull(IDS))
    np.testing.assert_array_equal(dst.table("bias").pull(), src.table("bias").pull())


def test_incremental_cluster_snapshots_chain_with_tombstones(cluster, tmp_path):
    src = pstore.connect(cluster(4))
    declare(src)
    train(src, range(6))
    src.snapshot(tmp_path / "s1")
    train(src, range(6, 9))
    gone = IDS[:50]
    assert src.table("adagrad").remove(gone) == 50
    inc = src.snapshot(tmp_path / "s2", incremental=True)
    assert inc["kind"] == "incremental"
    assert inc["parent"]["path"] == "s1"
    assert inc["parent"]["id"] == json.loads((tmp_path / "s1" / "cluster.json").read_text())["id"]
    addrs = cluster(2)
    pstore.restore_cluster(tmp_path / "s2", addrs)
    dst = pstore.connect(addrs)
    keep = np.setdiff1d(np.unique(np.concatenate([batch_ids(k) for k in range(9)])), gone)
    assert len(dst.table("adagrad")) == len(src.table("adagrad")) == len(keep)
    assert not dst.table("adagrad").contains(gone).any()
    np.testing.assert_array_equal(dst.table("adagrad").pull(keep), src.table("adagrad").pull(keep))
    np.testing.assert_array_equal(dst.table("sgd").pull(IDS), src.table("sgd").pull(IDS))
    # An increment whose servers' previous snapshots are not one cluster snapshot is refused:
    # here each server's last snapshot is a loose per-server one, with no cluster.json.
    src._inner.snapshot(str(tmp_path / "loose"))
    with pytest.raises(pstore.InvalidArgumentError, match="take a full cluster snapshot first"):
        src.snapshot(tmp_path / "s3", incremental=True)
    assert not (tmp_path / "s3" / "cluster.json").exists()


def test_a_worker_with_another_server_list_is_refused(cluster):
    addrs = cluster(3)
    a = pstore.connect(addrs)
    t = a.create_sparse_table("t", DIM)
    t.push(IDS[:10], grads(0, 10))
    before = t.pull(IDS)
    b = pstore.connect(addrs[:2])  # connecting (Status) works: the first data call fails
    with pytest.raises(pstore.InvalidArgumentError, match="same list of servers"):
        b.table("t").push(IDS[:10], grads(1, 10))
    with pytest.raises(pstore.InvalidArgumentError, match="hashes to"):
        b.create_sparse_table("t2", DIM)
    assert a.tables() == ["t"]
    np.testing.assert_array_equal(t.pull(IDS), before)
    # The same servers in another order are the same cluster (routing ignores the order).
    c = pstore.connect(list(reversed(addrs)))
    np.testing.assert_array_equal(c.table("t").pull(IDS), before)
    # Servers with no table left take the next list: a new cluster.
    a.drop_table("t")
    d = pstore.connect(addrs[:2])
    d.create_sparse_table("u", 2).pull([1, 2])
    with pytest.raises(pstore.InvalidArgumentError, match="hashes to"):
        a.table("u").pull([1, 2])


def test_bad_input_names_the_cause_and_loads_nothing(cluster, tmp_path):
    src = pstore.connect(cluster(3))
    declare(src)
    train(src, range(3))
    src.snapshot(tmp_path / "snap")
    addrs = cluster(2)
    dst = pstore.connect(addrs)

    # A manifest missing a part.
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "snap", broken)
    shutil.rmtree(broken / "server-2")
    with pytest.raises(pstore.InvalidArgumentError, match=r"part server-2 .* is missing"):
        pstore.restore_cluster(broken, addrs)
    assert dst.tables() == []

    # A damaged part file: refused before anything is written.
    damaged = tmp_path / "damaged"
    shutil.copytree(tmp_path / "snap", damaged)
    part = next((damaged / "server-1").rglob("part-*.arrow"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(pstore.PstoreError, match="part-"):
        pstore.restore_cluster(damaged, addrs)
    assert dst.tables() == []

    # A part of another cluster's snapshot put in place of this one's.
    src.snapshot(tmp_path / "other")  # the same servers, another snapshot
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "snap", mixed)
    shutil.rmtree(mixed / "server-0")
    shutil.copytree(tmp_path / "other" / "server-0", mixed / "server-0")
    with pytest.raises(pstore.PstoreError, match="part server-0 does not match its checksum"):
        pstore.restore_cluster(mixed, addrs)
    assert dst.tables() == []

    # Not a cluster snapshot at all.
    with pytest.raises(pstore.InvalidArgumentError, match="not a cluster snapshot"):
        pstore.restore_cluster(tmp_path / "snap" / "server-0", addrs)

    # A table of another dim or optimizer on one of the new servers.
    dst.create_sparse_table("adagrad", DIM + 1, optimizer=pstore.optim.Adagrad(lr=0.1))
    with pytest.raises(pstore.InvalidArgumentError, match=r"adagrad.*dim 9.*dim 8"):
        pstore.restore_cluster(tmp_path / "snap", addrs)
    assert dst.tables() == ["adagrad"] and len(dst.table("adagrad")) == 0
    dst.drop_table("adagrad")
    dst.create_sparse_table("sgd", DIM, optimizer=pstore.optim.Adagrad(lr=0.05))
    with pytest.raises(pstore.InvalidArgumentError, match=r"sgd.*optimizer"):
        pstore.restore_cluster(tmp_path / "snap", addrs)
    assert dst.tables() == ["sgd"] and len(dst.table("sgd")) == 0
    dst.drop_table("sgd")

    # Unsupported destinations are refused with the reason.
    with pytest.raises(pstore.InvalidArgumentError, match="not supported"):
        src.snapshot("gs://bucket/prefix")

    # And after all that, the snapshot loads whole.
    assert pstore.restore_cluster(tmp_path / "snap", addrs)["tables"] == 3
    assert len(dst.table("adagrad")) == len(src.table("adagrad"))


def test_reshard_command(cluster, tmp_path):
    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(4))
    src.snapshot(f"file://{tmp_path / 'snap'}")
    addrs = cluster(3)
    new = tmp_path / "new.json"
    new.write_text(json.dumps({"servers": addrs}))
    out = subprocess.run(
        [sys.executable, "-m", "pstore", "reshard", str(tmp_path / "snap"), "--cluster", str(new)],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "loaded" in out.stdout
    dst = pstore.connect(addrs)
    np.testing.assert_array_equal(dst.table("sgd").pull(IDS), src.table("sgd").pull(IDS))
