"""Bad input: the right exception, a message that names the problem, and nothing changed.

"A rejected push changes nothing: no row created, no row updated, counters unchanged."
"""

import math

import numpy as np
import pytest

import pstore
from pstore import init, optim

F32 = np.float32
DIM = 4
EXISTING = np.arange(10, dtype=np.uint64)
NEW = np.array([100, 101], dtype=np.uint64)
DTYPE = r"(?i)dtype"
SHAPE = r"(?i)shape|dim|len|mismatch|1-d|rows"
NAN = r"(?i)nan|finite"
INF = r"(?i)inf|finite"


def test_exception_hierarchy():
    assert issubclass(pstore.PstoreError, Exception)
    expected = {
        pstore.DtypeError: (pstore.PstoreError, TypeError),
        pstore.InvalidArgumentError: (pstore.PstoreError, ValueError),
        pstore.ShapeError: (pstore.InvalidArgumentError, pstore.PstoreError, ValueError),
        pstore.NonFiniteError: (pstore.InvalidArgumentError, pstore.PstoreError, ValueError),
        pstore.UnknownTableError: (pstore.PstoreError, KeyError),
        pstore.TableExistsError: (pstore.PstoreError, ValueError),
    }
    for cls, bases in expected.items():
        for base in bases:
            assert issubclass(cls, base), (cls, base)


def make_table(store, rng_seed=0):
    t = store.create_sparse_table(
        "emb",
        DIM,
        optimizer=optim.SGD(lr=0.1, momentum=0.9),
        initializer=init.Normal(0.0, 1.0),
        seed=3,
    )
    rng = np.random.default_rng(rng_seed)
    t.pull(EXISTING)
    t.push(EXISTING, rng.standard_normal((len(EXISTING), DIM)).astype(F32))
    return t


@pytest.fixture
def tables():
    """The table under test and a twin with the same history that never sees bad input."""
    store = pstore.Store(num_shards=4, threads=2)
    twin_store = pstore.Store(num_shards=4, threads=2)
    return store, make_table(store), make_table(twin_store)


class Snapshot:
    """Everything observable about a sparse table, taken without creating rows."""

    def __init__(self, t) -> None:
        self.values = t.pull(EXISTING)
        self.len = len(t)
        self.stats = t.stats()

    def check(self, t, twin) -> None:
        assert t.stats() == self.stats
        assert len(t) == self.len
        assert not t.contains(NEW).any(), "a rejected call created rows"
        np.testing.assert_array_equal(t.pull(EXISTING), self.values)
        # Hidden optimizer state (the momentum buffers) is unchanged too: the next good push gives
        # the same rows as on the twin, which never saw the bad input.
        g = np.full((len(EXISTING), DIM), 0.5, dtype=F32)
        t.push(EXISTING, g)
        twin.push(EXISTING, g)
        np.testing.assert_array_equal(t.pull(EXISTING), twin.pull(EXISTING))


def ids_and_grads():
    ids = np.concatenate([EXISTING[:3], NEW])  # existing rows first, new rows last
    grads = np.linspace(-1.0, 1.0, len(ids) * DIM, dtype=F32).reshape(len(ids), DIM)
    return ids, grads


def with_value(grads, index, value):
    grads = grads.copy()
    grads[index] = value
    return grads


def bad_pushes():
    ids, g = ids_and_grads()
    dup_ids = np.concatenate([ids, ids[:1]])
    dup_g = np.concatenate([g, g[:1]])
    return {
        "ids_float64": (ids.astype(np.float64), g, pstore.DtypeError, DTYPE),
        "ids_float32": (ids.astype(np.float32), g, pstore.DtypeError, DTYPE),
        "ids_int32": (ids.astype(np.int32), g, pstore.DtypeError, DTYPE),
        "grads_float64": (ids, g.astype(np.float64), pstore.DtypeError, DTYPE),
        "grads_float16": (ids, g.astype(np.float16), pstore.DtypeError, DTYPE),
        "grads_int32": (ids, g.astype(np.int32), pstore.DtypeError, DTYPE),
        "grads_wide": (ids, np.zeros((len(ids), DIM + 1), F32), pstore.ShapeError, SHAPE),
        "grads_narrow": (ids, np.zeros((len(ids), DIM - 1), F32), pstore.ShapeError, SHAPE),
        "grads_1d": (ids, g.reshape(-1), pstore.ShapeError, SHAPE),
        "grads_3d": (ids, g.reshape(len(ids), DIM, 1), pstore.ShapeError, SHAPE),
        "ids_2d": (ids.reshape(-1, 1), g, pstore.ShapeError, SHAPE),
        "fewer_grads": (ids, g[:-1], pstore.ShapeError, SHAPE),
        "more_grads": (ids[:-1], g, pstore.ShapeError, SHAPE),
        "nan_last_row": (ids, with_value(g, (-1, -1), np.nan), pstore.NonFiniteError, NAN),
        "nan_first_row": (ids, with_value(g, (0, 1), np.nan), pstore.NonFiniteError, NAN),
        "inf_middle": (ids, with_value(g, (2, 0), np.inf), pstore.NonFiniteError, INF),
        "neg_inf_last": (ids, with_value(g, (-1, 0), -np.inf), pstore.NonFiniteError, INF),
        "nan_on_duplicate": (
            dup_ids,
            with_value(dup_g, (-1, 2), np.nan),
            pstore.NonFiniteError,
            NAN,
        ),
    }


BAD_PUSHES = bad_pushes()


def assert_error_kind(excinfo, exc):
    err = excinfo.value
    assert isinstance(err, pstore.PstoreError)
    if exc is pstore.DtypeError:
        assert isinstance(err, TypeError)
    else:
        assert isinstance(err, ValueError)
        assert isinstance(err, pstore.InvalidArgumentError)


@pytest.mark.parametrize("case", BAD_PUSHES)
def test_rejected_push_changes_nothing(tables, case):
    _, t, twin = tables
    ids, grads, exc, pattern = BAD_PUSHES[case]
    snap = Snapshot(t)
    with pytest.raises(exc, match=pattern) as excinfo:
        t.push(ids, grads)
    assert_error_kind(excinfo, exc)
    snap.check(t, twin)


@pytest.mark.parametrize("case", BAD_PUSHES)
def test_rejected_push_async_raises_at_the_call(tables, case):
    store, t, twin = tables
    ids, grads, exc, pattern = BAD_PUSHES[case]
    snap = Snapshot(t)
    with pytest.raises(exc, match=pattern) as excinfo:
        t.push_async(ids, grads)
    assert_error_kind(excinfo, exc)
    store.flush()
    snap.check(t, twin)


BAD_IDS = {
    "float64": (EXISTING[:3].astype(np.float64), pstore.DtypeError, DTYPE),
    "int32": (EXISTING[:3].astype(np.int32), pstore.DtypeError, DTYPE),
    "int16": (EXISTING[:3].astype(np.int16), pstore.DtypeError, DTYPE),
    "2d": (np.concatenate([EXISTING[:2], NEW]).reshape(2, 2), pstore.ShapeError, SHAPE),
}


@pytest.mark.parametrize("method", ["pull", "contains", "remove"])
@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_ids_on_pull_contains_remove(tables, method, case):
    _, t, twin = tables
    ids, exc, pattern = BAD_IDS[case]
    if case != "2d":
        ids = np.concatenate([ids, NEW.astype(ids.dtype)])
    snap = Snapshot(t)
    with pytest.raises(exc, match=pattern) as excinfo:
        getattr(t, method)(ids)
    assert_error_kind(excinfo, exc)
    assert t.contains(EXISTING).all(), "a rejected remove removed rows"
    snap.check(t, twin)


def make_dense(store):
    d = store.create_dense_table(
        "w", (3, 4), optimizer=optim.Adam(lr=0.1), initializer=init.Normal(0.0, 1.0), seed=2
    )
    d.push(np.linspace(-1.0, 1.0, 12, dtype=F32).reshape(3, 4))
    return d


def good_dense_grad():
    return np.linspace(-2.0, 2.0, 12, dtype=F32).reshape(3, 4)


BAD_DENSE = {
    "float64": (good_dense_grad().astype(np.float64), pstore.DtypeError, DTYPE),
    "int32": (good_dense_grad().astype(np.int32), pstore.DtypeError, DTYPE),
    "transposed_shape": (np.zeros((4, 3), F32), pstore.ShapeError, SHAPE),
    "flat": (np.zeros(12, F32), pstore.ShapeError, SHAPE),
    "extra_dim": (np.zeros((3, 4, 1), F32), pstore.ShapeError, SHAPE),
    "too_big": (np.zeros((3, 5), F32), pstore.ShapeError, SHAPE),
    "nan_last": (with_value(good_dense_grad(), (2, 3), np.nan), pstore.NonFiniteError, NAN),
    "inf_first": (with_value(good_dense_grad(), (0, 0), np.inf), pstore.NonFiniteError, INF),
}


@pytest.mark.parametrize("use_async", [False, True], ids=["push", "push_async"])
@pytest.mark.parametrize("case", BAD_DENSE)
def test_rejected_dense_push_changes_nothing(case, use_async):
    store = pstore.Store(num_shards=2)
    d = make_dense(store)
    twin = make_dense(pstore.Store(num_shards=2))
    grad, exc, pattern = BAD_DENSE[case]
    before, step, stats = d.pull(), d.step, d.stats()
    with pytest.raises(exc, match=pattern) as excinfo:
        if use_async:
            d.push_async(grad)
        else:
            d.push(grad)
    assert_error_kind(excinfo, exc)
    store.flush()
    assert d.step == step
    assert d.stats() == stats
    np.testing.assert_array_equal(d.pull(), before)
    d.push(good_dense_grad())  # the Adam state and step count were not touched either
    twin.push(good_dense_grad())
    np.testing.assert_array_equal(d.pull(), twin.pull())


@pytest.mark.parametrize("dim", [0, 4097])
def test_bad_dim(store, dim):
    with pytest.raises(pstore.InvalidArgumentError, match=r"(?i)dim") as excinfo:
        store.create_sparse_table("emb", dim)
    assert isinstance(excinfo.value, ValueError)
    assert isinstance(excinfo.value, pstore.PstoreError)
    assert "emb" not in store
    assert store.tables() == []


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (0, 2)], ids=str)
def test_bad_dense_shape(store, shape):
    with pytest.raises(pstore.InvalidArgumentError, match=r"(?i)shape|dim|empty|size"):
        store.create_dense_table("w", shape)
    assert "w" not in store


BAD_OPTIMIZERS = {
    "sgd_lr_0": lambda: optim.SGD(lr=0.0),
    "sgd_lr_negative": lambda: optim.SGD(lr=-0.1),
    "sgd_lr_nan": lambda: optim.SGD(lr=math.nan),
    "adagrad_lr_0": lambda: optim.Adagrad(lr=0.0),
    "adagrad_lr_nan": lambda: optim.Adagrad(lr=math.nan),
    "adam_lr_negative": lambda: optim.Adam(lr=-1.0),
    "adam_lr_nan": lambda: optim.Adam(lr=math.nan),
    "ftrl_alpha_0": lambda: optim.Ftrl(alpha=0.0),
    "ftrl_alpha_nan": lambda: optim.Ftrl(alpha=math.nan),
}


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("case", BAD_OPTIMIZERS)
def test_bad_optimizer_params(store, case, kind):
    # The error may come from the config itself or from create_*_table: both are fine.
    with pytest.raises(pstore.InvalidArgumentError, match=r"(?i)lr|learning|alpha") as excinfo:
        opt = BAD_OPTIMIZERS[case]()
        if kind == "sparse":
            store.create_sparse_table("t", 4, optimizer=opt)
        else:
            store.create_dense_table("t", (4,), optimizer=opt)
    assert isinstance(excinfo.value, ValueError)
    assert "t" not in store


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("bad", [0.0, -0.5, math.nan], ids=["zero", "negative", "nan"])
@pytest.mark.parametrize("setter", ["property", "set_lr"])
def test_bad_lr_at_run_time(store, kind, bad, setter):
    if kind == "sparse":
        t = store.create_sparse_table("t", 4, optimizer=optim.Adagrad(lr=0.3))
    else:
        t = store.create_dense_table("t", (4,), optimizer=optim.Adagrad(lr=0.3))
    with pytest.raises(pstore.InvalidArgumentError, match=r"(?i)lr|learning"):
        if setter == "property":
            t.lr = bad
        else:
            t.set_lr(bad)
    assert t.lr == pytest.approx(0.3, rel=1e-6)
    if kind == "sparse":
        assert t.stats()["lr"] == pytest.approx(0.3, rel=1e-6)


def test_existing_name(store):
    store.create_sparse_table("emb", 4)
    store.create_dense_table("bias", (4,))
    for name, create in (
        ("emb", lambda: store.create_sparse_table("emb", 8)),
        ("emb", lambda: store.create_dense_table("emb", (8,))),
        ("bias", lambda: store.create_sparse_table("bias", 8)),
    ):
        with pytest.raises(pstore.TableExistsError, match=name) as excinfo:
            create()
        assert isinstance(excinfo.value, ValueError)
        assert isinstance(excinfo.value, pstore.PstoreError)
    assert store.table("emb").dim == 4  # the original table is untouched
    assert store.tables() == ["bias", "emb"]


@pytest.mark.parametrize("op", ["table", "drop_table"])
def test_unknown_table(store, op):
    store.create_sparse_table("emb", 4)
    with pytest.raises(pstore.UnknownTableError, match="no_such_table") as excinfo:
        getattr(store, op)("no_such_table")
    assert isinstance(excinfo.value, KeyError)
    assert isinstance(excinfo.value, pstore.PstoreError)
    assert store.tables() == ["emb"]


def test_drop_then_recreate_gives_a_fresh_table(store):
    """After drop_table the name is gone; creating it again gives a fresh table."""
    t = store.create_sparse_table("emb", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    t.push([1], np.ones((1, 2), dtype=F32))
    store.drop_table("emb")
    with pytest.raises(KeyError):
        store.table("emb")
    fresh = store.create_sparse_table("emb", 2, initializer=init.Zeros())
    assert len(fresh) == 0
    np.testing.assert_array_equal(fresh.pull([1]), [[0.0, 0.0]])


BAD_CONFIGS = {
    "sgd_lr_inf": (lambda: optim.SGD(lr=math.inf), "lr"),
    "clip_value_0": (lambda: optim.SGD(lr=0.1, clip_value=0.0), "clip_value"),
    "clip_value_negative": (lambda: optim.Adam(lr=0.1, clip_value=-1.0), "clip_value"),
    "clip_norm_0": (lambda: optim.Adagrad(lr=0.1, clip_norm=0.0), "clip_norm"),
    "clip_norm_nan": (lambda: optim.Ftrl(alpha=0.1, clip_norm=math.nan), "clip_norm"),
    "momentum_negative": (lambda: optim.SGD(lr=0.1, momentum=-0.5), "momentum"),
    "weight_decay_negative": (lambda: optim.SGD(lr=0.1, weight_decay=-1.0), "weight_decay"),
    "beta1_1": (lambda: optim.Adam(lr=0.1, betas=(1.0, 0.999)), "beta"),
    "beta2_above_1": (lambda: optim.Adam(lr=0.1, betas=(0.9, 1.5)), "beta"),
    "accumulator_negative": (
        lambda: optim.Adagrad(lr=0.1, initial_accumulator_value=-1.0),
        "initial_accumulator_value",
    ),
    "ftrl_l1_negative": (lambda: optim.Ftrl(alpha=0.1, l1=-1.0), "l1"),
    "ftrl_l2_negative": (lambda: optim.Ftrl(alpha=0.1, l2=-1.0), "l2"),
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_other_bad_optimizer_params(store, case):
    make, keyword = BAD_CONFIGS[case]
    with pytest.raises(pstore.InvalidArgumentError, match=keyword):
        store.create_sparse_table("t", 4, optimizer=make())
    assert "t" not in store


BAD_INITIALIZERS = {
    "uniform_low_above_high": lambda: init.Uniform(1.0, -1.0),
    "normal_std_negative": lambda: init.Normal(0.0, -1.0),
    "normal_std_nan": lambda: init.Normal(0.0, math.nan),
    "constant_nan": lambda: init.Constant(math.nan),
    "constant_inf": lambda: init.Constant(math.inf),
}


@pytest.mark.parametrize("kind", ["sparse", "dense"])
@pytest.mark.parametrize("case", BAD_INITIALIZERS)
def test_bad_initializer(store, case, kind):
    with pytest.raises(pstore.InvalidArgumentError):
        initializer = BAD_INITIALIZERS[case]()
        if kind == "sparse":
            store.create_sparse_table("t", 4, initializer=initializer)
        else:
            store.create_dense_table("t", (4,), initializer=initializer)
    assert "t" not in store


@pytest.mark.parametrize(
    ("kwargs", "keyword"),
    [({"num_shards": 0}, "num_shards"), ({"threads": 0}, "threads")],
    ids=["num_shards_0", "threads_0"],
)
def test_bad_store_config(kwargs, keyword):
    with pytest.raises(pstore.InvalidArgumentError, match=keyword):
        pstore.Store(**kwargs)


def test_config_objects_and_negative_sizes_get_pstore_errors():
    store = pstore.Store(num_shards=2, threads=1)
    with pytest.raises(pstore.DtypeError, match="optimizer"):
        store.create_sparse_table("a", 4, optimizer="sgd")
    with pytest.raises(pstore.DtypeError, match="initializer"):
        store.create_sparse_table("a", 4, initializer=0.1)
    with pytest.raises(pstore.InvalidArgumentError, match=r"dim must be in 1\.\.=4096, got -1"):
        store.create_sparse_table("a", -1)
    with pytest.raises(pstore.InvalidArgumentError, match="shape"):
        store.create_dense_table("a", (3, -2))
    with pytest.raises(pstore.InvalidArgumentError, match="num_shards"):
        pstore.Store(num_shards=-1)
    assert store.tables() == []


def test_a_dropped_tables_handle_refuses_work():
    store = pstore.Store(num_shards=2, threads=1)
    t = store.create_sparse_table("x", 2, initializer=pstore.init.Zeros())
    d = store.create_dense_table("w", (2,))
    t.pull([1])
    store.drop_table("x")
    store.drop_table("w")
    for call in (
        lambda: t.pull([1]),
        lambda: t.push([1], np.ones((1, 2), np.float32)),
        lambda: t.contains([1]),
        lambda: t.remove([1]),
        lambda: d.pull(),
        lambda: d.push(np.ones(2, np.float32)),
    ):
        with pytest.raises(pstore.UnknownTableError, match="dropped"):
            call()
    again = store.create_sparse_table("x", 2, initializer=pstore.init.Zeros())
    assert len(again) == 0
