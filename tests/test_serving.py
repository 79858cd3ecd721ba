"""Serving artifacts (`pstore.serving`): export from snapshot chains, lookups and their defaults,
quantization, read-only access (also through the `lmdb` package), live increments under readers
in this and other processes, damaged snapshots, the model server and the CLI.

Everything is real: training stores, their snapshots, artifacts on disk, servers on 127.0.0.1 and
`python -m pstore` processes.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import _rows
import lmdb
import numpy as np
import pytest
from _data import F32, grads, mix64, random_ids, u64
from _netutil import child_env, free_port
from _rows import RQ_HEAD, closed, error_text, rows_answer, rows_port_clients, rows_request
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import pstore
from pstore import init, optim, serving
from pstore.serving import ServingStore

READER = Path(__file__).with_name("_serving_reader.py")


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pstore", *map(str, args)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=timeout,
    )


# --- a training store with a chain: a full snapshot and two increments ----------------------


@dataclass
class Chain:
    """A training store, the snapshots it took under ``root`` and what it held at each."""

    root: Path
    rng: np.random.Generator
    store: pstore.Store = field(default_factory=lambda: pstore.Store(num_shards=4, threads=2))
    universe: dict[str, set[int]] = field(default_factory=dict)
    snaps: list[Path] = field(default_factory=list)
    manifests: list[dict] = field(default_factory=list)
    states: list[dict] = field(default_factory=list)
    # Per snapshot: table -> ids removed since the previous snapshot and not back (tombstones).
    removed: list[dict[str, np.ndarray]] = field(default_factory=list)

    def t(self, name: str):
        return self.store.table(name)

    def push(self, name: str, ids) -> None:
        ids = u64(ids)
        self.universe.setdefault(name, set()).update(int(i) for i in ids)
        self.t(name).push(ids, grads(self.rng, len(ids), self.t(name).dim))

    def present(self, name: str) -> np.ndarray:
        ids = u64(sorted(self.universe[name]))
        return ids[self.t(name).contains(ids)]

    def new_ids(self, name: str, n: int) -> np.ndarray:
        return random_ids(self.rng, n, avoid=self.universe.get(name, ()))

    def pick(self, ids: np.ndarray, n: int) -> np.ndarray:
        return self.rng.choice(ids, n, replace=False)

    def capture(self) -> dict:
        """Every table: sparse ones as (ids present ascending, their rows), dense ones' value.
        Rows are pulled only where they exist, so capturing creates none."""
        out: dict = {"tables": self.store.tables()}
        for name in self.store.tables():
            t = self.t(name)
            if isinstance(t, pstore.DenseTable):
                out[name] = t.pull()
            else:
                present = self.present(name)
                assert len(present) == len(t)
                out[name] = (present, t.pull(present))
        return out

    def snapshot(self, incremental: bool, removed: dict[str, np.ndarray] | None = None) -> Path:
        snap = self.root / f"snap-{len(self.snaps)}"
        self.manifests.append(self.store.snapshot(snap, incremental=incremental))
        self.snaps.append(snap)
        self.states.append(self.capture())
        self.removed.append(removed or {})
        return snap


def make_chain(root: Path, rng: np.random.Generator) -> Chain:
    """snap-0 (full): user, item, bias. snap-1: rows of user updated, added and removed, table
    late added. snap-2: item dropped, more user rows updated/added/removed (some removed ones
    come back), late rows added and removed."""
    root.mkdir(parents=True, exist_ok=True)
    c = Chain(root, rng)
    s = c.store
    s.create_sparse_table(
        "user", 8, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(0.0, 0.5), seed=3
    )
    s.create_sparse_table(
        "item", 4, optimizer=optim.SGD(lr=0.5), initializer=init.Uniform(-1.0, 1.0), seed=4
    )
    s.create_dense_table("bias", (2, 3), optimizer=optim.SGD(lr=0.5))
    c.push("user", c.new_ids("user", 1500))
    c.push("item", c.new_ids("item", 400))
    c.t("bias").push(grads(rng, 2, 3))
    c.snapshot(incremental=False)

    old = c.present("user")
    gone1 = c.pick(old, 100)
    assert c.t("user").remove(gone1) == 100
    kept = np.setdiff1d(old, gone1)
    c.push("user", np.concatenate([c.pick(kept, 200), c.new_ids("user", 150)]))
    s.create_sparse_table(
        "late", 3, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(0.25), seed=7
    )
    c.push("late", c.new_ids("late", 50))
    c.push("item", c.pick(c.present("item"), 50))
    c.t("bias").push(grads(rng, 2, 3))
    c.snapshot(incremental=True, removed={"user": np.sort(gone1)})

    old = c.present("user")
    gone2 = c.pick(old, 60)
    assert c.t("user").remove(gone2) == 60
    back = gone1[:5]  # removed in snap-1, back (fresh rows) in snap-2
    c.push("user", np.concatenate([c.pick(np.setdiff1d(old, gone2), 100), back]))
    c.push("user", c.new_ids("user", 30))
    late_gone = c.pick(c.present("late"), 5)
    assert c.t("late").remove(late_gone) == 5
    c.push("late", c.new_ids("late", 20))
    s.drop_table("item")
    c.t("bias").push(grads(rng, 2, 3))
    c.snapshot(incremental=True, removed={"user": np.sort(gone2), "late": np.sort(late_gone)})
    return c


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Chain:
    """A chain shared by the tests that only read its snapshots (none takes snapshots of it)."""
    c = make_chain(tmp_path_factory.mktemp("chain") / "snapshots", np.random.default_rng(7))
    yield c
    c.store.close()


def assert_artifact_is(model: ServingStore, want: dict, universe: dict[str, set[int]]) -> None:
    """The artifact holds exactly ``want`` (a Chain.capture): tables, rows (float32: bit for
    bit), masks of which ids it has, dense values."""
    assert model.tables() == want["tables"]
    for name in want["tables"]:
        if isinstance(want[name], tuple):
            ids, rows = want[name]
            np.testing.assert_array_equal(model.lookup(name, ids), rows, err_msg=name)
            everyone = u64(sorted(universe[name]))
            np.testing.assert_array_equal(
                model.contains(name, everyone), np.isin(everyone, ids), err_msg=name
            )
            assert model.table_info(name)["rows"] == len(ids)
            all_ids, all_rows = model.rows(name)
            np.testing.assert_array_equal(all_ids, ids)  # ascending, as captured
            np.testing.assert_array_equal(all_rows, rows)
        else:
            np.testing.assert_array_equal(model.dense(name), want[name], err_msg=name)


def artifact_bytes(out: Path) -> int:
    """The LMDB data file and the row files of an artifact."""
    rows = sum(f.stat().st_size for f in (out / "tables").glob("*.rows"))
    return (out / "data.mdb").stat().st_size + rows


def read_row_file(path: Path, row_id: int) -> tuple[dict, bytes | None]:
    """Reads one id's stored row from a row file with nothing but docs/FORMAT.md: the header,
    then a linear probe of the slots from ``mix64(id) & (slots - 1)``."""
    header, at, row_bytes = find_row(path, row_id)
    return header, None if at is None else path.read_bytes()[at : at + row_bytes]


def find_row(path: Path, row_id: int) -> tuple[dict, int | None, int]:
    """The header of a row file, the offset of one id's stored row in it (None when the file
    lacks the id) and the row's length in bytes."""
    raw = path.read_bytes()
    fields = struct.unpack_from("<8sIIIIQQQQQI", raw)
    magic, version, dtype, dim, stride, rows, slots, gen, length, artifact, crc = fields
    assert magic == b"PSTROWS\0" and version == 3 and zlib.crc32(raw[:64]) == crc
    assert length == len(raw)
    header = {"dtype": dtype, "dim": dim, "stride": stride, "rows": rows, "slots": slots}
    header |= {"generation": gen, "artifact": artifact}
    rows_at = -(-(4096 + 16 * slots) // 4096) * 4096
    row_bytes = {0: 4 * dim, 1: 2 * dim, 2: 4 + dim}[dtype]
    i = mix64(row_id) & (slots - 1)
    while True:
        k, w = struct.unpack_from("<QQ", raw, 4096 + 16 * i)
        if w == 0:
            return header, None, row_bytes
        r = w & ((1 << 40) - 1)
        assert w >> 40 == mix64(k ^ mix64(r ^ 0x707374726F777332)) >> 40, "the slot's check"
        if k == row_id:
            at = rows_at + (r - 1) * stride
            # Layout 3: the rows' checksums in an array after the rows.
            (row_sum,) = struct.unpack_from("<I", raw, rows_at + rows * stride + 4 * (r - 1))
            assert row_sum == zlib.crc32(struct.pack("<Q", k) + raw[at : at + row_bytes])
            return header, at, row_bytes
        i = (i + 1) & (slots - 1)


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --- 1. export: from a full snapshot and from chains ----------------------------------------


@pytest.mark.parametrize("upto", [0, 1, 2])
def test_export_holds_the_training_rows_at_the_snapshot(chain, tmp_path, upto):
    out = tmp_path / "model"
    info = serving.export(chain.snaps[upto], out)
    assert info["chain"] == upto + 1
    assert info["dtype"] == "float32"
    assert info["snapshot"]["id"] == chain.manifests[upto]["id"]
    assert info["file_bytes"] == artifact_bytes(out)
    model = ServingStore(out)
    assert not model.writable and model.dtype == "float32"
    state = model.info()
    assert state["snapshot"]["id"] == chain.manifests[upto]["id"]
    assert state["snapshot"]["kind"] == ("full" if upto == 0 else "incremental")
    assert state["generation"] == upto + 1
    assert [t["name"] for t in state["tables"]] == chain.states[upto]["tables"]
    assert_artifact_is(model, chain.states[upto], chain.universe)
    # The ids removed since the previous snapshot (tombstones) are gone from the artifact.
    for name, gone in chain.removed[upto].items():
        now = chain.states[upto][name][0]
        really_gone = np.setdiff1d(gone, now)
        assert len(really_gone) > 0
        assert not model.contains(name, really_gone).any()
        _, found = model.lookup(name, really_gone, return_found=True)
        assert not found.any()


def test_tables_added_and_dropped_by_increments(chain, tmp_path):
    serving.export(chain.snaps[2], tmp_path / "m2")
    model = ServingStore(tmp_path / "m2")
    assert model.tables() == ["bias", "late", "user"]
    assert "late" in model and "item" not in model and set(model) == {"bias", "late", "user"}
    with pytest.raises(pstore.UnknownTableError):
        model.lookup("item", [1, 2])
    with pytest.raises(pstore.UnknownTableError):
        model.table_info("item")
    # A selection keeps only the tables asked for.
    sel = serving.export(chain.snaps[2], tmp_path / "sel", tables=["user"])
    assert [t["name"] for t in sel["tables"]] == ["user"]
    assert ServingStore(tmp_path / "sel").tables() == ["user"]
    with pytest.raises(pstore.UnknownTableError):
        serving.export(chain.snaps[2], tmp_path / "nope", tables=["item"])  # dropped by then
    assert not (tmp_path / "nope").exists()


def test_contains_and_rows_work_as_the_first_call_on_a_table(chain, tmp_path):
    """Nothing but `contains` (or `rows`) is asked of a freshly opened artifact."""
    serving.export(chain.snaps[2], tmp_path / "m")
    ids, rows = chain.states[2]["user"]
    model = ServingStore(tmp_path / "m")
    assert model.contains("user", ids).all()
    got_ids, _ = ServingStore(tmp_path / "m").rows("late")
    np.testing.assert_array_equal(got_ids, chain.states[2]["late"][0])
    np.testing.assert_array_equal(model.lookup("user", ids), rows)


# --- 2. defaults and misuse -----------------------------------------------------------------


def test_defaults_of_ids_the_artifact_lacks(chain, tmp_path):
    serving.export(chain.snaps[2], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    have, rows = chain.states[2]["user"]
    missing = np.concatenate(
        [chain.new_ids("user", 200), np.setdiff1d(chain.removed[2]["user"], have)]
    )
    user = chain.t("user")
    mixed = np.concatenate([have[:300], missing, have[300:600]])
    is_have = np.isin(mixed, have)

    zeros, found = model.lookup("user", mixed, return_found=True)
    np.testing.assert_array_equal(found, is_have)
    np.testing.assert_array_equal(zeros[~is_have], 0.0)
    np.testing.assert_array_equal(zeros[is_have], np.concatenate([rows[:300], rows[300:600]]))
    np.testing.assert_array_equal(model.lookup("user", missing), np.zeros((len(missing), 8)))

    initial = model.lookup("user", mixed, default="initial")
    np.testing.assert_array_equal(initial[~is_have], user.initial_rows(missing))
    assert np.abs(initial[~is_have]).max() > 0  # Normal(0, 0.5): not zeros
    np.testing.assert_array_equal(initial[is_have], zeros[is_have])
    np.testing.assert_array_equal(
        model.lookup("late", missing, default="initial"), np.full((len(missing), 3), 0.25)
    )
    assert not user.contains(missing).any()  # initial_rows created nothing

    row = np.arange(8, dtype=F32) - 3.5
    given_row = model.lookup("user", mixed, default=row)
    np.testing.assert_array_equal(given_row[~is_have], np.tile(row, ((~is_have).sum(), 1)))
    np.testing.assert_array_equal(given_row[is_have], zeros[is_have])
    np.testing.assert_array_equal(
        model.lookup("user", missing, default=np.ones(8, F32)), np.ones((len(missing), 8))
    )
    with pytest.raises(pstore.DtypeError):
        model.lookup("user", missing, default=np.ones(8))  # float64: as strict as push
    # Int64 ids are the same ids as their uint64 bit pattern.
    np.testing.assert_array_equal(model.lookup("user", have[:50].view(np.int64)), rows[:50])
    assert model.lookup("user", u64([])).shape == (0, 8)

    with pytest.raises(pstore.ShapeError):
        model.lookup("user", missing, default=np.zeros(7, F32))
    with pytest.raises(pstore.ShapeError):
        model.lookup("user", missing, default=np.zeros((2, 8), F32))
    with pytest.raises(pstore.InvalidArgumentError):
        model.lookup("user", missing, default="random")
    with pytest.raises(pstore.UnknownTableError):
        model.lookup("nope", missing)
    with pytest.raises(pstore.UnknownTableError):
        model.contains("nope", missing)
    with pytest.raises(pstore.WrongTableKindError):
        model.lookup("bias", [0])
    with pytest.raises(pstore.WrongTableKindError):
        model.dense("user")
    with pytest.raises(pstore.UnknownTableError):
        model.dense("nope")
    np.testing.assert_array_equal(model.dense("bias"), chain.t("bias").pull())
    assert model.dense("bias").shape == (2, 3) and model.dense("bias").dtype == F32


# --- 3. quantization ------------------------------------------------------------------------


def sgd_table(store: pstore.Store, name: str, dim: int):
    """A table whose rows are what is pushed, negated: Zeros, then w <- 0 - 1 * g."""
    return store.create_sparse_table(
        name, dim, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros(), seed=0
    )


f16_rows = hnp.arrays(
    F32,
    st.tuples(st.integers(1, 24), st.integers(1, 16)),
    elements=st.floats(-60000.0, 60000.0, width=32, allow_nan=False, allow_infinity=False),
)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(rows=f16_rows, scale=st.sampled_from([1e-30, 1e-6, 1.0, 1e4, 1e30]))
@example(rows=np.array([[1.1754944e-38]], dtype=np.float32), scale=1e-06)  # subnormal row
def test_quantized_rows_stay_within_their_bounds(rows, scale):
    n, dim = rows.shape
    wide = (rows.astype(np.float64) * scale).astype(F32)
    wide[~np.isfinite(wide)] = 0.0
    ids = np.arange(1, n + 1, dtype=np.uint64)
    with tempfile.TemporaryDirectory() as tmp:
        store = pstore.Store(num_shards=2, threads=1)
        a, b = sgd_table(store, "a", dim), sgd_table(store, "b", dim)
        a.push(ids, -rows)
        b.push(ids, -wide)
        truth_a, truth_b = a.pull(ids), b.pull(ids)
        np.testing.assert_array_equal(truth_a, rows)
        store.snapshot(Path(tmp) / "snap")
        got = {}
        for dtype in ("float32", "float16", "int8"):
            out = Path(tmp) / dtype
            serving.export(
                Path(tmp) / "snap", out, dtype=dtype, tables=["a"] if dtype == "float16" else None
            )
            model = ServingStore(out)
            assert model.dtype == dtype
            got[dtype] = {name: model.lookup(name, ids) for name in model.tables()}
            for name in model.tables():
                r_ids, r_rows = model.rows(name)
                np.testing.assert_array_equal(r_ids, ids)
                np.testing.assert_array_equal(r_rows, got[dtype][name])
            if dtype == "int8":
                _, stored = model.stored_rows("b")
                peak = np.abs(truth_b).max(axis=1)
                q = np.abs(stored["q"].astype(np.int32)).max(axis=1)
                # A row's largest element is +-127 steps whenever the step is a normal float32;
                # a step in the subnormal range has too few bits for that, and one that would
                # underflow becomes the smallest float, but such a row is still not all zeros.
                normal = peak / 127 >= np.finfo(np.float32).tiny
                assert (q[(peak > 0) & normal] == 127).all()
                assert (q[(peak > 0) & ~normal] >= 1).all()
            model.close()
        store.close()

    np.testing.assert_array_equal(got["float32"]["a"], truth_a)
    np.testing.assert_array_equal(got["float32"]["b"], truth_b)
    w = truth_a.astype(np.float64)
    err16 = np.abs(got["float16"]["a"].astype(np.float64) - w)
    assert (err16 <= np.abs(w) * 2.0**-11 + 2.0**-24).all(), err16.max()
    for name, truth in (("a", truth_a), ("b", truth_b)):
        w = truth.astype(np.float64)
        bound = np.abs(w).max(axis=1, keepdims=True) / 254 * (1 + 1e-6) + 1e-12
        err8 = np.abs(got["int8"][name].astype(np.float64) - w)
        assert (err8 <= bound).all(), (name, (err8 - bound).max())


def test_bytes_per_row_by_dtype(tmp_path, rng):
    store = pstore.Store(num_shards=4, threads=2)
    t = sgd_table(store, "emb", 64)
    n = 20_000
    ids = random_ids(rng, n)
    t.push(ids, -grads(rng, n, 64))
    store.snapshot(tmp_path / "snap")
    sizes, per_row = {}, {}
    for dtype in ("float32", "float16", "int8"):
        info = serving.export(tmp_path / "snap", tmp_path / dtype, dtype=dtype)
        sizes[dtype] = artifact_bytes(tmp_path / dtype)
        assert info["file_bytes"] == sizes[dtype]
        per_row[dtype] = sizes[dtype] / n
        assert info["bytes_per_row"] == pytest.approx(per_row[dtype])
        # The row file: the rows at their stride, their 4-byte checksums after them, 16-byte
        # slots at most two thirds full.
        stride = {"float32": 256, "float16": 128, "int8": 68}[dtype] + 4
        assert per_row[dtype] >= stride
        assert per_row[dtype] <= stride + 16 * 3 + 8192 / n + 50_000 / n
    print(
        "bytes per row, dim 64: "
        + ", ".join(f"{d} {per_row[d]:.1f} ({per_row[d] / per_row['float32']:.2f}x)" for d in sizes)
    )
    assert sizes["float32"] > sizes["float16"] > sizes["int8"]
    assert sizes["float16"] < 0.65 * sizes["float32"]
    assert sizes["int8"] < 0.45 * sizes["float32"]
    store.close()


def test_float16_overflow_is_refused_and_leaves_nothing(tmp_path, rng):
    store = pstore.Store(num_shards=2, threads=1)
    t = sgd_table(store, "emb", 4)
    ids = np.arange(100, dtype=np.uint64)
    g = grads(rng, 100, 4)
    g[37, 2] = -1e6  # the row's weight: 1e6, over float16's 65504
    t.push(ids, g)
    store.snapshot(tmp_path / "snap")
    models = tmp_path / "models"
    models.mkdir()
    with pytest.raises(pstore.InvalidArgumentError, match="float32") as e:
        serving.export(tmp_path / "snap", models / "m16", dtype="float16")
    assert "emb" in str(e.value)
    assert os.listdir(models) == []  # neither the artifact nor its temporary directory
    # An empty directory given as the target is left as it was.
    (models / "empty").mkdir()
    with pytest.raises(pstore.InvalidArgumentError):
        serving.export(tmp_path / "snap", models / "empty", dtype="float16")
    assert os.listdir(models) == ["empty"] and os.listdir(models / "empty") == []
    # float32 and int8 hold it.
    serving.export(tmp_path / "snap", models / "m32", dtype="float32")
    assert ServingStore(models / "m32").lookup("emb", [37])[0, 2] == np.float32(1e6)
    serving.export(tmp_path / "snap", models / "m8", dtype="int8")
    assert ServingStore(models / "m8").lookup("emb", [37])[0, 2] == pytest.approx(1e6, rel=1e-6)
    with pytest.raises(pstore.InvalidArgumentError):
        serving.export(tmp_path / "snap", models / "bad", dtype="bfloat16")  # type: ignore[arg-type]
    with pytest.raises(pstore.InvalidArgumentError):
        serving.export(tmp_path / "snap", models / "m32")  # not empty
    assert sorted(os.listdir(models)) == ["empty", "m32", "m8"]
    store.close()


# --- 4. read-only ---------------------------------------------------------------------------


def test_a_read_only_artifact_cannot_be_written(chain, tmp_path):
    out = tmp_path / "m"
    serving.export(chain.snaps[1], out)
    before = file_digest(out / "data.mdb")
    model = ServingStore(out)
    assert model.writable is False
    with pytest.raises(pstore.InvalidArgumentError, match="read-only"):
        model.apply(chain.snaps[2])
    with pytest.raises(pstore.InvalidArgumentError):
        model.follow(chain.root)
    assert model.generation == 2 and model.info()["snapshot"]["id"] == chain.manifests[1]["id"]
    assert_artifact_is(model, chain.states[1], chain.universe)
    writes = {"push", "put", "remove", "delete", "insert", "update", "write", "set", "drop"}
    public = {n for n in dir(ServingStore) if not n.startswith("_")}
    assert not {n for n in public if any(n.startswith(w) for w in writes)}, public
    assert file_digest(out / "data.mdb") == before

    # Another reader: the lmdb package for the records, the row file read by hand.
    ids, rows = chain.states[1]["user"]
    env = lmdb.open(str(out), readonly=True, lock=False, max_dbs=16)
    try:
        meta = env.open_db(b"meta", create=False)
        with env.begin() as txn:
            assert struct.unpack("<Q", txn.get(b"generation", db=meta))[0] == 2
            state = json.loads(txn.get(b"state", db=meta))
            assert state["snapshot"]["id"] == chain.manifests[1]["id"]
            record = json.loads(txn.get(b"table/user", db=meta))
            assert record["dim"] == 8
            assert json.loads(txn.get(b"format", db=meta)) == {
                "format": "pstore-serving",
                "version": 2,
            }
    finally:
        env.close()
    path = out / record["index"]["file"]
    for k in (0, len(ids) // 2, len(ids) - 1):
        header, raw = read_row_file(path, int(ids[k]))
        assert raw is not None
        np.testing.assert_array_equal(np.frombuffer(raw, "<f4"), rows[k])
        np.testing.assert_array_equal(
            np.frombuffer(raw, "<f4"), model.lookup("user", ids[k : k + 1])[0]
        )
    assert header["rows"] == len(ids) and header["dim"] == 8 and header["dtype"] == 0
    assert header["generation"] == record["index"]["generation"]
    assert header["artifact"] == state["artifact"]
    assert read_row_file(path, int(chain.new_ids("user", 1)[0]))[1] is None
    assert file_digest(out / "data.mdb") == before


def test_a_read_only_opening_stays_read_only_beside_a_writable_one(chain, tmp_path):
    """Opening read-only while this process has the artifact open writable: still read-only."""
    out = tmp_path / "m"
    serving.export(chain.snaps[0], out)
    writer = ServingStore(out, writable=True)
    reader = ServingStore(out)
    assert writer.writable
    try:
        assert reader.writable is False
        with pytest.raises(pstore.InvalidArgumentError):
            reader.apply(chain.snaps[1])
        assert writer.generation == 1
    finally:
        reader.close()
        writer.close()


def test_an_artifact_exported_again_at_the_same_path_is_opened_afresh(chain, tmp_path):
    """Deployments replace an artifact by exporting a new one to its path. LMDB allows one
    opening of a file per process, so while this process still has the old one open a new
    opening is refused with a clear error (never the old, deleted files); once the old one is
    closed, the new one opens."""
    out = tmp_path / "m"
    serving.export(chain.snaps[0], out)
    old = ServingStore(out)
    assert old.info()["snapshot"]["id"] == chain.manifests[0]["id"]
    shutil.rmtree(out)
    serving.export(chain.snaps[2], out)
    with pytest.raises(pstore.InvalidArgumentError, match="replaced on disk"):
        ServingStore(out)
    old.close()
    del old
    gc.collect()
    new = ServingStore(out)
    try:
        assert new.info()["snapshot"]["id"] == chain.manifests[2]["id"]
        assert_artifact_is(new, chain.states[2], chain.universe)
    finally:
        new.close()


def test_follow_needs_only_the_increments_after_the_artifact(tmp_path, rng):
    """Old snapshots may be deleted once an artifact is past them."""
    c = make_chain(tmp_path / "snapshots", rng)
    out = tmp_path / "m"
    serving.export(c.snaps[1], out)
    shutil.rmtree(c.snaps[0])
    with ServingStore(out, writable=True) as model:
        assert model.lag(c.root)["pending"] == 1
        assert len(model.follow(c.root)) == 1
        assert model.info()["snapshot"]["id"] == c.manifests[2]["id"]
        assert_artifact_is(model, c.states[2], c.universe)


def test_a_closed_serving_store_says_so(chain, tmp_path):
    out = tmp_path / "m"
    serving.export(chain.snaps[0], out)
    model = ServingStore(out)
    model.close()
    with pytest.raises(pstore.InvalidArgumentError, match="closed"):
        model.lookup("user", u64([1]))


def test_a_default_row_applies_only_to_tables_of_its_dim(chain, tmp_path):
    """A server's default row is checked when an id needs it, so tables of other dims still
    answer the ids they have."""
    out = tmp_path / "m"
    serving.export(chain.snaps[0], out)
    model = ServingStore(out)
    user = np.sort(np.fromiter(chain.universe["user"], dtype=np.uint64))
    have = user[model.contains("user", user)][:5]
    item = np.sort(np.fromiter(chain.universe["item"], dtype=np.uint64))
    item_have = item[model.contains("item", item)][:5]
    row = np.full(8, 7.0, np.float32)  # user's dim
    np.testing.assert_array_equal(
        model.lookup("item", item_have, row),
        model.rows("item")[1][np.searchsorted(model.rows("item")[0], item_have)],
    )
    missing = u64([2**64 - 3])
    assert not model.contains("item", missing)[0]
    with pytest.raises(pstore.ShapeError, match="dim 4"):
        model.lookup("item", missing, row)
    np.testing.assert_array_equal(model.lookup("user", missing, row), row[None, :])
    assert have.size == 5


# --- 5. live increments ---------------------------------------------------------------------


def test_increments_apply_in_order_and_follow_catches_up(tmp_path, rng):
    c = make_chain(tmp_path / "snapshots", rng)
    out = tmp_path / "m"
    serving.export(c.snaps[0], out)
    model = ServingStore(out, writable=True)
    assert model.writable
    lag = model.lag(c.root)
    assert lag["pending"] == 2 and lag["generation"] == 1
    assert lag["snapshot_id"] == c.manifests[0]["id"]
    assert lag["seconds"] >= 0 and lag["newest_seconds"] > 0

    # Out of order: refused, nothing changes.
    before = model.info()
    with pytest.raises(pstore.InvalidArgumentError, match="increment"):
        model.apply(c.snaps[2])
    assert model.info() == before
    assert_artifact_is(model, c.states[0], c.universe)
    # At that snapshot already.
    assert model.apply(c.snaps[0]) is None
    assert model.generation == 1

    a = model.apply(c.snaps[1])
    assert a is not None
    assert (a["id"], a["kind"], a["generation"]) == (c.manifests[1]["id"], "incremental", 2)
    assert a["deleted"] == len(c.removed[1]["user"])
    assert model.apply(c.snaps[1]) is None
    assert model.generation == 2
    assert_artifact_is(model, c.states[1], c.universe)
    assert model.lag(c.root)["pending"] == 1

    applied = model.follow(c.root)
    assert [x["id"] for x in applied] == [c.manifests[2]["id"]]
    assert model.follow(c.root) == []
    assert model.lag(c.root)["pending"] == 0
    assert model.lag(c.root)["newest_seconds"] == 0
    assert model.generation == 3
    assert_artifact_is(model, c.states[2], c.universe)

    # Training takes a new full snapshot: follow replaces the artifact's tables with it.
    gone = c.pick(c.present("user"), 40)
    c.t("user").remove(gone)
    c.push("user", c.new_ids("user", 10))
    c.store.drop_table("late")
    c.store.create_dense_table("bias2", 5, optimizer=optim.SGD(lr=0.1))
    c.snapshot(incremental=False)
    assert model.lag(c.root)["pending"] == 1
    applied = model.follow(c.root)
    assert [(x["id"], x["kind"]) for x in applied] == [(c.manifests[3]["id"], "full")]
    assert model.generation == 4 and model.info()["snapshot"]["kind"] == "full"
    assert_artifact_is(model, c.states[3], c.universe)
    assert not model.contains("user", gone).any()

    # ... and goes on with increments of it.
    c.push("user", c.pick(c.present("user"), 30))
    c.snapshot(incremental=True)
    assert [x["id"] for x in model.follow(c.root)] == [c.manifests[4]["id"]]
    assert_artifact_is(model, c.states[4], c.universe)
    model.close()

    # The function `follow`, as `pstore serving follow --once` runs it, on a second artifact.
    serving.export(c.snaps[0], tmp_path / "m2")
    seen: list[dict] = []
    n = serving.follow(c.root, tmp_path / "m2", once=True, on_apply=seen.append)
    # The newest snapshot (snap-4) builds on the full snap-3, not on snap-0's chain.
    assert n == 2 and [x["id"] for x in seen] == [c.manifests[3]["id"], c.manifests[4]["id"]]
    assert_artifact_is(ServingStore(tmp_path / "m2"), c.states[4], c.universe)
    with pytest.raises(pstore.InvalidArgumentError):
        serving.follow(c.root, tmp_path / "m2", interval=0)
    c.store.close()


def test_follow_keeps_an_artifact_current_until_stopped(tmp_path, rng):
    c = make_chain(tmp_path / "snapshots", rng)
    # Only the full snapshot at first; the increments appear while follow runs.
    root = tmp_path / "live"
    root.mkdir()
    shutil.copytree(c.snaps[0], root / "snap-0")
    serving.export(root / "snap-0", tmp_path / "m")
    stop = threading.Event()
    seen: list[dict] = []
    t = threading.Thread(
        target=lambda: seen.append(
            serving.follow(root, tmp_path / "m", interval=0.05, stop=stop, on_apply=seen.append)
        )
    )
    t.start()
    try:
        for k in (1, 2):
            shutil.copytree(c.snaps[k], root / f".tmp-{k}")
            os.rename(root / f".tmp-{k}", root / f"snap-{k}")  # appears whole, as snapshots do
            deadline = time.monotonic() + 20
            while len(seen) < k and time.monotonic() < deadline:
                time.sleep(0.02)
            assert [x["id"] for x in seen] == [m["id"] for m in c.manifests[1 : k + 1]]
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    assert seen[-1] == 2  # follow's return value: snapshots applied
    assert_artifact_is(ServingStore(tmp_path / "m"), c.states[2], c.universe)
    c.store.close()


# --- 6. atomic versions under concurrent readers --------------------------------------------


def test_readers_never_see_a_mix_of_versions(tmp_path):
    """After training round k every row of every id is -k. Readers (threads of this process and
    another process, read-only) look all ids up in one call while increments are applied: each
    answer holds one value."""
    n, dim, rounds = 20_000, 4, 12
    store = pstore.Store(num_shards=8, threads=2)
    t = sgd_table(store, "emb", dim)
    ids = np.arange(n, dtype=np.uint64)
    ones = np.ones((n, dim), F32)
    root = tmp_path / "snapshots"
    root.mkdir()
    snaps = []
    for k in range(1, rounds + 1):
        t.push(ids, ones)
        snaps.append(root / f"snap-{k:02d}")
        store.snapshot(snaps[-1], incremental=k > 1)
    np.testing.assert_array_equal(t.pull(ids[:5]), -float(rounds))
    store.close()

    out = tmp_path / "m"
    serving.export(snaps[0], out)
    model = ServingStore(out, writable=True)
    np.testing.assert_array_equal(model.lookup("emb", ids), -1.0)

    stop = threading.Event()
    results: dict[str, dict] = {}

    def reader(name: str, batch: int, **kw) -> None:
        r = results[name] = {"reads": 0, "versions": [], "mixed": [], "backwards": []}
        some = ids[:batch] if batch < n else ids
        last = None
        try:
            while not stop.is_set():
                rows = model.lookup("emb", some, **kw)
                if kw.get("return_found"):
                    rows, found = rows
                    assert found.all()
                values = np.unique(rows)
                if len(values) != 1:
                    r["mixed"].append(values[:8].tolist())
                v = float(values[0])
                if v not in r["versions"]:
                    r["versions"].append(v)
                if last is not None and v > last:
                    r["backwards"].append((last, v))
                last = v
                r["reads"] += 1
        except Exception as e:
            r["error"] = repr(e)

    ready, stop_file = tmp_path / "ready", tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, str(READER), str(out), "emb", str(n), str(ready), str(stop_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    threads = [
        threading.Thread(target=reader, args=("big-1", n)),
        threading.Thread(target=reader, args=("big-2", n), kwargs={"return_found": True}),
        threading.Thread(target=reader, args=("big-initial", n), kwargs={"default": "initial"}),
        threading.Thread(target=reader, args=("small", 3000)),  # the one-transaction path
    ]
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the reader process did not start"
            time.sleep(0.02)
        for th in threads:
            th.start()
        deadline = time.monotonic() + 60
        while len(results) < len(threads) or min(r["reads"] for r in results.values()) == 0:
            assert time.monotonic() < deadline, results  # every thread has read version 1
            time.sleep(0.01)
        gens = []
        for snap in snaps[1:]:
            a = model.apply(snap)
            assert a is not None and a["rows"] == n
            gens.append(a["generation"])
            time.sleep(0.15)
    finally:
        stop.set()
        stop_file.write_text("stop\n")
        for th in threads:
            if th.ident is not None:  # started
                th.join(30)
        try:
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert gens == list(range(2, rounds + 1))
    np.testing.assert_array_equal(model.lookup("emb", ids), -float(rounds))
    assert proc.returncode == 0, stderr
    results["process"] = json.loads(stdout.strip().splitlines()[-1])
    assert results["process"]["writable"] is False
    print(
        "readers: "
        + ", ".join(
            f"{name} {r['reads']} reads, {len(r['versions'])} versions"
            for name, r in sorted(results.items())
        )
    )
    for name, r in results.items():
        assert r.get("error") is None, (name, r["error"])
        assert r["mixed"] == [], (name, r["mixed"][:3])
        assert r["backwards"] == [], (name, r["backwards"][:3])
        assert r["reads"] > 0
        assert len(r["versions"]) >= 2, (name, r)  # it read while versions changed
        assert set(r["versions"]) <= {-float(k) for k in range(1, rounds + 1)}, (name, r)
    model.close()


def test_increments_apply_while_first_lookups_of_many_tables_race_them(tmp_path):
    """Increments applied to a writable artifact while threads of this process (each starting
    with no table looked up yet, so they open tables while the writer writes) and a read-only
    process look up every table: every answer is one version (old or new) of its rows, never an
    error. Repeated over fresh artifacts; this used to fail with MDB_BAD_DBI in most rounds."""
    n, dim, tables, rounds, repeats = 500, 4, 10, 5, 6
    store = pstore.Store(num_shards=4, threads=2)
    ts = [sgd_table(store, f"t{i}", dim) for i in range(tables)]
    ids = np.arange(n, dtype=np.uint64)
    ones = np.ones((n, dim), F32)
    root = tmp_path / "snapshots"
    root.mkdir()
    snaps = []
    for k in range(1, rounds + 1):
        for t in ts:
            t.push(ids, ones)
        snaps.append(root / f"snap-{k:02d}")
        store.snapshot(snaps[-1], incremental=k > 1)
    store.close()

    for rep in range(repeats):
        out = tmp_path / f"m{rep}"
        serving.export(snaps[0], out)
        model = ServingStore(out, writable=True)
        stop = threading.Event()
        problems: list[str] = []

        def reader(
            j: int,
            model: ServingStore = model,
            stop: threading.Event = stop,
            problems: list[str] = problems,
        ) -> None:
            last: dict[str, float] = {}
            try:
                while not stop.is_set():
                    for i in range(tables):
                        name = f"t{(i * (j + 1) + j) % tables}"
                        values = np.unique(model.lookup(name, ids))
                        if len(values) != 1:
                            problems.append(f"{name} mixed {values[:4]}")
                        v = float(values[0])
                        if v > last.get(name, 0.0) or v not in {-float(k) for k in range(1, 6)}:
                            problems.append(f"{name} went from {last.get(name)} to {v}")
                        last[name] = v
            except Exception as e:
                problems.append(repr(e))

        ready, stop_file = tmp_path / f"ready-{rep}", tmp_path / f"stop-{rep}"
        proc = subprocess.Popen(
            [sys.executable, str(READER), str(out), "t3", str(n), str(ready), str(stop_file)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        threads = [threading.Thread(target=reader, args=(j,)) for j in range(4)]
        try:
            deadline = time.monotonic() + 60
            while not ready.exists():
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the reader process did not start"
                time.sleep(0.01)
            for th in threads:
                th.start()
            for snap in snaps[1:]:
                a = model.apply(snap)
                assert a is not None and a["rows"] == n * tables
        finally:
            stop.set()
            stop_file.write_text("stop\n")
            for th in threads:
                if th.ident is not None:
                    th.join(30)
            try:
                stdout, stderr = proc.communicate(timeout=60)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        assert problems == [], (rep, problems[:5])
        assert proc.returncode == 0, stderr
        seen = json.loads(stdout.strip().splitlines()[-1])
        assert seen["error"] is None and seen["mixed"] == [] and seen["backwards"] == [], seen
        for t in range(tables):
            np.testing.assert_array_equal(model.lookup(f"t{t}", ids), -float(rounds))
        model.close()


# --- 7. a damaged increment -----------------------------------------------------------------


def test_a_damaged_increment_is_refused_and_changes_nothing(chain, tmp_path):
    root = tmp_path / "snapshots"
    shutil.copytree(chain.root, root)
    serving.export(root / "snap-0", tmp_path / "m")
    model = ServingStore(tmp_path / "m", writable=True)
    entry = next(e for e in chain.manifests[1]["tables"] if e["name"] == "user")
    part = entry["files"][0]["name"]
    original = (root / "snap-1" / part).read_bytes()
    flip_byte(root / "snap-1" / part)
    before_info = model.info()
    model.lookup("user", [1])  # (scan as the first call on a table: see the test above)
    before_rows = model.stored_rows("user")
    with pytest.raises(pstore.CorruptError) as e:
        model.apply(root / "snap-1")
    assert Path(part).name in str(e.value) and "snap-1" in str(e.value)
    with pytest.raises(pstore.CorruptError):
        model.follow(root)
    assert model.info() == before_info
    assert model.generation == 1
    after_rows = model.stored_rows("user")
    np.testing.assert_array_equal(after_rows[0], before_rows[0])
    np.testing.assert_array_equal(after_rows[1], before_rows[1])
    assert_artifact_is(model, chain.states[0], chain.universe)
    assert "late" not in model  # the table the increment adds is not half there

    # A damaged tombstones file too.
    (root / "snap-1" / part).write_bytes(original)
    tomb = entry["tombstones"]["name"]
    flip_byte(root / "snap-1" / tomb)
    with pytest.raises(pstore.CorruptError, match=Path(tomb).name):
        model.apply(root / "snap-1")
    assert model.info() == before_info

    # Repaired, the increment applies.
    shutil.copyfile(chain.snaps[1] / tomb, root / "snap-1" / tomb)
    assert model.apply(root / "snap-1")["generation"] == 2
    assert_artifact_is(model, chain.states[1], chain.universe)
    model.close()


def write_version_1(model_dir: Path, out: Path) -> None:
    """A format version 1 artifact of the same tables as ``model_dir``, written with the
    ``lmdb`` package from docs/FORMAT.md: the rows in ``rows/<name>`` (id big-endian -> row as
    stored), the records in ``meta``, no row files."""
    m = ServingStore(model_dir)
    state = m.info()
    out.mkdir()
    env = lmdb.open(str(out), max_dbs=16, map_size=1 << 30)
    with env.begin(write=True) as txn:
        meta = env.open_db(b"meta", txn=txn)
        txn.put(b"format", json.dumps({"format": "pstore-serving", "version": 1}).encode(), db=meta)
        tables = []
        for t in state["tables"]:
            t = {k: v for k, v in t.items() if k != "index"}
            tables.append(t)
            txn.put(f"table/{t['name']}".encode(), json.dumps(t).encode(), db=meta)
            if t["kind"] == "dense":
                txn.put(f"dense/{t['name']}".encode(), m.dense(t["name"]).tobytes(), db=meta)
                continue
            rows = env.open_db(f"rows/{t['name']}".encode(), txn=txn)
            ids, stored = m.stored_rows(t["name"])
            for i, row in zip(ids, stored, strict=True):
                txn.put(struct.pack(">Q", int(i)), row.tobytes(), db=rows)
        v1 = {k: v for k, v in state.items() if k not in ("artifact",)}
        v1 |= {"version": 1, "tables": tables}
        txn.put(b"state", json.dumps(v1).encode(), db=meta)
        txn.put(b"generation", struct.pack("<Q", state["generation"]), db=meta)
    env.close()
    m.close()


def test_a_version_1_artifact_is_read_and_migrated_when_opened_writable(chain, tmp_path):
    serving.export(chain.snaps[0], tmp_path / "v2")
    write_version_1(tmp_path / "v2", tmp_path / "v1")
    v1 = tmp_path / "v1"
    # Read-only: the rows come from LMDB, as version 1 stores them.
    model = ServingStore(v1)
    assert model.info()["version"] == 1 and not (v1 / "tables").exists()
    assert_artifact_is(model, chain.states[0], chain.universe)
    model.close()
    del model
    gc.collect()
    # Writable: migrated to row files in one transaction, then increments apply as usual.
    model = ServingStore(v1, writable=True)
    info = model.info()
    assert info["version"] == 2 and info["generation"] == 2
    assert all(
        t["index"]["file"].startswith("tables/") for t in info["tables"] if t["kind"] == "sparse"
    )
    assert_artifact_is(model, chain.states[0], chain.universe)
    env = lmdb.open(str(v1), readonly=True, lock=False, max_dbs=16)
    with env.begin() as txn:
        assert json.loads(txn.get(b"format", db=env.open_db(b"meta", txn=txn)))["version"] == 2
        assert txn.stat(env.open_db(b"rows/user", txn=txn))["entries"] == 0
    env.close()
    model.apply(chain.snaps[1])
    model.apply(chain.snaps[2])
    assert_artifact_is(model, chain.states[2], chain.universe)
    model.close()


def reopened(path: Path) -> ServingStore:
    """A read-only opening that is the process's first (earlier ones collected)."""
    gc.collect()
    return ServingStore(path)


def test_damaged_foreign_and_stale_row_files_are_refused_by_name(chain, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    serving.export(chain.snaps[0], a)
    serving.export(chain.snaps[0], b)
    w = ServingStore(a, writable=True)

    def user_file(m: ServingStore) -> str:
        return str(next(t for t in m.info()["tables"] if t["name"] == "user")["index"]["file"])

    old = user_file(w)
    w.apply(chain.snaps[1])
    cur = user_file(w)
    assert cur != old and (a / old).exists()  # the previous generation's file stays a while
    w.close()
    del w
    path = a / cur
    good = path.read_bytes()
    cases = {
        "torn": good[: len(good) // 2],
        "foreign": b"\x00" * len(good),
        "header": good[:20] + bytes([good[20] ^ 1]) + good[21:],
        "stale": (a / old).read_bytes(),
        "another artifact": (b / b"tables".decode() / Path(old).name).read_bytes(),
    }
    want = {
        "torn": "torn",
        "foreign": "not a pstore row file",
        "header": "CRC-32",
        "stale": "written by generation 1",
        "another artifact": "another artifact",
    }
    for case, data in cases.items():
        path.write_bytes(data)
        m = reopened(a)
        with pytest.raises(pstore.CorruptError) as e:
            m.lookup("user", [1, 2, 3])
        assert str(path) in str(e.value) and want[case] in str(e.value), (case, str(e.value))
        m.close()
        del m
    path.write_bytes(good)
    m = reopened(a)
    assert_artifact_is(m, chain.states[1], chain.universe)
    # Ids of the wrong dtype name the argument.
    with pytest.raises(pstore.DtypeError, match="ids"):
        m.lookup("user", np.array([1.5, 2.0]))
    with pytest.raises(pstore.DtypeError, match="ids"):
        m.lookup("user", np.array([1, 2], dtype=np.int32))
    with pytest.raises(pstore.DtypeError, match="ids"):
        m.contains("user", np.array(["1"]))
    m.close()


# --- 8. the model server --------------------------------------------------------------------


def test_model_server_answers_lookups_and_refuses_writes(chain, tmp_path):
    root = tmp_path / "snapshots"
    root.mkdir()
    for k in (0, 1):
        shutil.copytree(chain.snaps[k], root / f"snap-{k}")
    out = tmp_path / "m"
    serving.export(root / "snap-1", out)
    model = ServingStore(out)  # read-only: another process applies snapshots
    srv = model.serve(token="write-secret", read_token="read-secret", metrics_port=0)
    open_srv = None
    try:
        assert isinstance(srv, serving.ModelServer) and srv.running
        c = pstore.connect([srv.address], "read-secret", timeout=10.0)
        assert c.tables() == ["bias", "item", "late", "user"]
        have, rows = chain.states[1]["user"]
        missing = chain.new_ids("user", 100)
        ids = np.concatenate([have, missing])
        user = c.table("user")
        assert isinstance(user, pstore.SparseTable) and user.dim == 8
        got = user.pull(ids)
        np.testing.assert_array_equal(got, model.lookup("user", ids, default="initial"))
        np.testing.assert_array_equal(got[: len(have)], rows)
        np.testing.assert_array_equal(got[len(have) :], chain.t("user").initial_rows(missing))
        np.testing.assert_array_equal(c.table("bias").pull(), chain.states[1]["bias"])
        item_ids, item_rows = chain.states[1]["item"]
        np.testing.assert_array_equal(c.table("item").pull(item_ids), item_rows)
        np.testing.assert_array_equal(c.table("item").contains(item_ids), True)
        assert not c.table("item").contains(missing).any()

        # Every write is refused, with the read token and the write token alike.
        w = pstore.connect([srv.address], "write-secret", timeout=10.0)
        for client in (c, w):
            writes = (
                lambda cl: cl.table("user").push(have[:2], np.ones((2, 8), F32)),
                lambda cl: cl.table("user").remove(have[:2]),
                lambda cl: cl.table("bias").push(np.ones((2, 3), F32)),
                lambda cl: cl.create_sparse_table("new", 4, optimizer=optim.SGD(lr=0.1)),
                lambda cl: cl.drop_table("user"),
            )
            for write in writes:
                with pytest.raises(pstore.PstoreError, match="read-only"):
                    write(client)
        np.testing.assert_array_equal(user.pull(have), rows)
        assert model.tables() == ["bias", "item", "late", "user"]
        for token in ("wrong", None):
            with pytest.raises(pstore.AuthenticationError):
                pstore.connect([srv.address], token, timeout=10.0, retries=0).table("user").pull(
                    have[:3]
                )

        (status,) = c.status()
        assert [t["name"] for t in status["tables"]] == ["bias", "item", "late", "user"]
        assert {t["name"]: t["rows"] for t in status["tables"]}["user"] == len(have)

        def metrics() -> str:
            url = f"http://127.0.0.1:{srv.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=10) as r:
                return r.read().decode()

        text = metrics()
        assert "pstore_model_lag_seconds" in text
        assert "pstore_model_generation 2" in text

        # Another process applies snapshot 2 while the server serves: it answers the new rows.
        shutil.copytree(chain.snaps[2], root / "snap-2")
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from pstore import serving; "
                "print(serving.follow(sys.argv[1], sys.argv[2], once=True))",
                str(root),
                str(out),
            ],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == "1"
        have2, rows2 = chain.states[2]["user"]
        np.testing.assert_array_equal(c.table("user").pull(have2), rows2)
        gone = np.setdiff1d(chain.removed[2]["user"], have2)
        np.testing.assert_array_equal(
            c.table("user").pull(gone), chain.t("user").initial_rows(gone)
        )
        assert c.tables() == ["bias", "late", "user"]
        with pytest.raises(pstore.UnknownTableError):
            c.table("item")
        np.testing.assert_array_equal(c.table("bias").pull(), chain.states[2]["bias"])
        assert "pstore_model_generation 3" in metrics()
        assert model.generation == 3

        # Without tokens, and with zeros for ids the artifact lacks.
        open_srv = model.serve(default="zeros")
        anon = pstore.connect([open_srv.address], timeout=10.0)
        got = anon.table("user").pull(np.concatenate([have2[:50], missing]))
        np.testing.assert_array_equal(got[:50], rows2[:50])
        np.testing.assert_array_equal(got[50:], 0.0)
        with pytest.raises(pstore.PstoreError, match="read-only"):
            anon.table("user").push(have2[:1], np.ones((1, 8), F32))
    finally:
        srv.stop(grace=1.0)
        if open_srv is not None:
            open_srv.stop(grace=1.0)
    assert not srv.running


# The model server's batch boundaries: a lookup of 2048 ids or more is split over the rayon pool
# in parts of at most 512 (serving/mod.rs); a pull of more than 8192 ids runs on the blocking
# pool, not the runtime's thread (server/model.rs).
PARALLEL_IDS, INLINE_IDS = 2048, 8192


def rows_port_of(rows: bool) -> dict:
    """The serve() arguments of a model server with a rows port (any free one) or without."""
    return {"rows_port": 0} if rows else {}


@pytest.mark.parametrize("via_rows", [False, True], ids=["grpc", "rows-port"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
def test_model_server_pulls_are_lookups_at_every_batch_size(chain, tmp_path, dtype, via_rows):
    """A pull's rows are looked up straight into the buffer sent to the socket (server/model.rs,
    net/splice.rs; on the rows port server/rows.rs): every batch, whatever its size against the
    server's boundaries, with known, unknown and repeated ids in any order, gets exactly the
    in-process lookup's rows, for every dtype of artifact and wire."""
    serving.export(chain.snaps[1], tmp_path / "m", dtype=dtype)
    model = ServingStore(tmp_path / "m")
    have = chain.states[1]["user"][0]
    missing = chain.new_ids("user", 300)
    pool = np.concatenate([have, missing])
    rng = np.random.default_rng(35)
    sizes = [1, 511, 513, PARALLEL_IDS - 1, PARALLEL_IDS, PARALLEL_IDS + 1, INLINE_IDS]
    sizes += [INLINE_IDS + 1, 40_000, 0]
    servers = {d: model.serve(default=d, **rows_port_of(via_rows)) for d in ("initial", "zeros")}
    try:
        for default, srv in servers.items():
            c = pstore.connect([srv.address], timeout=30.0)
            half = pstore.connect([srv.address], timeout=30.0, wire_dtype="float16")
            for n in sizes:
                ids = rng.choice(pool, n)
                want = model.lookup("user", ids, default=default)
                got = c.table("user").pull(ids)
                assert got.dtype == F32 and got.shape == (n, 8)
                np.testing.assert_array_equal(got, want, err_msg=f"{default}, {n} ids")
                # float16 on the wire: the same rows, rounded.
                np.testing.assert_array_equal(
                    half.table("user").pull(ids),
                    want.astype(np.float16).astype(F32),
                    err_msg=f"{default}, {n} ids, float16 wire",
                )
            # Every id the artifact has, in id order and reversed, in one batch.
            for ids in (have, have[::-1].copy()):
                many = np.tile(ids, -(-(INLINE_IDS + 5) // len(ids)))
                np.testing.assert_array_equal(
                    c.table("user").pull(many), model.lookup("user", many, default=default)
                )
            # A client whose message limit splits a batch into requests: on the rows port they
            # go one after the other on one connection, each into its part of the output.
            small = pstore.connect([srv.address], timeout=30.0, max_message=1 << 16)
            for n in (0, 1, 1433, 1434, 5000):
                ids = rng.choice(pool, n)
                np.testing.assert_array_equal(
                    small.table("user").pull(ids), model.lookup("user", ids, default=default)
                )
            # The pulls went over the rows port when the server has one (the clients keep
            # their connections to it).
            if via_rows:
                assert srv.rows_port
                assert rows_port_clients(srv.rows_port) >= 3
            else:
                assert srv.rows_port is None
    finally:
        for srv in servers.values():
            srv.stop(grace=1.0)
    model.close()


@pytest.mark.parametrize("via_rows", [False, True], ids=["grpc", "rows-port"])
def test_model_server_pull_of_a_damaged_row_fails_and_the_server_goes_on(chain, tmp_path, via_rows):
    """A damaged row anywhere in a pull, small or big, fails the pull with CorruptError naming
    the id, never a wrong row; the server answers the next pulls."""
    serving.export(chain.snaps[0], tmp_path / "m")
    probe = ServingStore(tmp_path / "m")
    info = next(t for t in probe.info()["tables"] if t["name"] == "user")
    have = chain.states[0]["user"][0]
    rows = probe.lookup("user", have)
    probe.close()
    del probe
    path = tmp_path / "m" / info["index"]["file"]
    bad = int(have[len(have) // 2])
    _, at, _ = find_row(path, bad)
    assert at is not None
    data = bytearray(path.read_bytes())
    data[at + 3] ^= 0x5A
    path.write_bytes(bytes(data))
    good = have[have != bad]

    model = ServingStore(tmp_path / "m")
    srv = model.serve(**rows_port_of(via_rows))
    try:
        c = pstore.connect([srv.address], timeout=30.0)
        user = c.table("user")
        for n, where in ((PARALLEL_IDS, 0), (PARALLEL_IDS, 1500), (INLINE_IDS + 9, INLINE_IDS)):
            filler = np.resize(good, n)
            ids = filler.copy()
            ids[where] = bad
            with pytest.raises(pstore.CorruptError, match=f"id {bad}"):
                user.pull(ids)
            # The server goes on: the next pull, big or small, is answered in full.
            got = user.pull(filler)
            np.testing.assert_array_equal(got, np.resize(rows[have != bad], (n, 8)))
            np.testing.assert_array_equal(user.pull(good[:5]), rows[have != bad][:5])
        # A small pull of the damaged row fails the same way.
        with pytest.raises(pstore.CorruptError, match=f"id {bad}"):
            user.pull(np.array([bad], dtype=np.uint64))
    finally:
        srv.stop(grace=1.0)
    model.close()


@pytest.mark.parametrize("via_rows", [False, True], ids=["grpc", "rows-port"])
def test_model_server_refuses_bad_pulls_and_goes_on(chain, tmp_path, via_rows):
    serving.export(chain.snaps[0], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    srv = model.serve(max_message=1 << 20, **rows_port_of(via_rows))
    try:
        c = pstore.connect([srv.address], timeout=30.0)
        have = chain.states[0]["user"][0]
        # An answer over the server's message limit: refused before any row is read.
        with pytest.raises(pstore.PstoreError, match="message limit"):
            c.table("user").pull(np.resize(have, (1 << 20) // 32 + 1))
        with pytest.raises(pstore.UnknownTableError):
            c.table("nope")
        big = np.resize(have, INLINE_IDS + 3)
        np.testing.assert_array_equal(c.table("user").pull(big), model.lookup("user", big))
    finally:
        srv.stop(grace=1.0)
    model.close()


def test_rows_port_speaks_its_framing_and_survives_any_request(chain, tmp_path):
    """The rows port as docs/PROTOCOL.md describes it, spoken from a plain socket: rows exactly
    the lookup's; a request it can still frame but not answer (unknown table, bad dtype, no or a
    wrong token) gets the gRPC path's status and the connection goes on; one it cannot frame (a
    foreign protocol, a name or token over the limits, ids over the message limit) gets an error
    and its connection closed; requests cut anywhere or dropped halfway leave the server
    answering."""
    import socket

    serving.export(chain.snaps[1], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    srv = model.serve(rows_port=0, read_token="rt", max_message=1 << 20)
    addr = ("127.0.0.1", srv.rows_port)
    have = chain.states[1]["user"][0]
    ids = np.concatenate([have, chain.new_ids("user", 7), have[:3]])
    want = model.lookup("user", ids, default="initial")
    try:
        with socket.create_connection(addr, timeout=30) as s:
            for _ in range(2):  # the connection takes call after call
                s.sendall(rows_request("user", ids, "rt"))
                code, dtype, dim, gen, body = rows_answer(s)
                assert (code, dtype, dim, gen) == (0, 0, 8, model.generation)
                np.testing.assert_array_equal(np.frombuffer(body, "<f4").reshape(-1, 8), want)
            # float16 on the wire.
            s.sendall(rows_request("user", ids, "rt", dtype=1))
            code, dtype, dim, _, body = rows_answer(s)
            assert (code, dtype, dim) == (0, 1, 8)
            np.testing.assert_array_equal(
                np.frombuffer(body, "<f2").astype(F32).reshape(-1, 8),
                want.astype(np.float16).astype(F32),
            )
            # Answered with the gRPC path's status; the connection goes on.
            for req, code, words in (
                (rows_request("nope", ids, "rt"), 5, "nope"),
                (rows_request("user", ids, "rt", dtype=7), 3, "dtype"),
                (rows_request("user", ids), 16, "needs a token"),
                (rows_request("user", ids, "wrong"), 16, "wrong token"),
                (rows_request("user", np.resize(have, (1 << 20) // 32 + 1), "rt"), 3, "limit"),
                # A push (a call), which only a store server's port takes.
                (
                    _rows.call_request(_rows.push_message("user", have[:2], np.ones(16)), "rt"),
                    12,
                    "pulls only",
                ),
            ):
                # Sent a byte at a time for one of them: framing does not depend on the cuts.
                if code == 5:
                    for b in req:
                        s.send(bytes([b]))
                else:
                    s.sendall(req)
                got, _, _, _, body = rows_answer(s)
                assert got == code, (code, error_text(body))
                assert words in error_text(body)[0]
            s.sendall(rows_request("user", ids[:5], "rt"))
            assert rows_answer(s)[0] == 0
        # Not framable: an error, then the connection is closed.
        for req, words in (
            (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "not a pstore rows request"),
            (rows_request("user", ids, "rt", magic=b"PSq3"), "not a pstore rows request"),
            # PSq2's 8 more bytes of head are the name's and the token's: not a head.
            (rows_request("user", ids, "rt", magic=b"PSq2"), "reserved word"),
            (RQ_HEAD.pack(b"PSq1", 0, 1 << 20, 0, 1), "table name"),
            (RQ_HEAD.pack(b"PSq1", 0, 4, 1 << 30, 1), "token"),
            (RQ_HEAD.pack(b"PSq1", 0, 4, 2, 1 << 40), "too large"),
        ):
            with socket.create_connection(addr, timeout=30) as s:
                s.sendall(req)
                code, _, _, _, body = rows_answer(s)
                assert code != 0 and words in error_text(body)[0], error_text(body)
                assert closed(s)
        # Dropped halfway through a request, or silent: the server goes on.
        with socket.create_connection(addr, timeout=30) as s:
            s.sendall(rows_request("user", ids, "rt")[:40])
        with socket.create_connection(addr, timeout=30):
            pass
        c = pstore.connect([srv.address], "rt", timeout=30.0)
        np.testing.assert_array_equal(c.table("user").pull(ids), want)
        # Stopping the server closes the rows port's connections.
        s = socket.create_connection(addr, timeout=30)
        s.sendall(rows_request("user", ids[:1], "rt"))
        assert rows_answer(s)[0] == 0
    finally:
        srv.stop(grace=1.0)
    assert closed(s)
    s.close()
    model.close()


def test_rows_port_clients_share_it_and_fall_back_to_grpc_when_it_goes(chain, tmp_path):
    """Threads pulling at once through one client each get exact rows over the rows port; when
    the server comes back on its gRPC port without a rows port, the client's kept connection is
    dead and the port refused, and its pulls go over gRPC, still exact."""
    serving.export(chain.snaps[1], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    have = chain.states[1]["user"][0]
    rng = np.random.default_rng(120)
    batches = [rng.choice(have, n) for n in (1, 256, 4096, 3000) * 5]
    wants = [model.lookup("user", b, default="initial") for b in batches]
    srv = model.serve(rows_port=0)
    port, rows_port = srv.port, srv.rows_port
    c = pstore.connect([srv.address], timeout=30.0)
    user = c.table("user")
    errors: list[BaseException] = []

    def pull_all() -> None:
        try:
            for b, w in zip(batches, wants, strict=True):
                np.testing.assert_array_equal(user.pull(b), w)
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=pull_all) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        assert rows_port_clients(rows_port) >= 1
    finally:
        srv.stop(grace=1.0)
    again = model.serve(port=port)
    try:
        assert again.rows_port is None
        for b, w in zip(batches, wants, strict=True):
            np.testing.assert_array_equal(user.pull(b), w)
        assert rows_port_clients(rows_port) == 0
    finally:
        again.stop(grace=1.0)
    model.close()


def test_rows_port_settings_are_checked(chain, tmp_path):
    serving.export(chain.snaps[0], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    with pytest.raises(pstore.InvalidArgumentError, match="rows_port"):
        model.serve(rows_port=70000)
    (tmp_path / "c.pem").write_text("not read")
    with pytest.raises(pstore.InvalidArgumentError, match="TLS"):
        model.serve(rows_port=0, tls_cert=tmp_path / "c.pem", tls_key=tmp_path / "c.pem")
    busy = model.serve(rows_port=0)
    try:
        # A port in use: refused, naming it.
        with pytest.raises(pstore.InvalidArgumentError, match="rows port"):
            model.serve(rows_port=busy.rows_port)
    finally:
        busy.stop(grace=1.0)
    model.close()


def test_model_server_contains_before_any_pull(chain, tmp_path):
    serving.export(chain.snaps[2], tmp_path / "m")
    srv = ServingStore(tmp_path / "m").serve()
    try:
        c = pstore.connect([srv.address], timeout=10.0)
        have = chain.states[2]["late"][0]
        np.testing.assert_array_equal(c.table("late").contains(have), True)
    finally:
        srv.stop(grace=1.0)


def test_model_server_status_names_its_role_and_artifact(chain, tmp_path):
    serving.export(chain.snaps[2], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    srv = model.serve()
    try:
        (status,) = pstore.connect([srv.address], timeout=10.0).status()
        assert status["durability"] == "read-only"
        assert status["role"] == "model"
        assert status["model"]["snapshot"]["id"] == chain.manifests[2]["id"]
        assert status["model"]["generation"] == model.generation == 3
        assert status["model"]["dtype"] == "float32"
    finally:
        srv.stop(grace=1.0)


def test_model_server_arguments_are_checked(chain, tmp_path):
    serving.export(chain.snaps[0], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    with pytest.raises(pstore.InvalidArgumentError):
        model.serve(default="random")
    with pytest.raises(pstore.InvalidArgumentError):
        model.serve(token="")
    with pytest.raises(pstore.InvalidArgumentError):
        model.serve(port=70000)
    with pytest.raises(pstore.InvalidArgumentError, match="no serving artifact"):
        ServingStore(chain.snaps[0])  # a snapshot, not an artifact
    srv = model.serve(default=np.full(8, 2.0, F32))
    try:
        c = pstore.connect([srv.address], timeout=10.0)
        np.testing.assert_array_equal(c.table("user").pull(chain.new_ids("user", 3)), 2.0)
    finally:
        srv.stop(grace=1.0)


def test_model_server_with_only_a_read_token_guards_reads(chain, tmp_path):
    """Unlike a store server, a model server takes a read token alone (every write is refused
    anyway): calls need it."""
    serving.export(chain.snaps[0], tmp_path / "m")
    model = ServingStore(tmp_path / "m")
    srv = model.serve(read_token="only-read")
    try:
        ids, rows = chain.states[0]["user"]
        c = pstore.connect([srv.address], "only-read", timeout=10.0)
        np.testing.assert_array_equal(c.table("user").pull(ids), rows)
        with pytest.raises(pstore.PstoreError, match="read-only"):
            c.table("user").push(ids[:1], np.ones((1, 8), F32))
        for token in (None, "wrong"):
            with pytest.raises(pstore.AuthenticationError):
                pstore.connect([srv.address], token, timeout=10.0, retries=0).table("user").pull(
                    ids[:1]
                )
    finally:
        srv.stop(grace=1.0)
    with pytest.raises(pstore.InvalidArgumentError):
        pstore.server.Server(pstore.Store(), read_token="only-read")  # a store server: refused


# --- 9. the CLI -----------------------------------------------------------------------------


def test_cli_export_then_follow(chain, tmp_path):
    root = tmp_path / "snapshots"
    root.mkdir()
    shutil.copytree(chain.snaps[0], root / "snap-0")
    out = tmp_path / "m"
    done = run_cli(
        "export", root / "snap-0", "--out", out, "--dtype", "float16", "--tables", "user", "--quiet"
    )
    assert done.returncode == 0, done.stderr
    assert "float16" in done.stdout
    model = ServingStore(out)
    assert model.dtype == "float16" and model.tables() == ["user"]
    ids, rows = chain.states[0]["user"]
    got = model.lookup("user", ids)
    assert (np.abs(got - rows) <= np.abs(rows) * 2.0**-11 + 2.0**-24).all()
    model.close()
    del model

    for k in (1, 2):
        shutil.copytree(chain.snaps[k], root / f"snap-{k}")
    done = run_cli("serving", "follow", root, "--model", out, "--once")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("event=applied") == 2, done.stderr
    model = ServingStore(out)
    assert model.generation == 3 and model.info()["snapshot"]["id"] == chain.manifests[2]["id"]
    assert model.tables() == ["user"]  # the selection holds: late is not added
    ids, rows = chain.states[2]["user"]
    got = model.lookup("user", ids)
    assert (np.abs(got - rows) <= np.abs(rows) * 2.0**-11 + 2.0**-24).all()
    assert not model.contains("user", np.setdiff1d(chain.removed[2]["user"], ids)).any()

    # Nothing more to apply: still exit 0.
    again = run_cli("serving", "follow", root, "--model", out, "--once")
    assert again.returncode == 0 and "event=applied" not in again.stderr, again.stderr


def test_cli_rejects_a_bad_dtype_and_bad_paths(chain, tmp_path):
    bad = run_cli("export", chain.snaps[0], "--out", tmp_path / "m", "--dtype", "float64")
    assert bad.returncode != 0
    assert "float64" in bad.stderr and "dtype" in bad.stderr, bad.stderr
    assert not (tmp_path / "m").exists()
    nowhere = run_cli("export", tmp_path / "nowhere", "--out", tmp_path / "m2", "--quiet")
    assert nowhere.returncode != 0 and nowhere.stderr.strip(), nowhere.stderr
    assert not (tmp_path / "m2").exists()
    no_model = run_cli("serving", "follow", chain.root, "--model", tmp_path / "none", "--once")
    assert no_model.returncode != 0 and "no serving artifact" in no_model.stderr, no_model.stderr
    # One writer at a time: while this process holds the artifact writable, another is refused.
    serving.export(chain.snaps[0], tmp_path / "held")
    held = ServingStore(tmp_path / "held", writable=True)
    try:
        busy = run_cli("serving", "follow", chain.root, "--model", tmp_path / "held", "--once")
        assert busy.returncode != 0 and "another process" in busy.stderr, busy.stderr
        assert held.generation == 1
    finally:
        held.close()


def test_cli_serve_model_follows_and_stops_on_sigterm(chain, tmp_path):
    root = tmp_path / "snapshots"
    root.mkdir()
    shutil.copytree(chain.snaps[0], root / "snap-0")
    out = tmp_path / "m"
    assert run_cli("export", root / "snap-0", "--out", out, "--quiet").returncode == 0
    port, metrics_port, rows_port = free_port(), free_port(), free_port()
    log = tmp_path / "server.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pstore",
                "serve-model",
                str(out),
                "--port",
                str(port),
                "--metrics-port",
                str(metrics_port),
                "--default",
                "zeros",
                "--follow",
                str(root),
                "--interval",
                "0.1",
                "--log-interval",
                "0",
                "--rows-port",
                str(rows_port),
            ],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=child_env(),
        )
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                c = pstore.connect([f"127.0.0.1:{port}"], timeout=2.0, retries=0)
                break
            except pstore.ServerError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        ids, rows = chain.states[0]["user"]
        missing = chain.new_ids("user", 20)
        np.testing.assert_array_equal(c.table("user").pull(ids), rows)
        np.testing.assert_array_equal(c.table("user").pull(missing), 0.0)
        with pytest.raises(pstore.PstoreError, match="read-only"):
            c.table("user").push(ids[:1], np.ones((1, 8), F32))

        for k in (1, 2):
            shutil.copytree(chain.snaps[k], root / f".tmp-{k}")
            os.rename(root / f".tmp-{k}", root / f"snap-{k}")
        ids2, rows2 = chain.states[2]["user"]
        deadline = time.monotonic() + 30
        while not np.array_equal(c.table("user").pull(ids2), rows2):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        assert c.tables() == ["bias", "late", "user"]
        # The pulls, new snapshots' rows included, came over the rows port.
        assert rows_port_clients(rows_port) >= 1
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert "pstore_model_generation 3" in r.read().decode()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = log.read_text()
    assert code == 0, text
    assert "event=serving" in text and f"address=127.0.0.1:{port}" in text, text
    assert f"rows_port={rows_port}" in text, text
    assert text.count("event=applied") == 2, text
    assert "event=stopped" in text, text


def test_progress_reports_the_snapshots_of_the_chain(chain, tmp_path):
    seen: list[int] = []
    info = serving.export(chain.snaps[2], tmp_path / "m", progress=seen.append)
    assert seen and seen[-1] == info["chain"] == 3
    assert seen == sorted(seen)
    assert set(serving.DTYPES) == {"float32", "float16", "int8"}
