"""A DeepFM click-through-rate model whose every categorical field lives in pstore.

>>> import pstore
>>> from pstore.apps import ctr, datasets
>>> train, test = datasets.criteo_like(200_000, scale=0.01).split(0.1)  # doctest: +SKIP
>>> m = ctr.train_deepfm(pstore.Store(), train, test, epochs=2)  # doctest: +SKIP
>>> m["test_auc"], m["oracle_auc"], m["samples_per_s"]  # doctest: +SKIP

**Model** (Guo et al. 2017, DeepFM). For a sample with categorical ids ``x_1..x_F`` and numeric
features ``d``::

    logit = b + <a, d> + sum_f w(x_f) + sum_{f<g} <e(x_f), e(x_g)> + MLP([e(x_1), ..., e(x_F), d])

The first-order weights ``w`` and the ``dim``-wide embeddings ``e`` of all fields live in two
sparse tables of a store (:func:`make_tables`), ids namespaced per field by the cumulative
cardinality offset (field ``f``'s id ``i`` is row ``offset_f + i``, :func:`field_offsets`), so one
pull per table per batch serves every field. They are looked up through
:class:`pstore.torch.Embedding`, whose backward pass pushes the rows' gradients to the store, where
the tables' optimizer applies them. The dense part (``b``, ``a`` and the MLP: ReLU layers of
``hidden`` units) is trained by ``torch.optim.Adam``.

**The pure-torch twin** (:func:`torch_deepfm`, :func:`train_deepfm_torch`) is the same model with
the two tables as ``torch.nn.Embedding(sparse=True)`` over the whole id space, so benchmarks can
compare them. Everything else is shared: the forward pass, the data order, the initial dense
weights (the same seeded draws), the initial distributions of the sparse rows (first-order
weights 0, embeddings ``Normal(0, init_std)``; different draws) and the optimizers:

- sparse rows: Adagrad, ``sum += g * g; w -= lr * g / (sqrt(sum) + eps)`` with ``sum`` starting
  at ``initial_accumulator_value`` (default 1e-4) and ``eps = 1e-10``:
  ``pstore.optim.Adagrad(lr, initial_accumulator_value, eps=1e-10)`` in the store,
  ``torch.optim.Adagrad(lr, initial_accumulator_value=..., eps=1e-10)`` (lr_decay 0,
  weight_decay 0; it takes sparse gradients) in torch -- the same formula (docs/API_SPEC.md).
  Adagrad rather than Adam because ``torch.optim.SparseAdam`` corrects its bias with one step
  count per tensor while the store counts steps per row. The small starting ``sum`` damps the
  updates of rows whose gradients are tiny (a rare id's gradient is one sample's divided by
  the batch size): with 0, every row's first step is ``lr`` times the gradient's sign, rows of
  rare ids memorise their samples, and the test AUC falls after the first epoch;
- dense parameters: ``torch.optim.Adam(lr=dense_lr)`` in both, the global bias starting at the
  training set's log-odds.

What differs: the store sums a batch's duplicate ids' gradients in float64 (torch: float32), then
updates in float32 as torch does; when the store's work shares torch's threads (the default on
Linux with torch on several threads, see :mod:`pstore.torch`) each push is applied in the
backward pass, as torch's step is; otherwise (``share_threads=False``, a remote store) with
``staleness >= 1`` a forward pass may read rows before the previous batch's update has landed
(``staleness=0`` is synchronous, as torch is), and with ``prefetch=True`` it always does: the
next batch's rows are pulled during the backward pass (one epoch of the 45,000-sample test set,
batches of 512: AUC 0.701 to 0.704 with it, 0.718 to 0.723 without, torch 0.725; at W8's scale the
difference was 0.0001); the store holds only the rows it has seen, torch
allocates every row of the id space (and its Adagrad state) up front.

Importing :mod:`pstore` never imports this module (it imports torch).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any, TextIO

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import pstore
import pstore.torch as pstore_torch
from pstore._progress import Progress, format_seconds
from pstore.apps.datasets import CTRData, auc

__all__ = [
    "ADAGRAD_EPS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_DENSE_LR",
    "DEFAULT_DIM",
    "DEFAULT_HIDDEN",
    "DEFAULT_INITIAL_ACCUMULATOR",
    "DEFAULT_INIT_STD",
    "DEFAULT_LR",
    "DeepFM",
    "field_offsets",
    "global_ids",
    "make_tables",
    "pstore_deepfm",
    "torch_deepfm",
    "train_deepfm",
    "train_deepfm_torch",
]

DEFAULT_DIM = 16
DEFAULT_HIDDEN = (256, 256)
DEFAULT_BATCH_SIZE = 4096
DEFAULT_LR = 0.05
"""Adagrad learning rate of the sparse rows (first-order weights and embeddings)."""
DEFAULT_DENSE_LR = 1e-3
"""Adam learning rate of the dense parameters (bias, numeric weights, MLP)."""
DEFAULT_INIT_STD = 0.01
"""Std of the embeddings' initial normal distribution (first-order weights start at 0)."""
DEFAULT_INITIAL_ACCUMULATOR = 1e-4
"""Adagrad's starting ``sum`` for the sparse rows (see the module's docs)."""
ADAGRAD_EPS = 1e-10

_EVAL_BATCH = 32768


def field_offsets(cardinalities: Sequence[int]) -> np.ndarray:
    """Where each field's ids start in the shared id space: ``[0, c_0, c_0 + c_1, ...]`` (int64,
    one per field)."""
    cards = np.asarray(cardinalities, dtype=np.int64)
    return np.concatenate([[0], np.cumsum(cards)[:-1]]).astype(np.int64)


def global_ids(data: CTRData) -> np.ndarray:
    """The samples' ids in the shared id space: ``data.sparse + field_offsets(...)`` (int64
    ``(n, n_fields)``); field ``f``'s id ``i`` is row ``offset_f + i`` of both tables."""
    ids: np.ndarray = data.sparse + field_offsets(data.cardinalities)[None, :]
    return ids


class DeepFM(nn.Module):
    """DeepFM over two embedding modules (first-order weights of width 1, embeddings of width
    ``dim``), each mapping int64 ids ``(B, F)`` to ``(B, F, width)``.

    Parameters
    ----------
    first_order, embedding : torch.nn.Module
        The lookups: :class:`pstore.torch.Embedding` over a store's tables, or
        ``torch.nn.Embedding``.
    n_fields, n_dense : int
        Categorical and numeric fields per sample.
    dim : int
        Width of ``embedding``'s rows.
    hidden : sequence of int
        Units of the MLP's hidden ReLU layers.
    seed : int
        Seed of the dense parameters' initial values (torch's default law for ``nn.Linear``,
        ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))``, drawn from a generator of its own, so torch's
        global random state is left alone).
    """

    def __init__(
        self,
        first_order: nn.Module,
        embedding: nn.Module,
        n_fields: int,
        n_dense: int,
        dim: int,
        hidden: Sequence[int] = DEFAULT_HIDDEN,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.first_order = first_order
        self.embedding = embedding
        self.n_fields, self.n_dense, self.dim = n_fields, n_dense, dim
        # nn.Linear draws its initial values from torch's global generator: restore that after.
        with torch.random.fork_rng(devices=[]):
            self.dense_linear = nn.Linear(n_dense, 1)  # its bias is the model's global bias
            layers: list[nn.Module] = []
            width = n_fields * dim + n_dense
            for units in hidden:
                layers += [nn.Linear(width, units), nn.ReLU()]
                width = units
            layers.append(nn.Linear(width, 1))
            self.mlp = nn.Sequential(*layers)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    bound = 1.0 / math.sqrt(m.in_features)
                    m.weight.uniform_(-bound, bound, generator=g)
                    m.bias.uniform_(-bound, bound, generator=g)

    def dense_parameters(self) -> list[nn.Parameter]:
        """The parameters outside the two lookups (for a dense optimizer)."""
        return [*self.dense_linear.parameters(), *self.mlp.parameters()]

    def forward(self, ids: Tensor, dense: Tensor) -> Tensor:
        """Logits ``(B,)`` of ids ``(B, n_fields)`` (shared id space) and numeric features
        ``(B, n_dense)``."""
        w: Tensor = self.first_order(ids)  # (B, F, 1)
        e: Tensor = self.embedding(ids)  # (B, F, dim)
        a: Tensor = self.dense_linear(dense)  # (B, 1)
        mlp: Tensor = self.mlp(torch.cat([e.flatten(1), dense], dim=1))  # (B, 1)
        linear = w.sum(dim=(1, 2)) + a.squeeze(1)
        s = e.sum(dim=1)
        fm = 0.5 * (s * s - (e * e).sum(dim=1)).sum(dim=1)
        return linear + fm + mlp.squeeze(1)

    def flush(self) -> None:
        """Wait for the lookups' pending pushes (a no-op for torch's own modules)."""
        for m in (self.first_order, self.embedding):
            flush = getattr(m, "flush", None)
            if callable(flush):
                flush()

    def prefetch(self, ids: Tensor) -> None:
        """Start pulling the rows of the next batch's ``ids`` (see
        :meth:`pstore.torch.Embedding.prefetch`; a no-op for torch's own modules)."""
        for m in (self.first_order, self.embedding):
            prefetch = getattr(m, "prefetch", None)
            if callable(prefetch):
                prefetch(ids)


def make_tables(
    store: Any,
    dim: int = DEFAULT_DIM,
    *,
    lr: float = DEFAULT_LR,
    init_std: float = DEFAULT_INIT_STD,
    initial_accumulator_value: float = DEFAULT_INITIAL_ACCUMULATOR,
    seed: int = 0,
    prefix: str = "deepfm",
) -> tuple[pstore.SparseTable, pstore.SparseTable]:
    """Create the model's two sparse tables in ``store`` (embedded or remote).

    ``{prefix}_first_order`` (dim 1, zeros) and ``{prefix}_embedding`` (dim ``dim``,
    ``Normal(0, init_std)``), both with ``pstore.optim.Adagrad(lr, initial_accumulator_value,
    eps=1e-10)``, torch's Adagrad formula.

    Returns
    -------
    (SparseTable, SparseTable)
        The first-order and the embedding table.
    """
    opt = pstore.optim.Adagrad(
        lr=lr, initial_accumulator_value=initial_accumulator_value, eps=ADAGRAD_EPS
    )
    first = store.create_sparse_table(
        f"{prefix}_first_order", 1, optimizer=opt, initializer=pstore.init.Zeros(), seed=seed
    )
    emb = store.create_sparse_table(
        f"{prefix}_embedding",
        dim,
        optimizer=opt,
        initializer=pstore.init.Normal(0.0, init_std),
        seed=seed + 1,
    )
    return first, emb


def pstore_deepfm(
    store: Any,
    n_fields: int,
    n_dense: int,
    *,
    dim: int = DEFAULT_DIM,
    hidden: Sequence[int] = DEFAULT_HIDDEN,
    lr: float = DEFAULT_LR,
    init_std: float = DEFAULT_INIT_STD,
    initial_accumulator_value: float = DEFAULT_INITIAL_ACCUMULATOR,
    staleness: int = 1,
    share_threads: bool = True,
    seed: int = 0,
    prefix: str = "deepfm",
) -> DeepFM:
    """A :class:`DeepFM` whose two lookups are :class:`pstore.torch.Embedding` modules over new
    tables of ``store`` (see :func:`make_tables`)."""
    first, emb = make_tables(
        store,
        dim,
        lr=lr,
        init_std=init_std,
        initial_accumulator_value=initial_accumulator_value,
        seed=seed,
        prefix=prefix,
    )
    return DeepFM(
        pstore_torch.Embedding(first, staleness=staleness, share_threads=share_threads),
        pstore_torch.Embedding(emb, staleness=staleness, share_threads=share_threads),
        n_fields,
        n_dense,
        dim,
        hidden,
        seed,
    )


def torch_deepfm(
    cardinalities: Sequence[int],
    n_dense: int,
    *,
    dim: int = DEFAULT_DIM,
    hidden: Sequence[int] = DEFAULT_HIDDEN,
    init_std: float = DEFAULT_INIT_STD,
    seed: int = 0,
) -> DeepFM:
    """The pure-torch twin: :class:`DeepFM` over ``torch.nn.Embedding(sum(cardinalities), ...,
    sparse=True)`` lookups (first-order weights 0, embeddings ``Normal(0, init_std)`` drawn from
    a generator seeded with ``seed``). Train the lookups' weights with
    ``torch.optim.Adagrad(..., eps=1e-10)`` as :func:`train_deepfm_torch` does."""
    rows = int(sum(int(c) for c in cardinalities))
    g = torch.Generator().manual_seed(seed + 1)
    first = nn.Embedding.from_pretrained(torch.zeros(rows, 1), freeze=False, sparse=True)
    emb = nn.Embedding.from_pretrained(
        torch.empty(rows, dim).normal_(0.0, init_std, generator=g), freeze=False, sparse=True
    )
    return DeepFM(first, emb, len(cardinalities), n_dense, dim, hidden, seed)


def _check(train: CTRData, test: CTRData, epochs: int, batch_size: int) -> None:
    if epochs < 1:
        raise ValueError("epochs must be at least 1")
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    if tuple(train.cardinalities) != tuple(test.cardinalities):
        raise ValueError("train and test must have the same cardinalities")
    if len(train) == 0 or len(test) == 0:
        raise ValueError("train and test must not be empty")


def _scores(model: DeepFM, ids: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The model's logits for every sample, in batches, without gradients."""
    out = np.empty(len(ids), dtype=np.float32)
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids), _EVAL_BATCH):
            stop = start + _EVAL_BATCH
            logits = model(torch.from_numpy(ids[start:stop]), torch.from_numpy(dense[start:stop]))
            out[start:stop] = logits.numpy()
    model.train()
    return out


def _fit(
    model: DeepFM,
    sparse_optimizer: torch.optim.Optimizer | None,
    train: CTRData,
    test: CTRData,
    *,
    backend: str,
    epochs: int,
    batch_size: int,
    dense_lr: float,
    seed: int,
    progress: bool,
    out: TextIO | None,
    prefetch: bool = False,
) -> dict[str, Any]:
    """The training loop both versions share; returns the common part of their metrics."""
    ids = global_ids(train)
    test_ids = global_ids(test)
    dense_optimizer = torch.optim.Adam(model.dense_parameters(), lr=dense_lr)
    with torch.no_grad():  # start the global bias at the training set's log-odds
        ctr = min(max(train.ctr, 1e-6), 1.0 - 1e-6)
        model.dense_linear.bias.fill_(math.log(ctr / (1.0 - ctr)))
    rng = np.random.default_rng(seed)
    n = len(train)
    n_batches = -(-n // batch_size)
    history: list[dict[str, Any]] = []
    train_seconds = 0.0
    bar = Progress(
        n_batches * epochs, desc=f"deepfm ({backend})", unit="batches", disable=not progress
    )
    with bar:
        for epoch in range(1, epochs + 1):
            order = rng.permutation(n)
            loss_sum = 0.0
            start = time.perf_counter()
            x = torch.from_numpy(np.take(ids, order[:batch_size], axis=0))
            for b in range(n_batches):
                idx = order[b * batch_size : (b + 1) * batch_size]
                d = torch.from_numpy(np.take(train.dense, idx, axis=0))
                y = torch.from_numpy(np.take(train.labels, idx))
                loss = F.binary_cross_entropy_with_logits(model(x, d), y)
                if b + 1 < n_batches:
                    following = order[(b + 1) * batch_size : (b + 2) * batch_size]
                    x = torch.from_numpy(np.take(ids, following, axis=0))
                    if prefetch:  # the store pulls them during this batch's backward pass
                        model.prefetch(x)
                dense_optimizer.zero_grad(set_to_none=True)
                if sparse_optimizer is not None:
                    sparse_optimizer.zero_grad(set_to_none=True)
                loss.backward()
                dense_optimizer.step()
                if sparse_optimizer is not None:
                    sparse_optimizer.step()
                loss_sum += loss.item() * len(idx)
                seen = min((b + 1) * batch_size, n)
                bar.update(postfix=f"epoch {epoch}/{epochs} loss {loss_sum / seen:.4f}")
            model.flush()
            seconds = time.perf_counter() - start
            train_seconds += seconds
            test_auc = auc(test.labels, _scores(model, test_ids, test.dense))
            history.append(
                {
                    "epoch": epoch,
                    "train_loss": loss_sum / n,
                    "test_auc": test_auc,
                    "seconds": seconds,
                    "samples_per_s": n / seconds,
                }
            )
            if out is not None:
                bar.write(
                    f"epoch {epoch:>{len(str(epochs))}}/{epochs}  train loss "
                    f"{loss_sum / n:.4f}  test AUC {test_auc:.4f} (oracle "
                    f"{test.oracle_auc:.4f})  {n / seconds:,.0f} samples/s "
                    f"({format_seconds(seconds)})",
                    file=out,
                )
    return {
        "model": "deepfm",
        "backend": backend,
        "dataset": train.name,
        "n_train": n,
        "n_test": len(test),
        "n_fields": train.n_fields,
        "n_dense": train.n_dense,
        "id_space": int(sum(train.cardinalities)),
        "dim": model.dim,
        "epochs": epochs,
        "batch_size": batch_size,
        "dense_lr": dense_lr,
        "seed": seed,
        "test_auc": history[-1]["test_auc"],
        "oracle_auc": test.oracle_auc,
        "history": history,
        "train_seconds": train_seconds,
        "samples_per_s": n * epochs / train_seconds,
        "torch_threads": torch.get_num_threads(),
    }


def train_deepfm(
    store_or_remote: Any,
    train: CTRData,
    test: CTRData,
    *,
    epochs: int = 2,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dim: int = DEFAULT_DIM,
    hidden: Sequence[int] = DEFAULT_HIDDEN,
    lr: float = DEFAULT_LR,
    dense_lr: float = DEFAULT_DENSE_LR,
    init_std: float = DEFAULT_INIT_STD,
    initial_accumulator_value: float = DEFAULT_INITIAL_ACCUMULATOR,
    staleness: int = 1,
    prefetch: bool = False,
    share_threads: bool = True,
    seed: int = 0,
    prefix: str = "deepfm",
    progress: bool = True,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Train DeepFM with its sparse rows in a store and report test AUC and throughput.

    Parameters
    ----------
    store_or_remote : pstore.Store or pstore.RemoteStore
        Where the two tables are created (``{prefix}_first_order``, ``{prefix}_embedding``).
    train, test : CTRData
        From :func:`pstore.apps.datasets.criteo_like` (and its ``split``).
    epochs : int
        Passes over ``train`` (shuffled by a generator seeded with ``seed``).
    batch_size : int
        Samples per step.
    dim : int
        Embedding width.
    hidden : sequence of int
        Hidden units of the MLP.
    lr : float
        Adagrad learning rate of the sparse rows (in the store).
    dense_lr : float
        Adam learning rate of the dense parameters.
    init_std : float
        Std of the embeddings' initial values.
    initial_accumulator_value : float
        Adagrad's starting ``sum`` (see the module's docs).
    staleness : int
        See :mod:`pstore.torch`: 0 is synchronous, 1 lets a batch's pushes overlap the next
        forward pass.
    prefetch : bool
        Pull the next batch's rows during each backward pass
        (:meth:`pstore.torch.Embedding.prefetch`; with ``staleness >= 1``). Faster, and every
        row the current batch updates is then read before that update lands: on a small id
        space, where consecutive batches share most rows, it costs AUC (see the module's docs).
    share_threads : bool
        Run the embedded store's work on torch's OpenMP threads, pushes applied in the backward
        pass (see :mod:`pstore.torch`); False keeps the store's own pool.
    seed : int
        Seed of the tables' initialisers, the dense initial values and the batch order.
    prefix : str
        Prefix of the table names.
    progress : bool
        Show a progress bar on stderr.
    out : file-like, optional
        Where to print one line per epoch (test AUC vs the oracle's, samples/s); None prints
        nothing.

    Returns
    -------
    dict
        ``test_auc`` (after the last epoch), ``oracle_auc`` (the planted model's on ``test``),
        ``history`` (per epoch: ``epoch``, ``train_loss``, ``test_auc``, ``seconds``,
        ``samples_per_s``), ``train_seconds`` (training only, each epoch ending with a
        flush), ``samples_per_s`` (training samples over ``train_seconds``), ``rows`` (rows
        each table holds at the end: the ids trained on, as evaluation creates none),
        ``table_bytes`` (the two tables' ``bytes_used``), and the settings: ``model``, ``backend``
        (``"pstore"``), ``dataset``, ``n_train``, ``n_test``, ``n_fields``, ``n_dense``,
        ``id_space`` (sum of the cardinalities), ``dim``, ``hidden``, ``epochs``,
        ``batch_size``, ``lr``, ``initial_accumulator_value``, ``dense_lr``, ``staleness``,
        ``prefetch``, ``share_threads`` (whether the store's work ran on torch's threads),
        ``seed``, ``torch_threads``, ``store_threads``.
    """
    _check(train, test, epochs, batch_size)
    model = pstore_deepfm(
        store_or_remote,
        train.n_fields,
        train.n_dense,
        dim=dim,
        hidden=hidden,
        lr=lr,
        init_std=init_std,
        initial_accumulator_value=initial_accumulator_value,
        staleness=staleness,
        share_threads=share_threads,
        seed=seed,
        prefix=prefix,
    )
    metrics = _fit(
        model,
        None,
        train,
        test,
        backend="pstore",
        epochs=epochs,
        batch_size=batch_size,
        dense_lr=dense_lr,
        seed=seed,
        progress=progress,
        out=out,
        prefetch=prefetch,
    )
    stats = {
        name: store_or_remote.sparse_table(f"{prefix}_{name}").stats()
        for name in ("first_order", "embedding")
    }
    return {
        **metrics,
        "hidden": list(hidden),
        "lr": lr,
        "initial_accumulator_value": initial_accumulator_value,
        "staleness": staleness,
        "prefetch": prefetch,
        "share_threads": bool(getattr(model.embedding, "shares_threads", False)),
        "rows": {name: int(s["rows"]) for name, s in stats.items()},
        "table_bytes": {name: int(s.get("bytes_used", 0)) for name, s in stats.items()},
        "store_threads": getattr(store_or_remote, "threads", None),
    }


def train_deepfm_torch(
    train: CTRData,
    test: CTRData,
    *,
    epochs: int = 2,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dim: int = DEFAULT_DIM,
    hidden: Sequence[int] = DEFAULT_HIDDEN,
    lr: float = DEFAULT_LR,
    dense_lr: float = DEFAULT_DENSE_LR,
    init_std: float = DEFAULT_INIT_STD,
    initial_accumulator_value: float = DEFAULT_INITIAL_ACCUMULATOR,
    seed: int = 0,
    progress: bool = True,
    out: TextIO | None = None,
) -> dict[str, Any]:
    """Train the pure-torch twin (:func:`torch_deepfm`) like :func:`train_deepfm`.

    The sparse rows are ``nn.Embedding(sum(cardinalities), ..., sparse=True)`` weights trained
    by ``torch.optim.Adagrad(lr, initial_accumulator_value, eps=1e-10)``; everything else is
    as in :func:`train_deepfm`. Returns the same dict, with ``backend`` ``"torch"``,
    ``staleness`` 0 (every step is synchronous), ``rows`` the rows allocated (the whole id
    space), ``table_bytes`` the bytes of the weights and their Adagrad state, and
    ``store_threads`` None.
    """
    _check(train, test, epochs, batch_size)
    model = torch_deepfm(
        train.cardinalities, train.n_dense, dim=dim, hidden=hidden, init_std=init_std, seed=seed
    )
    sparse_params = [*model.first_order.parameters(), *model.embedding.parameters()]
    sparse_optimizer = torch.optim.Adagrad(
        sparse_params,
        lr=lr,
        initial_accumulator_value=initial_accumulator_value,
        eps=ADAGRAD_EPS,
        foreach=False,
    )
    # torch.optim.Adagrad builds sparse COO tensors, and torch warns on the first one unless
    # the (off by default, costly) invariant checks are switched on or off explicitly: off.
    with torch.sparse.check_sparse_tensor_invariants(enable=False):
        metrics = _fit(
            model,
            sparse_optimizer,
            train,
            test,
            backend="torch",
            epochs=epochs,
            batch_size=batch_size,
            dense_lr=dense_lr,
            seed=seed,
            progress=progress,
            out=out,
        )
    weights: dict[str, Tensor] = {
        "first_order": sparse_params[0],
        "embedding": sparse_params[1],
    }
    return {
        **metrics,
        "hidden": list(hidden),
        "lr": lr,
        "initial_accumulator_value": initial_accumulator_value,
        "staleness": 0,
        "rows": {name: int(w.shape[0]) for name, w in weights.items()},
        # The weights and Adagrad's sum, one float32 each per element.
        "table_bytes": {name: 2 * 4 * int(w.numel()) for name, w in weights.items()},
        "store_threads": None,
    }
