"""A store server's rows port (decisions 0128, 0129): pulls and pushes that go to one server
alone travel over plain TCP, answered by the same code as a gRPC Pull or Push (tokens, routing
and layout checks, row creation, table versions, request ids), and anything the port refuses
goes over gRPC."""

from __future__ import annotations

import re
import socket
import struct
import threading
import urllib.request

import numpy as np
import pytest
from _netutil import ServerProcess, stop_all
from _rows import (
    RQ_HEAD,
    call_request,
    closed,
    error_text,
    push_message,
    rows_answer,
    rows_port_clients,
    rows_request,
)

import pstore
from pstore import init, optim
from pstore.server import Server

DIM = 8


def test_pulls_over_the_rows_port_equal_the_grpc_pulls_and_create_the_same_rows(rng):
    """One store served twice, with and without a rows port: every pull (new ids created,
    repeats, an empty batch, float16 and bfloat16 on the wire, batches split by the message
    limit) reads the same rows through either, and the client used the port."""
    store = pstore.Store(num_shards=4, threads=2)
    with (
        Server(store, rows_port=0, max_message=1 << 16) as fast,
        Server(store, max_message=1 << 16) as plain,
    ):
        assert fast.rows_port and plain.rows_port is None
        a = pstore.connect([fast.address], timeout=30.0, max_message=48 << 10)
        b = pstore.connect([plain.address], timeout=30.0, max_message=48 << 10)
        ta = a.create_sparse_table("t", DIM, optimizer=optim.SGD(lr=0.5), seed=3)
        tb = b.table("t")
        seen: set[int] = set()
        for _ in range(6):
            ids = rng.integers(0, 5000, size=int(rng.integers(1, 3000)), dtype=np.uint64)
            got = ta.pull(ids)  # creates the new ids' rows over the rows port
            seen.update(ids.tolist())
            assert len(store.table("t")) == len(seen)
            np.testing.assert_array_equal(got, tb.pull(ids))
            np.testing.assert_array_equal(got, store.table("t").pull(ids))
            ta.push(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32))
        assert ta.pull(np.array([], np.uint64)).shape == (0, DIM)
        assert rows_port_clients(fast.rows_port) >= 1
        for wire in ("float16", "bfloat16"):
            c = pstore.connect([fast.address], max_message=48 << 10, wire_dtype=wire)
            d = pstore.connect([plain.address], max_message=48 << 10, wire_dtype=wire)
            ids = np.arange(0, 4000, 7, dtype=np.uint64)
            np.testing.assert_array_equal(c.table("t").pull(ids), d.table("t").pull(ids))
        assert len(store.table("t")) == len(tb)


def _metric(metrics_port: int, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        m = re.search(rf"^{name} (\d+)$", r.read().decode(), re.M)
    assert m, name
    return int(m.group(1))


def test_pulls_of_half_a_mib_to_two_mib_stream_over_the_rows_port_and_equal_grpc(rng, tmp_path):
    """Pulls of 512 KiB to 2 MiB of float32 rows are sent as their rows are looked up, a slice
    at a time (decision 0133): new ids are created as over gRPC, repeated ids read one row, a
    read-only token creates nothing, a durable store's pulls (on tokio's blocking threads)
    read the same; each such pull is counted as streamed, and no other is."""
    wide = 64  # 256-byte rows: 2048 ids are 512 KiB
    store = pstore.Store(num_shards=4, threads=2)
    with (
        Server(store, token="w", read_token="r", rows_port=0, metrics_port=0) as fast,
        Server(store, token="w", read_token="r") as plain,
    ):
        ta = pstore.connect([fast.address], "w").create_sparse_table(
            "wide", wide, optimizer=optim.SGD(lr=0.5), seed=5
        )
        tb = pstore.connect([plain.address], "w").table("wide")
        seen: set[int] = set()
        for n in (2048, 3001, 5000, 8192, 1000):  # the last (250 KiB) is not streamed
            ids = rng.integers(0, 20_000, size=n, dtype=np.uint64)
            got = ta.pull(ids)  # creates the new ids' rows, slice by slice
            seen.update(ids.tolist())
            assert len(store.table("wide")) == len(seen)
            np.testing.assert_array_equal(got, tb.pull(ids))
            np.testing.assert_array_equal(got, store.table("wide").pull(ids))
            ta.push(ids, rng.standard_normal((n, wide)).astype(np.float32))
        fresh = np.arange(100_000, 104_096, dtype=np.uint64)
        rows = pstore.connect([fast.address], "r").table("wide").pull(fresh)
        assert not store.table("wide").contains(fresh).any()  # read as initial values
        slow = pstore.connect([plain.address], "r").table("wide")
        np.testing.assert_array_equal(rows, slow.pull(fresh))
        assert _metric(fast.metrics_port, "pstore_rows_port_streamed_pulls_total") == 5
        assert rows_port_clients(fast.rows_port) >= 1
    durable = pstore.Store(path=tmp_path / "d", durability="sync")
    with Server(durable, rows_port=0, metrics_port=0) as srv:
        t = pstore.connect([srv.address]).create_sparse_table("wide", wide, seed=2)
        ids = rng.integers(0, 10_000, size=4096, dtype=np.uint64)
        np.testing.assert_array_equal(t.pull(ids), durable.table("wide").pull(ids))
        assert _metric(srv.metrics_port, "pstore_rows_port_streamed_pulls_total") == 1
    durable.close()


def test_streamed_pulls_beside_pushes_never_read_a_half_updated_row(rng):
    """Two threads pull 4096 ids (1 MiB of rows, streamed) over the rows port while a third
    pushes gradients that are the same across each row: every row read is one value repeated
    (a row read half updated, or a slice sent before it was written, would not be), and the
    values only grow."""
    wide, n = 64, 4096
    store = pstore.Store(num_shards=4, threads=2)
    with Server(store, rows_port=0, metrics_port=0) as srv:
        table = pstore.connect([srv.address]).create_sparse_table(
            "t", wide, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
        )
        ids = np.arange(20_000, dtype=np.uint64)
        table.pull(ids)
        stop = threading.Event()
        bad: list[str] = []

        def push() -> None:
            c = pstore.connect([srv.address]).table("t")
            r = np.random.default_rng(1)
            while not stop.is_set():
                batch = r.choice(ids, size=n, replace=False)
                c.push(batch, np.repeat(-r.random((n, 1), dtype=np.float32), wide, axis=1))

        def pull(seed: int) -> None:
            c = pstore.connect([srv.address]).table("t")
            r = np.random.default_rng(seed)
            last = np.zeros(len(ids), np.float32)
            while not stop.is_set() and not bad:
                batch = r.choice(ids, size=n, replace=False)
                rows = c.pull(batch)
                if not (rows == rows[:, :1]).all():
                    bad.append(
                        f"a row of differing values: {rows[(rows != rows[:, :1]).any(1)][0]}"
                    )
                if (rows[:, 0] < last[batch.astype(np.int64)]).any():
                    bad.append("a row read older than one read before")
                last[batch.astype(np.int64)] = rows[:, 0]

        threads = [threading.Thread(target=push)]
        threads += [threading.Thread(target=pull, args=(s,)) for s in (2, 3)]
        for t in threads:
            t.start()
        stop.wait(3.0)
        stop.set()
        for t in threads:
            t.join(60)
        assert not bad, bad[0]
        assert _metric(srv.metrics_port, "pstore_rows_port_streamed_pulls_total") >= 20
        assert rows_port_clients(srv.rows_port) >= 1


def test_a_pull_of_several_requests_on_the_rows_port_sends_each_ahead_of_the_last_answer():
    """A pull larger than one message goes on the rows port as several requests, each sent
    before the answer to the one before is read. Requests larger than the sockets' buffers
    (2.8 MiB of ids each, rows of one float) go out in part before that answer and the rest
    after it. Every request came on the port (none fell back to gRPC), and the rows are those
    of gRPC."""
    store = pstore.Store(num_shards=4, threads=2)
    with Server(store, rows_port=0, metrics_port=0) as fast, Server(store) as plain:
        ta = pstore.connect([fast.address]).create_sparse_table("narrow", 1, seed=8)
        tb = pstore.connect([plain.address]).table("narrow")
        ids = np.arange(1_000_000, dtype=np.uint64)[::-1].copy()
        got = ta.pull(ids)  # three requests of about 2.8 MiB of ids each
        np.testing.assert_array_equal(got, tb.pull(ids))
        pulls = _counted(fast.metrics_port, "pstore_requests_total", "Pull")
        assert pulls == 3
        assert _counted(fast.metrics_port, "pstore_rows_port_requests_total", "Pull") == pulls


def test_a_pull_over_the_rows_port_gives_its_version_to_the_push_after_it():
    """The push after a pull carries the table version the pull read (the staleness check):
    with `drop`, a push computed from rows three pushes old is dropped."""
    with Server(pstore.Store(), rows_port=0) as srv:
        a = pstore.connect([srv.address])
        b = pstore.connect([srv.address])
        ids = np.array([7], np.uint64)
        one = np.ones((1, 1), np.float32)
        ta = a.create_sparse_table(
            "s",
            1,
            optimizer=optim.SGD(lr=1.0),
            initializer=init.Zeros(),
            stale_policy="drop",
            max_staleness=2,
        )
        tb = b.table("s")
        ta.pull(ids)
        for _ in range(3):
            tb.pull(ids)
            tb.push(ids, one)
        ta.push(ids, one)  # three versions behind: dropped
        assert tb.pull(ids)[0, 0] == pytest.approx(-3.0)
        assert ta.stats()["staleness"]["dropped"]
        assert rows_port_clients(srv.rows_port) >= 1


def test_tokens_on_the_rows_port_are_those_of_grpc():
    """A read-only token pulls without creating rows; a missing or wrong token is refused with
    gRPC's status and the connection goes on; a write token creates the rows."""
    store = pstore.Store()
    with Server(store, token="w", read_token="r", rows_port=0) as srv:
        pstore.connect([srv.address], "w").create_sparse_table("t", DIM, seed=1)
        ids = np.arange(10, dtype=np.uint64)
        reader = pstore.connect([srv.address], "r")
        rows = reader.table("t").pull(ids)
        assert len(store.table("t")) == 0  # read as initial values, nothing created
        assert rows_port_clients(srv.rows_port) >= 1
        np.testing.assert_array_equal(rows, store.table("t").pull(ids))
        store.table("t").remove(ids)
        with socket.create_connection(("127.0.0.1", srv.rows_port), timeout=30) as s:
            for token, words in (("", "token"), ("wrong", "token"), ("r", "")):
                s.sendall(rows_request("t", ids, token))
                code, _, dim, _, body = rows_answer(s)
                if words:
                    assert code == 16 and words in error_text(body)[0], error_text(body)
                else:
                    assert (code, dim) == (0, DIM)
                    np.testing.assert_array_equal(np.frombuffer(body, "<f4").reshape(-1, DIM), rows)
        assert len(store.table("t")) == 0
        pstore.connect([srv.address], "w").table("t").pull(ids)
        assert len(store.table("t")) == 10


def test_a_reader_behind_a_join_is_moved_on_the_rows_port_and_reads_the_new_owners_rows():
    """A reader (a read-only token: its pulls create no rows, so no ownership check refuses
    them) of one server pulls over its rows port; a server joins and half the slots move to it.
    The reader's next pull, by its old routing, is refused on the port ("moved": ids the old
    owner no longer owns), goes over gRPC, meets "moved" there, takes the new routing and reads
    every row where it now lives, pushes made since the move included."""
    env = {"PSTORE_TOKEN": "w", "PSTORE_READ_TOKEN": "r"}
    procs = [ServerProcess("--rows-port", "0", env=env) for _ in range(2)]
    try:
        admin = procs[0].wait_ready("w")
        procs[1].wait_ready("w")
        port = int(procs[0].stderr_tail().split("rows_port=")[1].split()[0])
        t = admin.create_sparse_table("t", DIM, optimizer=optim.SGD(lr=1.0), seed=5)
        ids = np.arange(2000, dtype=np.uint64)
        t.push(ids, np.ones((len(ids), DIM), np.float32))
        reader = pstore.connect([procs[0].address], "r")
        before = reader.table("t").pull(ids)
        assert rows_port_clients(port) >= 1
        np.testing.assert_array_equal(before, t.pull(ids))
        admin.add_server(procs[1].address)
        t.push(ids, np.ones((len(ids), DIM), np.float32))  # half of them on the new owner
        after = t.pull(ids)
        np.testing.assert_array_equal(after, before - 1.0)
        np.testing.assert_array_equal(reader.table("t").pull(ids), after)
        assert reader.servers == [procs[0].address, procs[1].address]
    finally:
        assert stop_all(procs) == [0, 0]


def test_a_store_servers_rows_port_frames_its_metadata_and_survives_any_request():
    """The rows port of `pstore serve --rows-port`: a request with metadata (`PSq2`) whose
    metadata cannot be framed gets an error and its connection closed; one whose keys or values
    are not metadata gets gRPC's INVALID_ARGUMENT and the connection goes on; the server then
    answers clients as before. The port is in the start log."""
    p = ServerProcess("--rows-port", "0")
    try:
        c = p.wait_ready()
        port = int(p.stderr_tail().split("rows_port=")[1].split()[0])
        c.create_sparse_table("t", DIM)
        head = RQ_HEAD.pack(b"PSq2", 0, 1, 0, 1)
        for extra, words in (
            (struct.pack("<II", 5000, 0), "metadata"),
            (struct.pack("<II", 4, 1), "reserved"),
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
                s.sendall(head + extra)
                code, _, _, _, body = rows_answer(s)
                assert code == 3 and words in error_text(body)[0]
                assert closed(s)
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            for meta in (
                struct.pack("<I", 3) + b"a b" + struct.pack("<I", 1) + b"1",
                struct.pack("<I", 9),  # a key cut short
            ):
                s.sendall(
                    RQ_HEAD.pack(b"PSq2", 0, 1, 0, 1)
                    + struct.pack("<II", len(meta), 0)
                    + b"t"
                    + meta
                    + struct.pack("<Q", 1)
                )
                code, _, _, _, body = rows_answer(s)
                assert code == 3, error_text(body)
        np.testing.assert_array_equal(
            c.table("t").pull(np.arange(5, dtype=np.uint64)).shape, (5, DIM)
        )
    finally:
        assert stop_all([p]) == [0]


def test_the_rows_port_is_refused_with_tls(tmp_path):
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    cert.write_text("not a certificate")
    key.write_text("not a key")
    with pytest.raises(pstore.InvalidArgumentError, match="plain TCP"):
        Server(pstore.Store(), rows_port=0, tls_cert=cert, tls_key=key)


def test_a_durable_servers_rows_port_answers_from_its_pool(tmp_path, rng):
    """A durable store's pulls run on its pool, not on the calling thread: the rows port
    answers them the same, before and after a restart of the store."""
    ids = rng.integers(0, 10_000, size=3000, dtype=np.uint64)
    grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    store = pstore.Store(path=tmp_path / "s", durability="sync")
    with Server(store, rows_port=0) as srv:
        t = pstore.connect([srv.address]).create_sparse_table("t", DIM, seed=9)
        first = t.pull(ids)
        t.push(ids, grads)
        second = t.pull(ids)
        assert rows_port_clients(srv.rows_port) >= 1
        port = srv.port  # the same address after the restart: the same server list
    store.close()
    store = pstore.Store(path=tmp_path / "s")
    np.testing.assert_array_equal(store.table("t").pull(ids), second)
    assert not np.array_equal(first, second)
    with Server(store, port=port, rows_port=0) as srv:
        np.testing.assert_array_equal(pstore.connect([srv.address]).table("t").pull(ids), second)
    store.close()


def _counted(metrics_port: int, name: str, method: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf'^{name}{{method="{method}"}} (\d+)$', text, re.M)
    return int(m.group(1)) if m else 0


def test_pushes_over_the_rows_port_equal_the_grpc_pushes(rng):
    """Two stores, one served with a rows port and one without, take the same pushes (Adam,
    repeated ids, batches split by the message limit, float32 and bfloat16 on the wire): their
    rows stay bit-identical, and every push message of the first came on its rows port."""
    sa, sb = pstore.Store(num_shards=4, threads=2), pstore.Store(num_shards=4, threads=2)
    with (
        Server(sa, rows_port=0, metrics_port=0, max_message=1 << 16) as fast,
        Server(sb, max_message=1 << 16) as plain,
    ):
        for wire in ("float32", "bfloat16"):
            a = pstore.connect([fast.address], max_message=48 << 10, wire_dtype=wire)
            b = pstore.connect([plain.address], max_message=48 << 10, wire_dtype=wire)
            name = f"t_{wire}"
            ta = a.create_sparse_table(name, DIM, optimizer=optim.Adam(lr=0.1), seed=3)
            tb = b.create_sparse_table(name, DIM, optimizer=optim.Adam(lr=0.1), seed=3)
            for k in range(6):
                # Repeated ids in one message; a batch of several messages has each id once (a
                # push's messages to one server go one at a time on the port, at once over
                # gRPC: two updates of one row by Adam in either order differ).
                ids = (
                    rng.integers(0, 3000, size=int(rng.integers(1, 1000)), dtype=np.uint64)
                    if k % 2
                    else rng.permutation(3000)[: int(rng.integers(1500, 3000))].astype(np.uint64)
                )
                g = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                ta.push(ids, g)
                tb.push(ids, g)
                every = np.arange(3000, dtype=np.uint64)
                np.testing.assert_array_equal(
                    sa.table(name).pull(every), sb.table(name).pull(every)
                )
            assert sa.table(name).stats()["seq"] == sb.table(name).stats()["seq"]
        pushes = _counted(fast.metrics_port, "pstore_requests_total", "Push")
        assert pushes >= 10
        assert _counted(fast.metrics_port, "pstore_rows_port_requests_total", "Push") == pushes


def test_a_push_sent_twice_on_the_rows_port_is_applied_once_and_bad_calls_change_nothing():
    """A push whose answer was lost, sent again with its request id, is answered as applied and
    not applied twice. A message that is not a push, an unknown method, a missing token get
    gRPC's status and the connection goes on; a call whose head cannot be read, or that is over
    the message limit, is answered and its connection closed. The rows are as before."""
    store = pstore.Store()
    with Server(store, token="w", rows_port=0, max_message=1 << 16) as srv:
        pstore.connect([srv.address], "w").create_sparse_table(
            "t", 1, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
        )
        ids = np.arange(4, dtype=np.uint64)
        one = push_message("t", ids, np.ones(4), client=77, seq=1)
        with socket.create_connection(("127.0.0.1", srv.rows_port), timeout=30) as s:
            for _ in range(2):
                s.sendall(call_request(one, "w"))
                code, _, _, _, body = rows_answer(s)
                assert code == 0 and body[:2] == b"\x08\x01", (code, body)  # applied: true
            np.testing.assert_array_equal(store.table("t").pull(ids)[:, 0], [-1.0] * 4)
            for request, want, words in (
                (call_request(b"\xff\xff\xff", "w"), 3, "malformed push"),
                (call_request(one, "w", method=9), 12, "no method 9"),
                (call_request(push_message("t", ids, np.ones(4), 77, 2)), 16, "token"),
                (call_request(push_message("t", ids, [1, 2, np.nan, 4], 77, 3), "w"), 3, "NaN"),
                (call_request(push_message("nope", ids, np.ones(4), 77, 4), "w"), 5, "nope"),
            ):
                s.sendall(request)
                code, _, _, _, body = rows_answer(s)
                assert code == want and words in error_text(body)[0], error_text(body)
        for request, want, words in (
            (RQ_HEAD.pack(b"PSc1", 1, 5000, 0, 0), 3, "token"),
            (RQ_HEAD.pack(b"PSc1", 1, 0, 5000, 0), 3, "metadata"),
            (RQ_HEAD.pack(b"PSc1", 1, 0, 0, 1 << 20), 11, "too large"),
        ):
            with socket.create_connection(("127.0.0.1", srv.rows_port), timeout=30) as s:
                s.sendall(request)
                code, _, _, _, body = rows_answer(s)
                assert code == want and words in error_text(body)[0], error_text(body)
                assert closed(s)
        np.testing.assert_array_equal(store.table("t").pull(ids)[:, 0], [-1.0] * 4)
        assert store.table("t").stats()["seq"] == 1


def test_a_writer_behind_a_join_pushes_on_the_rows_port_and_the_moved_parts_over_grpc():
    """A writer of one server pushes over its rows port; a server joins and half the slots move
    to it. The writer's next push, split by its old routing, is refused on the port ("moved"),
    goes over gRPC, meets "moved" there, takes the new routing and is applied once on each
    owner; the writer then finds the new server's rows port and pushes on both."""
    procs = [ServerProcess("--rows-port", "0") for _ in range(2)]
    try:
        admin = procs[0].wait_ready()
        procs[1].wait_ready()
        port = int(procs[0].stderr_tail().split("rows_port=")[1].split()[0])
        t = admin.create_sparse_table(
            "t", DIM, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros()
        )
        ids = np.arange(2000, dtype=np.uint64)
        ones = np.ones((len(ids), DIM), np.float32)
        writer = pstore.connect([procs[0].address])
        writer.table("t").push(ids, ones)
        assert rows_port_clients(port) >= 1
        admin.add_server(procs[1].address)
        writer.table("t").push(ids, ones)
        assert writer.servers == [procs[0].address, procs[1].address]
        np.testing.assert_array_equal(t.pull(ids), np.full((len(ids), DIM), -2.0, np.float32))
        joined = int(procs[1].stderr_tail().split("rows_port=")[1].split()[0])
        before = rows_port_clients(joined)  # the admin's, whose pull found the port
        writer.table("t").push(ids, ones)
        assert rows_port_clients(joined) == before + 1
        np.testing.assert_array_equal(t.pull(ids), np.full((len(ids), DIM), -3.0, np.float32))
        per_server = [
            next(x["rows"] for x in st["tables"] if x["name"] == "t") for st in admin.status()
        ]
        assert sum(per_server) == len(ids) and min(per_server) > 0
    finally:
        assert stop_all(procs) == [0, 0]


def test_a_list_of_several_servers_pulls_and_pushes_on_every_rows_port(rng):
    """Two servers with rows ports and two without, as two lists of two: the same pulls (new
    rows created, a batch with no id on one server) and pushes (Adagrad, repeated ids) leave
    both lists' rows bit-identical, every pull and push of the first list came on the ports, and
    a pull's versions carry to the push after it as over gRPC."""
    stores = [pstore.Store(num_shards=2) for _ in range(4)]
    servers = [Server(s, rows_port=0, metrics_port=0) for s in stores[:2]]
    servers += [Server(s) for s in stores[2:]]
    try:
        a = pstore.connect([s.address for s in servers[:2]])
        b = pstore.connect([s.address for s in servers[2:]])
        ta = a.create_sparse_table("t", DIM, optimizer=optim.Adagrad(lr=0.1), seed=4)
        tb = b.create_sparse_table("t", DIM, optimizer=optim.Adagrad(lr=0.1), seed=4)
        every = np.arange(5000, dtype=np.uint64)
        for k in range(6):
            ids = rng.integers(0, 5000, size=int(rng.integers(1, 3000)), dtype=np.uint64)
            if k == 3:  # ids of the first server only: the second answers its version alone
                ids = every[stores[0].table("t").contains(every)][:50]
                assert len(ids) and not stores[1].table("t").contains(ids).any()
            np.testing.assert_array_equal(ta.pull(ids), tb.pull(ids))
            g = rng.standard_normal((len(ids), DIM)).astype(np.float32)
            ta.push(ids, g)
            tb.push(ids, g)
        # Every push carried the versions its pull read, as over gRPC (staleness counted).
        assert ta.stats()["staleness"] == tb.stats()["staleness"]
        assert ta.stats()["staleness"]["pushes"] == 6
        np.testing.assert_array_equal(ta.pull(every), tb.pull(every))
        assert [len(s.table("t")) for s in stores[:2]] == [len(s.table("t")) for s in stores[2:]]
        for srv in servers[:2]:
            for method in ("Pull", "Push"):
                n = _counted(srv.metrics_port, "pstore_requests_total", method)
                assert n >= 6
                assert _counted(srv.metrics_port, "pstore_rows_port_requests_total", method) == n
    finally:
        for srv in servers:
            srv.stop()
