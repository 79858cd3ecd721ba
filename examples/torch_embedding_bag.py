"""Train a small PyTorch classifier whose embeddings live in a pstore table.

Each sample is a bag of item ids; its label says whether the bag's items are, on the whole,
"liked" (a hidden score per item, summed). The model is ``pstore.torch.EmbeddingBag`` (mean of
the bag's rows, kept in a sparse table of the store and trained by the table's Adagrad) followed
by a ``torch.nn.Linear`` trained by ``torch.optim.Adam``.

    python examples/torch_embedding_bag.py            # in memory
    python examples/torch_embedding_bag.py --path run # durable: the rows persist in ./run

Needs torch (``pip install 'pstore[torch]'``).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import pstore
import pstore.torch


def make_data(n: int, items: int, bag: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` bags of ``bag`` item ids and their labels (1.0 when the items' hidden scores sum
    to more than zero)."""
    rng = np.random.default_rng(seed)
    score = rng.normal(size=items)
    ids = rng.integers(0, items, size=(n, bag))
    labels = (score[ids].sum(axis=1) > 0).astype(np.float32)
    return torch.from_numpy(ids), torch.from_numpy(labels)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=None, help="a durable store directory")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)

    ids, labels = make_data(args.samples, items=1_000, bag=5, seed=0)
    split = len(ids) * 9 // 10
    with pstore.Store(args.path) as store:
        if "item" not in store.tables():
            store.create_sparse_table(
                "item", dim=16, optimizer=pstore.optim.Adagrad(lr=0.5), seed=1
            )
        bag = pstore.torch.EmbeddingBag(store.table("item"), mode="mean")
        head = torch.nn.Linear(16, 1)
        optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
        loss_fn = torch.nn.BCEWithLogitsLoss()
        accuracy = float("nan")
        for epoch in range(args.epochs):
            order = torch.randperm(split, generator=torch.Generator().manual_seed(epoch))
            for start in range(0, split, args.batch_size):
                batch = order[start : start + args.batch_size]
                loss = loss_fn(head(bag(ids[batch])).squeeze(1), labels[batch])
                optimizer.zero_grad()
                loss.backward()  # pushes the rows' gradients to the table
                optimizer.step()
            bag.flush()
            with torch.no_grad():  # evaluation creates no rows
                logits = head(bag(ids[split:])).squeeze(1)
            accuracy = float(((logits > 0).float() == labels[split:]).float().mean())
            print(f"epoch {epoch + 1}: test accuracy {accuracy:.3f}, {len(bag.table)} rows")
    return accuracy


if __name__ == "__main__":
    main()
