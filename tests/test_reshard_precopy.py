"""Slot moves copy a batch's rows while writes go on, then freeze it for what was written
meanwhile (decision 0114). A writer pushes (counted), pushes rows into being and removes rows
while `move_slots` gives every slot to the other server; afterwards every counted row holds
exactly its pushes, every row pushed into being is there once, no removed row came back, and
the old owner holds nothing. With replica groups the receiving group's follower ends with its
primary's rows, byte for byte. (The exact record of each write kind during a pre-copy, from a
client of the .proto, is test_contract.py's test_a_pre_copy_records_writes_...)"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from _netutil import ServerProcess
from test_replication import _rows_of, _wait_caught_up

import pstore

SLOTS = 16384
ROWS = 60_000
DIM = 8


def _fill(store: pstore.RemoteStore) -> pstore.SparseTable:
    """Table `c`: SGD lr 1, zeros, so a row's first weight is minus its pushes of gradient 1."""
    t = store.create_sparse_table(
        "c", DIM, optimizer=pstore.optim.SGD(lr=1.0), initializer=pstore.init.Zeros()
    )
    ids = np.arange(ROWS, dtype=np.int64)
    for k in range(0, ROWS, 20_000):
        part = ids[k : k + 20_000]
        t.push(part, np.zeros((len(part), DIM), np.float32))
    return t  # type: ignore[return-value]


class Writer:
    """Pushes ids 0..999 once per round (gradient 1), pushes 20 new ids into being per round
    (from 1,000,000 on) and removes 20 existing ids per round (from 10,000 on), until stopped.
    Rows 0..999 and 10,000 on were written before it starts."""

    def __init__(self, t: pstore.SparseTable) -> None:
        self.t, self.rounds, self.stop = t, 0, threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        ones = np.ones((1000, DIM), np.float32)
        try:
            while not self.stop.is_set():
                k = self.rounds
                self.t.push(np.arange(1000, dtype=np.int64), ones)
                new = np.arange(1_000_000 + 20 * k, 1_000_000 + 20 * (k + 1), dtype=np.int64)
                self.t.push(new, np.ones((20, DIM), np.float32))
                self.t.remove(np.arange(10_000 + 20 * k, 10_000 + 20 * (k + 1), dtype=np.int64))
                self.rounds += 1
        except BaseException as e:  # reported by check()
            self.error = e

    def __enter__(self) -> Writer:
        self.thread.start()
        # Some rounds before the move, so the move meets writes at every step.
        deadline = time.monotonic() + 30
        while self.rounds < 3:
            assert self.error is None and time.monotonic() < deadline, self.error
            time.sleep(0.01)
        return self

    def __exit__(self, *_: Any) -> None:
        self.stop.set()
        self.thread.join(60)

    def check(self, t: pstore.SparseTable, rounds_during: int) -> None:
        """Every write arrived exactly once on the table's owner."""
        assert self.error is None, self.error
        # The writes went on during the move (else this would prove nothing).
        assert rounds_during > 0
        n = self.rounds
        pushed = t.pull(np.arange(1000, dtype=np.int64))
        assert np.all(pushed == -float(n)), np.unique(pushed, return_counts=True)
        new = np.arange(1_000_000, 1_000_000 + 20 * n, dtype=np.int64)
        assert t.contains(new).all()
        assert np.all(t.pull(new) == -1.0)
        gone = np.arange(10_000, 10_000 + 20 * n, dtype=np.int64)
        assert not t.contains(gone).any()
        kept = np.arange(10_000 + 20 * n, ROWS, dtype=np.int64)
        assert t.contains(kept).all()


def _rows(store: pstore.RemoteStore, table: str = "c") -> list[int]:
    return [sum(int(x["rows"]) for x in s["tables"] if x["name"] == table) for s in store.status()]


def test_rows_written_created_and_removed_during_a_move_arrive_exactly(cluster) -> None:
    servers = cluster(2)
    admin = pstore.connect(servers)
    admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, SLOTS, 0]]})
    t = _fill(admin)
    writer_store = pstore.connect(servers)
    with Writer(writer_store.sparse_table("c")) as w:
        before = w.rounds
        r = admin.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]})
        during = w.rounds - before
    assert r["slots"] == SLOTS and r["batches"] == SLOTS // 512
    # The pre-copy copied every row once; the delta only what was written meanwhile.
    assert r["rows"] >= ROWS - 20 * w.rounds
    assert 0 < r["delta_rows"] < r["rows"]
    w.check(t, during)
    assert _rows(admin)[0] == 0


def test_a_group_follower_ends_identical_to_its_primary_after_a_move(tmp_path: Path) -> None:
    procs: list[ServerProcess] = []
    try:
        for g in ("g0", "g1"):
            primary = ServerProcess("--path", str(tmp_path / f"{g}-a"), "--durability", "sync")
            primary.wait_ready()
            follower = ServerProcess(
                "--path",
                str(tmp_path / f"{g}-b"),
                "--durability",
                "sync",
                "--follow",
                primary.address,
            )
            follower.wait_ready()
            procs += [primary, follower]
        groups = [[procs[0].address, procs[1].address], [procs[2].address, procs[3].address]]
        admin = pstore.connect(groups)  # type: ignore[arg-type]
        t = _fill(admin)
        with Writer(pstore.connect(groups).sparse_table("c")) as w:  # type: ignore[arg-type]
            before = w.rounds
            admin.move_slots(dict(admin.slots, ranges=[[0, SLOTS, 1]]))
            during = w.rounds - before
        w.check(t, during)
        assert _rows(admin)[0] == 0
        for p, f in ((procs[0], procs[1]), (procs[2], procs[3])):
            _wait_caught_up(pstore.connect([p.address], timeout=10.0), pstore.connect([f.address]))
        for p in procs:
            p.stop()
        assert _rows_of(tmp_path / "g1-a") == _rows_of(tmp_path / "g1-b")
        assert _rows_of(tmp_path / "g0-a") == _rows_of(tmp_path / "g0-b")
    finally:
        for p in procs:
            p.stop()


BUDGET = 100_000
CHUNK = 2000


class NewIds:
    """Pushes CHUNK new ids per call (gradient 1, from `start` on) until stopped, so every push
    past the budget makes the table evict its oldest rows."""

    def __init__(self, t: pstore.SparseTable, start: int) -> None:
        self.t, self.start, self.next, self.calls = t, start, start, 0
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self.run)

    def run(self) -> None:
        ones = np.ones((CHUNK, DIM), np.float32)
        try:
            while not self.stop.is_set():
                self.t.push(np.arange(self.next, self.next + CHUNK, dtype=np.int64), ones)
                self.next += CHUNK
                self.calls += 1
        except BaseException as e:  # reported by the test
            self.error = e

    def ids(self) -> np.ndarray:
        return np.arange(self.start, self.next, dtype=np.int64)


def test_rows_a_max_rows_budget_evicts_during_a_move_do_not_stay_on_the_new_owner(cluster) -> None:
    """Decision 0122: a table with a `max_rows` budget (LRU) gets new ids pushed while
    `move_slots` gives every slot to the other server, so the old owner's budget evicts rows of
    the batches being copied (and would evict rows of frozen ones). Afterwards every id pushed
    is either a row (once, holding exactly its one push) or counted evicted, never both: no row
    the old owner evicted came back on the new owner (main kept them there), and the row counts
    agree with the rows found."""
    servers = cluster(2)
    admin = pstore.connect(servers)
    admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, SLOTS, 0]]})
    t = admin.create_sparse_table(
        "b",
        DIM,
        optimizer=pstore.optim.SGD(lr=1.0),
        initializer=pstore.init.Zeros(),
        max_rows=BUDGET,
        evict_policy="lru",
    )
    t.push(np.arange(BUDGET, dtype=np.int64), np.ones((BUDGET, DIM), np.float32))
    writers = [
        NewIds(pstore.connect(servers).sparse_table("b"), start) for start in (BUDGET, 1 << 40)
    ]
    for w in writers:
        w.thread.start()
    try:
        deadline = time.monotonic() + 30
        while min(w.calls for w in writers) < 3:  # over the budget before the move starts
            assert all(w.error is None for w in writers) and time.monotonic() < deadline
            time.sleep(0.01)
        before = sum(w.calls for w in writers)
        r = admin.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, SLOTS, 1]]})
        during = sum(w.calls for w in writers) - before
    finally:
        for w in writers:
            w.stop.set()
            w.thread.join(60)
    assert all(w.error is None for w in writers), [w.error for w in writers]
    assert r["slots"] == SLOTS and during > 0
    pushed = np.concatenate([np.arange(BUDGET, dtype=np.int64)] + [w.ids() for w in writers])
    held = t.contains(pushed)
    s = t.stats()
    # Each id was pushed once: a row, or evicted once.
    assert int(held.sum()) == s["rows"]
    assert s["rows"] + s["rows_evicted"] == len(pushed), (s["rows"], s["rows_evicted"], len(pushed))
    assert s["rows_evicted"] > 0
    # Nothing applied twice (nor lost): every row holds its one push.
    assert np.all(t.pull(pushed[held]) == -1.0)
    assert _rows(admin, "b")[0] == 0
