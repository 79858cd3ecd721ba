"""``pstore demo``: train a matrix-factorisation recommender on MovieLens-100k with the store.

The model predicts a rating as ``r_hat = mu + b_u + b_i + <p_u, q_i>``, where ``mu`` is the mean
training rating and the user and item embeddings ``p``, ``q`` and biases ``b`` live in four sparse
tables of a :class:`pstore.Store` (the biases in tables of dim 1). Each mini-batch pulls the rows
of its user and item ids, computes the squared-error loss with L2 regularisation and its gradients
in numpy (vectorised over the batch), and pushes float32 gradients back; the store applies the
optimizer (Adagrad by default) to each row. Ids repeated in a batch are coalesced by the store, so
a row receives the sum of its samples' gradients.

The data is MovieLens-100k when it can be found (see :mod:`pstore.apps.datasets`), else a
synthetic set of the same shape with a planted low-rank signal. Ratings are split 90/10 into train
and test with a seeded permutation; the demo prints the test RMSE of the global-mean baseline, then
the train and test RMSE after each epoch. After training it takes a snapshot, exports it as a
serving artifact (:mod:`pstore.serving`), and prints the top recommendations of a few users scored
from the artifact alone.

``pstore demo --model deepfm`` trains a DeepFM click-through-rate model instead
(:mod:`pstore.apps.ctr`, which needs torch): on a seeded Criteo-shaped data set
(:func:`pstore.apps.datasets.criteo_like`, 26 categorical fields with about 34 million ids in all,
labels from a planted model), with the first-order weights and embeddings of every field in two
tables of the embedded store. It prints the test AUC after each epoch next to the oracle AUC (the
planted model's own probabilities) and the training throughput.

Examples
--------
From the command line::

    pstore demo                      # MovieLens-100k if found, else synthetic
    pstore demo --fetch              # download the recbole wheel that ships MovieLens-100k first
    pstore demo --data synthetic --epochs 5
    pstore demo --model deepfm       # DeepFM on Criteo-shaped clicks (needs torch)

From Python:

>>> from pstore.apps.demo import run_demo
>>> metrics = run_demo(data="synthetic", epochs=2, progress=False)  # doctest: +SKIP
>>> metrics["test_rmse"] < metrics["baseline_rmse"]  # doctest: +SKIP
True
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

import pstore
from pstore._progress import Progress, format_seconds
from pstore.apps import datasets

__all__ = [
    "DEEPFM_DEFAULTS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_DIM",
    "DEFAULT_EPOCHS",
    "DEFAULT_L2",
    "DEFAULT_LR",
    "DEFAULT_OPTIMIZER",
    "MODELS",
    "OPTIMIZERS",
    "add_arguments",
    "main",
    "register_command",
    "run_deepfm_demo",
    "run_demo",
]

DEFAULT_EPOCHS = 12
DEFAULT_DIM = 32
DEFAULT_BATCH_SIZE = 1024
DEFAULT_OPTIMIZER = "adagrad"
DEFAULT_LR = {"adagrad": 0.1, "adam": 0.005}
DEFAULT_L2 = 0.1
OPTIMIZERS = ("adagrad", "adam")
MODELS = ("mf", "deepfm")
DEEPFM_DEFAULTS = {"epochs": 2, "dim": 16, "batch_size": 4096, "samples": 1_000_000}
"""Defaults of ``--model deepfm`` where they differ from the MF demo's."""
_DEEPFM_LR = 0.05  # pstore.apps.ctr.DEFAULT_LR, for --help (ctr imports torch)

_TABLES = ("user_emb", "item_emb", "user_bias", "item_bias")


def _make_optimizer(name: str, lr: float) -> Any:
    if name == "adagrad":
        return pstore.optim.Adagrad(lr=lr)
    if name == "adam":
        return pstore.optim.Adam(lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; expected one of {', '.join(OPTIMIZERS)}")


class _MatrixFactorization:
    """Biased matrix factorisation whose parameters live in four tables of a store."""

    def __init__(
        self, store: Any, dim: int, mu: float, optimizer: str, lr: float, l2: float, seed: int
    ) -> None:
        self.mu = np.float32(mu)
        self.l2 = np.float32(l2)
        opt = _make_optimizer(optimizer, lr)
        emb_init = pstore.init.Normal(0.0, 0.1)
        self.user_emb = store.create_sparse_table(
            "user_emb", dim, optimizer=opt, initializer=emb_init, seed=seed
        )
        self.item_emb = store.create_sparse_table(
            "item_emb", dim, optimizer=opt, initializer=emb_init, seed=seed + 1
        )
        self.user_bias = store.create_sparse_table(
            "user_bias", 1, optimizer=opt, initializer=pstore.init.Zeros(), seed=seed
        )
        self.item_bias = store.create_sparse_table(
            "item_bias", 1, optimizer=opt, initializer=pstore.init.Zeros(), seed=seed
        )
        # The model's dense part: mu, kept in the store (never pushed) so that a snapshot, its
        # serving artifact and the ONNX model carry the whole model.
        self.global_mean = store.create_dense_table(
            "global_mean",
            shape=(1,),
            optimizer=pstore.optim.SGD(lr=0.01),
            initializer=pstore.init.Constant(float(self.mu)),
        )

    def _pull(
        self, users: np.ndarray, items: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        p = self.user_emb.pull(users)
        q = self.item_emb.pull(items)
        b_u = self.user_bias.pull(users)[:, 0]
        b_i = self.item_bias.pull(items)[:, 0]
        return p, q, b_u, b_i

    def predict(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Predicted ratings (float32). Pulling creates rows for ids never trained on."""
        p, q, b_u, b_i = self._pull(users, items)
        rating: np.ndarray = self.mu + b_u + b_i + np.einsum("nk,nk->n", p, q)
        return rating

    def rmse(self, data: datasets.Ratings, lo: float, hi: float) -> float:
        """RMSE on ``data`` of the predictions clipped to the rating range ``[lo, hi]``."""
        return _rmse(np.clip(self.predict(data.users, data.items), lo, hi), data.ratings)

    def train_step(self, users: np.ndarray, items: np.ndarray, ratings: np.ndarray) -> float:
        """One mini-batch of gradient descent; returns the batch's sum of squared errors.

        The loss is ``sum_n 0.5 * e_n**2 + 0.5 * l2 * (|p_u|^2 + |q_i|^2 + b_u^2 + b_i^2)`` with
        ``e_n = r_hat_n - r_n``, so the regularisation of a row grows with its number of ratings.
        """
        p, q, b_u, b_i = self._pull(users, items)
        err = self.mu + b_u + b_i + np.einsum("nk,nk->n", p, q) - ratings
        l2 = self.l2
        grad_p = err[:, None] * q + l2 * p
        grad_q = err[:, None] * p + l2 * q
        grad_bu = (err + l2 * b_u)[:, None]
        grad_bi = (err + l2 * b_i)[:, None]
        # The four tables are independent: let the store apply them concurrently.
        handles = [
            self.user_emb.push_async(users, grad_p),
            self.item_emb.push_async(items, grad_q),
            self.user_bias.push_async(users, grad_bu),
            self.item_bias.push_async(items, grad_bi),
        ]
        for handle in handles:
            handle.wait()
        return float(np.dot(err, err))


def _serve(
    store: pstore.Store,
    model: _MatrixFactorization,
    train: datasets.Ratings,
    test: datasets.Ratings,
    n_items: int,
    workdir: str,
    say: Any,
    users_to_show: int = 3,
    top: int = 5,
    onnx_out: str | None = None,
) -> dict[str, Any]:
    """Snapshot the trained store, export a serving artifact, and recommend from it.

    Scores come only from the artifact (``ServingStore.lookup``), as an inference process
    would read them; they are checked against the trained model's predictions.
    """
    from pstore import serving

    start = time.perf_counter()
    snap = os.path.join(workdir, "snapshot")
    model_dir = os.path.join(workdir, "model")
    store.snapshot(snap)
    info = serving.export(snap, model_dir)
    with serving.ServingStore(model_dir) as art:
        mu = float(art.dense("global_mean")[0])

        def score(users: np.ndarray, items: np.ndarray) -> np.ndarray:
            p = art.lookup("user_emb", users, default="initial")
            q = art.lookup("item_emb", items, default="initial")
            b_u = art.lookup("user_bias", users)[:, 0]
            b_i = art.lookup("item_bias", items)[:, 0]
            rating: np.ndarray = np.float32(mu) + b_u + b_i + np.einsum("nk,nk->n", p, q)
            return rating

        diff = float(
            np.max(np.abs(score(test.users, test.items) - model.predict(test.users, test.items)))
        )
        took = format_seconds(time.perf_counter() - start)
        say(
            f"serving: snapshot -> artifact ({info['dtype']}, {info['bytes_per_row']:.0f} "
            f"bytes/row) in {took}; its test predictions match the trained store "
            f"(max |diff| {diff:.2g})"
        )
        items = np.arange(n_items, dtype=np.int64)
        users = np.unique(test.users)[:users_to_show]
        recs: dict[int, list[tuple[int, float]]] = {}
        for u in users:
            s = score(np.full(n_items, u, dtype=np.int64), items)
            s[train.items[train.users == u]] = -np.inf  # not what the user rated already
            best = np.argsort(-s, kind="stable")[:top]
            recs[int(u)] = [(int(i), float(s[i])) for i in best]
            shown = ", ".join(f"{i} ({r:.2f})" for i, r in recs[int(u)])
            say(f"  top {top} for user {int(u)}: items {shown}")
    served: dict[str, Any] = {
        "artifact": model_dir,
        "artifact_bytes": info["file_bytes"],
        "serving_max_diff": diff,
        "recommendations": recs,
    }
    if onnx_out is not None:
        served.update(_onnx(model, model_dir, test, onnx_out, say))
    return served


def _onnx(
    model: _MatrixFactorization, model_dir: str, test: datasets.Ratings, out: str, say: Any
) -> dict[str, Any]:
    """Export the whole model (tables and mu) as one ONNX graph from (user id, item id) to the
    predicted rating; with onnxruntime installed, check it against the model's predictions."""
    from pstore.apps.mf_onnx import export_mf_onnx

    info = export_mf_onnx(model_dir, out)
    result: dict[str, Any] = {"onnx": info["path"], "onnx_max_diff": None}
    try:
        import onnxruntime as ort
    except ImportError:
        say(f"onnx: wrote {info['path']} (install onnxruntime to check it)")
        return result
    sess = ort.InferenceSession(info["path"], providers=["CPUExecutionProvider"])
    (pred,) = sess.run(None, {"user_id": test.users, "item_id": test.items})
    diff = float(np.max(np.abs(pred - model.predict(test.users, test.items))))
    result["onnx_max_diff"] = diff
    say(
        f"onnx: wrote {info['path']}: (user id, item id) -> rating; onnxruntime's test "
        f"predictions match the model's (max |diff| {diff:.2g})"
    )
    return result


def _printer(out: TextIO | None) -> Callable[..., None]:
    """A function printing a line to ``out`` (default stdout), flushed."""
    stream = sys.stdout if out is None else out

    def say(message: str = "") -> None:
        stream.write(message + "\n")
        stream.flush()

    return say


def _rmse(pred: np.ndarray, target: np.ndarray) -> float:
    diff = pred.astype(np.float64) - target
    return float(np.sqrt(np.mean(diff * diff)))


def run_demo(
    data: str | None = None,
    epochs: int = DEFAULT_EPOCHS,
    dim: int = DEFAULT_DIM,
    seed: int = 0,
    fetch: bool = False,
    out: TextIO | None = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    optimizer: str = DEFAULT_OPTIMIZER,
    lr: float | None = None,
    l2: float = DEFAULT_L2,
    threads: int | None = None,
    progress: bool = True,
    model_dir: str | None = None,
    onnx: str | None = None,
) -> dict[str, Any]:
    """Train biased matrix factorisation on ratings with a pstore store and report RMSE.

    Parameters
    ----------
    data : str, optional
        ``"synthetic"`` for the synthetic data set, or a MovieLens-100k ``.inter`` file, recbole
        wheel or directory holding either. None searches ``$PSTORE_ML100K``, an installed
        ``recbole`` and the cache directory, and falls back to synthetic data
        (see :func:`pstore.apps.datasets.load_ratings`).
    epochs : int
        Passes over the training set.
    dim : int
        Embedding dimension.
    seed : int
        Seed of the synthetic data, the train/test split, the batch order and the initialisers.
    fetch : bool
        Download the recbole wheel (``pip download``) when MovieLens-100k is not found.
    out : file-like, optional
        Where to print the report; default ``sys.stdout``. The progress bar goes to stderr.
    batch_size : int
        Ratings per mini-batch.
    optimizer : {"adagrad", "adam"}
        Optimizer of every table.
    lr : float, optional
        Learning rate; default 0.1 for Adagrad, 0.005 for Adam.
    l2 : float
        L2 regularisation of embeddings and biases, per rating.
    threads : int, optional
        Size of the store's thread pool; default one per core.
    progress : bool
        Show the progress bar on stderr.
    model_dir : str, optional
        Where to keep the snapshot (``model_dir/snapshot``) and the serving artifact
        (``model_dir/model``) made after training (a new or empty directory); default a
        temporary directory, removed at the end.
    onnx : str, optional
        Also export the whole model as one ONNX graph to this file (needs ``pstore[onnx]``) and,
        with onnxruntime installed, check its predictions against the model's.

    Returns
    -------
    dict
        ``dataset`` (``"ml-100k"`` or ``"synthetic"``), ``source``, ``n_users``, ``n_items``,
        ``n_train``, ``n_test``, ``dim``, ``epochs``, ``optimizer``, ``lr``, ``l2``, ``batch_size``,
        ``global_mean``, ``baseline_rmse`` (test RMSE of predicting the global mean),
        ``train_rmse`` and ``test_rmse`` (after the last epoch), ``history`` (a list of
        ``{"epoch", "train_rmse", "test_rmse", "seconds"}``), ``rows`` (rows stored per table),
        ``train_seconds``, ``recommendations`` (``{user: [(item, score), ...]}`` scored from
        the serving artifact), ``serving_max_diff`` (largest difference between the artifact's
        and the trained store's test predictions) and ``seconds`` (wall time of the whole run).
    """
    if epochs < 1:
        raise ValueError("epochs must be at least 1")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if optimizer not in OPTIMIZERS:
        raise ValueError(
            f"unknown optimizer {optimizer!r}; expected one of {', '.join(OPTIMIZERS)}"
        )
    if lr is None:
        lr = DEFAULT_LR[optimizer]
    out = sys.stdout if out is None else out
    say = _printer(out)

    start = time.perf_counter()
    ratings = datasets.load_ratings(data, fetch=fetch, seed=seed, log=say)
    train, test = datasets.train_test_split(ratings, 0.1, seed=seed)
    label = "MovieLens-100k" if ratings.name == "ml-100k" else "synthetic ratings"
    say(f"dataset: {label} ({ratings.source})")
    say(
        f"  {ratings.n_users} users, {ratings.n_items} items, {len(ratings)} ratings; "
        f"split {len(train)} train / {len(test)} test (seed {seed})"
    )
    if ratings.name != "ml-100k" and data is None:
        say("  (MovieLens-100k not found: pass --data PATH, set PSTORE_ML100K, or use --fetch)")

    mu = float(np.mean(train.ratings, dtype=np.float64))
    baseline = _rmse(np.full(len(test), mu), test.ratings)
    lo, hi = float(ratings.ratings.min()), float(ratings.ratings.max())
    say(f"baseline: global mean {mu:.4f}, test RMSE {baseline:.4f}")
    say(
        f"model: biased MF, dim {dim}, {optimizer} lr {lr:g}, l2 {l2:g}, "
        f"batch {batch_size}, {epochs} epochs"
    )

    store = pstore.Store(threads=threads)
    model = _MatrixFactorization(store, dim, mu, optimizer, lr, l2, seed)
    rng = np.random.default_rng(seed)
    n_batches = -(-len(train) // batch_size)
    history: list[dict[str, Any]] = []
    train_start = time.perf_counter()
    bar = Progress(n_batches * epochs, desc="training", unit="batches", disable=not progress)
    with bar:
        for epoch in range(1, epochs + 1):
            epoch_start = time.perf_counter()
            order = rng.permutation(len(train))
            sse = 0.0
            for b in range(n_batches):
                idx = order[b * batch_size : (b + 1) * batch_size]
                sse += model.train_step(train.users[idx], train.items[idx], train.ratings[idx])
                seen = min((b + 1) * batch_size, len(train))
                bar.update(postfix=f"epoch {epoch}/{epochs} running RMSE {np.sqrt(sse / seen):.4f}")
            train_rmse = model.rmse(train, lo, hi)
            test_rmse = model.rmse(test, lo, hi)
            seconds = time.perf_counter() - epoch_start
            history.append(
                {
                    "epoch": epoch,
                    "train_rmse": train_rmse,
                    "test_rmse": test_rmse,
                    "seconds": seconds,
                }
            )
            bar.write(
                f"epoch {epoch:>{len(str(epochs))}}/{epochs}  train RMSE {train_rmse:.4f}  "
                f"test RMSE {test_rmse:.4f}  ({format_seconds(seconds)})",
                file=out,
            )
    store.flush()
    train_seconds = time.perf_counter() - train_start
    final = history[-1]
    gain = 100.0 * (baseline - final["test_rmse"]) / baseline
    say(
        f"final: test RMSE {final['test_rmse']:.4f} vs baseline {baseline:.4f} "
        f"({gain:.1f}% lower); trained in {format_seconds(train_seconds)}"
    )
    if model_dir is None:
        with tempfile.TemporaryDirectory(prefix="pstore-demo-") as d:
            served = _serve(store, model, train, test, ratings.n_items, d, say, onnx_out=onnx)
            served["artifact"] = None
    else:
        os.makedirs(model_dir, exist_ok=True)
        served = _serve(store, model, train, test, ratings.n_items, model_dir, say, onnx_out=onnx)
    return {
        **served,
        "dataset": ratings.name,
        "source": ratings.source,
        "n_users": ratings.n_users,
        "n_items": ratings.n_items,
        "n_train": len(train),
        "n_test": len(test),
        "dim": dim,
        "epochs": epochs,
        "optimizer": optimizer,
        "lr": lr,
        "l2": l2,
        "batch_size": batch_size,
        "global_mean": mu,
        "baseline_rmse": baseline,
        "train_rmse": final["train_rmse"],
        "test_rmse": final["test_rmse"],
        "history": history,
        "rows": {name: len(getattr(model, name)) for name in _TABLES},
        "train_seconds": train_seconds,
        "seconds": time.perf_counter() - start,
    }


def run_deepfm_demo(
    samples: int = DEEPFM_DEFAULTS["samples"],
    epochs: int = DEEPFM_DEFAULTS["epochs"],
    dim: int = DEEPFM_DEFAULTS["dim"],
    seed: int = 0,
    out: TextIO | None = None,
    *,
    scale: float = 1.0,
    batch_size: int = DEEPFM_DEFAULTS["batch_size"],
    lr: float | None = None,
    staleness: int = 1,
    threads: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Train DeepFM on Criteo-shaped clicks with the embedded store and report test AUC.

    Parameters
    ----------
    samples : int
        Samples generated (:func:`pstore.apps.datasets.criteo_like`); 10% go to the test set.
    epochs : int
        Passes over the training set.
    dim : int
        Embedding width.
    seed : int
        Seed of the data, the split, the batch order and the initial values.
    out : file-like, optional
        Where to print the report; default ``sys.stdout``. The progress bar goes to stderr.
    scale : float
        Multiplies the fields' cardinalities (default: Criteo's, about 34 million ids).
    batch_size : int
        Samples per step.
    lr : float, optional
        Adagrad learning rate of the store's tables; default :data:`pstore.apps.ctr.DEFAULT_LR`.
    staleness : int
        Backward passes whose pushes a forward pass may run ahead of (see :mod:`pstore.torch`).
    threads : int, optional
        Size of the store's thread pool; default one per core.
    progress : bool
        Show the progress bar on stderr.

    Returns
    -------
    dict
        What :func:`pstore.apps.ctr.train_deepfm` returns, plus ``source`` (how the data was made),
        ``ctr`` (share of positive labels), ``generate_seconds`` and ``seconds`` (wall time of
        the whole run).

    Raises
    ------
    RuntimeError
        If torch is not installed.
    """
    if samples < 2:
        raise ValueError("samples must be at least 2")
    if epochs < 1:
        raise ValueError("epochs must be at least 1")
    try:
        from pstore.apps import ctr
    except ImportError as e:
        raise RuntimeError(
            f"--model deepfm needs torch ({e}); install it with: pip install 'pstore[torch]'"
        ) from None
    if lr is None:
        lr = ctr.DEFAULT_LR
    out = sys.stdout if out is None else out
    say = _printer(out)

    start = time.perf_counter()
    data = datasets.criteo_like(samples, seed=seed, scale=scale)
    train, test = data.split(0.1, seed=seed)
    generate_seconds = time.perf_counter() - start
    say(f"dataset: Criteo-like clicks ({data.source})")
    say(
        f"  {len(data)} samples, {100 * data.ctr:.1f}% clicked; split {len(train)} train / "
        f"{len(test)} test (seed {seed}); made in {format_seconds(generate_seconds)}"
    )
    say(f"  oracle test AUC {test.oracle_auc:.4f} (the planted model's own probabilities)")
    hidden = "-".join(str(h) for h in ctr.DEFAULT_HIDDEN)
    say(
        f"model: DeepFM, dim {dim}, MLP {hidden}; first-order weights and embeddings of all "
        f"{data.n_fields} fields in 2 store tables (Adagrad lr {lr:g}), dense part Adam lr "
        f"{ctr.DEFAULT_DENSE_LR:g}; batch {batch_size}, {epochs} epochs, staleness {staleness}"
    )
    store = pstore.Store(threads=threads)
    metrics = ctr.train_deepfm(
        store,
        train,
        test,
        epochs=epochs,
        batch_size=batch_size,
        dim=dim,
        lr=lr,
        staleness=staleness,
        seed=seed,
        progress=progress,
        out=out,
    )
    rows = metrics["rows"]["embedding"]
    say(
        f"final: test AUC {metrics['test_auc']:.4f} vs oracle {metrics['oracle_auc']:.4f} "
        f"(0.5 is chance); {metrics['samples_per_s']:,.0f} samples/s over "
        f"{format_seconds(metrics['train_seconds'])} of training; {rows:,} rows per table "
        f"of {sum(data.cardinalities):,} ids"
    )
    return {
        **metrics,
        "source": data.source,
        "ctr": data.ctr,
        "generate_seconds": generate_seconds,
        "seconds": time.perf_counter() - start,
    }


def register_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``pstore demo`` to the subcommands ``sub`` of the ``pstore`` command: the
    ``pstore.commands`` entry point ``demo`` (see :data:`pstore.cli.COMMANDS_GROUP`)."""
    p = sub.add_parser(
        "demo",
        help="train a recommender on the embedded store: matrix factorisation (MovieLens-100k "
        "when available, else synthetic data), or --model deepfm (Criteo-shaped clicks, "
        "PyTorch)",
    )
    add_arguments(p)
    p.set_defaults(func=main)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the demo's flags on ``parser`` (an ``argparse`` subparser) and return it.

    Parameters
    ----------
    parser : argparse.ArgumentParser
        Typically ``subparsers.add_parser("demo", ...)``.

    Returns
    -------
    argparse.ArgumentParser
        The same parser, for chaining.
    """
    parser.add_argument(
        "--model",
        choices=MODELS,
        default="mf",
        help="mf: matrix factorisation on ratings; deepfm: a DeepFM click-through-rate model "
        "on Criteo-shaped data, needs torch (default: %(default)s)",
    )
    parser.add_argument(
        "--data",
        metavar="PATH",
        default=None,
        help="MovieLens-100k .inter file, recbole wheel, or a directory holding either; "
        "'synthetic' for synthetic ratings (default: $PSTORE_ML100K, an installed recbole, "
        "a recbole wheel in ~/.cache/pstore, else synthetic)",
    )
    parser.add_argument(
        "--fetch",
        action="store_true",
        help="download the recbole wheel (which ships MovieLens-100k) from PyPI into "
        "~/.cache/pstore when the data is not found",
    )
    parser.add_argument(
        "--epochs",
        type=_positive_int,
        default=DEFAULT_EPOCHS,
        action=_Given,
        help=f"passes over the data (default: %(default)s; {DEEPFM_DEFAULTS['epochs']} with "
        "--model deepfm)",
    )
    parser.add_argument(
        "--dim",
        type=_positive_int,
        default=DEFAULT_DIM,
        action=_Given,
        help=f"embedding dimension (default: %(default)s; {DEEPFM_DEFAULTS['dim']} with "
        "--model deepfm)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the synthetic data, split, batch order and init (default: 0)",
    )
    parser.add_argument(
        "--batch-size",
        type=_positive_int,
        default=DEFAULT_BATCH_SIZE,
        action=_Given,
        help=f"ratings (samples) per batch (default: %(default)s; "
        f"{DEEPFM_DEFAULTS['batch_size']} with --model deepfm)",
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default=DEFAULT_OPTIMIZER,
        help="optimizer of every table (default: %(default)s)",
    )
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help=f"learning rate (default {DEFAULT_LR['adagrad']} for adagrad, "
        f"{DEFAULT_LR['adam']} for adam; with --model deepfm, the Adagrad rate of the store's "
        f"tables, default {_DEEPFM_LR})",
    )
    parser.add_argument(
        "--l2",
        type=float,
        default=DEFAULT_L2,
        help="L2 regularisation per rating (default: %(default)s)",
    )
    parser.add_argument(
        "--threads", type=_positive_int, default=None, help="store threads (default: cores)"
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        help="keep the snapshot and serving artifact made after training here (default: a "
        "temporary directory)",
    )
    parser.add_argument(
        "--onnx",
        default=None,
        metavar="PATH",
        help="also export the trained model as one ONNX graph (needs pstore[onnx])",
    )
    parser.add_argument(
        "--samples",
        type=_positive_int,
        default=DEEPFM_DEFAULTS["samples"],
        help="--model deepfm: samples to generate, 10%% of them for testing (default: %(default)s)",
    )
    parser.add_argument(
        "--scale",
        type=_positive_float,
        default=1.0,
        help="--model deepfm: multiplies every field's cardinality (default 1: Criteo's, "
        "about 34 million ids)",
    )
    parser.add_argument(
        "--staleness",
        type=_non_negative_int,
        default=1,
        help="--model deepfm: backward passes a forward pass may run ahead of; 0 is "
        "synchronous (default: %(default)s)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    parser.add_argument(
        "--json", action="store_true", help="print the final metrics as one JSON line at the end"
    )
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


class _Given(argparse.Action):
    """Store the value and note that the flag was given: its default depends on ``--model``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        setattr(namespace, self.dest, values)
        namespace._given = {*getattr(namespace, "_given", ()), self.dest}


_MF_ONLY: dict[str, Any] = {
    "data": None,
    "fetch": False,
    "model_dir": None,
    "onnx": None,
    "optimizer": DEFAULT_OPTIMIZER,
    "l2": DEFAULT_L2,
}


def _main_deepfm(args: argparse.Namespace) -> int:
    given: set[str] = getattr(args, "_given", set())

    def pick(name: str) -> Any:
        return getattr(args, name) if name in given else DEEPFM_DEFAULTS[name]

    for name, default in _MF_ONLY.items():
        if getattr(args, name, default) != default:
            flag = "--" + name.replace("_", "-")
            print(f"pstore demo: error: {flag} applies to --model mf only", file=sys.stderr)
            return 2
    try:
        metrics = run_deepfm_demo(
            samples=args.samples,
            epochs=pick("epochs"),
            dim=pick("dim"),
            seed=args.seed,
            scale=args.scale,
            batch_size=pick("batch_size"),
            lr=args.lr,
            staleness=args.staleness,
            threads=args.threads,
            progress=not args.no_progress,
        )
    except (RuntimeError, ValueError) as e:
        print(f"pstore demo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(metrics))
    return 0


def main(args: argparse.Namespace | Sequence[str] | None = None) -> int:
    """Run the demo from parsed arguments.

    Parameters
    ----------
    args : argparse.Namespace or sequence of str, optional
        A namespace from a parser set up with :func:`add_arguments`, or a list of command-line
        arguments (default ``sys.argv[1:]``) to parse with a parser of its own.

    Returns
    -------
    int
        The process exit code: 0, or 2 when the data cannot be found or fetched, or
        ``--model deepfm`` cannot run (no torch, a flag of the MF demo only); the error is
        printed to stderr.
    """
    if not isinstance(args, argparse.Namespace):
        parser = argparse.ArgumentParser(
            prog="pstore demo",
            description="Train a matrix-factorisation recommender (or, with --model deepfm, "
            "a DeepFM click-through-rate model) on the embedded store.",
        )
        args = add_arguments(parser).parse_args(args)
    if getattr(args, "model", "mf") == "deepfm":
        return _main_deepfm(args)
    try:
        metrics = run_demo(
            data=args.data,
            epochs=args.epochs,
            dim=args.dim,
            seed=args.seed,
            fetch=args.fetch,
            batch_size=args.batch_size,
            optimizer=args.optimizer,
            lr=args.lr,
            l2=args.l2,
            threads=args.threads,
            progress=not args.no_progress,
            model_dir=args.model_dir,
            onnx=args.onnx,
        )
    except (FileNotFoundError, RuntimeError, ValueError) as e:
        print(f"pstore demo: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
