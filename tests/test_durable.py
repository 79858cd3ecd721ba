"""Durable stores: the LMDB replica, reopening, durability modes, a full disk."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from test_lmdb_format import read_replica

import pstore
from pstore import init, optim


def ones(n: int, dim: int) -> np.ndarray:
    return np.ones((n, dim), dtype=np.float32)


def arange(a: int, b: int | None = None) -> np.ndarray:
    return np.arange(a, b, dtype=np.uint64) if b is not None else np.arange(a, dtype=np.uint64)


def make_tables(store: pstore.Store) -> None:
    store.create_sparse_table(
        "adam", 6, optimizer=optim.Adam(lr=0.01), initializer=init.Uniform(-1, 1), seed=5
    )
    store.create_sparse_table("sgd", 3, optimizer=optim.SGD(lr=0.1, momentum=0.9))
    store.create_dense_table("bias", (2, 3), optimizer=optim.Adagrad(lr=0.1))


def train(store: pstore.Store, steps: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        ids = rng.integers(0, 5000, 1000).astype(np.uint64)
        for name, dim in (("adam", 6), ("sgd", 3)):
            store.sparse_table(name).push(ids, rng.standard_normal((1000, dim)).astype(np.float32))
        bias = store.table("bias")
        assert isinstance(bias, pstore.DenseTable)
        bias.push(rng.standard_normal((2, 3)).astype(np.float32))


@pytest.mark.parametrize(
    ("durability", "environments"),
    [("sync", 1), ("async", 1), ("none", 1), ("sync", 2), ("async", 3)],
)
def test_reopen_restores_everything_and_training_continues_identically(
    tmp_path, durability, environments
):
    live = pstore.Store(num_shards=8)
    disk = pstore.Store(
        tmp_path / "s",
        durability=durability,
        flush_interval=0.05,
        num_shards=8,
        environments=environments,
    )
    for s in (live, disk):
        make_tables(s)
        train(s, 5, seed=1)
        s.sparse_table("sgd").lr = 0.05
        s.sparse_table("sgd").remove(arange(100))
    disk.close()
    # Any shard count: rows are found by id. The store keeps its environments.
    disk = pstore.Store(tmp_path / "s", num_shards=3)
    assert disk.storage_info()["environments"] == environments
    assert disk.tables() == live.tables() == ["adam", "bias", "sgd"]
    for name in ("adam", "sgd"):
        a, b = live.sparse_table(name), disk.sparse_table(name)
        assert len(b) == len(a) and b.stats()["rows_unloaded"] == len(a), "rows load lazily"
        assert b.lr == a.lr and b.seq == a.seq
        assert b.optimizer == a.optimizer and b.initializer == a.initializer
        for key in ("pushes", "ids_pushed", "rows_updated", "rows_created"):
            assert b.stats()[key] == a.stats()[key], key
        ids = arange(5000)
        np.testing.assert_array_equal(b.contains(ids), a.contains(ids))
    # Training goes on the same way: weights, optimizer state and Adam's steps were restored.
    train(live, 3, seed=2)
    train(disk, 3, seed=2)
    for name in ("adam", "sgd"):
        ids = arange(5000)
        got, want = disk.sparse_table(name).pull(ids), live.sparse_table(name).pull(ids)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(disk.table("bias").pull(), live.table("bias").pull())
    assert disk.sparse_table("adam").stats()["rows_unloaded"] == 0
    disk.close()


def test_lazy_rows_answer_contains_remove_and_len_without_loading(tmp_path):
    with pstore.Store(tmp_path / "s", num_shards=4) as s:
        s.create_sparse_table("t", 2).push(arange(1000), ones(1000, 2))
    s = pstore.Store(tmp_path / "s", num_shards=4)
    t = s.sparse_table("t")
    assert len(t) == 1000
    assert t.contains(arange(995, 1005)).tolist() == [True] * 5 + [False] * 5
    assert t.stats()["rows_unloaded"] == 1000
    assert t.remove(arange(990, 1010)) == 10
    assert len(t) == 990
    assert not t.contains(arange(990, 1000)).any()
    s.close()
    s = pstore.Store(tmp_path / "s")
    t = s.sparse_table("t")
    assert len(t) == 990 and not t.contains(arange(990, 1000)).any()
    # A removed id starts afresh: its old row does not come back from the replica.
    t.pull(arange(995, 996))
    assert t.stats()["rows_unloaded"] == 990
    np.testing.assert_array_equal(t.pull(arange(995, 996)), t.initial_rows(arange(995, 996)))
    s.close()


@pytest.mark.parametrize("environments", [1, 2])
def test_first_reads_with_repeated_and_absent_ids_load_each_row_once(tmp_path, environments):
    rng = np.random.default_rng(5)
    with pstore.Store(tmp_path / "s", num_shards=4, environments=environments) as s:
        t = s.create_sparse_table("t", 3, optimizer=optim.Adagrad(lr=0.1))
        t.push(arange(500), rng.standard_normal((500, 3)).astype(np.float32))
        want = t.pull(arange(500))
    s = pstore.Store(tmp_path / "s", num_shards=4, environments=environments)
    t = s.sparse_table("t")
    # Stored ids several times over, in no order, mixed with ids the replica does not hold.
    ids = rng.choice(np.arange(700, dtype=np.uint64), 2000)
    got = t.pull(ids)
    held = ids < 500
    np.testing.assert_array_equal(got[held], want[ids[held].astype(np.int64)])
    np.testing.assert_array_equal(got[~held], t.initial_rows(ids[~held]))
    st = t.stats()
    assert st["rows_unloaded"] == 500 - len(np.unique(ids[held]))
    assert len(t) == 500 + len(np.unique(ids[~held]))
    # A push of repeated ids loads each row once and sums its gradients.
    rest = np.setdiff1d(arange(500), ids)[:2]
    t.push(np.repeat(rest, 3), np.zeros((6, 3), np.float32))
    np.testing.assert_array_equal(t.pull(rest), want[rest.astype(np.int64)])
    assert t.stats()["rows_unloaded"] == st["rows_unloaded"] - 2
    s.close()


@pytest.mark.parametrize("environments", [1, 2])
def test_dropped_tables_leave_the_replica(tmp_path, environments):
    with pstore.Store(tmp_path / "s", environments=environments) as s:
        s.create_sparse_table("t", 2).push(arange(1000), ones(1000, 2))
        s.create_dense_table("d", 3)
    with pstore.Store(tmp_path / "s") as s:
        s.drop_table("t")
        s.drop_table("d")
    with pstore.Store(tmp_path / "s") as s:
        assert s.tables() == []
        t = s.create_sparse_table("t", 2)
        assert len(t) == 0 and not t.contains(arange(1000)).any()
    info = pstore.inspection.inspect_store(tmp_path / "s")
    assert [(t["name"], t["rows"]) for t in info["tables"]] == [("t", 0)]


def test_modes_commit_when_they_say(tmp_path):
    def cycle(s: pstore.Store) -> int:
        info = s.storage_info()
        assert info is not None
        return info["cycle"]

    sync = pstore.Store(tmp_path / "sync", durability="sync")
    t = sync.create_sparse_table("t", 2)
    c0 = cycle(sync)
    t.push(arange(5), ones(5, 2))
    assert cycle(sync) > c0, "a sync push returns after its commit"
    assert sync.durability == "sync"
    sync.close()

    none = pstore.Store(tmp_path / "none", durability="none")
    t = none.create_sparse_table("t", 2)
    c0 = cycle(none)
    t.push(arange(5), ones(5, 2))
    time.sleep(0.3)
    assert cycle(none) == c0, "none never writes by itself"
    none.flush()
    assert cycle(none) == c0 + 1
    none.close()

    asyn = pstore.Store(tmp_path / "async", durability="async", flush_interval=0.1)
    t = asyn.create_sparse_table("t", 2)
    c0 = cycle(asyn)
    t.push(arange(5), ones(5, 2))
    deadline = time.monotonic() + 5
    while cycle(asyn) == c0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cycle(asyn) > c0, "the flusher commits within the interval"
    asyn.close()
    assert asyn.storage_info() is None and asyn.durability is None
    asyn.close()  # idempotent
    with pytest.raises(pstore.StorageError, match="closed"):
        t.push(arange(1), ones(1, 2))


def can_lift_idle_threads() -> bool:
    """Whether this process may move a thread from SCHED_IDLE back to normal priority."""
    return os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


def flusher_policy() -> int:
    """The scheduling policy of this process's flusher thread (field 41 of its stat)."""
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] == "pstore-flusher":
            return int(stat[stat.rindex(")") + 2 :].split()[41 - 3])
    raise AssertionError("no pstore-flusher thread")


SCHED_OTHER, SCHED_IDLE = 0, 5


def test_async_background_writes_run_at_idle_priority(tmp_path):
    for mode in ("sync", "none"):
        s = pstore.Store(tmp_path / mode, durability=mode)
        info = s.storage_info()
        assert info is not None and info["idle_writes"] is False, mode
        s.close()
    s = pstore.Store(tmp_path / "async", durability="async", flush_interval=0.05)
    info = s.storage_info()
    assert info is not None
    assert info["idle_writes"] is can_lift_idle_threads()
    assert info["idle_lifts"] == 0 and info["flush_lag"] >= 0.0
    if not info["idle_writes"]:
        s.close()
        pytest.skip("this process may not lift a thread out of SCHED_IDLE: writes stay normal")
    t = s.create_sparse_table("t", 64, optimizer=optim.Adagrad(lr=0.01))
    n = 100_000
    seen = set()
    deadline = time.monotonic() + 20
    while SCHED_IDLE not in seen:
        assert time.monotonic() < deadline, f"no background write went idle: {seen}"
        # Every row changes: the next cycle writes for tens of milliseconds.
        t.push(arange(n), ones(n, 64))
        until = time.monotonic() + 0.3
        while time.monotonic() < until and SCHED_IDLE not in seen:
            seen.add(flusher_policy())
            time.sleep(0.001)
    # Only the write runs idle: a flush (which waits for its cycle) leaves it normal.
    s.flush()
    assert flusher_policy() == SCHED_OTHER
    s.close()


def test_a_starved_idle_write_is_lifted_so_the_loss_window_stays_bounded(tmp_path):
    """Other processes fill every core: an idle-priority write would barely run. The watchdog
    lifts it after twice the interval, so cycles go on committing; the flusher stretches its
    interval while that lasts (up to 16 x flush_interval) and shrinks it back after."""
    if not can_lift_idle_threads():
        pytest.skip("this process may not lift a thread out of SCHED_IDLE: writes stay normal")
    interval = 0.1
    s = pstore.Store(tmp_path / "s", durability="async", flush_interval=interval)
    t = s.create_sparse_table("t", 64, optimizer=optim.Adagrad(lr=0.01))
    n, batch = 100_000, 8192
    rng = np.random.default_rng(7)
    grads = rng.standard_normal((batch, 64)).astype(np.float32)
    t.push(arange(n), np.ones((n, 64), dtype=np.float32))
    s.flush()
    info = s.storage_info()
    assert info is not None and info["current_flush_interval"] == interval
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 2)
    ]
    try:
        time.sleep(0.2)
        info = s.storage_info()
        assert info is not None
        c0, lags, intervals = info["cycle"], [], []
        t0 = time.monotonic()
        # Long enough for two cycles at the largest stretch (16 x 0.1 s): an interval, an
        # allowance of two, a write at normal priority beside the burners (up to 2 s seen).
        while time.monotonic() - t0 < 14.0:
            t.push(rng.integers(0, n, batch).astype(np.uint64), grads)
            info = s.storage_info()
            assert info is not None
            lags.append(info["flush_lag"])
            intervals.append(info["current_flush_interval"])
    finally:
        for p in burners:
            p.kill()
        for p in burners:
            p.wait()
    info = s.storage_info()
    assert info is not None
    cycles, lifts = info["cycle"] - c0, info["idle_lifts"]
    seen = (
        f"{cycles} cycles, {lifts} lifts, largest lag {max(lags):.3f} s, "
        f"intervals {sorted(set(intervals))}"
    )
    # Each cycle rewrites tens of MB: at idle priority beside the burners it cannot finish in
    # the allowance, so the watchdog lifts it, and cycles keep committing.
    assert lifts >= 1, seen
    assert cycles >= 2, seen
    # Lifted cycles that outlast the interval stretch it (powers of two, at most 16x).
    assert max(intervals) > interval, seen
    assert all(round(i / interval) in (1, 2, 4, 8, 16) for i in intervals), seen
    # The lag counts from the start of the last cycle that committed: that cycle's own length
    # (at most an allowance of the interval before it and a write), then the interval in use,
    # the allowance (2 of them) and a write at normal priority beside the burners (seen here:
    # up to 2 s). Hence 5 intervals in use, and 4 s for the two writes and scheduling. A write
    # left idle would not finish at all: no second cycle, and a lag as long as the loop.
    assert max(lags) < 5 * max(intervals) + 4.0, seen
    # With the cores free again, writes finish at idle priority and the interval shrinks back.
    t0 = time.monotonic()
    while time.monotonic() - t0 < 20.0:
        t.push(rng.integers(0, n, 256).astype(np.uint64), grads[:256])
        info = s.storage_info()
        assert info is not None
        if info["current_flush_interval"] == interval:
            break
        time.sleep(0.05)
    s.close()
    assert info["current_flush_interval"] == interval, seen


def test_flush_during_a_background_write_takes_its_rows_over(tmp_path):
    """flush() during an idle background write: that write gives its rows back and flush()'s
    cycle writes them. Nothing is lost from the replica or from the increments' change log."""
    s = pstore.Store(tmp_path / "s", durability="async", flush_interval=0.05)
    info = s.storage_info()
    assert info is not None
    if not info["idle_writes"]:
        s.close()
        pytest.skip("this process may not lift a thread out of SCHED_IDLE: no background writes")
    n = 200_000
    t = s.create_sparse_table("t", 32, optimizer=optim.Adagrad(lr=0.1), seed=3)
    t.push(arange(n), ones(n, 32))
    s.flush()
    s.snapshot(tmp_path / "full")
    # The first cycle after the snapshot logs every row's change in `changed/`.
    t.push(arange(n), ones(n, 32))
    s.flush()
    info = s.storage_info()
    assert info is not None
    logged_in = info["cycle"]
    rng = np.random.default_rng(5)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, "no flush() met a background write"
        # Every row changes; wait for the background write of them, then flush().
        t.push(arange(n), rng.standard_normal((n, 32)).astype(np.float32))
        until = time.monotonic() + 0.5
        while time.monotonic() < until and flusher_policy() != SCHED_IDLE:
            time.sleep(0.0005)
        s.flush()
        info = s.storage_info()
        assert info is not None
        if info["superseded_writes"] > 0:
            break
    assert info["last_error"] is None
    expected = t.pull(arange(n))
    s.close()
    # The superseded take gave its rows back without forgetting that their changes were logged
    # by the earlier cycle, so flush()'s cycle did not log them again.
    changed = read_replica(tmp_path / "s").changed["t"]
    assert len(changed) == n and set(changed.values()) == {logged_in}
    again = pstore.Store(tmp_path / "s")
    np.testing.assert_array_equal(again.sparse_table("t").pull(arange(n)), expected)
    again.snapshot(tmp_path / "inc", incremental=True)
    again.close()
    restored = pstore.Store.restore(tmp_path / "inc")
    np.testing.assert_array_equal(restored.sparse_table("t").pull(arange(n)), expected)
    restored.close()


def test_bad_arguments_and_a_second_opener(tmp_path):
    with pytest.raises(pstore.InvalidArgumentError, match="durability"):
        pstore.Store(tmp_path / "a", durability="fast")  # type: ignore[arg-type]
    with pytest.raises(pstore.InvalidArgumentError, match="flush_interval"):
        pstore.Store(tmp_path / "b", flush_interval=0)
    for bad in (0, 17):
        message = "environments must be between 1 and 16, got"
        with pytest.raises(pstore.InvalidArgumentError, match=message):
            pstore.Store(tmp_path / "e", environments=bad)
    (tmp_path / "file").write_text("x")
    with pytest.raises(pstore.InvalidArgumentError, match="not a directory"):
        pstore.Store(tmp_path / "file")
    s = pstore.Store(tmp_path / "c")
    with pytest.raises(pstore.StorageError, match="open in another"):
        pstore.Store(tmp_path / "c")
    s.close()
    pstore.Store(tmp_path / "c").close()  # released by close


def test_the_map_grows_as_needed(tmp_path):
    s = pstore.Store(tmp_path / "s", durability="none", map_size=1 << 20)
    t = s.create_sparse_table("t", 64, optimizer=optim.Adagrad(lr=0.1))
    t.push(arange(20000), ones(20000, 64))  # about 11 MB of rows into a 1 MiB map
    s.flush()
    info = s.storage_info()
    assert info is not None and info["map_bytes"] > 8 << 20 and info["last_error"] is None
    s.close()
    s = pstore.Store(tmp_path / "s")
    assert len(s.sparse_table("t")) == 20000
    s.close()


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys
    import numpy as np
    import pstore

    path, limit = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    store = pstore.Store(path, durability="sync")  # the number of environments it was made with
    t = store.create_sparse_table("t", 64)
    ids = np.arange(1000, dtype=np.uint64)
    t.push(ids, np.ones((1000, 64), np.float32))
    before = t.pull(ids)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))  # "the disk is full"
    big = np.arange(1000, 200000, dtype=np.uint64)
    try:
        t.push(big, np.ones((len(big), 64), np.float32))
        print("no error")
    except pstore.StorageError as e:
        print("first:", e)
    np.testing.assert_array_equal(t.pull(ids), before)  # the refused push applied nothing
    print("rows:", len(t))
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # "space was freed"
    t.push(ids, np.ones((1000, 64), np.float32))
    store.flush()
    after = t.pull(ids)
    store.close()
    store = pstore.Store(path)
    t = store.table("t")
    print("reopened rows:", len(t))
    np.testing.assert_array_equal(t.pull(ids), after)
    store.close()
    print("recovered")
    """
)


@pytest.mark.parametrize("environments", [1, 2])
def test_a_full_disk_gives_a_clear_error_and_training_goes_on_after(tmp_path, environments):
    # RLIMIT_FSIZE makes writes past the limit fail (EFBIG), as a full disk fails them (ENOSPC),
    # without needing a small file system. With two environments each file is limited: a cycle
    # may then commit in one environment and fail in the other, and the next one, once space is
    # freed, writes everything again.
    path = tmp_path / "s"
    with pstore.Store(path, environments=environments) as s:
        s.create_sparse_table("warm", 2)
    size = (path / "data.mdb").stat().st_size
    r = subprocess.run(
        [sys.executable, "-c", FULL_DISK, str(path), str(size + (2 << 20))],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    # A sync push whose commit failed is undone: the error says so, and its retry applies once.
    assert lines[0].startswith("first:") and "the push was not applied" in lines[0], lines
    assert "disk may be full" in lines[0] and str(path) in lines[0], lines
    if environments == 1:
        assert lines[1] == "rows: 1000" and lines[2] == "reopened rows: 1000", lines
    else:
        # Rows of the environments whose commit succeeded stay; the error says that too.
        assert "several environments" in lines[0], lines
        assert 1000 <= int(lines[1].split()[-1]) <= 200000, lines
    assert lines[-1] == "recovered"
