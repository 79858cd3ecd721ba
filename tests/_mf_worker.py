"""One training worker of the distributed matrix-factorisation test (tests/test_distributed.py).

Worker k of W takes batches k, k + W, k + 2W, ... of each epoch's shuffled order and ends each
step with ``store.end_step()``, which enforces the training mode.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import pstore
from pstore.apps import datasets
from pstore.apps.demo import _MatrixFactorization

DIM, BATCH, LR, L2 = 16, 512, 0.1, 0.1


def data() -> tuple[datasets.Ratings, datasets.Ratings]:
    ratings = datasets.synthetic_ratings(n_users=600, n_items=900, n_ratings=30_000, seed=3)
    return datasets.train_test_split(ratings, 0.1, seed=3)


def model(store: object, train: datasets.Ratings) -> _MatrixFactorization:
    mu = float(np.mean(train.ratings, dtype=np.float64))
    return _MatrixFactorization(store, DIM, mu, "adagrad", LR, L2, seed=5)


def batches(train: datasets.Ratings, epochs: int, workers: int, worker: int):
    """The batches of one worker; with workers=1, worker=0: every worker's, in step order."""
    rng = np.random.default_rng(7)
    steps = (len(train) // BATCH) // workers
    for _ in range(epochs):
        order = rng.permutation(len(train))
        for j in range(steps):
            b = j * workers + worker
            yield order[b * BATCH : (b + 1) * BATCH]


ITEM_ID0 = 1 << 40


def count_ids(train: datasets.Ratings, idx: np.ndarray) -> np.ndarray:
    """The ids of table `count` one batch pushes to (one per rating, repeated ids summed)."""
    return np.concatenate(
        [train.users[idx].astype(np.uint64), train.items[idx].astype(np.uint64) + ITEM_ID0]
    )


def expected_counts(train: datasets.Ratings, epochs: int, workers: int) -> dict[int, int]:
    """The pushes table `count` gets per id from `workers` workers over `epochs` epochs."""
    expected: dict[int, int] = {}
    for k in range(workers):
        for idx in batches(train, epochs, workers, k):
            ids, n = np.unique(count_ids(train, idx), return_counts=True)
            for i, c in zip(ids.tolist(), n.tolist(), strict=True):
                expected[i] = expected.get(i, 0) + c
    return expected


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--servers", required=True)
    p.add_argument("--worker", type=int, required=True)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--mode", default="async")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument(
        "--count",
        action="store_true",
        help="also push -1 per rating into the table `count` (dim 1, SGD lr 1, zeros) at the "
        "ids users and ITEM_ID0 + items, so that each row holds the pushes it got",
    )
    a = p.parse_args()
    train, _ = data()
    store = pstore.connect(
        a.servers.split(","),
        mode=a.mode,
        staleness=a.staleness,
        worker=a.worker,
        num_workers=a.workers,
        barrier_timeout=120.0,
    )
    m = model(store, train)
    steps = 0
    for idx in batches(train, a.epochs, a.workers, a.worker):
        m.train_step(train.users[idx], train.items[idx], train.ratings[idx])
        if a.count:
            ids = count_ids(train, idx)
            store.table("count").push(ids, np.full((len(ids), 1), -1.0, np.float32))
        store.end_step()
        steps += 1
    print(json.dumps({"worker": a.worker, "steps": steps}))


if __name__ == "__main__":
    main()
