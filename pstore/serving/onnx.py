"""ONNX export of serving artifacts: id -> row lookups as self-contained ONNX graphs.

>>> from pstore.serving.onnx import export_onnx  # doctest: +SKIP
>>> export_onnx("model", "tables.onnx", tables=["user"])  # doctest: +SKIP

Needs the ``onnx`` package (``pip install 'pstore[onnx]'``); importing :mod:`pstore` or
:mod:`pstore.serving` does not import it.

Each sparse table becomes an ``ai.onnx.ml`` ``LabelEncoder`` that maps an id to its row index
(ids the table lacks map to one extra default row) and a ``Gather`` of its rows. The rows keep
the artifact's stored dtype: float16 rows are gathered then cast to float32, int8 rows are
gathered with their per-row scales and multiplied out in float32, so a model's output equals
:meth:`pstore.serving.ServingStore.lookup` bit for bit. ONNX has no unsigned ids: a graph takes
int64 ids, the uint64 ids viewed bit for bit (``ids.view(np.int64)``).

The id map is a node attribute, which protobuf keeps in the model file, about 16 bytes per id:
a model holds at most about 100 million ids in all. The rows are initializers; past
``external_data_threshold`` bytes they are written beside the model, in ``<model>.data``.
ONNX Runtime wants every graph input fed: give a table you do not query an empty batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pstore.serving.onnx needs the onnx package: pip install 'pstore[onnx]'"
    ) from e

from pstore import __version__
from pstore.exceptions import (
    InvalidArgumentError,
    ShapeError,
    StorageError,
    WrongTableKindError,
)
from pstore.serving import PathLike, ServingStore, export
from pstore.store import _as_f32

__all__ = ["IR_VERSION", "ML_OPSET", "OPSET", "export_onnx"]

OPSET = 17
"""The default-domain opset of exported models."""
ML_OPSET = 3
"""The ``ai.onnx.ml`` opset of exported models (``LabelEncoder`` with ``keys_int64s``)."""
IR_VERSION = 8
"""The ONNX IR version of exported models (what opset 17 shipped with)."""

# A serialized protobuf message cannot reach 2 GiB; keep a margin for the graph's other parts.
_PROTO_LIMIT = 2**31 - 2**24
_ATTEMPTS = 3


def export_onnx(
    source: PathLike,
    out: PathLike,
    *,
    tables: Sequence[str] | None = None,
    default: str | npt.ArrayLike = "zeros",
    external_data_threshold: int = 2**31 - 2**20,
) -> dict[str, Any]:
    """Write an ONNX model of the tables of ``source`` to the file ``out``.

    ``source`` is a serving artifact, or a snapshot (exported to a temporary float32 artifact
    first). ``tables`` selects tables by name (default: all). For each sparse table ``t`` the
    model has an input ``"t_ids"`` (int64, ``[N_t]``) and an output ``"t"`` (float32,
    ``[N_t, dim]``) equal to ``ServingStore.lookup(t, ids, default)``; for each dense table an
    output of its value, fed by no input. ``default`` is the row of ids a table lacks:
    ``"zeros"`` or a float32 row of the table's dim (``"initial"``, the training
    initializer's row, cannot be expressed in ONNX and is refused).

    When the rows take more than ``external_data_threshold`` bytes they are written to
    ``<out>.data`` beside the model (ONNX external data). The model is checked with
    ``onnx.checker`` and renamed into place: on an error nothing is left.

    Returns ``"path"``, ``"tables"`` (per table: ``name``, ``kind``, ``dtype``, ``dim``,
    ``rows``, ``input``, ``output``), ``"bytes"`` (model and data files) and
    ``"external_data"``.
    """
    names = None if tables is None else list(dict.fromkeys(tables))
    if names is not None and not names:
        raise InvalidArgumentError("no tables selected: give at least one table name")
    if isinstance(default, str) and default not in ("zeros", "initial"):
        raise InvalidArgumentError(f"default must be 'zeros' or a row, got {default!r}")
    if isinstance(default, str) and default == "initial":
        raise InvalidArgumentError(
            "default='initial' cannot be exported to ONNX: the training initializer's row of "
            "an unknown id is not an ONNX operation; use 'zeros' or a row"
        )
    threshold = _check_threshold(external_data_threshold)

    with _open(source, names) as model:

        def build() -> tuple[list[dict[str, Any]], _Graph]:
            g = _Graph()
            selected = model.tables() if names is None else names
            infos = [model.table_info(t) for t in selected]
            for info in infos:  # public names first, so internal names avoid them
                if info["kind"] == "sparse":
                    g.reserve(f"{info['name']}_ids")
                g.reserve(info["name"])
            entries = []
            for info in infos:
                t = info["name"]
                if info["kind"] == "sparse":
                    row = _default_row(default, t, info["dim"])
                    ids = f"{t}_ids"
                    n = f"N_{t}"
                    g.inputs.append(helper.make_tensor_value_info(ids, TensorProto.INT64, [n]))
                    _, rows = _lookup(g, model, t, ids, row, out=t)
                    g.outputs.append(
                        helper.make_tensor_value_info(t, TensorProto.FLOAT, [n, info["dim"]])
                    )
                else:
                    ids = None
                    rows = info["rows"]
                    value = model.dense(t).reshape(info["shape"])
                    src = g.initializer(f"{t}/value", value)
                    g.node("Identity", [src], out=t)
                    g.outputs.append(
                        helper.make_tensor_value_info(t, TensorProto.FLOAT, list(value.shape))
                    )
                entries.append(
                    {
                        "name": t,
                        "kind": info["kind"],
                        "dtype": info["dtype"],
                        "dim": info["dim"],
                        "rows": rows,
                        "input": ids,
                        "output": t,
                    }
                )
            doc = (
                "pstore tables: for each sparse table t, input t_ids (int64 ids, uint64 viewed "
                "bit for bit) gives output t (float32 rows; unknown ids get the default row); "
                "each dense table is an output of its value."
            )
            g.finish("pstore_tables", doc, model)
            return entries, g

        entries, g = _consistent(model, build)
    path, nbytes, external = _save(g, out, threshold)
    return {"path": path, "tables": entries, "bytes": nbytes, "external_data": external}


# --- graph building ------------------------------------------------------------------------


class _Graph:
    """Nodes, initializers and unique names of a graph being built."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        # Initializers as arrays: turned into tensors (inline or external) only when saved, so
        # that rows over protobuf's 2 GiB limit never pass through a message.
        self.arrays: list[tuple[str, np.ndarray]] = []
        self.name = ""
        self.doc = ""
        self.props: dict[str, str] = {}
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.used: set[str] = set()
        self.init_bytes = 0  # initializers: what external data can move out of the model
        self.attr_bytes = 0  # id maps: node attributes, always in the model file

    def reserve(self, name: str) -> None:
        """Claim a public (input or output) name."""
        if name in self.used:
            raise InvalidArgumentError(
                f"two inputs or outputs of the ONNX model would be called {name!r} (a table "
                "named like another's ids input?); select the tables apart"
            )
        self.used.add(name)

    def fresh(self, base: str) -> str:
        """A new internal name: ``base``, or ``base_1``, ``base_2``, ... if taken."""
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}_{k}"
        self.used.add(name)
        return name

    def node(
        self,
        op: str,
        inputs: list[str],
        *,
        base: str | None = None,
        out: str | None = None,
        domain: str = "",
        **attrs: Any,
    ) -> str:
        """Add a node; returns its output (``out``, reserved already, or a fresh name)."""
        name = out if out is not None else self.fresh(base or op)
        self.nodes.append(
            helper.make_node(op, inputs, [name], name=f"{name}/{op}", domain=domain, **attrs)
        )
        return name

    def constant(self, base: str, value: np.ndarray) -> str:
        """A small constant, kept in the model (a Constant node, never external data)."""
        return self.node("Constant", [], base=base, value=numpy_helper.from_array(value))

    def initializer(self, base: str, value: np.ndarray) -> str:
        """A table's data: an initializer, moved to external data with the others."""
        name = self.fresh(base)
        self.arrays.append((name, np.ascontiguousarray(value)))
        self.init_bytes += value.nbytes
        return name

    def finish(self, name: str, doc: str, source: ServingStore) -> None:
        """Name the graph and record the artifact's version it was read from."""
        info = source.info()
        self.name, self.doc = name, doc
        self.props = {
            "pstore.dtype": str(info["dtype"]),
            "pstore.snapshot_id": str(info["snapshot"]["id"]),
            "pstore.snapshot_created_at": repr(info["snapshot"]["created_at"]),
            "pstore.generation": str(info["generation"]),
        }

    def model(self, external: tuple[str, str] | None = None) -> onnx.ModelProto:
        """The model; with ``external = (directory, file)``, the initializers' bytes are
        written to that file (each at an offset aligned to 4 KiB) and referenced from it."""
        if external is None:
            inits = [numpy_helper.from_array(a, n) for n, a in self.arrays]
        else:
            inits = []
            folder, file = external
            with open(os.path.join(folder, file), "wb") as f:
                for n, a in self.arrays:
                    f.write(b"\0" * (-f.tell() % 4096))
                    offset = f.tell()
                    little = a.astype(a.dtype.newbyteorder("<"), copy=False)
                    f.write(little.reshape(-1).view(np.uint8).data)
                    t = TensorProto()
                    t.name = n
                    t.data_type = helper.np_dtype_to_tensor_dtype(a.dtype)
                    t.dims.extend(a.shape)
                    t.data_location = TensorProto.EXTERNAL
                    for key, value in (
                        ("location", file),
                        ("offset", str(offset)),
                        ("length", str(a.nbytes)),
                    ):
                        entry = t.external_data.add()
                        entry.key, entry.value = key, value
                    inits.append(t)
                f.flush()
                os.fsync(f.fileno())
        graph = helper.make_graph(
            self.nodes, self.name, self.inputs, self.outputs, inits, doc_string=self.doc
        )
        m = helper.make_model(
            graph,
            opset_imports=[
                helper.make_opsetid("", OPSET),
                helper.make_opsetid("ai.onnx.ml", ML_OPSET),
            ],
            producer_name="pstore",
            producer_version=__version__,
            ir_version=IR_VERSION,
        )
        helper.set_model_props(m, self.props)
        return m


def _lookup(
    g: _Graph,
    model: ServingStore,
    table: str,
    ids: str,
    default_row: np.ndarray | None,
    *,
    out: str | None = None,
) -> tuple[str, int]:
    """Add the nodes mapping the int64 tensor ``ids`` to the float32 rows of sparse ``table``
    (``default_row``, or zeros, for ids it lacks). Returns the rows' name (``out`` if given)
    and the table's row count."""
    info = model.table_info(table)
    if info["kind"] != "sparse":
        raise WrongTableKindError(f"table {table!r} is a dense table, not a sparse one")
    dim = int(info["dim"])
    keys_u, stored = model.stored_rows(table)
    n = len(keys_u)
    keys = keys_u.view(np.int64)
    values = np.arange(n, dtype=np.int64)
    if n == 0:  # LabelEncoder wants keys: map one id to the default row, as any other id
        keys, values = np.zeros(1, np.int64), np.zeros(1, np.int64)
    g.attr_bytes += _attribute_bytes(keys) + _attribute_bytes(values)
    if g.attr_bytes > _PROTO_LIMIT:
        raise InvalidArgumentError(
            f"the ids of table {table!r} and the tables before it do not fit one ONNX model: "
            "an id map is a LabelEncoder attribute, which protobuf keeps under 2 GiB (about "
            "100 million ids); export fewer tables per model"
        )
    index = g.node(
        "LabelEncoder",
        [ids],
        base=f"{table}/index",
        domain="ai.onnx.ml",
        keys_int64s=keys.tolist(),
        values_int64s=values.tolist(),
        default_int64=n,
    )

    dtype = info["dtype"]
    if dtype == "float32":
        extra = np.zeros((1, dim), np.float32) if default_row is None else default_row[None]
        rows = g.initializer(f"{table}/rows", np.concatenate([stored, extra]))
        return g.node("Gather", [rows, index], base=table, out=out, axis=0), n
    if dtype == "float16":
        data = g.initializer(
            f"{table}/rows_f16", np.concatenate([stored, np.zeros((1, dim), np.float16)])
        )
        half = g.node("Gather", [data, index], base=f"{table}/rows_f16", axis=0)
        last = out if default_row is None else None
        rows = g.node("Cast", [half], base=table, out=last, to=TensorProto.FLOAT)
    elif dtype == "int8":
        qs = np.concatenate([stored["q"], np.zeros((1, dim), np.int8)])
        scales = np.concatenate([stored["scale"], np.zeros(1, np.float32)])
        q_data = g.initializer(f"{table}/q", qs)
        s_data = g.initializer(f"{table}/scale", scales)
        q = g.node("Gather", [q_data, index], base=f"{table}/q", axis=0)
        s = g.node("Gather", [s_data, index], base=f"{table}/scale", axis=0)
        qf = g.node("Cast", [q], base=f"{table}/qf", to=TensorProto.FLOAT)
        axis1 = g.constant(f"{table}/axis1", np.array([1], np.int64))
        s1 = g.node("Unsqueeze", [s, axis1], base=f"{table}/scale_col")
        last = out if default_row is None else None
        rows = g.node("Mul", [qf, s1], base=table, out=last)
    else:
        raise StorageError(f"table {table!r} is stored as {dtype!r}, which this pstore lacks")
    if default_row is None:  # the appended zero row decodes to zeros
        return rows, n
    # A float32 default row may not survive float16 or int8: choose it after decoding.
    last_index = g.constant(f"{table}/default_index", np.array(n, np.int64))
    missing = g.node("Equal", [index, last_index], base=f"{table}/missing")
    axis1 = g.constant(f"{table}/default_axis1", np.array([1], np.int64))
    missing = g.node("Unsqueeze", [missing, axis1], base=f"{table}/missing_col")
    row = g.constant(f"{table}/default", default_row)
    return g.node("Where", [missing, row, rows], base=table, out=out), n


def _default_row(default: str | npt.ArrayLike, table: str, dim: int) -> np.ndarray | None:
    """None for zeros, else the float32 row, checked against the table's dim."""
    if isinstance(default, str):
        return None
    row = _as_f32(default, "the default row")
    if row.shape != (dim,):
        raise ShapeError(
            f"the default row has shape {row.shape}; table {table!r} needs a row of {dim}"
        )
    return row


def _attribute_bytes(values: np.ndarray) -> int:
    """Bytes of an int64 list in an (unpacked, proto2) AttributeProto: tag + varint each."""
    u = values.view(np.uint64)
    total = 2 * len(u)
    for k in range(1, 10):
        total += int(np.count_nonzero(u >= np.uint64(1 << (7 * k))))
    return total


def _check_threshold(threshold: int) -> int:
    if isinstance(threshold, bool) or not isinstance(threshold, int | np.integer):
        raise InvalidArgumentError(
            f"external_data_threshold must be an int, got {type(threshold).__name__}"
        )
    if threshold < 0:
        raise InvalidArgumentError(f"external_data_threshold must be >= 0, got {threshold}")
    return int(threshold)


# --- sources and files ---------------------------------------------------------------------


@contextlib.contextmanager
def _open(source: PathLike, tables: list[str] | None) -> Iterator[ServingStore]:
    """The artifact ``source``, or a temporary float32 artifact of the snapshot ``source``."""
    path = os.fspath(source)
    if os.path.isfile(os.path.join(path, "data.mdb")):
        model = ServingStore(path)
        try:
            yield model
        finally:
            model.close()
        return
    fmt = None
    manifest = os.path.join(path, "manifest.json")
    if os.path.isfile(manifest):
        with open(manifest, "rb") as f:
            try:
                fmt = json.load(f).get("format")
            except (ValueError, AttributeError):
                fmt = None
    if fmt != "pstore-snapshot":
        raise InvalidArgumentError(
            f"{path} is neither a serving artifact (no data.mdb) nor a snapshot (no "
            "manifest.json of format pstore-snapshot)"
        )
    with tempfile.TemporaryDirectory(prefix="pstore-onnx-") as tmp:
        artifact = os.path.join(tmp, "artifact")
        export(path, artifact, tables=tables, dtype="float32")
        model = ServingStore(artifact)
        try:
            yield model
        finally:
            model.close()


def _consistent(model: ServingStore, build: Any) -> Any:
    """``build()``, redone if a snapshot was applied to the artifact meanwhile (tables are read
    one transaction each: the model must not mix versions)."""
    for _ in range(_ATTEMPTS):
        generation = model.generation
        result = build()
        if model.generation == generation:
            return result
    raise StorageError(
        f"the artifact at {model.path} changed while it was exported, {_ATTEMPTS} times; "
        "export a copy, or pause its follower"
    )


def _save(g: _Graph, out: PathLike, threshold: int) -> tuple[str, int, bool]:
    """Write the model of ``g`` to ``out`` (and, when its initializers take more than
    ``threshold`` bytes or the model would pass protobuf's limit, ``out.data``), checked,
    renamed into place. Returns the path, the bytes written and whether data went external."""
    external = g.init_bytes > threshold or g.init_bytes + g.attr_bytes > _PROTO_LIMIT
    path = os.path.abspath(os.fspath(out))
    base = os.path.basename(path)
    if not base:
        raise InvalidArgumentError(f"out must name a file, got {os.fspath(out)!r}")
    data = base + ".data"
    tmp = tempfile.mkdtemp(prefix=f".{base}.", dir=os.path.dirname(path))
    try:
        staged = os.path.join(tmp, base)
        external = external and bool(g.arrays)
        onnx.save_model(g.model((tmp, data) if external else None), staged)
        # By path: the checker then reads external data from beside the model, and a model
        # over 2 GiB is never loaded whole.
        onnx.checker.check_model(staged)
        nbytes = os.path.getsize(staged)
        if external:
            nbytes += os.path.getsize(os.path.join(tmp, data))
            os.replace(os.path.join(tmp, data), path + ".data")
        os.replace(staged, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path, nbytes, external
