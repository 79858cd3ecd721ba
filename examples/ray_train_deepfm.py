"""Train the DeepFM click model with Ray Train's TorchTrainer, its embeddings in a pstore cluster
on Ray: BSP through pstore for the sparse rows, DDP for the dense layers.

    python examples/ray_train_deepfm.py                      # a local Ray cluster
    RAY_ADDRESS=auto python examples/ray_train_deepfm.py     # the Ray cluster this node is in

The script starts a pstore cluster (``pstore.ray.Cluster``), then ``num_workers`` Ray Train
workers. Each worker connects with ``pstore.ray.connect(..., mode="bsp")``, trains on its shard
of a seeded Criteo-shaped data set (``pstore.apps.datasets.criteo_like``, made on the worker, no
download) and ends every batch with ``store.end_step()``: the servers apply each step's summed
gradients once every worker has pushed its own. The dense layers are wrapped by
``ray.train.torch.prepare_model`` (DDP). Prints one JSON line: the loss of the first and of the
last epoch, samples per second and the tables' row counts.

Needs Ray Train and torch (``pip install 'pstore[ray,torch]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

import pstore.ray

DEFAULTS: dict[str, Any] = {
    "samples": 24_000,
    "scale": 0.0005,
    "epochs": 3,
    "batch_size": 512,
    "dim": 8,
    "seed": 0,
    "prefix": "deepfm",
}


def worker_batches(
    n: int, rank: int, world: int, batch_size: int, epoch: int, seed: int
) -> Iterator[np.ndarray]:
    """The sample indices of each batch of worker ``rank`` in ``epoch``: the worker's shard is
    every ``world``-th sample of the first ``n - n % world`` (so every worker has as many
    batches, as BSP needs), shuffled per epoch by a seeded generator."""
    shard = np.arange(rank, n - n % world, world)
    order = np.random.default_rng([seed, epoch, rank]).permutation(shard)
    for start in range(0, len(order), batch_size):
        yield order[start : start + batch_size]


def pushed_ids(config: dict[str, Any], world: int) -> dict[int, int]:
    """How many BSP steps pushed each global id: what the rows' push counts must be after
    training. The servers apply a step's gradients of all workers as one update per row, so a
    row's count grows by one per step in which any worker pushed it."""
    from pstore.apps import ctr, datasets

    c = {**DEFAULTS, **config}
    data = datasets.criteo_like(c["samples"], scale=c["scale"], seed=c["seed"])
    ids = ctr.global_ids(data)
    counts: dict[int, int] = {}
    for epoch in range(c["epochs"]):
        per_rank = [
            worker_batches(len(data), rank, world, c["batch_size"], epoch, c["seed"])
            for rank in range(world)
        ]
        for batches in zip(*per_rank, strict=True):  # one BSP step: a batch of every worker
            for i in np.unique(ids[np.concatenate(batches)]).tolist():
                counts[i] = counts.get(i, 0) + 1
    return counts


def fit(
    store: pstore.RemoteStore,
    rank: int,
    world: int,
    config: dict[str, Any],
    prepare: Callable[[Any], Any],
    report: Callable[[dict[str, Any]], None],
) -> None:
    """The training loop of worker ``rank`` of ``world`` on ``store`` (connected in BSP mode),
    the dense layers wrapped by ``prepare`` (DDP), ``report`` called after every epoch with the
    losses so far, and at the end with ``samples_per_s`` over every worker."""
    import torch
    from torch.nn import functional as F

    from pstore.apps import ctr, datasets

    c = {**DEFAULTS, **config}
    torch.set_num_threads(1)
    data = datasets.criteo_like(c["samples"], scale=c["scale"], seed=c["seed"])
    ids = ctr.global_ids(data)
    model = ctr.pstore_deepfm(
        store,
        data.n_fields,
        data.n_dense,
        dim=c["dim"],
        staleness=0,
        share_threads=False,
        seed=c["seed"],
        prefix=c["prefix"],
    )
    with torch.no_grad():  # the global bias starts at the data's log-odds
        p = min(max(data.ctr, 1e-6), 1 - 1e-6)
        model.dense_linear.bias.fill_(math.log(p / (1 - p)))
    dense = model.dense_parameters()
    wrapped = prepare(model)
    opt = torch.optim.Adam(dense, lr=ctr.DEFAULT_DENSE_LR)
    losses: list[float] = []
    samples, seconds = 0, 0.0
    for epoch in range(c["epochs"]):
        total, seen = 0.0, 0
        start = time.perf_counter()
        for idx in worker_batches(len(data), rank, world, c["batch_size"], epoch, c["seed"]):
            x = torch.from_numpy(ids[idx])
            d = torch.from_numpy(data.dense[idx])
            y = torch.from_numpy(data.labels[idx])
            loss = F.binary_cross_entropy_with_logits(wrapped(x, d), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()  # pushes the rows' gradients, tagged with this step
            opt.step()
            store.end_step()  # BSP: every worker's pushes of this step applied, once
            total += loss.item() * len(idx)
            seen += len(idx)
        seconds += time.perf_counter() - start
        samples += seen
        losses.append(total / seen)
        report({"epoch": epoch, "loss": losses[-1], "losses": losses})
    # BSP: every worker runs the same steps at the pace of the slowest.
    report(
        {
            "epoch": c["epochs"],
            "loss": losses[-1],
            "losses": losses,
            "samples_per_s": world * samples / seconds,
            "steps": store.clock,
        }
    )


def train_loop(config: dict[str, Any]) -> None:
    """One Ray Train worker."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    store = pstore.ray.connect(
        config["cluster"], mode="bsp", worker=rank, num_workers=world, job=config["job"]
    )

    def report(metrics: dict[str, Any]) -> None:
        if "samples_per_s" not in metrics or rank != 0:
            ray.train.report(metrics)
            return
        # Ray Train keeps the metrics that come with a checkpoint: rank 0's last report has one.
        with tempfile.TemporaryDirectory() as d:
            with open(os.path.join(d, "metrics.json"), "w", encoding="utf-8") as f:
                json.dump(metrics, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))

    fit(store, rank, world, config, ray.train.torch.prepare_model, report)


def train(
    cluster: pstore.ray.Cluster,
    *,
    num_workers: int = 2,
    cpus_per_worker: float = 1.0,
    storage: str | None = None,
    **config: Any,
) -> dict[str, Any]:
    """Train with ``num_workers`` Ray Train workers against ``cluster``; returns rank 0's last
    report (``losses`` per epoch, ``samples_per_s``, ``steps``)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    loop_config = {**DEFAULTS, **config, "cluster": cluster.name, "job": uuid.uuid4().hex}
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(
            num_workers=num_workers, resources_per_worker={"CPU": cpus_per_worker}
        ),
        run_config=RunConfig(
            name=f"pstore-deepfm-{loop_config['job'][:8]}",
            storage_path=storage or os.path.join(tempfile.gettempdir(), "pstore-ray-train"),
        ),
    )
    result = trainer.fit()
    metrics: dict[str, Any] = dict(result.metrics or {})
    return metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--servers", type=int, default=2, help="store servers")
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers")
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--samples", type=int, default=DEFAULTS["samples"])
    p.add_argument("--path", default=None, help="base directory of durable server stores")
    p.add_argument("--name", default="deepfm-example", help="the pstore cluster's name")
    a = p.parse_args()
    cluster = pstore.ray.Cluster(
        a.servers,
        path=a.path,
        durability="async" if a.path else "none",
        name=a.name,
        server_cpus=0.5,
    )
    try:
        m = train(
            cluster,
            num_workers=a.workers,
            cpus_per_worker=0.5,
            epochs=a.epochs,
            samples=a.samples,
        )
        store = cluster.connect()
        rows = {t: len(store.table(t)) for t in store.tables()}
        print(json.dumps({**m, "rows": rows}))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
