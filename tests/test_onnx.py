"""ONNX export of serving artifacts: lookups (pstore.serving.onnx) and the demo's matrix
factorisation (pstore.apps.mf_onnx) run by ONNX Runtime."""

import os
import subprocess
import sys

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import pstore  # noqa: E402
from pstore import init, optim, serving  # noqa: E402
from pstore.apps.mf_onnx import export_mf_onnx  # noqa: E402
from pstore.serving.onnx import export_onnx  # noqa: E402

F32 = np.float32
U64_MAX = np.iinfo(np.uint64).max
DTYPES = ("float32", "float16", "int8")
SPARSE = {"d1": 1, "d8": 8, "d33": 33, "empty": 4}
MF = {"user_emb": 16, "item_emb": 16, "user_bias": 1, "item_bias": 1}
EDGE_IDS = [0, 1, 2**63 - 1, 2**63, 2**63 + 5, 2**64 - 2, 2**64 - 1]
MU = 3.5


def u64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.uint64)


def session(path):
    return ort.InferenceSession(os.fspath(path), providers=["CPUExecutionProvider"])


def run(sess, feeds: dict) -> dict:
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def assert_same(got: np.ndarray, want: np.ndarray) -> None:
    """Equal, dtype and shape included, and bit for bit."""
    assert got.dtype == want.dtype == F32
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A snapshot of a trained store and its artifacts in every dtype; returns
    ``(snapshot_dir, {dtype: artifact_dir}, {table: ids})``."""
    root = tmp_path_factory.mktemp("onnx")
    rng = np.random.default_rng(20240611)
    store = pstore.Store(num_shards=2, threads=2)
    known = {}
    for name, dim in {**SPARSE, **MF}.items():
        t = store.create_sparse_table(
            name, dim, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(0.0, 0.3), seed=7
        )
        if name == "empty":
            known[name] = u64([])
            continue
        ids = np.unique(rng.integers(0, U64_MAX, size=300, dtype=np.uint64, endpoint=True))
        ids = np.union1d(ids, u64(EDGE_IDS))
        for _ in range(3):
            t.push(ids, rng.standard_normal((len(ids), dim)).astype(F32))
        known[name] = ids
    gm = store.create_dense_table("global_mean", 1, optimizer=optim.SGD(lr=1.0))
    gm.push(np.array([-MU], F32))
    w = store.create_dense_table("w", (2, 3), initializer=init.Normal(0.0, 1.0))
    w.push(np.ones((2, 3), F32))
    snap = root / "snap"
    store.snapshot(snap)
    artifacts = {}
    for dtype in DTYPES:
        artifacts[dtype] = root / f"model-{dtype}"
        serving.export(snap, artifacts[dtype], dtype=dtype)
    return snap, artifacts, known


def queries(rng: np.random.Generator, known: np.ndarray) -> dict[str, np.ndarray]:
    """Batches of uint64 ids: known, unknown, duplicated, mixed, one, empty."""
    unknown = rng.integers(0, U64_MAX, size=50, dtype=np.uint64, endpoint=True)
    unknown = np.setdiff1d(unknown, known)
    some = rng.permutation(known)[:40] if len(known) else u64([])
    mixed = rng.permutation(np.concatenate([some, unknown[:20], u64(EDGE_IDS)]))
    return {
        "known": rng.permutation(known),
        "unknown": unknown,
        "duplicates": np.concatenate([some[:5], some[:5], unknown[:3], unknown[:3], some[:1]]),
        "mixed": mixed,
        "one": mixed[:1],
        "empty": u64([]),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_lookups_equal_the_serving_store(world, tmp_path, dtype):
    _, artifacts, known = world
    rng = np.random.default_rng(1)
    out = tmp_path / "tables.onnx"
    info = export_onnx(artifacts[dtype], out)
    assert info["path"] == os.path.abspath(out)
    assert info["external_data"] is False
    assert info["bytes"] == out.stat().st_size
    assert not (tmp_path / "tables.onnx.data").exists()
    assert sorted(os.listdir(tmp_path)) == ["tables.onnx"]  # no staging leftovers
    onnx.checker.check_model(os.fspath(out))

    model = serving.ServingStore(artifacts[dtype])
    entries = {e["name"]: e for e in info["tables"]}
    assert set(entries) == set(model.tables())
    for name, dim in {**SPARSE, **MF}.items():
        assert entries[name] == {
            "name": name,
            "kind": "sparse",
            "dtype": dtype,
            "dim": dim,
            "rows": len(known[name]),
            "input": f"{name}_ids",
            "output": name,
        }
    assert entries["w"]["kind"] == "dense" and entries["w"]["input"] is None

    sess = session(out)
    inputs = {i.name: i for i in sess.get_inputs()}
    assert set(inputs) == {f"{t}_ids" for t in {**SPARSE, **MF}}
    assert all(i.type == "tensor(int64)" for i in inputs.values())
    outputs = {o.name: o for o in sess.get_outputs()}
    assert outputs["d33"].type == "tensor(float)" and outputs["d33"].shape == ["N_d33", 33]

    for batch, ids in queries(rng, known["d33"]).items():
        feeds = {name: np.empty(0, np.int64) for name in inputs}
        for t in {**SPARSE, **MF}:
            feeds[f"{t}_ids"] = ids.view(np.int64)
        got = run(sess, feeds)
        for t, dim in {**SPARSE, **MF}.items():
            want = model.lookup(t, ids, default="zeros")
            assert want.shape == (len(ids), dim), batch
            assert_same(got[t], want)
        assert_same(got["w"], model.dense("w"))
        assert_same(got["global_mean"], model.dense("global_mean"))
    # The known ids of each table, all at once.
    feeds = {f"{t}_ids": known[t].view(np.int64) for t in {**SPARSE, **MF}}
    got = run(sess, feeds)
    for t in {**SPARSE, **MF}:
        assert_same(got[t], model.rows(t)[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_default_row(world, tmp_path, dtype):
    _, artifacts, known = world
    rng = np.random.default_rng(2)
    row = (np.arange(8, dtype=F32) / 3 + F32(0.1)).astype(F32)  # not exact in float16 or int8
    info = export_onnx(artifacts[dtype], tmp_path / "d8.onnx", tables=["d8"], default=row)
    assert [e["name"] for e in info["tables"]] == ["d8"]
    sess = session(info["path"])
    assert [i.name for i in sess.get_inputs()] == ["d8_ids"]
    assert [o.name for o in sess.get_outputs()] == ["d8"]
    model = serving.ServingStore(artifacts[dtype])
    for ids in queries(rng, known["d8"]).values():
        (got,) = sess.run(None, {"d8_ids": ids.view(np.int64)})
        assert_same(got, model.lookup("d8", ids, default=row))
    unknown = u64([12345, 2**63 + 12345])
    (got,) = sess.run(None, {"d8_ids": unknown.view(np.int64)})
    assert_same(got, np.stack([row, row]))
    # An empty table: every id gets the default row.
    info = export_onnx(artifacts[dtype], tmp_path / "e.onnx", tables=["empty"], default=row[:4])
    (got,) = session(info["path"]).run(None, {"empty_ids": u64([0, 5, 5]).view(np.int64)})
    assert_same(got, np.stack([row[:4]] * 3))


def test_bad_defaults_are_refused(world, tmp_path):
    _, artifacts, _ = world
    out = tmp_path / "m.onnx"
    with pytest.raises(pstore.InvalidArgumentError, match="initial"):
        export_onnx(artifacts["float32"], out, default="initial")
    with pytest.raises(pstore.InvalidArgumentError, match="default"):
        export_onnx(artifacts["float32"], out, default="ones")
    with pytest.raises(pstore.ShapeError, match="d8"):
        export_onnx(artifacts["float32"], out, tables=["d8"], default=np.zeros(7, F32))
    with pytest.raises(pstore.ShapeError):  # one row, tables of several dims
        export_onnx(artifacts["float32"], out, default=np.zeros(8, F32))
    with pytest.raises(pstore.DtypeError):
        export_onnx(artifacts["float32"], out, tables=["d8"], default=np.zeros(8))
    assert os.listdir(tmp_path) == []


def test_bad_arguments_are_refused(world, tmp_path):
    snap, artifacts, _ = world
    out = tmp_path / "m.onnx"
    with pytest.raises(pstore.UnknownTableError):
        export_onnx(artifacts["float32"], out, tables=["d8", "nope"])
    with pytest.raises(pstore.UnknownTableError):
        export_onnx(snap, out, tables=["nope"])
    with pytest.raises(pstore.InvalidArgumentError, match="no tables"):
        export_onnx(artifacts["float32"], out, tables=[])
    with pytest.raises(pstore.InvalidArgumentError, match="neither"):
        export_onnx(tmp_path, out)
    with pytest.raises(pstore.InvalidArgumentError, match="external_data_threshold"):
        export_onnx(artifacts["float32"], out, external_data_threshold=-1)
    assert os.listdir(tmp_path) == []


def test_names_that_collide_are_refused(tmp_path):
    store = pstore.Store()
    store.create_sparse_table("a", 2).push(u64([1]), np.ones((1, 2), F32))
    store.create_sparse_table("a_ids", 2)
    store.snapshot(tmp_path / "snap")
    with pytest.raises(pstore.InvalidArgumentError, match="a_ids"):
        export_onnx(tmp_path / "snap", tmp_path / "m.onnx")
    info = export_onnx(tmp_path / "snap", tmp_path / "m.onnx", tables=["a"])
    (got,) = session(info["path"]).run(None, {"a_ids": np.array([1, 2], np.int64)})
    assert got.shape == (2, 2) and np.all(got[1] == 0) and np.all(got[0] != 0)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_external_data(world, tmp_path, dtype):
    _, artifacts, known = world
    out = tmp_path / "big.onnx"
    info = export_onnx(artifacts[dtype], out, tables=["d33", "d1", "w"], external_data_threshold=1)
    data = tmp_path / "big.onnx.data"
    assert info["external_data"] is True
    assert data.exists() and data.stat().st_size > len(known["d33"]) * 33
    assert info["bytes"] == out.stat().st_size + data.stat().st_size
    assert sorted(os.listdir(tmp_path)) == ["big.onnx", "big.onnx.data"]
    onnx.checker.check_model(os.fspath(out))
    # The id maps stay in the model file; the rows moved out.
    assert out.stat().st_size < data.stat().st_size
    sess = session(out)
    model = serving.ServingStore(artifacts[dtype])
    ids = np.concatenate([known["d33"][::3], u64([42, 2**64 - 1, 7])])
    got = run(sess, {"d33_ids": ids.view(np.int64), "d1_ids": ids.view(np.int64)})
    assert_same(got["d33"], model.lookup("d33", ids))
    assert_same(got["d1"], model.lookup("d1", ids))
    assert_same(got["w"], model.dense("w"))
    # Exported again in place: the data file is replaced, not appended to.
    again = export_onnx(artifacts[dtype], out, tables=["d33", "d1", "w"], external_data_threshold=1)
    assert again["bytes"] == info["bytes"]
    got = run(session(out), {"d33_ids": ids.view(np.int64), "d1_ids": np.empty(0, np.int64)})
    assert_same(got["d33"], model.lookup("d33", ids))
    assert got["d1"].shape == (0, 1)


def test_export_from_a_snapshot(world, tmp_path):
    snap, artifacts, known = world
    info = export_onnx(snap, tmp_path / "snap.onnx", tables=["d33", "w"])
    assert [e["name"] for e in info["tables"]] == ["d33", "w"]
    assert info["tables"][0]["dtype"] == "float32"
    model = serving.ServingStore(artifacts["float32"])
    ids = np.concatenate([known["d33"], u64([3, 2**63 + 3])])
    got = run(session(info["path"]), {"d33_ids": ids.view(np.int64)})
    assert_same(got["d33"], model.lookup("d33", ids))
    assert_same(got["w"], model.dense("w"))
    assert sorted(os.listdir(tmp_path)) == ["snap.onnx"]


def test_cli_export_onnx(world, tmp_path):
    """`pstore export-onnx` writes a model that onnxruntime reads and that `onnx.checker`
    accepts; a bad source exits with an error message."""
    _snap, artifacts, known = world
    out = tmp_path / "cli.onnx"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pstore",
            "export-onnx",
            str(artifacts["int8"]),
            "--out",
            str(out),
            "--tables",
            "d33",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "1 table(s)" in r.stdout
    ids = known["d33"][:50]
    got = run(session(str(out)), {"d33_ids": ids.view(np.int64)})
    assert_same(got["d33"], serving.ServingStore(artifacts["int8"]).lookup("d33", ids))
    r = subprocess.run(
        [sys.executable, "-m", "pstore", "export-onnx", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and "pstore: error" in r.stderr


def mf_reference(model, users, items, *, mu=None, biases=True, clip=None) -> np.ndarray:
    p = model.lookup("user_emb", users).astype(np.float64)
    q = model.lookup("item_emb", items).astype(np.float64)
    r = np.full(len(users), float(model.dense("global_mean")[0]) if mu is None else mu)
    if biases:
        r += model.lookup("user_bias", users)[:, 0] + model.lookup("item_bias", items)[:, 0]
    r += (p * q).sum(axis=1)
    return r if clip is None else np.clip(r, *clip)


@pytest.mark.parametrize("dtype", DTYPES)
def test_matrix_factorisation(world, tmp_path, dtype):
    snap, artifacts, known = world
    rng = np.random.default_rng(3)
    model = serving.ServingStore(artifacts[dtype])
    users = np.concatenate(
        [rng.choice(known["user_emb"], 200), u64([5, 2**64 - 1, 2**63 + 5, 9]), u64([77] * 3)]
    )
    items = np.concatenate(
        [rng.choice(known["item_emb"], 200), u64([2**63 + 5, 6, 2**64 - 1]), u64([88, 1, 88, 2])]
    )
    feeds = {"user_id": users.view(np.int64), "item_id": items.view(np.int64)}

    info = export_mf_onnx(artifacts[dtype], tmp_path / "mf.onnx")
    assert info["dim"] == 16
    assert info["global_mean"] == pytest.approx(MU)
    assert [e["name"] for e in info["tables"]] == ["user_emb", "item_emb", "user_bias", "item_bias"]
    onnx.checker.check_model(info["path"])
    sess = session(info["path"])
    assert [i.name for i in sess.get_inputs()] == ["user_id", "item_id"]
    assert [(o.name, o.type) for o in sess.get_outputs()] == [("rating", "tensor(float)")]
    (got,) = sess.run(None, feeds)
    assert got.dtype == F32 and got.shape == (len(users),)
    want = mf_reference(model, users, items)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.ptp(want) > 1.0  # the terms matter
    (empty,) = sess.run(None, {"user_id": np.empty(0, np.int64), "item_id": np.empty(0, np.int64)})
    assert empty.shape == (0,)
    # Unknown users and items: mu plus the known side's bias.
    unknown = u64([123456789, 2**63 + 123])
    (got,) = sess.run(
        None, {"user_id": unknown.view(np.int64), "item_id": items[:2].view(np.int64)}
    )
    np.testing.assert_allclose(
        got, MU + model.lookup("item_bias", items[:2])[:, 0], rtol=1e-6, atol=1e-6
    )

    # Clipped, mu given, from the snapshot.
    f32 = serving.ServingStore(artifacts["float32"])
    want = mf_reference(f32, users, items, mu=1.25)
    lo, hi = float(np.quantile(want, 0.25)), float(np.quantile(want, 0.75))
    info = export_mf_onnx(snap, tmp_path / "clip.onnx", global_mean=1.25, clip=(lo, hi))
    (got,) = session(info["path"]).run(None, feeds)
    want = np.clip(want, F32(lo), F32(hi))
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.any(got == F32(lo)) and np.any(got == F32(hi))

    # No biases, no mean: a plain dot product.
    info = export_mf_onnx(
        artifacts[dtype], tmp_path / "dot.onnx", user_bias=None, item_bias=None, global_mean=None
    )
    assert [e["name"] for e in info["tables"]] == ["user_emb", "item_emb"]
    (got,) = session(info["path"]).run(None, feeds)
    want = mf_reference(model, users, items, mu=0.0, biases=False)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_matrix_factorisation_misuse(world, tmp_path):
    _, artifacts, _ = world
    a = artifacts["float32"]
    out = tmp_path / "mf.onnx"
    with pytest.raises(pstore.ShapeError, match="dim"):
        export_mf_onnx(a, out, user_emb="d8", item_emb="d33")
    with pytest.raises(pstore.ShapeError, match="bias"):
        export_mf_onnx(a, out, user_bias="d8", item_emb="d33", user_emb="d33")
    with pytest.raises(pstore.InvalidArgumentError, match="clip"):
        export_mf_onnx(a, out, clip=(5.0, 1.0))
    with pytest.raises(pstore.ShapeError, match="global_mean"):
        export_mf_onnx(a, out, global_mean="w")
    with pytest.raises(pstore.WrongTableKindError):
        export_mf_onnx(a, out, global_mean="d1")
    with pytest.raises(pstore.UnknownTableError):
        export_mf_onnx(a, out, user_emb="nope")
    assert os.listdir(tmp_path) == []


def test_importing_pstore_does_not_import_onnx():
    code = (
        "import sys, pstore, pstore.serving, pstore.cli\n"
        "assert 'onnx' not in sys.modules and 'onnxruntime' not in sys.modules\n"
        "import pstore.serving.onnx\n"
        "assert 'onnx' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
