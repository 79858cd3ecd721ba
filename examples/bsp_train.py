"""Train in BSP on store servers with workers started by a launcher: torchrun, or a Kubernetes
indexed Job (deploy/kubernetes/). No rank or worker count is passed: ``pstore.connect`` takes
them from the launcher's environment (RANK or JOB_COMPLETION_INDEX, WORLD_SIZE), and pstore
does the synchronisation: the script never starts torch.distributed.

    torchrun --nproc-per-node 2 --standalone examples/bsp_train.py --cluster cluster.json

The model is chosen so that every number is known beforehand, which makes the script a check
of a deployment: an embedding (``pstore.torch.Embedding`` over a sparse table of the servers,
rows starting at 0, SGD) read through a fixed linear map ``w``, with the loss of worker ``r``
``(r + 1) * sum(emb(ids) @ w)``. Every worker reads ids 0..7 (shared) and 8 ids of its own.
Under BSP each step applies the sum of all workers' gradients once, so at the start of step
``s`` a shared row is ``-lr * s * w * W(W+1)/2`` and worker r's own row ``-lr * s * w * (r+1)``
(W workers), exactly: every value is a multiple of a power of two. Each worker prints one JSON
line per step (its rank, the step, the loss) and checks the loss against that closed form; it
exits with status 1 on the first difference.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

import pstore
import pstore.torch

DIM = 4
LR = 0.5
W = (1.0, 0.5, 0.25, 2.0)
SHARED = 8
OWN = 8


def say(record: dict[str, object]) -> None:
    """One JSON line in a single write: the workers of a launcher share one stdout pipe, and a
    write of under 4 KiB to a pipe is never interleaved with another (print would write the
    line and its newline apart)."""
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def ids_of(rank: int) -> np.ndarray:
    """The ids worker ``rank`` trains on: the shared ones, then its own."""
    own = 1000 * (rank + 1) + np.arange(OWN)
    return np.concatenate([np.arange(SHARED), own]).astype(np.int64)


def expected_loss(rank: int, world: int, step: int) -> float:
    """The loss of worker ``rank`` at the start of ``step`` (rows as BSP leaves them)."""
    w2 = float(np.dot(W, W))
    shared = -LR * step * w2 * world * (world + 1) / 2
    own = -LR * step * w2 * (rank + 1)
    return (rank + 1) * (SHARED * shared + OWN * own)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", required=True, help="the servers' cluster file")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--table", default=None, help="the table to train (default: one named after the job)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    store = pstore.connect(args.cluster, mode="bsp", barrier_timeout=120.0)
    rank, world = store.worker, store.num_workers
    assert rank is not None and world is not None
    table = store.create_sparse_table(
        args.table or f"bsp_train_{store.job}",
        dim=DIM,
        optimizer=pstore.optim.SGD(lr=LR),
        initializer=pstore.init.Constant(0.0),
    )
    emb = pstore.torch.Embedding(table, staleness=0)
    w = torch.tensor(W)
    ids = torch.from_numpy(ids_of(rank))
    status = 0
    while store.clock < args.steps:
        step = store.clock
        loss = (rank + 1) * (emb(ids) @ w).sum()
        loss.backward()
        want = expected_loss(rank, world, step)
        ok = loss.item() == want
        say(
            {
                "rank": rank,
                "world": world,
                "job": store.job,
                "step": step,
                "loss": loss.item(),
                "expected": want,
                "ok": ok,
            }
        )
        if not ok:
            status = 1
            break
        store.end_step()
    say(
        {
            "rank": rank,
            "world": world,
            "job": store.job,
            "table": table.name,
            "clock": store.clock,
            "distributed": torch.distributed.is_initialized(),
        }
    )
    return status


if __name__ == "__main__":
    sys.exit(main())
