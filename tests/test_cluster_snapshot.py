"""Cluster snapshots (one manifest + every server's part) and restores onto any server list,
against real `pstore serve` processes on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, child_env, start_servers, stop_all
from test_snapshot import file_rows

import pstore

DIM = 8
IDS = np.arange(1, 401, dtype=np.uint64) * 7919


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


@pytest.mark.parametrize("via", ["servers", "client"])
def test_snapshot_on_4_restores_bit_exact_on_8_and_2_and_trains_on(cluster, tmp_path, via):
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
        report = pstore.restore_cluster(dest, addrs, via=via)
        assert report["tables"] == 3 and report["parts"] == 4
        assert report["rows"] == 2 * len(touched) + 1
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


@pytest.mark.parametrize("via", ["servers", "client"])
def test_incremental_cluster_snapshots_chain_with_tombstones(cluster, tmp_path, via):
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
    pstore.restore_cluster(tmp_path / "s2", addrs, via=via)
    dst = pstore.connect(addrs)
    keep = np.setdiff1d(np.unique(np.concatenate([batch_ids(k) for k in range(9)])), gone)
    assert len(dst.table("adagrad")) == len(src.table("adagrad")) == len(keep)
    assert not dst.table("adagrad").contains(gone).any()
    np.testing.assert_array_equal(dst.table("adagrad").pull(keep), src.table("adagrad").pull(keep))
    np.testing.assert_array_equal(dst.table("sgd").pull(IDS), src.table("sgd").pull(IDS))
    # Every row bit-exact, optimizer state included: full snapshots of both sides compared.
    src.snapshot(tmp_path / "src-full")
    dst.snapshot(tmp_path / "dst-full")
    assert cluster_rows(tmp_path / "dst-full") == cluster_rows(tmp_path / "src-full")

    # Onto servers that hold rows already: the chain's rows replace those of the same ids, and
    # its tombstones hide only the chain's own older rows, whichever way the rows go.
    more = cluster(2)
    pre = pstore.connect(more)
    t = pre.create_sparse_table("adagrad", DIM, optimizer=pstore.optim.Adagrad(lr=0.1))
    own = np.array([10**12 + k for k in range(5)], dtype=np.uint64)
    t.push(np.concatenate([gone[:5], keep[:5], own]), grads(99, 15))
    before = t.pull(np.concatenate([gone[:5], own]))
    pstore.restore_cluster(tmp_path / "s2", more, via=via)
    np.testing.assert_array_equal(t.pull(np.concatenate([gone[:5], own])), before)
    assert not t.contains(gone[5:]).any()
    np.testing.assert_array_equal(t.pull(keep), src.table("adagrad").pull(keep))
    assert len(t) == len(keep) + 10
    # An increment whose servers' previous snapshots are not one cluster snapshot is refused:
    # here each server's last snapshot is a loose per-server one, with no cluster.json.
    src._inner.snapshot(str(tmp_path / "loose"))
    with pytest.raises(pstore.InvalidArgumentError, match="take a full cluster snapshot first"):
        src.snapshot(tmp_path / "s3", incremental=True)
    assert not (tmp_path / "s3" / "cluster.json").exists()


def test_a_worker_with_another_server_list_is_refused(cluster, tmp_path):
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
    # The same servers in another order route otherwise (slots are owned by positions): refused.
    c = pstore.connect(list(reversed(addrs)))
    with pytest.raises(pstore.InvalidArgumentError, match="same list of servers"):
        c.table("t").pull(IDS)
    # The same list with its (uniform) slot table spelled out in a cluster file is the same
    # cluster.
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"servers": addrs, "slots": a.slots}))
    e = pstore.connect(f)
    assert e.slots == a.slots
    np.testing.assert_array_equal(e.table("t").pull(IDS), before)
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


def unshare_works() -> bool:
    """Whether this machine lets a process have its own mount namespace (Linux, unprivileged
    user namespaces or root)."""
    if not shutil.which("unshare"):
        return False
    r = subprocess.run(
        ["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs none /tmp"],
        capture_output=True,
        timeout=30,
        check=False,
    )
    return r.returncode == 0


@pytest.mark.skipif(not unshare_works(), reason="needs `unshare -r -m` (a mount namespace)")
def test_a_server_that_cannot_read_the_snapshot_is_named_and_nothing_stays(cluster, tmp_path):
    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(3))
    snap = tmp_path / "shared" / "snap"
    src.snapshot(snap)
    # One new server sees an empty directory where the snapshot is (its own mount namespace with
    # a tmpfs over the parent): as a server on another machine without the shared file system.
    blind = ServerProcess(
        prefix=[
            "unshare", "-r", "-m", "sh", "-c",
            f'mount -t tmpfs none "{tmp_path / "shared"}" && exec "$0" "$@"',
        ]
    )  # fmt: skip
    try:
        blind.wait_ready()
        addrs = [*cluster(2), blind.address]
        dst = pstore.connect(addrs)
        with pytest.raises(pstore.InvalidArgumentError) as e:
            pstore.restore_cluster(snap, addrs)
        msg = str(e.value)
        assert f"server {blind.address}" in msg, msg
        assert f"cannot read the cluster snapshot at {snap.resolve()}" in msg, msg
        assert 'via="client"' in msg and "were dropped" in msg, msg
        assert dst.tables() == []
        # The documented fallback: the client reads the parts and sends the rows.
        pstore.restore_cluster(snap, addrs, via="client")
        for name in ("adagrad", "sgd"):
            np.testing.assert_array_equal(dst.table(name).pull(IDS), src.table(name).pull(IDS))
    finally:
        blind.stop()


def table_rows_on(address: str | pstore.RemoteStore, name: str) -> int:
    """Rows of table `name` on the one server at `address` (or connected to, a store of one
    server: no connection to open) (0 while it has no such table)."""
    store = (
        pstore.connect([address], timeout=5.0, retries=0) if isinstance(address, str) else address
    )
    for t in store.status()[0]["tables"]:
        if t["name"] == name:
            return int(t["rows"])
    return 0


def test_a_server_killed_during_the_load_leaves_no_table(cluster, tmp_path):
    src = pstore.connect(cluster(4))
    t = src.create_sparse_table("big", 32, optimizer=pstore.optim.Adagrad(lr=0.1))
    n, chunk = 600_000, 1 << 16
    rng = np.random.default_rng(3)
    for lo in range(0, n, chunk):
        ids = np.arange(lo, min(n, lo + chunk), dtype=np.uint64)
        t.push(ids, rng.standard_normal((len(ids), 32), dtype=np.float32))
    src.snapshot(tmp_path / "snap")
    procs = start_servers(2, "--threads", "1")
    survivor, victim = procs
    try:
        addrs = [p.address for p in procs]
        outcome: dict[str, BaseException | dict[str, int]] = {}

        def restore() -> None:
            try:
                outcome["report"] = pstore.restore_cluster(tmp_path / "snap", addrs)
            except BaseException as e:  # handed to the test's thread
                outcome["error"] = e

        # Asked on a connection opened beforehand: each check is one Status call, so the kill
        # comes within a millisecond or so of the victim's first loaded chunk, not after it
        # has loaded everything (a check that opened a connection each time let a quiet
        # machine finish the load first).
        probe = pstore.connect([victim.address], timeout=5.0, retries=0)
        th = threading.Thread(target=restore)
        th.start()
        # SIGKILL the victim as soon as it holds some of its rows, not all.
        while th.is_alive() and table_rows_on(probe, "big") == 0:
            time.sleep(0.0005)
        victim.send(signal.SIGKILL)
        th.join(timeout=300)
        assert not th.is_alive()
        assert "error" in outcome, f"the load ended before the kill: {outcome}"
        msg = str(outcome["error"])
        assert victim.address in msg, msg
        assert "the tables it created (big) were dropped on the servers that answered" in msg, msg
        # The survivor finished its part, then dropped the table: no half-loaded table is left.
        assert table_rows_on(survivor.address, "big") == 0
        assert pstore.connect([survivor.address]).status()[0]["tables"] == []
    finally:
        stop_all(procs)


def test_reshard_command_via_client_and_a_bad_via(cluster, tmp_path):
    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(4))
    src.snapshot(tmp_path / "snap")
    addrs = cluster(3)

    def reshard(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pstore", "reshard", str(tmp_path / "snap"), *addrs, *extra],
            capture_output=True,
            text=True,
            timeout=120,
            env=child_env(),
            check=False,
        )

    bad = reshard("--via", "carrier-pigeon")
    assert bad.returncode != 0 and "--via" in bad.stderr
    assert pstore.connect(addrs).tables() == []
    out = reshard("--via", "client")
    assert out.returncode == 0, out.stderr
    dst = pstore.connect(addrs)
    np.testing.assert_array_equal(dst.table("adagrad").pull(IDS), src.table("adagrad").pull(IDS))
    with pytest.raises(pstore.InvalidArgumentError, match='"servers" or "client"'):
        dst.restore_cluster(tmp_path / "snap", via="nowhere")  # type: ignore[arg-type]


def test_durable_servers_load_on_their_side_and_keep_the_rows_after_a_restart(cluster, tmp_path):
    src = pstore.connect(cluster(3))
    declare(src)
    train(src, range(5))
    src.snapshot(tmp_path / "snap")
    paths = [tmp_path / f"durable-{i}" for i in range(2)]
    procs = [ServerProcess("--path", str(p)) for p in paths]
    try:
        for p in procs:
            p.wait_ready()
        addrs = [p.address for p in procs]
        pstore.restore_cluster(tmp_path / "snap", addrs)
        # The load was flushed: the same servers restarted on their directories hold every row.
        stop_all(procs)
        procs = [
            ServerProcess("--path", str(d), port=p.port) for d, p in zip(paths, procs, strict=True)
        ]
        for p in procs:
            p.wait_ready()
        dst = pstore.connect(addrs)
        for name in ("adagrad", "sgd"):
            np.testing.assert_array_equal(dst.table(name).pull(IDS), src.table(name).pull(IDS))
        np.testing.assert_array_equal(dst.table("bias").pull(), src.table("bias").pull())
    finally:
        stop_all(procs)
