"""A training process for tests/test_crash.py, meant to be killed with SIGKILL at any moment.

It opens (or creates) a durable store, opens (or creates) the sparse table ``emb`` (Adagrad,
lr 0.1, initial accumulator 0.1, dim 8) and pushes a gradient of all ones for the same ids
``0 .. --ids - 1``, forever: every push updates every row exactly once, so after ``k`` pushes of
the table's life every row has step ``k``. Resuming a store, it continues from the table's ``seq``
(pushes applied over the table's life), which equals the rows' step in a consistent store.

Protocol, one line per event on stdout, each flushed at once:

    start <k> <unix time>    the store is open; the next push is number k + 1
    ack <k> <unix time>      push k returned (in sync mode: it is on disk)
    flushed <k> <unix time>  store.flush() returned after push k

Periodic chores run after a push (``--flush-every``); a later ``--snapshot-every`` adds one more
entry to ``chores`` below.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import numpy as np

import pstore
from pstore import optim

TABLE = "emb"
DIM = 8
LR = 0.1
INITIAL_ACCUMULATOR = 0.1
SEED = 11


def say(*words: object) -> None:
    sys.stdout.write(" ".join(str(w) for w in words) + "\n")
    sys.stdout.flush()


def open_table(store: pstore.Store) -> pstore.SparseTable:
    if TABLE in store:
        return store.sparse_table(TABLE)
    return store.create_sparse_table(
        TABLE,
        DIM,
        optimizer=optim.Adagrad(lr=LR, initial_accumulator_value=INITIAL_ACCUMULATOR),
        seed=SEED,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path", help="the store directory")
    ap.add_argument("--durability", choices=["sync", "async", "none"], default="sync")
    ap.add_argument("--flush-interval", type=float, default=1.0)
    ap.add_argument("--ids", type=int, default=2000, help="rows pushed by every push")
    ap.add_argument("--flush-every", type=int, default=0, help="store.flush() every N pushes")
    ap.add_argument("--max-pushes", type=int, default=0, help="stop after N pushes (0: never)")
    ap.add_argument(
        "--snapshot-every", type=int, default=0, help="a snapshot every N pushes (0: never)"
    )
    ap.add_argument("--snapshots", default="", help="the directory snapshots are written in")
    ap.add_argument("--environments", type=int, default=1, help="LMDB environments of the store")
    args = ap.parse_args(argv)

    store = pstore.Store(
        args.path,
        durability=args.durability,
        flush_interval=args.flush_interval,
        threads=2,
        environments=args.environments,
    )
    table = open_table(store)
    ids = np.arange(args.ids, dtype=np.uint64)
    grads = np.ones((args.ids, DIM), dtype=np.float32)
    k = table.seq

    def flush() -> None:
        store.flush()
        say("flushed", k, repr(time.time()))

    taken = [0]

    def snapshot() -> None:
        # Every third one full, the others increments on the store's previous snapshot (which
        # the store remembers across reopening).
        incremental = taken[0] % 3 != 0
        out = f"{args.snapshots}/snap-{k:08d}"
        try:
            store.snapshot(out, incremental=incremental)
        except pstore.InvalidArgumentError:
            # No previous snapshot (a fresh store), or its parent is gone: a full one.
            store.snapshot(out)
        taken[0] += 1
        say("snapshot", k, repr(time.time()))

    # (every n pushes, what to do); n == 0 disables a chore.
    chores: list[tuple[int, Callable[[], None]]] = [
        (args.flush_every, flush),
        (args.snapshot_every, snapshot),
    ]

    say("start", k, repr(time.time()))
    pushed = 0
    while args.max_pushes == 0 or pushed < args.max_pushes:
        table.push(ids, grads)
        k += 1
        pushed += 1
        say("ack", k, repr(time.time()))
        for every, chore in chores:
            if every and k % every == 0:
                chore()
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
