"""The routing the servers hold (decision 0102): a published slot table with its epoch, clients
that take it at connect, stale clients redirected by "moved" without applying anything twice or
in the wrong place, bad publishes refused without changing anything, and a durable server that
keeps its routing across a restart."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _netutil import ServerProcess, start_servers, stop_all

import pstore

SLOTS = 16384
IDS = np.arange(1, 2001, dtype=np.uint64) * 104729


@pytest.fixture
def cluster() -> Iterator[Callable[..., list[ServerProcess]]]:
    procs: list[ServerProcess] = []

    def start(n: int, *args: str) -> list[ServerProcess]:
        new = start_servers(n, *args)
        procs.extend(new)
        return new

    yield start
    stop_all(procs)


def rows_per_server(store: pstore.RemoteStore, name: str) -> list[int]:
    return [sum(int(t["rows"]) for t in s["tables"] if t["name"] == name) for s in store.status()]


def all_to(owner: int, servers: int, epoch: int) -> dict[str, object]:
    return {"epoch": epoch, "servers": servers, "ranges": [[0, SLOTS, owner]]}


def test_a_stale_client_is_redirected_and_applies_once_in_the_right_place(cluster):
    addrs = [p.address for p in cluster(2)]
    stale = pstore.connect(addrs)
    pusher = pstore.connect(addrs)
    reader = pstore.connect(addrs)
    admin = pstore.connect(addrs)
    assert stale.slots["epoch"] == 0
    zeros, sgd = pstore.init.Zeros(), pstore.optim.SGD(lr=1.0)
    t = stale.create_sparse_table("t", 4, optimizer=sgd, initializer=zeros)
    d = stale.create_dense_table("d", (3,), optimizer=sgd, initializer=zeros)
    # Find the dense table's home under the uniform table: the server whose value the push hit.
    d.push(np.ones(3, np.float32))
    admin.publish_routing(all_to(0, 2, 1))
    home = 0 if admin.table("d").pull()[0] == -1.0 else 1
    new = 1 - home
    admin.publish_routing(all_to(new, 2, 2))
    assert admin.slots == all_to(new, 2, 2)
    # The stale client (epoch 0) sends its dense push to the old home: refused there as moved,
    # sent to the new home, applied once.
    d.push(np.ones(3, np.float32))
    assert stale.slots == all_to(new, 2, 2)
    np.testing.assert_array_equal(admin.table("d").pull(), np.full(3, -1.0, np.float32))
    # A stale client's sparse push sends part of the batch to server `home` first.
    assert pusher.slots["epoch"] == 0
    pusher.table("t").push(IDS, np.ones((len(IDS), 4), np.float32))
    assert pusher.slots["epoch"] == 2
    rows = rows_per_server(admin, "t")
    assert rows[new] == len(IDS) and rows[home] == 0, rows
    np.testing.assert_array_equal(t.pull(IDS), np.full((len(IDS), 4), -1.0, np.float32))
    # A stale reader (epoch 0, the uniform table) is redirected, and creates no row on the
    # server that does not own the ids.
    np.testing.assert_array_equal(
        reader.table("t").pull(IDS[::7]), np.full((len(IDS[::7]), 4), -1.0, np.float32)
    )
    assert reader.slots["epoch"] == 2
    assert rows_per_server(admin, "t")[home] == 0
    # A client connecting now takes the held table, whatever it was given.
    assert pstore.connect(addrs).slots == all_to(new, 2, 2)


def test_bad_publishes_are_refused_and_change_nothing(cluster):
    addrs = [p.address for p in cluster(2)]
    stale = pstore.connect(addrs)
    admin = pstore.connect(addrs)
    good = {"epoch": 3, "servers": 2, "ranges": [[0, 8000, 1], [8000, SLOTS, 0]]}
    admin.publish_routing(good)
    # The same routing again is accepted (a publish can be retried).
    admin.publish_routing(good)
    with pytest.raises(pstore.InvalidArgumentError, match="not above this client's epoch 3"):
        admin.publish_routing({**good, "epoch": 2})
    # A client that has not seen epoch 3 asks the servers, which refuse it.
    with pytest.raises(pstore.InvalidArgumentError, match="not newer than the held epoch 3"):
        stale.publish_routing(all_to(0, 2, 2))
    with pytest.raises(pstore.InvalidArgumentError, match="addresses 3 servers, the cluster has 2"):
        admin.publish_routing(all_to(0, 3, 9))
    with pytest.raises(pstore.InvalidArgumentError, match="owned by server 2"):
        admin.publish_routing(all_to(2, 2, 9))
    with pytest.raises(TypeError, match="slots must be a dict"):
        admin.publish_routing("{}")  # type: ignore[arg-type]
    assert pstore.connect(addrs).slots == good


def test_epoch_zero_is_not_a_published_routing(cluster):
    addrs = [p.address for p in cluster(1)]
    store = pstore.connect(addrs)
    store.publish_routing(all_to(0, 1, 1))
    other = pstore.connect(addrs)
    with pytest.raises(pstore.InvalidArgumentError, match="routing epoch 0"):
        # This client holds epoch 1 already: a table of epoch 0 is refused before any server.
        other._inner.publish_routing('{"epoch": 0, "servers": 1, "ranges": [[0, 16384, 0]]}')


def test_a_durable_server_keeps_its_routing(tmp_path: Path):
    a = ServerProcess("--path", str(tmp_path / "a"))
    b = ServerProcess("--path", str(tmp_path / "b"))
    try:
        a.wait_ready()
        b.wait_ready()
        addrs = [a.address, b.address]
        store = pstore.connect(addrs)
        t = store.create_sparse_table(
            "t", 2, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
        )
        store.publish_routing(all_to(1, 2, 5))
        t.push(IDS, np.ones((len(IDS), 2), np.float32))
        store.flush()
        a.stop()
        a = ServerProcess("--path", str(tmp_path / "a"), port=a.port)
        a.wait_ready()
        again = pstore.connect(addrs)
        assert again.slots == all_to(1, 2, 5)
        # The restarted server still refuses rows it does not own: a client that was given the
        # uniform table is redirected, and reads what was pushed.
        np.testing.assert_array_equal(
            again.table("t").pull(IDS), np.full((len(IDS), 2), -1.0, np.float32)
        )
        assert rows_per_server(again, "t") == [0, len(IDS)]
    finally:
        stop_all([a, b])
