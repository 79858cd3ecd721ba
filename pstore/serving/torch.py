"""Serving a trained PyTorch model with ``torch.export``, its embedding lookups read from a
serving artifact.

>>> from pstore.serving.torch import ArtifactEmbedding  # doctest: +SKIP
>>> model.user = ArtifactEmbedding("model_dir", "user")  # doctest: +SKIP
>>> program = torch.export.export(model.eval(), (ids,))  # doctest: +SKIP
>>> torch.export.save(program, "model.pt2")  # doctest: +SKIP

:class:`ArtifactEmbedding` is a drop-in for :class:`pstore.torch.Embedding` at inference: its
``forward`` (here ``model.user`` stood for a ``pstore.torch.Embedding``) calls the custom
operator ``torch.ops.pstore.artifact_lookup``, which looks the ids
up in the mapped artifact (:meth:`pstore.serving.ServingStore.lookup`: the GIL released, pages
shared by every process serving it, increments applied by a follower seen at the next call).
``torch.export`` records the operator with the artifact's directory and table as constants
(its fake implementation gives the output's shape), so the exported program holds the dense
part of the model and reads the rows from the artifact when it runs. A process that loads the
saved program imports this module first, which registers the operator.

Unknown ids get the row the training table would have created (``default="initial"``), as
:class:`pstore.torch.Embedding` returns them under ``torch.no_grad()``, so a float32 artifact
gives the training-side model's outputs exactly. ONNX export is separate
(:mod:`pstore.serving.onnx`).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from pstore.exceptions import DtypeError
from pstore.serving import ServingStore

__all__ = ["ArtifactEmbedding", "artifact_lookup"]

_open: dict[str, ServingStore] = {}
_lock = threading.Lock()


def _store(path: str) -> ServingStore:
    with _lock:
        s = _open.get(path)
        if s is None:
            s = _open[path] = ServingStore(path)
        return s


@torch.library.custom_op("pstore::artifact_lookup", mutates_args=())
def artifact_lookup(
    path: str, table: str, ids: torch.Tensor, dim: int, default: str
) -> torch.Tensor:
    """The float32 rows ``(len(ids), dim)`` of the int64 ``ids`` (bits read as uint64) in table
    ``table`` of the artifact at ``path``; ``default`` is ``"zeros"`` or ``"initial"``."""
    if ids.dtype != torch.int64:
        raise DtypeError(f"ids must be an int64 tensor, got {ids.dtype}")
    keys = ids.detach().to("cpu").contiguous().numpy().view(np.uint64).reshape(-1)
    rows = _store(path).lookup(table, keys, default)
    return torch.from_numpy(rows)


@artifact_lookup.register_fake
def _(path: str, table: str, ids: torch.Tensor, dim: int, default: str) -> torch.Tensor:
    return ids.new_empty((ids.shape[0], dim), dtype=torch.float32)


class ArtifactEmbedding(torch.nn.Module):
    """``forward(ids)`` -> ``(*ids.shape, dim)`` float32 rows of ``table`` in the serving
    artifact at ``path``: :class:`pstore.torch.Embedding` for inference and ``torch.export``.

    Parameters
    ----------
    path : str or os.PathLike
        The artifact's directory (recorded as given in an exported program: give a path the
        serving machine has).
    table : str
        A sparse table of the artifact.
    default : {"initial", "zeros"}
        What ids the artifact lacks get.
    """

    def __init__(
        self, path: str | os.PathLike[str], table: str, *, default: str = "initial"
    ) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self.table = table
        self.default = default
        info = _store(self.path).table_info(table)
        self.dim = int(info["dim"])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        rows: torch.Tensor = torch.ops.pstore.artifact_lookup(
            self.path, self.table, flat, self.dim, self.default
        )
        return rows.reshape(*ids.shape, self.dim)
