"""What a durable store server keeps across a restart besides its rows: the request ids of every
kind of write (sparse and dense pushes, removals, evictions; per LMDB environment), the hash of
its cluster's server list, and the table versions staleness is counted on. Also: the `pushes`
counter of a table spread over servers counts each push once. Real `pstore serve` processes
on loopback, real LMDB on disk; the retries go through plain grpcio with request ids of their
own, so a retry is exactly the request the server saw before it was killed."""

from __future__ import annotations

import importlib
import importlib.resources
import json
import signal
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from _netutil import ServerProcess, free_port, start_servers, stop_all
from grpc_tools import protoc

import pstore
import pstore.cli
from pstore import init, optim

PROTO = Path(__file__).resolve().parents[1] / "proto" / "pstore" / "v1" / "pstore.proto"
TIMEOUT = 10.0
CLIENT = 0x5E3A_7171_0000_0001


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """The message classes and stub generated from the proto now."""
    out = tmp_path_factory.mktemp("stubs_restart")
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    argv = ["grpc_tools.protoc", f"-I{PROTO.parent}", f"-I{include}"]
    argv += [f"--python_out={out}", f"--grpc_python_out={out}", str(PROTO)]
    assert protoc.main(argv) == 0
    names = ("pstore_pb2", "pstore_pb2_grpc")
    saved = {n: sys.modules.pop(n) for n in names if n in sys.modules}
    sys.path.insert(0, str(out))
    try:
        pb2, grpc_mod = (importlib.import_module(n) for n in names)
        yield SimpleNamespace(pb=pb2, Stub=grpc_mod.PStoreStub)
    finally:
        sys.path.remove(str(out))
        for n in names:
            sys.modules.pop(n, None)
        sys.modules.update(saved)


def ids_bytes(ids: Any) -> bytes:
    return np.asarray(ids, dtype=np.uint64).astype("<u8").tobytes()


def f32_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float32).astype("<f4").tobytes()


def sgd_sparse(dim: int) -> str:
    sgd = {"kind": {"sgd": {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}}, "lr": 1.0}
    return json.dumps({"dim": dim, "optimizer": sgd, "initializer": "zeros", "seed": 0})


def sgd_dense(shape: list[int]) -> str:
    sgd = {"kind": {"sgd": {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}}, "lr": 1.0}
    return json.dumps({"shape": shape, "optimizer": sgd, "initializer": "zeros", "seed": 0})


def rid(m: SimpleNamespace, seq: int) -> Any:
    return m.pb.RequestId(client=CLIENT, seq=seq)


class Durable:
    """One durable `sync` server, killed and restarted on the same port and directory."""

    def __init__(self, path: Path, *extra: str) -> None:
        self.args = ("--path", str(path), "--durability", "sync", *extra)
        self.proc = ServerProcess(*self.args)
        self.proc.wait_ready()
        self.channel = grpc.insecure_channel(self.proc.address)

    def restart(self, sig: int) -> None:
        self.channel.close()
        self.proc.stop(sig)
        self.proc = ServerProcess(*self.args, port=self.proc.port)
        self.proc.wait_ready()
        self.channel = grpc.insecure_channel(self.proc.address)

    def stub(self, m: SimpleNamespace) -> Any:
        return m.Stub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.proc.stop()


def rows(stub: Any, m: SimpleNamespace, table: str, ids: list[int], dim: int) -> np.ndarray:
    r = stub.Pull(m.pb.PullRequest(table=table, ids=ids_bytes(ids)), timeout=TIMEOUT)
    return np.frombuffer(r.rows, dtype="<f4").reshape(len(ids), dim)


def test_removes_evictions_and_dense_pushes_apply_once_across_kill_9(m, tmp_path):
    srv = Durable(tmp_path / "srv")
    try:
        s = srv.stub(m)
        pb = m.pb
        s.CreateTable(pb.CreateTableRequest(name="t", kind=pb.SPARSE, config_json=sgd_sparse(2)))
        s.CreateTable(pb.CreateTableRequest(name="d", kind=pb.DENSE, config_json=sgd_dense([3])))
        ones = f32_bytes(np.ones((6, 2)))
        s.Push(
            pb.PushRequest(table="t", ids=ids_bytes(range(1, 7)), grads=ones, request_id=rid(m, 1))
        )
        s.Push(
            pb.PushRequest(
                table="t",
                ids=ids_bytes([3, 4]),
                grads=f32_bytes(np.ones((2, 2))),
                request_id=rid(m, 2),
            )
        )
        remove = pb.RemoveRequest(table="t", ids=ids_bytes([1, 2]), request_id=rid(m, 3))
        assert s.Remove(remove, timeout=TIMEOUT).removed == 2
        # Rows not updated by the last push (5, 6) go.
        evict = pb.EvictRequest(table="t", not_updated_for_steps=1, request_id=rid(m, 4))
        assert s.Evict(evict, timeout=TIMEOUT).removed == 2
        dense = pb.DensePushRequest(
            table="d", grad=f32_bytes([1.0, 2.0, 4.0]), request_id=rid(m, 5)
        )
        assert s.DensePush(dense, timeout=TIMEOUT).applied

        srv.restart(signal.SIGKILL)  # everything above was acknowledged, so committed
        s = srv.stub(m)
        # Rows 1, 2 (removed) and 5 (evicted) are written again by push seq 3; 3 and 4 keep
        # version 2.
        s.Push(
            pb.PushRequest(
                table="t",
                ids=ids_bytes([1, 2, 5]),
                grads=f32_bytes(np.ones((3, 2))),
                request_id=rid(m, 6),
            )
        )
        # The retries of the remove, the evict and the dense push are answered, not applied:
        # applied again, the remove would delete 1 and 2, the evict (its steps now counted
        # from seq 3) rows 3 and 4, the dense push would step the value again.
        assert s.Remove(remove, timeout=TIMEOUT).removed == 0
        assert s.Evict(evict, timeout=TIMEOUT).removed == 0
        assert s.DensePush(dense, timeout=TIMEOUT).applied
        mask = s.Contains(pb.ContainsRequest(table="t", ids=ids_bytes(range(1, 7))))
        assert list(mask.mask) == [1, 1, 1, 1, 1, 0]
        got = rows(s, m, "t", [1, 2, 3, 4, 5], 2)
        assert np.array_equal(got[:, 0], [-1.0, -1.0, -2.0, -2.0, -1.0])
        d = s.DensePull(pb.DensePullRequest(table="d"), timeout=TIMEOUT)
        assert np.array_equal(np.frombuffer(d.values, "<f4"), [-1.0, -2.0, -4.0])

        # Once more across a second kill: the ids stay committed.
        srv.restart(signal.SIGKILL)
        s = srv.stub(m)
        assert s.Remove(remove, timeout=TIMEOUT).removed == 0
        assert s.DensePush(dense, timeout=TIMEOUT).applied
        d = s.DensePull(pb.DensePullRequest(table="d"), timeout=TIMEOUT)
        assert np.array_equal(np.frombuffer(d.values, "<f4"), [-1.0, -2.0, -4.0])
        assert list(s.Contains(pb.ContainsRequest(table="t", ids=ids_bytes([1, 2]))).mask) == [1, 1]
    finally:
        srv.close()


def _mix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & mask
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & mask
    return x ^ (x >> 31)


def test_a_retry_applies_only_in_the_environments_that_missed_it(m, tmp_path):
    """A store of two LMDB environments commits them apart: a crash between the two commits of
    a push leaves its rows (and its request id) in one environment only. Its retry must apply
    the part of the environment that missed it, and nothing in the other one."""
    lmdb = pytest.importorskip("lmdb")
    path = tmp_path / "srv"
    srv = Durable(path, "--environments", "2")
    ids = list(range(1, 41))
    env_of = [(_mix64(i) * 2) >> 64 for i in ids]
    assert set(env_of) == {0, 1}
    push = m.pb.PushRequest(
        table="t", ids=ids_bytes(ids), grads=f32_bytes(np.ones((len(ids), 2))), request_id=rid(m, 1)
    )
    try:
        s = srv.stub(m)
        s.CreateTable(
            m.pb.CreateTableRequest(name="t", kind=m.pb.SPARSE, config_json=sgd_sparse(2))
        )
        s.Push(push, timeout=TIMEOUT)
        srv.channel.close()
        assert srv.proc.stop() == 0
        # The crash between the commits: environment 1 committed the push, environment 0 (the
        # store directory) did not: neither its rows of the push nor its request id.
        env = lmdb.open(str(path), max_dbs=3072, subdir=True)
        with env.begin(write=True) as txn:
            meta = env.open_db(b"meta", txn=txn, create=False)
            assert txn.delete(b"applied/t", db=meta)
            rows_db = env.open_db(b"rows/t", txn=txn, create=False)
            keys = [k for k, _ in txn.cursor(db=rows_db)]
            assert len(keys) == env_of.count(0)
            for k in keys:
                txn.delete(k, db=rows_db)
        env.close()
        srv.proc = ServerProcess(*srv.args, port=srv.proc.port)
        srv.proc.wait_ready()
        srv.channel = grpc.insecure_channel(srv.proc.address)
        s = srv.stub(m)
        assert s.Push(push, timeout=TIMEOUT).applied
        got = rows(s, m, "t", ids, 2)
        # Every row holds the push once: environment 0's rows applied now, 1's not again.
        assert np.array_equal(got, -np.ones((len(ids), 2), np.float32)), got[:, 0]
        # And the push is now known everywhere.
        assert s.Push(push, timeout=TIMEOUT).applied
        srv.restart(signal.SIGKILL)
        s = srv.stub(m)
        assert s.Push(push, timeout=TIMEOUT).applied
        assert np.array_equal(rows(s, m, "t", ids, 2), -np.ones((len(ids), 2), np.float32))
    finally:
        srv.close()


def test_a_restarted_server_keeps_its_layout_and_versions(tmp_path):
    path = tmp_path / "a"
    a = ServerProcess("--path", str(path), "--durability", "sync")
    other = start_servers(1)
    try:
        store = a.wait_ready()
        t = store.create_sparse_table("v", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
        ids = np.arange(8, dtype=np.uint64)
        for _ in range(3):
            t.pull(ids)
            t.push(ids, np.ones((8, 2), np.float32))
        _, before = t.pull(ids, return_version=True)
        assert before == (3,)
        a.stop(signal.SIGKILL)
        a = ServerProcess("--path", str(path), "--durability", "sync", port=a.port)
        store = a.wait_ready()
        t = store.table("v")
        # The version goes on where it was: a push computed from the pull before the kill,
        # made after one more push, has staleness 1 (unknown, and not counted, if the server
        # had started its versions from 0 again).
        _, now = t.pull(ids, return_version=True)
        assert now == (3,)
        t.push(ids, np.ones((8, 2), np.float32))
        t.push(ids, np.ones((8, 2), np.float32), version=before)
        st = t.stats()["staleness"]
        assert (st["max"], st["histogram"][1]) == (1, 1)
        # A worker with another server list is still refused after the restart.
        with pytest.raises(pstore.InvalidArgumentError, match="hashes to"):
            pstore.connect([a.address, other[0].address], retries=0).table("v").pull(ids)
    finally:
        a.stop()
        stop_all(other)


def test_pushes_over_two_servers_count_once(tmp_path, capsys):
    mports = [free_port(), free_port()]
    procs = [ServerProcess("--metrics-port", str(p)) for p in mports]
    try:
        for p in procs:
            p.wait_ready()
        store = pstore.connect([p.address for p in procs])
        t = store.create_sparse_table("c", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
        ids = np.arange(64, dtype=np.uint64)
        t.pull(ids)
        t.push(ids, np.ones((64, 2), np.float32))
        t.push(ids[:1], np.ones((1, 2), np.float32))  # ids on one server only
        s = t.stats()
        assert all(x["rows"] > 0 for x in s["servers"])
        assert s["pushes"] == 2
        assert s["staleness"]["pushes"] == 1  # the one with a pull
        total = 0
        for port in mports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith('pstore_table_pushes_total{table="c"'):
                        total += int(float(line.split()[-1]))
        assert total == 2
        assert pstore.cli.main(["status", *(p.address for p in procs)]) == 0
        assert "cluster: c 2 pushes" in capsys.readouterr().out
    finally:
        stop_all(procs)


def test_dense_staleness_is_counted_from_the_batchs_own_pull():
    procs = start_servers(2)
    try:
        a = pstore.connect([p.address for p in procs])
        b = pstore.connect([p.address for p in procs])
        ta = a.create_dense_table(
            "dv", (3,), optimizer=optim.SGD(lr=1.0), initializer=init.Zeros(), stale_policy="apply"
        )
        tb = b.table("dv")
        assert isinstance(tb, pstore.DenseTable)
        value, version = ta.pull(return_version=True)
        assert value.shape == (3,) and len(version) == 1
        for _ in range(3):  # another worker pushes meanwhile
            tb.pull()
            tb.push(np.ones(3, np.float32))
        ta.pull()  # a's next batch, read before the first one's push
        ta.push(np.ones(3, np.float32), version=version)
        ta.pull()
        ta.push(np.ones(3, np.float32))  # by default: the version of the last pull
        st = ta.stats()["staleness"]
        assert (st["pushes"], st["max"]) == (5, 3)
        assert st["histogram"][:4] == [4, 0, 0, 1]
        _, now = tb.pull(return_version=True)
        assert now == (5,)
        with pytest.raises(pstore.InvalidArgumentError, match="one number"):
            ta.push(np.ones(3, np.float32), version=(1, 2))
        # An embedded table has no version.
        local = pstore.Store().create_dense_table("e", (2,))
        assert local.pull(return_version=True)[1] == ()
    finally:
        stop_all(procs)
