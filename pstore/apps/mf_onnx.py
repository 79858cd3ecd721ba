"""The ``pstore demo`` model as one ONNX graph: (user id, item id) -> predicted rating.

>>> from pstore.apps.mf_onnx import export_mf_onnx  # doctest: +SKIP
>>> export_mf_onnx("snapshots/full-0001", "mf.onnx", clip=(1.0, 5.0))  # doctest: +SKIP

Built from the lookups of :mod:`pstore.serving.onnx` (the library's per-table export), which
needs the ``onnx`` package (``pip install 'pstore[onnx]'``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from pstore.exceptions import InvalidArgumentError, ShapeError, WrongTableKindError
from pstore.serving import PathLike, ServingStore
from pstore.serving.onnx import _check_threshold, _consistent, _Graph, _lookup, _open, _save

__all__ = ["export_mf_onnx"]


def export_mf_onnx(
    source: PathLike,
    out: PathLike,
    *,
    user_emb: str = "user_emb",
    item_emb: str = "item_emb",
    user_bias: str | None = "user_bias",
    item_bias: str | None = "item_bias",
    global_mean: str | float | None = "global_mean",
    clip: tuple[float, float] | None = None,
    external_data_threshold: int = 2**31 - 2**20,
) -> dict[str, Any]:
    """Write an ONNX model of a biased matrix factorisation to the file ``out``.

    Inputs ``user_id`` and ``item_id`` (int64, ``[N]``); output ``rating`` (float32, ``[N]``)
    ``= mu + b_u + b_i + sum_k p_u[k] * q_i[k]``, with ``p_u``, ``q_i`` rows of the sparse
    tables ``user_emb`` and ``item_emb`` (same dim), ``b_u``, ``b_i`` of the dim-1 sparse tables
    ``user_bias`` and ``item_bias`` (None: no such term), and ``mu`` the one value of the dense
    table ``global_mean``, or the float given (None: 0). ``clip=(lo, hi)`` clips the rating.

    Ids a table lacks get zeros (rows and biases). Unlike a training store's pull, which gives
    an unknown id its initializer's row, ONNX cannot compute that: the model then predicts
    ``mu`` plus whatever terms the known side contributes.

    ``source``, ``external_data_threshold`` and the result are as for
    :func:`pstore.serving.onnx.export_onnx`; the
    result adds ``"dim"`` and ``"global_mean"`` (mu).
    """
    bounds = None
    if clip is not None:
        bounds = (float(clip[0]), float(clip[1]))
        if not bounds[0] <= bounds[1]:
            raise InvalidArgumentError(f"clip must be (lo, hi) with lo <= hi, got {clip!r}")
    threshold = _check_threshold(external_data_threshold)
    sparse = [t for t in (user_emb, item_emb, user_bias, item_bias) if t is not None]
    needed = [*sparse, global_mean] if isinstance(global_mean, str) else sparse

    with _open(source, list(dict.fromkeys(needed))) as model:

        def build() -> tuple[list[dict[str, Any]], _Graph, int, float]:
            g = _Graph()
            for name in ("user_id", "item_id", "rating"):
                g.reserve(name)
            for name in ("user_id", "item_id"):
                g.inputs.append(helper.make_tensor_value_info(name, TensorProto.INT64, ["N"]))
            entries = []

            def lookup(table: str, ids: str) -> tuple[str, int]:
                info = model.table_info(table)
                rows, nrows = _lookup(g, model, table, ids, None)
                entries.append(
                    {
                        "name": table,
                        "kind": "sparse",
                        "dtype": info["dtype"],
                        "dim": info["dim"],
                        "rows": nrows,
                        "input": ids,
                        "output": None,
                    }
                )
                return rows, info["dim"]

            p, dim = lookup(user_emb, "user_id")
            q, qdim = lookup(item_emb, "item_id")
            if qdim != dim:
                raise ShapeError(
                    f"table {user_emb!r} has dim {dim} but {item_emb!r} has dim {qdim}; "
                    "a dot product needs one dim"
                )
            mu = _global_mean(model, global_mean)
            axis1 = g.constant("axis1", np.array([1], np.int64))
            # mu + b_u + b_i + dot, added in that order.
            total = g.constant("global_mean", np.array(mu, np.float32))
            for table, ids in ((user_bias, "user_id"), (item_bias, "item_id")):
                if table is None:
                    continue
                b, bdim = lookup(table, ids)
                if bdim != 1:
                    raise ShapeError(f"bias table {table!r} has dim {bdim}, not 1")
                b = g.node("Squeeze", [b, axis1], base=f"{table}/bias")
                total = g.node("Add", [total, b], base="rating/sum")
            pq = g.node("Mul", [p, q], base="rating/products")
            dot = g.node("ReduceSum", [pq, axis1], base="rating/dot", keepdims=0)
            if bounds is None:
                g.node("Add", [total, dot], out="rating")
            else:
                total = g.node("Add", [total, dot], base="rating/sum")
                lo_c = g.constant("rating/lo", np.array(bounds[0], np.float32))
                hi_c = g.constant("rating/hi", np.array(bounds[1], np.float32))
                g.node("Clip", [total, lo_c, hi_c], out="rating")
            g.outputs.append(helper.make_tensor_value_info("rating", TensorProto.FLOAT, ["N"]))
            doc = (
                "pstore biased matrix factorisation: rating = mu + b_u + b_i + <p_u, q_i> for "
                "int64 user_id, item_id (uint64 viewed bit for bit); unknown ids get zeros."
                + ("" if bounds is None else f" Clipped to [{bounds[0]}, {bounds[1]}].")
            )
            g.finish("pstore_mf", doc, model)
            return entries, g, dim, mu

        entries, g, dim, mu = _consistent(model, build)
    path, nbytes, external = _save(g, out, threshold)
    return {
        "path": path,
        "tables": entries,
        "bytes": nbytes,
        "external_data": external,
        "dim": dim,
        "global_mean": mu,
    }


def _global_mean(model: ServingStore, global_mean: str | float | None) -> float:
    if global_mean is None:
        return 0.0
    if isinstance(global_mean, str):
        info = model.table_info(global_mean)
        if info["kind"] != "dense":
            raise WrongTableKindError(
                f"global_mean table {global_mean!r} is sparse; it must be a dense table of one "
                "value"
            )
        value = model.dense(global_mean)
        if value.size != 1:
            raise ShapeError(
                f"global_mean table {global_mean!r} has shape {tuple(value.shape)}, not one value"
            )
        return float(value.reshape(()))
    mu = float(global_mean)
    if not math.isfinite(mu):
        raise InvalidArgumentError(f"global_mean must be finite, got {global_mean!r}")
    return mu
