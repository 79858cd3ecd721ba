"""Failover in replica groups: promotion under a new group epoch, fencing of the old primary,
client failover with exactly-once retries. Real `pstore serve` processes on loopback; each
test plays the control plane (it detects a death and calls `pstore.promote`)."""

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
from _netutil import ServerProcess, child_env, free_port
from test_replication import _rows_of, _status, _wait_caught_up, _wait_stopped

import pstore
from pstore.client import load_cluster

DIM = 4


def _group(tmp_path: Path, name: str = "g", *primary_args: str) -> tuple[ServerProcess, ...]:
    primary = ServerProcess(
        "--path", str(tmp_path / f"{name}-a"), "--durability", "sync", *primary_args
    )
    primary.wait_ready()
    follower = ServerProcess(
        "--path",
        str(tmp_path / f"{name}-b"),
        "--durability",
        "sync",
        "--follow",
        primary.address,
    )
    try:
        follower.wait_ready()
    except BaseException:
        primary.stop()
        raise
    return primary, follower


def _sgd_table(remote: pstore.RemoteStore) -> pstore.SparseTable:
    return remote.create_sparse_table(  # type: ignore[return-value]
        "t", dim=DIM, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )


def _group_with_a_joined_server(
    a: ServerProcess, b: ServerProcess, d: ServerProcess, **worker: Any
) -> pstore.SparseTable:
    """The group [a, b] and the server d as one cluster whose servers hold a routing (d joined
    through `add_server`): table "t", and a worker's handle on it, connected with that list
    (`worker`: more arguments of its `connect`)."""
    d.wait_ready()
    admin = pstore.connect([[a.address, b.address]], ack="all")  # type: ignore[list-item]
    _sgd_table(admin)
    admin.add_server(d.address)
    remote = pstore.connect(
        [[a.address, b.address], d.address],  # type: ignore[list-item]
        ack="all",
        **worker,
    )
    return remote.sparse_table("t")  # type: ignore[return-value]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    return _varint(num << 3 | 2) + _varint(len(payload)) + payload


def _raw_push(address: str, ids: np.ndarray, epoch: int | None) -> tuple[grpc.StatusCode, str]:
    """A Push sent with plain grpcio (a client generated from the .proto, which sends no layout
    hash), with the group epoch it knows as metadata, or none; its status code and message."""
    msg = (
        _field(1, b"t")
        + _field(2, ids.astype("<u8").tobytes())
        + _field(3, np.ones((ids.size, DIM), "<f4").tobytes())
    )
    md = [] if epoch is None else [("pstore-epoch", str(epoch))]
    with grpc.insecure_channel(address) as ch:
        push = ch.unary_unary(
            "/pstore.v1.PStore/Push",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            push(msg, metadata=md, timeout=20)
        except grpc.RpcError as e:
            return e.code(), e.details()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def _wait_role(remote: pstore.RemoteStore, role: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        rep = _status(remote)
        if rep["role"] == role:
            return rep
        assert time.monotonic() < deadline, rep
        time.sleep(0.05)


def test_a_cluster_file_takes_replica_groups(tmp_path: Path) -> None:
    f = tmp_path / "cluster.json"
    f.write_text(json.dumps({"servers": [["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:3"]}))
    assert load_cluster(f)["servers"][0] == ["127.0.0.1:1", "127.0.0.1:2"]
    for bad, what in [
        ([[]], "non-empty lists"),
        ([["127.0.0.1:1", 5]], "host:port"),
        ([["127.0.0.1:1", "127.0.0.1:2"], "127.0.0.1:2"], "twice"),
    ]:
        f.write_text(json.dumps({"servers": bad}))
        with pytest.raises(pstore.InvalidArgumentError, match=what):
            load_cluster(f)
    with pytest.raises(pstore.InvalidArgumentError, match="twice"):
        pstore.connect([["127.0.0.1:1"], ["127.0.0.1:1"]])  # type: ignore[list-item]
    with pytest.raises(pstore.InvalidArgumentError, match="read_from"):
        pstore.connect(["127.0.0.1:1"], read_from="any")  # type: ignore[arg-type]


def test_promote_refuses_a_bad_target_with_a_clear_error(tmp_path: Path) -> None:
    a, b = _group(tmp_path, "one")
    c, d = _group(tmp_path, "two")
    try:
        p = pstore.connect([a.address])
        _sgd_table(p)
        _wait_caught_up(p, pstore.connect([b.address], retries=0))
        with pytest.raises(pstore.ServerError, match="already the primary"):
            pstore.promote(a.address)
        with pytest.raises(pstore.ServerError, match="cannot reach"):
            pstore.promote(f"127.0.0.1:{free_port()}", timeout=2.0)
        # The file says d is in a's group; d follows c: a follower of another group.
        f = tmp_path / "cluster.json"
        f.write_text(json.dumps({"servers": [[a.address, d.address], [c.address, b.address]]}))
        with pytest.raises(pstore.ServerError, match=f"follows {c.address}, not {a.address}"):
            pstore.promote(d.address, cluster=f)
        with pytest.raises(pstore.InvalidArgumentError, match="no member"):
            pstore.promote("127.0.0.1:9", cluster=f)
        out = subprocess.run(
            [sys.executable, "-m", "pstore", "cluster", "promote", a.address],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=60,
        )
        assert out.returncode != 0 and "already the primary" in out.stderr, out
        # Nothing changed: a is still the primary of epoch 1, b its follower.
        assert _status(p)["role"] == "primary" and _status(p)["epoch"] == 1
        q = pstore.connect([b.address], retries=0)
        assert _status(q)["role"] == "follower"
    finally:
        for s in (d, c, b, a):
            s.stop()


def _failover_trial(tmp_path: Path, rng: np.random.Generator, restart_old: bool) -> int:
    """Pushes with ack="all" through a client of the group [a, b]; a is killed with SIGKILL at
    a random moment, the control plane (here) promotes b, the client fails over by itself and
    goes on. Every push is acknowledged exactly once (SGD from zeros: -1 per push), no row is
    torn. Returns the pushes acknowledged."""
    a, b = _group(tmp_path)
    old: ServerProcess | None = None
    try:
        c = pstore.connect([[a.address, b.address]], ack="all", timeout=10.0)  # type: ignore[list-item]
        t = _sgd_table(c)
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        kill_at = float(rng.uniform(0.05, 0.8))
        promoted = threading.Event()

        def control_plane() -> None:
            time.sleep(kill_at)
            a.send(signal.SIGKILL)
            a.proc.wait(30)
            pstore.promote(b.address)
            promoted.set()

        cp = threading.Thread(target=control_plane)
        cp.start()
        n = 0
        try:
            # Push k writes ids 4k..4k+3 once, gradient 1.
            while not promoted.is_set() or n < 5:
                ids = np.arange(4 * n, 4 * n + 4, dtype=np.int64)
                t.push(ids, np.ones((4, DIM), np.float32))
                n += 1
        finally:
            cp.join()
        rows = t.pull(np.arange(4 * n + 8, dtype=np.int64)).reshape(-1, 4, DIM)
        for k in range(n):
            v = rows[k]
            assert np.all(v == -1.0), f"push {k} of {n}: {v} (0: lost, -2: applied twice)"
        assert np.all(rows[n:] == 0.0)
        assert _status(pstore.connect([b.address]))["epoch"] == 2
        if restart_old:
            # The old primary comes back on its disk: it asks its recorded follower, learns
            # epoch 2, refuses writes and follows b.
            old = ServerProcess(
                "--path", str(tmp_path / "g-a"), "--durability", "sync", port=a.port
            )
            o = old.wait_ready()
            code, _ = _raw_push(old.address, np.array([10**6], np.int64), None)
            assert code != grpc.StatusCode.OK
            rep = _wait_role(o, "follower")
            assert rep["primary"] == b.address and rep["epoch"] == 2
            assert rep["dropped_commits"] is not None
            assert np.all(t.pull(np.array([10**6], np.int64)) == 0.0)
        return n
    finally:
        if old is not None:
            old.stop()
        b.stop()
        a.stop()


def test_kill_9_of_the_primary_then_promotion_loses_no_push_and_applies_none_twice(
    tmp_path: Path,
) -> None:
    rng = np.random.default_rng(330)
    total = sum(_failover_trial(tmp_path / f"trial-{i}", rng, i == 0) for i in range(20))
    assert total > 20 * 5


@pytest.mark.soak
@pytest.mark.timeout(3600)  # 200 trials, each waits out a write lease
def test_kill_9_failover_soak(tmp_path: Path) -> None:
    rng = np.random.default_rng(331)
    for i in range(200):
        _failover_trial(tmp_path / f"trial-{i}", rng, i % 10 == 0)


def test_a_paused_old_primary_never_accepts_a_write_under_its_old_epoch(tmp_path: Path) -> None:
    a, b = _group(tmp_path)
    try:
        new = pstore.connect([[a.address, b.address]], ack="all")  # type: ignore[list-item]
        t = _sgd_table(new)
        t.push(np.arange(8, dtype=np.int64), np.ones((8, DIM), np.float32))
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        a.send(signal.SIGSTOP)
        _wait_stopped(a.proc.pid)
        # Writes sent while it is paused wait in its socket.
        queued: list[tuple[grpc.StatusCode, str]] = []
        senders = [
            threading.Thread(
                target=lambda i=i: queued.append(
                    _raw_push(a.address, np.array([1000 + i], np.int64), None)
                )
            )
            for i in range(3)
        ]
        for s in senders:
            s.start()
        try:
            r = pstore.promote(b.address)
            assert r["epoch"] == 2
            t.push(np.arange(8, 16, dtype=np.int64), np.ones((8, DIM), np.float32))
        finally:
            a.send(signal.SIGCONT)
        # Resumed: no write under epoch 1 is accepted, with the old epoch or with none.
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            for i, epoch in ((2000, 1), (3000, None)):
                code, _ = _raw_push(a.address, np.array([i], np.int64), epoch)
                assert code != grpc.StatusCode.OK
        for s in senders:
            s.join()
        assert all(code != grpc.StatusCode.OK for code, _ in queued), queued
        rep = _wait_role(pstore.connect([a.address]), "follower")
        assert rep["primary"] == b.address and rep["epoch"] == 2
        code, msg = _raw_push(a.address, np.array([2001], np.int64), 1)
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "epoch 2" in msg, msg
        # The new primary goes on; the old one, a follower now, ends identical to it.
        t.push(np.arange(16, 24, dtype=np.int64), np.ones((8, DIM), np.float32))
        rows = t.pull(np.array([1000, 1001, 1002, 2000, 2001, 3000], np.int64))
        assert np.all(rows == 0.0)
        assert np.all(t.pull(np.arange(24, dtype=np.int64)) == -1.0)
        new.flush()  # the rows the pulls created, committed
        _wait_caught_up(pstore.connect([b.address]), pstore.connect([a.address], retries=0))
    finally:
        b.stop()
        a.stop()
    assert _rows_of(tmp_path / "g-a") == _rows_of(tmp_path / "g-b")


def _push_with_ids(
    address: str, ids: np.ndarray, rid: tuple[int, int], split_from: tuple[int, int] | None
) -> tuple[grpc.StatusCode, str]:
    """A raw Push with its request id and, optionally, the id of the part it was split from."""

    def request_id(client: int, seq: int) -> bytes:
        return b"\x09" + client.to_bytes(8, "little") + b"\x11" + seq.to_bytes(8, "little")

    msg = (
        _field(1, b"t")
        + _field(2, ids.astype("<u8").tobytes())
        + _field(3, np.ones((ids.size, DIM), "<f4").tobytes())
        + _field(5, request_id(*rid))
    )
    if split_from is not None:
        msg += _field(90, request_id(*split_from))
    with grpc.insecure_channel(address) as ch:
        push = ch.unary_unary(
            "/pstore.v1.PStore/Push",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        try:
            push(msg, timeout=20)
        except grpc.RpcError as e:
            return e.code(), e.details()  # type: ignore[attr-defined]
    return grpc.StatusCode.OK, ""


def test_a_promoted_follower_answers_a_part_split_from_a_push_its_old_primary_applied(
    tmp_path: Path,
) -> None:
    """A push applied by the primary (and replicated) whose answer was lost, then sent again
    split by a newer routing (new request id, split_from the old one: the client could not reach
    the group and asked the other servers, decision 0112) to the promoted follower: answered
    as applied, not applied twice."""
    a, b = _group(tmp_path)
    try:
        remote = pstore.connect([[a.address, b.address]])  # type: ignore[list-item]
        t = _sgd_table(remote)
        ids = np.arange(4, dtype=np.int64)
        client = 0x5EED
        assert _push_with_ids(a.address, ids, (client, 1), None) == (grpc.StatusCode.OK, "")
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        assert pstore.promote(b.address)["epoch"] == 2
        code, msg = _push_with_ids(b.address, ids, (client, 2), (client, 1))
        assert code == grpc.StatusCode.OK, msg
        assert np.all(t.pull(ids) == -1.0)
        # A part split from a push nobody applied is applied.
        code, msg = _push_with_ids(b.address, ids, (client, 4), (client, 3))
        assert code == grpc.StatusCode.OK, msg
        assert np.all(t.pull(ids) == -2.0)
    finally:
        b.stop()
        a.stop()


def test_reads_from_a_follower_after_a_failover_report_its_lag(tmp_path: Path) -> None:
    a, b = _group(tmp_path)
    a2: ServerProcess | None = None
    try:
        group = [[a.address, b.address]]
        c = pstore.connect(group)  # type: ignore[arg-type]
        t = _sgd_table(c)
        ids = np.arange(16, dtype=np.int64)
        for _ in range(3):
            t.push(ids, np.ones((16, DIM), np.float32))
        _wait_caught_up(pstore.connect([a.address]), pstore.connect([b.address], retries=0))
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        pstore.promote(b.address)
        for _ in range(2):
            t.push(ids, np.ones((16, DIM), np.float32))
        assert np.all(t.pull(ids) == -5.0)
        assert c.replica_groups()[0]["primary"] == b.address
        # A new follower in a's old place: reads go to it, its lag is reported.
        a2 = ServerProcess(
            "--path",
            str(tmp_path / "c"),
            "--durability",
            "sync",
            "--follow",
            b.address,
            port=a.port,
        )
        a2.wait_ready()
        r = pstore.connect(group, read_from="follower")  # type: ignore[arg-type]
        _wait_caught_up(pstore.connect([b.address]), pstore.connect([a2.address], retries=0))
        g = r.replica_groups()[0]
        assert g["reads_from"] == a2.address and g["primary"] == b.address
        lag = next(m for m in g["members"] if m["name"] == a2.address)
        assert lag["role"] == "follower" and lag["lag_entries"] == 0
        assert np.all(r.sparse_table("t").pull(ids) == -5.0)
        # The follower pulls from its copy: an id it lacks reads its initial value, uncreated.
        assert np.all(r.sparse_table("t").pull(np.array([999], np.int64)) == 0.0)
        assert _status(pstore.connect([a2.address]))["lsn"] > 0
    finally:
        if a2 is not None:
            a2.stop()
        b.stop()
        a.stop()


def _get_routing(address: str) -> bytes:
    """The raw `Routing` a server answers GetRouting with (empty: it holds none)."""
    with grpc.insecure_channel(address) as ch:
        get = ch.unary_unary(
            "/pstore.v1.PStore/GetRouting",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        out: bytes = get(b"", timeout=20)
        return out


def _assert_moved(address: str, ids: np.ndarray) -> None:
    code, msg = _raw_push(address, ids, None)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and msg.startswith("moved:"), (code, msg)


def test_a_follower_promoted_after_a_move_refuses_the_slots_its_group_gave_away(
    tmp_path: Path,
) -> None:
    """The manual run that found the defect: slots move away from a replica group of 2, its
    primary is killed with SIGKILL, its follower promoted; a worker connected before the move
    pushes again. The promoted follower holds the routing (it came through the replication
    log), answers "moved", and the worker's push lands on the new owner: every row exactly two
    pushes, none one short (the defect) and none applied twice."""
    a0, b0 = _group(tmp_path, "g0")
    a1, b1 = _group(tmp_path, "g1")
    procs = [a0, b0, a1, b1]
    try:
        groups = [[a0.address, b0.address], [a1.address, b1.address]]
        stale = pstore.connect(groups, timeout=10.0)  # type: ignore[arg-type]
        t = _sgd_table(stale)
        ids = np.arange(1, 2001, dtype=np.int64)
        grads = np.ones((len(ids), DIM), np.float32)
        t.push(ids, grads)
        mover = pstore.connect(groups)  # type: ignore[arg-type]
        before = mover.slots
        rep = mover.move_slots(dict(before, ranges=[[0, 16384, 1]]))
        assert rep["slots"] == sum(e - s for s, e, o in before["ranges"] if o == 0) > 0
        assert rep["rows"] > 0
        # The giving group's follower has the routing before the move returned.
        assert _get_routing(b0.address) == _get_routing(a0.address) != b""
        a0.send(signal.SIGKILL)
        a0.proc.wait(30)
        assert pstore.promote(b0.address)["epoch"] == 2
        # Every id is group 1's now: the promoted follower refuses them all.
        _assert_moved(b0.address, ids[:8])
        # The stale worker (routing epoch 0) pushes again: its part for group 0 fails over to
        # b0, is answered "moved", and goes to group 1.
        t.push(ids, grads)
        fresh = pstore.connect(groups)  # type: ignore[arg-type]
        assert fresh.slots["ranges"] == [[0, 16384, 1]]
        rows = fresh.sparse_table("t").pull(ids)
        assert np.all(rows == -2.0), np.unique(rows, return_counts=True)
        for p in procs:
            p.stop()
        # The request ids the move copied to group 1 are kept, on its follower too (a retry
        # split from a push applied on group 0 is answered there after a failover or restart).
        copied = [_meta(tmp_path / f"g1-{m}", b"cluster/copied_request_ids") for m in "ab"]
        assert copied[0] and len(copied[0]) % 16 == 0 and copied[0] == copied[1]
    finally:
        for p in procs:
            p.stop()


def _meta(path: Path, key: bytes) -> bytes | None:
    """A key of a stopped server's `meta` database."""
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, max_dbs=1024, subdir=True)
    try:
        db = env.open_db(b"meta", create=False)
        with env.begin(db=db) as txn:
            v = txn.get(key)
            return None if v is None else bytes(v)
    finally:
        env.close()


def test_a_follower_that_resyncs_gets_the_routing_and_keeps_it(tmp_path: Path) -> None:
    """A follower started after a move gets the routing with its resync from a snapshot, keeps
    it on disk, and enforces it once promoted, across a restart too."""
    a0, b0 = _group(tmp_path, "g0")
    a1, b1 = _group(tmp_path, "g1")
    procs = [a0, b0, a1, b1]
    try:
        groups = [[a0.address, b0.address], [a1.address, b1.address]]
        c = pstore.connect(groups)  # type: ignore[arg-type]
        t = _sgd_table(c)
        ids = np.arange(1, 1001, dtype=np.int64)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        c.move_slots(dict(c.slots, ranges=[[0, 16384, 1]]))
        assert np.all(c.sparse_table("t").pull(ids) == -1.0)
        # A new follower of group 0: no log covers it, it resyncs.
        d0 = ServerProcess(
            "--path", str(tmp_path / "g0-d"), "--durability", "sync", "--follow", a0.address
        )
        procs.append(d0)
        d = d0.wait_ready()
        _wait_caught_up(pstore.connect([a0.address]), d)
        assert _status(d)["resyncs"] >= 1
        assert _get_routing(d0.address) == _get_routing(a0.address) != b""
        b0.stop()
        a0.send(signal.SIGKILL)
        a0.proc.wait(30)
        pstore.promote(d0.address)
        _assert_moved(d0.address, ids[:8])
        d0.stop()
        d0b = ServerProcess("--path", str(tmp_path / "g0-d"), "--durability", "sync")
        procs.append(d0b)
        d0b.wait_ready()
        _assert_moved(d0b.address, ids[:8])
    finally:
        for p in procs:
            p.stop()


def test_a_third_member_follows_the_promoted_follower(tmp_path: Path) -> None:
    """A group of three: when its primary is killed and one follower promoted, the other
    follower (which knows its fellow followers from the primary's heartbeats) finds the new
    primary by itself, resyncs from it and acknowledges its pushes."""
    a, b = _group(tmp_path)
    c = ServerProcess(
        "--path", str(tmp_path / "g-c"), "--durability", "sync", "--follow", a.address
    )
    try:
        c.wait_ready()
        group = [a.address, b.address, c.address]
        w = pstore.connect([group], ack="all", timeout=20.0)  # type: ignore[list-item]
        t = _sgd_table(w)
        ids = np.arange(1, 101, dtype=np.int64)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        cs = pstore.connect([c.address], retries=0)
        _wait_caught_up(pstore.connect([a.address]), cs)
        time.sleep(1.5)  # a heartbeat names every follower to every follower
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        pstore.promote(b.address)
        rep = _wait_role(cs, "follower")
        deadline = time.monotonic() + 30
        while rep["primary"] != b.address:
            assert time.monotonic() < deadline, rep
            time.sleep(0.1)
            rep = _status(cs)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        _wait_caught_up(pstore.connect([b.address]), cs)
        assert rep["epoch"] == 2 or _status(cs)["epoch"] == 2
        b.stop()
        c.stop()
        rows = _rows_of(tmp_path / "g-c")
        assert rows == _rows_of(tmp_path / "g-b")
    finally:
        for p in (c, b, a):
            p.stop()


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pstore", "cluster", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    return out


def test_a_machine_replaced_by_hand_is_followed_after_pstore_cluster_members(
    tmp_path: Path,
) -> None:
    # "Replacing a machine" done by a person, twice: a group [a, b] and a server d (the servers
    # hold a routing: d joined). a dies, b is promoted by hand, c is started to follow b and
    # published with `pstore cluster members`; then b dies and c is promoted by hand. A worker
    # connected with the first list ([a, b], d) pushes on to c without a restart: it finds no
    # primary among a and b, asks d, and follows the members published (decision 0112).
    a, b = _group(tmp_path, "g0")
    d = ServerProcess("--path", str(tmp_path / "d"), "--durability", "sync")
    c = None
    try:
        t = _group_with_a_joined_server(a, b, d)
        ids = np.arange(1000, dtype=np.int64)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        a.send(signal.SIGKILL)
        a.proc.wait(30)
        _cli("promote", b.address)
        c = ServerProcess(
            "--path",
            str(tmp_path / "g0-c"),
            "--durability",
            "sync",
            "--follow",
            b.address,
        )
        c.wait_ready()
        servers = ["--servers", f"{b.address},{c.address}", d.address]
        out = _cli("members", f"{b.address},{c.address}", *servers, "--json")
        epoch = json.loads(out.stdout)["epoch"]
        assert isinstance(epoch, int) and epoch > 0
        # The same members again: nothing to publish.
        again = _cli("members", f"{c.address},{b.address}", *servers)
        assert "nothing published" in again.stdout, again.stdout
        _wait_caught_up(pstore.connect([b.address]), pstore.connect([c.address], retries=0))
        b.send(signal.SIGKILL)
        b.proc.wait(30)
        _cli("promote", c.address)
        started = time.monotonic()
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        took = time.monotonic() - started
        assert took < 15.0, f"the push after the second promotion took {took:.1f} s"
        rows = t.pull(ids)
        np.testing.assert_array_equal(rows, np.full((len(ids), DIM), -2.0, np.float32))
        assert _status(pstore.connect([c.address]))["role"] == "primary"
    finally:
        for p in (a, b, d, *([c] if c else [])):
            p.stop()
