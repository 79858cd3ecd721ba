"""Cluster semantics of pushes: staleness counted from a batch's own pull on a version every
server counts alike, declarations that never change a table, and a push that failed on some
servers retried only where it did not apply. Real `pstore serve` processes on loopback."""

from __future__ import annotations

import signal
import threading
import urllib.request

import numpy as np
import pytest
from _netutil import ServerProcess, free_port, start_servers, stop_all

import pstore
import pstore.cli
from pstore import init, optim

IDS = np.arange(64, dtype=np.uint64)  # spread over both servers
OTHER = np.arange(1000, 1064, dtype=np.uint64)


def _spans_every_server(t: pstore.SparseTable, n: int) -> None:
    servers = t.stats()["servers"]
    assert len(servers) == n and all(s["rows"] > 0 for s in servers), servers


@pytest.fixture(scope="module")
def two_servers():
    procs = start_servers(2)
    yield [p.address for p in procs]
    assert stop_all(procs) == [0, 0]


def _table(store: pstore.RemoteStore, name: str, policy: str, bound: int = 0):
    return store.create_sparse_table(
        name,
        2,
        optimizer=optim.SGD(lr=1.0),
        initializer=init.Zeros(),
        stale_policy=policy,  # type: ignore[arg-type]
        max_staleness=bound,
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [("apply", -3.0), ("drop", 0.0), ("scale", -1.0)],
)
@pytest.mark.parametrize("explicit", [False, True])
def test_staleness_is_counted_from_the_batchs_own_pull(two_servers, policy, expected, explicit):
    k = 3
    a, b = pstore.connect(two_servers), pstore.connect(two_servers)
    name = f"st_{policy}_{int(explicit)}"
    ta = _table(a, name, policy, bound=k - 1)
    tb = b.table(name)
    if explicit:
        _, version = ta.pull(IDS, return_version=True)
        assert len(version) == 2
    else:
        ta.pull(IDS)  # worker a reads its batch
    for _ in range(k):  # worker b pushes k fresh gradients of other ids
        tb.pull(OTHER)
        tb.push(OTHER, np.ones((len(OTHER), 2), np.float32))
    ta.pull(OTHER)  # a's next batch, prefetched: it must not change the first batch's staleness
    grads = np.full((len(IDS), 2), 3.0, np.float32)
    if explicit:
        ta.push(IDS, grads, version=version)
    else:
        ta.push(IDS, grads)
    # drop: staleness 3 > 2, rows unchanged; scale: lr / 3 exactly; apply: the whole step.
    assert np.array_equal(tb.pull(IDS), np.full((len(IDS), 2), expected, np.float32))
    _spans_every_server(ta, 2)
    st = ta.stats()["staleness"]
    # Every push counted once (not once per server): k fresh ones, then a's of staleness k.
    assert (st["pushes"], st["max"]) == (k + 1, k)
    assert st["histogram"] == [k, 0, 0, 1, 0, 0, 0, 0, 0]
    assert st["buckets"] == [0, 1, 2, 4, 8, 16, 32, 64]
    assert (st["dropped"], st["scaled"]) == (int(policy == "drop"), int(policy == "scale"))
    # Every server counted each push once: the same version everywhere.
    _, v = tb.pull(IDS, return_version=True)
    assert v == (k + 1, k + 1)


def test_staleness_histogram_in_metrics_and_status(capsys):
    mport = free_port()
    srv = ServerProcess("--metrics-port", str(mport))
    try:
        srv.wait_ready()
        s = pstore.connect([srv.address])
        t = _table(s, "h", "apply")
        t.pull(IDS)
        t.push(IDS, np.ones((len(IDS), 2), np.float32))
        assert pstore.cli.main(["status", srv.address]) == 0
        out = capsys.readouterr().out
        assert "staleness histogram  0: 1" in out
        with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10) as r:
            text = r.read().decode()
        assert 'pstore_table_staleness_bucket{table="h",kind="sparse",le="0"} 1' in text
        assert 'pstore_table_staleness_bucket{table="h",kind="sparse",le="+Inf"} 1' in text
        assert 'pstore_table_staleness_count{table="h",kind="sparse"} 1' in text
    finally:
        assert srv.stop() == 0


def test_declaring_an_existing_table_matches_or_fails(two_servers):
    a, b = pstore.connect(two_servers), pstore.connect(two_servers)
    _table(a, "decl", "drop", bound=2)
    # Same config, policy left unset: the table as it is.
    t = b.create_sparse_table("decl", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    with pytest.raises(pstore.TableExistsError, match=r'stale_policy = "drop".*"apply"'):
        _table(b, "decl", "apply")
    with pytest.raises(pstore.TableExistsError, match=r"max_staleness = 2.*gives 5"):
        _table(b, "decl", "drop", bound=5)
    with pytest.raises(pstore.TableExistsError, match="dim = 2, this declaration gives 3"):
        b.create_sparse_table("decl", 3, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    with pytest.raises(pstore.TableExistsError, match=r"optimizer\.lr = 1\.0.*gives 0\.5"):
        b.create_sparse_table("decl", 2, optimizer=optim.SGD(lr=0.5), initializer=init.Zeros())
    for s in t.stats()["servers"]:
        assert (s["stale_policy"], s["max_staleness"]) == ("drop", 2)
    assert _table(b, "decl", "drop", bound=2).name == "decl"


def _three_durable_servers(tmp_path, name: str):
    """Three `sync` servers with a directory each, and an SGD table (lr 0.5, zeros) on them."""
    args = [("--path", str(tmp_path / f"s{i}"), "--durability", "sync") for i in range(3)]
    procs = [ServerProcess(*a) for a in args]
    for p in procs:
        p.wait_ready()
    store = pstore.connect([p.address for p in procs], timeout=2.0, retries=1)
    t = store.create_sparse_table(name, 4, optimizer=optim.SGD(lr=0.5), initializer=init.Zeros())
    return args, procs, t


def test_a_push_that_failed_on_one_server_is_retried_only_where_it_missed(tmp_path):
    args, procs, t = _three_durable_servers(tmp_path, "sgd")
    try:
        ids = np.arange(300, dtype=np.uint64)
        expected = np.zeros((len(ids), 4), np.float32)
        rng = np.random.default_rng(5)
        missed: list[np.ndarray] = []
        for step in range(12):
            g = rng.integers(-4, 5, size=(len(ids), 4)).astype(np.float32)
            if step == 5:  # the third server dies between two pushes
                procs[2].stop(signal.SIGKILL)
            if step == 8:  # back, on the same port and directory
                procs[2] = ServerProcess(*args[2], port=procs[2].port)
                procs[2].wait_ready()
                for old in missed:
                    t.push(ids, old)  # the same call again: only the missing part applies
            try:
                t.push(ids, g)
            except pstore.PartialPushError as e:
                assert e.failed == [procs[2].address]
                assert sorted(e.applied) == sorted(p.address for p in procs[:2])
                assert isinstance(e, pstore.ServerError)
                missed.append(g)
            expected -= 0.5 * g  # SGD; exact in float32 (multiples of 0.5)
        assert len(missed) == 3
        assert np.array_equal(t.pull(ids), expected)
        _spans_every_server(t, 3)
    finally:
        stop_all(procs)


def test_a_server_killed_mid_stream_and_restarted_leaves_exact_rows(tmp_path):
    """One of three durable servers gets SIGKILL at a random moment of a stream of SGD pushes
    (perhaps mid-push, before or after its commit); the pushes it missed raise
    PartialPushError and are made again once it is back: every row ends exactly as expected."""
    args, procs, t = _three_durable_servers(tmp_path, "mid")
    try:
        ids = np.arange(300, dtype=np.uint64)
        expected = np.zeros((len(ids), 4), np.float32)
        rng = np.random.default_rng(7)
        missed: list[np.ndarray] = []
        victim = procs[1]
        timer = threading.Timer(float(rng.uniform(0.05, 0.3)), victim.send, (signal.SIGKILL,))
        timer.start()
        step = 0
        while len(missed) < 3:
            g = rng.integers(-4, 5, size=(len(ids), 4)).astype(np.float32)
            step += 1
            try:
                t.push(ids, g)
            except pstore.PartialPushError as e:
                assert e.failed == [victim.address]
                missed.append(g)
            expected -= 0.5 * g  # SGD; exact in float32 (multiples of 0.5)
            assert step < 10_000
        timer.join()
        victim.proc.wait(30)
        procs[1] = ServerProcess(*args[1], port=victim.port)
        procs[1].wait_ready()
        for old in missed:
            t.push(ids, old)  # the same calls again: only the missing parts apply, once
        for _ in range(3):
            g = rng.integers(-4, 5, size=(len(ids), 4)).astype(np.float32)
            t.push(ids, g)
            expected -= 0.5 * g
        assert np.array_equal(t.pull(ids), expected)
        _spans_every_server(t, 3)
    finally:
        stop_all(procs)


def test_pushes_retried_across_kill_9_apply_exactly_once(tmp_path):
    """A durable sync server killed at random points during a stream of pushes: each push that
    failed is retried (the same call: its request ids) after the restart, and every push is
    applied exactly once, whether the kill came before or after its commit."""
    path = tmp_path / "srv"
    srv = ServerProcess("--path", str(path), "--durability", "sync")
    srv.wait_ready()
    rng = np.random.default_rng(11)
    ids = np.arange(40, dtype=np.uint64)
    expected = np.zeros((len(ids), 2), np.float32)
    store = pstore.connect([srv.address], timeout=5.0, retries=0)
    t = store.create_sparse_table("once", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    kills, retried = 0, 0
    try:
        for round_ in range(4):
            timer = threading.Timer(float(rng.uniform(0.05, 0.4)), srv.send, (signal.SIGKILL,))
            timer.start()
            step = 0
            while True:
                g = np.full((len(ids), 2), float(round_ * 1000 + step + 1), np.float32)
                step += 1
                try:
                    t.push(ids, g)
                except pstore.ServerError:
                    timer.join()
                    srv.proc.wait(30)
                    kills += 1
                    srv = ServerProcess("--path", str(path), "--durability", "sync", port=srv.port)
                    srv.wait_ready()
                    t.push(ids, g)  # the same call again, after the restart
                    retried += 1
                    expected -= g
                    break
                expected -= g
        assert (kills, retried) == (4, 4)
        assert np.array_equal(t.pull(ids), expected)
    finally:
        srv.stop()


def test_torch_modules_push_with_their_batchs_version(two_servers):
    torch = pytest.importorskip("torch")
    import pstore.torch as pt

    a, b = pstore.connect(two_servers), pstore.connect(two_servers)
    t = _table(a, "torch_v", "apply")
    tb = b.table("torch_v")
    emb = pt.Embedding(t, staleness=2)
    out = emb(torch.arange(64))  # pulls the batch's rows
    for _ in range(3):  # another worker pushes meanwhile
        tb.pull(OTHER)
        tb.push(OTHER, np.ones((len(OTHER), 2), np.float32))
    emb.prefetch(torch.arange(100, 164))  # the next batch, pulled before this one's push
    out.sum().backward()  # pushes the first batch's gradients
    emb.flush()
    st = t.stats()["staleness"]
    assert (st["pushes"], st["max"]) == (4, 3)
    assert st["histogram"][:4] == [3, 0, 0, 1]
