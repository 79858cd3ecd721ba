"""Sparse tables: pull/push/contains/remove, ids, initialisers, determinism, stats, the catalog."""

import os

import numpy as np
import pytest
from _data import F32, U64_MAX, random_ids, u64
from hypothesis import given, settings
from hypothesis import strategies as st

import pstore
from pstore import init, optim

F64 = np.float64


# --- pull, push, contains, remove -----------------------------------------------------------


def test_table_attributes(store):
    opt = optim.Adagrad(lr=0.3)
    ini = init.Uniform(-1.0, 2.0)
    t = store.create_sparse_table("emb", 6, optimizer=opt, initializer=ini, seed=17)
    assert isinstance(t, pstore.SparseTable)
    assert (t.name, t.dim, t.seed) == ("emb", 6, 17)
    assert t.optimizer == opt
    assert t.initializer == ini
    assert len(t) == 0
    assert t.lr == pytest.approx(0.3, rel=1e-6)


def test_defaults(store):
    t = store.create_sparse_table("emb", 3)
    assert t.optimizer == optim.SGD(lr=0.01)
    assert t.initializer == init.Normal(0.0, 0.01)
    assert t.seed == 0
    w0 = t.pull([1]).astype(F64)
    g = np.array([[1.0, -2.0, 4.0]], dtype=F32)
    t.push([1], g)
    np.testing.assert_allclose(t.pull([1]), (w0 - 0.01 * g).astype(F32), rtol=1e-6)


def test_store_attributes():
    s = pstore.Store()
    assert s.num_shards == 64
    assert s.threads >= 1
    s = pstore.Store(num_shards=3, threads=2)
    assert (s.num_shards, s.threads) == (3, 2)


@pytest.mark.parametrize("dim", [1, 4, 4096])
def test_pull_shape_dtype_and_fresh_copy(store, dim):
    t = store.create_sparse_table("emb", dim, initializer=init.Normal(0.0, 1.0))
    ids = u64([5, 1, 9])
    a = t.pull(ids)
    assert a.shape == (3, dim)
    assert a.dtype == np.float32
    assert a.flags.writeable
    b = t.pull(ids)
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, b)
    a[:] = 123.0  # writing to a pulled array never touches the table
    np.testing.assert_array_equal(t.pull(ids), b)
    assert not (b == 123.0).any()


def test_pull_creates_rows_contains_does_not(store):
    t = store.create_sparse_table("emb", 4)
    assert len(t) == 0
    probe = u64([1, 2, 3, 4])
    has = t.contains(probe)
    assert isinstance(has, np.ndarray)
    assert has.dtype == np.bool_
    assert has.shape == (4,)
    assert not has.any()
    assert len(t) == 0  # contains never creates
    t.pull(u64([2, 4, 2]))  # duplicates create one row each
    assert len(t) == 2
    np.testing.assert_array_equal(t.contains(probe), [False, True, False, True])
    t.pull(u64([4, 5]))
    assert len(t) == 3
    np.testing.assert_array_equal(t.contains(u64([5, 5, 6])), [True, True, False])
    assert len(t) == 3


def test_pull_duplicates_return_the_same_row(store):
    t = store.create_sparse_table("emb", 8, initializer=init.Normal(0.0, 1.0))
    rows = t.pull(u64([3, 7, 3, 3]))
    np.testing.assert_array_equal(rows[0], rows[2])
    np.testing.assert_array_equal(rows[0], rows[3])
    assert not np.array_equal(rows[0], rows[1])


def test_empty_ids(store):
    t = store.create_sparse_table("emb", 4)
    assert t.pull(np.empty(0, dtype=np.uint64)).shape == (0, 4)
    t.push(np.empty(0, dtype=np.uint64), np.empty((0, 4), dtype=F32))
    assert t.contains(np.empty(0, dtype=np.uint64)).shape == (0,)
    assert t.remove(np.empty(0, dtype=np.uint64)) == 0
    assert len(t) == 0


def test_push_returns_none_and_applies(sgd_table):
    t = sgd_table
    g = np.array([[1.0, 2.0, 3.0, 4.0], [0.25, 0.0, -1.0, 8.0]], dtype=F32)
    assert t.push(u64([10, 11]), g) is None
    np.testing.assert_array_equal(t.pull(u64([10, 11])), 0.5 - g)


def test_push_coalesces_duplicates(sgd_table):
    t = sgd_table
    g = np.array([[1.0, 0, 0, 0], [0, 2.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 0.5]], dtype=F32)
    t.push(u64([4, 9, 4, 4]), g)
    np.testing.assert_array_equal(t.pull(u64([4])), [[-0.5, 0.5, -2.5, 0.0]])
    np.testing.assert_array_equal(t.pull(u64([9])), [[0.5, -1.5, 0.5, 0.5]])
    assert len(t) == 2


def test_push_creates_missing_rows_from_their_initial_value(rng):
    """A push to an absent id creates the row at its initial value and updates it."""
    kw = {"optimizer": optim.SGD(lr=0.5), "initializer": init.Normal(0.0, 1.0), "seed": 9}
    t = pstore.Store(num_shards=4).create_sparse_table("emb", 6, **kw)
    twin = pstore.Store(num_shards=4).create_sparse_table("emb", 6, **kw)
    ids = u64([3, 1 << 40, U64_MAX])
    g = rng.standard_normal((3, 6)).astype(F32)
    t.push(ids, g)
    assert len(t) == 3
    assert t.contains(ids).all()
    expected = (twin.pull(ids).astype(F64) - 0.5 * g.astype(F64)).astype(F32)
    np.testing.assert_allclose(t.pull(ids), expected, rtol=1e-6, atol=1e-7)


def test_push_accepts_non_contiguous_grads_and_id_lists(sgd_table):
    t = sgd_table
    wide = np.arange(24, dtype=F32).reshape(3, 8)
    g = wide[:, ::2]  # strided view, (3, 4)
    assert not g.flags.c_contiguous
    t.push([1, 2, 3], g)
    np.testing.assert_array_equal(t.pull([1, 2, 3]), 0.5 - np.ascontiguousarray(g))
    gt = np.ones((4, 3), dtype=F32).T  # Fortran-ordered (3, 4)
    t.push(u64([1, 2, 3]), gt)
    np.testing.assert_array_equal(t.pull(u64([1, 2, 3])), 0.5 - np.ascontiguousarray(g) - 1.0)


def test_list_uint64_and_int64_ids_address_the_same_rows(store):
    t = store.create_sparse_table("emb", 4, initializer=init.Normal(0.0, 1.0))
    a = t.pull([0, 7, 123456789])
    b = t.pull(np.array([0, 7, 123456789], dtype=np.uint64))
    c = t.pull(np.array([0, 7, 123456789], dtype=np.int64))
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(a, c)
    assert len(t) == 3


def test_int64_ids_are_reinterpreted_as_uint64(store):
    t = store.create_sparse_table(
        "emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Normal(0.0, 1.0)
    )
    signed = np.array([-1, -2, np.iinfo(np.int64).min], dtype=np.int64)
    unsigned = u64([U64_MAX, U64_MAX - 1, 1 << 63])
    np.testing.assert_array_equal(signed.view(np.uint64), unsigned)
    a = t.pull(signed)
    assert len(t) == 3
    np.testing.assert_array_equal(t.contains(unsigned), [True, True, True])
    np.testing.assert_array_equal(t.pull(unsigned), a)
    assert len(t) == 3
    g = np.full((3, 4), 0.25, dtype=F32)
    t.push(unsigned, g)
    np.testing.assert_array_equal(t.pull(signed), (a.astype(F64) - 0.25).astype(F32))
    assert t.remove(signed[:1]) == 1
    np.testing.assert_array_equal(t.contains(unsigned), [False, True, True])


def test_remove_returns_count_and_reinitialises(store, rng):
    t = store.create_sparse_table(
        "emb", 5, optimizer=optim.SGD(lr=0.1), initializer=init.Normal(0.0, 1.0), seed=4
    )
    ids = u64([1, 2, 3, 4])
    initial = t.pull(ids)
    t.push(ids, rng.standard_normal((4, 5)).astype(F32))
    trained = t.pull(ids)
    assert not np.array_equal(initial, trained)
    assert t.remove(u64([2, 4, 99, 2])) == 2  # absent ids ignored, duplicates counted once
    assert len(t) == 2
    np.testing.assert_array_equal(t.contains(ids), [True, False, True, False])
    assert t.remove(u64([2, 4])) == 0
    again = t.pull(ids)
    np.testing.assert_array_equal(again[[1, 3]], initial[[1, 3]])  # back to the initial value
    np.testing.assert_array_equal(again[[0, 2]], trained[[0, 2]])  # untouched
    assert len(t) == 4


def test_remove_resets_optimizer_state(store):
    """A removed row comes back with fresh optimizer state (here the momentum buffer)."""
    t = store.create_sparse_table(
        "emb", 2, optimizer=optim.SGD(lr=1.0, momentum=0.5), initializer=init.Zeros()
    )
    g = np.array([[1.0, 2.0]], dtype=F32)
    t.push([8], g)
    first = t.pull([8])
    t.push([8], g)  # momentum: buf = 1.5 g
    np.testing.assert_array_equal(t.pull([8]), first - 1.5 * g)
    assert t.remove([8]) == 1
    t.push([8], g)
    np.testing.assert_array_equal(t.pull([8]), first)


def test_dim_4096_push_and_pull(store, rng):
    t = store.create_sparse_table(
        "big", 4096, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(1.0)
    )
    ids = u64([1, 2, 3, 2])
    g = rng.integers(-4, 5, size=(4, 4096)).astype(F32)
    t.push(ids, g)
    expected = np.ones((3, 4096), dtype=F32)
    expected[0] -= g[0]
    expected[1] -= g[1] + g[3]
    expected[2] -= g[2]
    np.testing.assert_array_equal(t.pull(u64([1, 2, 3])), expected)
    assert t.stats()["dim"] == 4096


def test_dim_1(store):
    t = store.create_sparse_table("one", 1, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    t.push([5, 5, 6], np.array([[1.0], [2.0], [4.0]], dtype=F32))
    np.testing.assert_array_equal(t.pull([5, 6, 7]), [[-3.0], [-4.0], [0.0]])


# --- initialisers ---------------------------------------------------------------------------


def many_rows(store, initializer, n=5000, dim=32, seed=1):
    t = store.create_sparse_table("init", dim, initializer=initializer, seed=seed)
    return t.pull(np.arange(n, dtype=np.uint64)).astype(F64)


def test_zeros_and_constant(store):
    z = store.create_sparse_table("z", 7, initializer=init.Zeros())
    np.testing.assert_array_equal(z.pull(np.arange(50, dtype=np.uint64)), 0.0)
    c = store.create_sparse_table("c", 7, initializer=init.Constant(-2.5))
    np.testing.assert_array_equal(c.pull(np.arange(50, dtype=np.uint64)), -2.5)


def test_uniform(store):
    w = many_rows(store, init.Uniform(-0.5, 1.5))
    assert w.min() >= -0.5
    assert w.max() <= 1.5
    assert w.min() < -0.49
    assert w.max() > 1.49
    assert w.mean() == pytest.approx(0.5, abs=0.01)
    assert w.std() == pytest.approx(2.0 / np.sqrt(12.0), rel=0.02)


def test_normal(store):
    w = many_rows(store, init.Normal(3.0, 2.0))
    assert w.mean() == pytest.approx(3.0, abs=0.03)
    assert w.std() == pytest.approx(2.0, rel=0.02)
    # every element position has the same distribution (SE of a column mean: 2 / sqrt(5000))
    np.testing.assert_allclose(w.mean(axis=0), 3.0, atol=0.15)
    np.testing.assert_allclose(w.std(axis=0), 2.0, rtol=0.08)
    assert abs(np.corrcoef(w[:, 0], w[:, 1])[0, 1]) < 0.06
    assert len(np.unique(w)) > 0.95 * w.size  # no repeated rows or columns


def test_default_normal_std(store):
    w = many_rows(store, init.Normal(0.0, 0.01), n=2000, dim=16)
    assert w.mean() == pytest.approx(0.0, abs=5e-4)
    assert w.std() == pytest.approx(0.01, rel=0.03)


def test_truncated_normal(store):
    mean, std = 1.0, 0.5
    w = many_rows(store, init.TruncatedNormal(mean, std))
    assert w.min() >= mean - 2 * std
    assert w.max() <= mean + 2 * std
    assert w.min() < mean - 1.9 * std  # the tails are populated up to the cut
    assert w.max() > mean + 1.9 * std
    assert w.mean() == pytest.approx(mean, abs=0.01)
    assert w.std() == pytest.approx(0.8796 * std, rel=0.03)  # sd of N(0,1) truncated at +-2


def test_initializer_values_are_frozen_dataclasses():
    assert init.Normal(0.0, 1.0) == init.Normal(0.0, 1.0)
    assert init.Normal(0.0, 1.0) != init.Normal(0.0, 2.0)
    assert init.Constant(2.0).value == 2.0
    u = init.Uniform(-1.0, 1.0)
    assert (u.low, u.high) == (-1.0, 1.0)
    n = init.TruncatedNormal(0.5, 0.1)
    assert (n.mean, n.std) == (0.5, 0.1)


# --- determinism ----------------------------------------------------------------------------

CONFIGS = [(1, 1), (3, 1), (3, 2), (64, 1), (64, 2)]  # (num_shards, threads)
INITS = [init.Normal(0.0, 1.0), init.Uniform(-1.0, 1.0), init.TruncatedNormal(0.0, 0.5)]


@pytest.mark.parametrize("initializer", INITS, ids=lambda i: type(i).__name__)
def test_initial_rows_depend_only_on_seed_and_id(rng, initializer):
    ids = np.concatenate([np.arange(300, dtype=np.uint64), random_ids(rng, 300)])
    ids = np.unique(ids)
    reference = None
    for k, (num_shards, threads) in enumerate(CONFIGS):
        t = pstore.Store(num_shards=num_shards, threads=threads).create_sparse_table(
            "emb", 16, initializer=initializer, seed=42
        )
        # a different pull order and batching for every configuration
        order = rng.permutation(len(ids))
        rows = np.empty((len(ids), 16), dtype=F32)
        for chunk in np.array_split(order, k + 1):
            rows[chunk] = t.pull(ids[chunk])
        if reference is None:
            reference = rows
        else:
            np.testing.assert_array_equal(rows, reference, err_msg=f"{num_shards=} {threads=}")
    other = pstore.Store().create_sparse_table("emb", 16, initializer=initializer, seed=43)
    differs = (other.pull(ids) != reference).any(axis=1)
    assert differs.all()  # another seed gives other rows


def run_training(num_shards: int, threads: int, use_async: bool) -> np.ndarray:
    store = pstore.Store(num_shards=num_shards, threads=threads)
    t = store.create_sparse_table(
        "emb",
        12,
        optimizer=optim.Adam(lr=0.01, weight_decay=0.01, clip_norm=1.0),
        initializer=init.Normal(0.0, 0.1),
        seed=7,
    )
    rng = np.random.default_rng(1234)
    space = random_ids(rng, 200)
    for step in range(40):
        ids = space[rng.integers(0, len(space), size=64)]
        grads = rng.standard_normal((64, 12)).astype(F32)
        if use_async:
            t.push_async(ids, grads)
        else:
            t.push(ids, grads)
        if step % 10 == 9:
            store.flush()
            t.remove(space[rng.integers(0, len(space), size=10)])
            t.pull(space[rng.integers(0, len(space), size=16)])
    store.flush()
    return t.pull(space)


def test_training_is_bitwise_identical_across_shards_and_threads():
    reference = run_training(1, 1, use_async=False)
    for num_shards, threads in CONFIGS[1:]:
        got = run_training(num_shards, threads, use_async=False)
        np.testing.assert_array_equal(got, reference, err_msg=f"{num_shards=} {threads=}")
    np.testing.assert_array_equal(run_training(3, 2, use_async=True), reference)


# --- stats and the catalog ------------------------------------------------------------------

STATS_KEYS = {
    "rows",
    "dim",
    "bytes_used",
    "huge_page_bytes",
    "pushes",
    "pulls",
    "ids_pushed",
    "ids_pulled",
    "rows_updated",
    "num_shards",
    "lr",
    "optimizer",
}


def test_stats(store):
    t = store.create_sparse_table("emb", 8, optimizer=optim.SGD(lr=0.25))
    s = t.stats()
    assert isinstance(s, dict)
    assert STATS_KEYS <= set(s)
    assert s["rows"] == 0
    assert s["dim"] == 8
    assert s["num_shards"] == store.num_shards == 4
    assert s["lr"] == pytest.approx(0.25, rel=1e-6)
    assert "sgd" in str(s["optimizer"]).lower()
    for key in ("pushes", "pulls", "ids_pushed", "ids_pulled", "rows_updated"):
        assert s[key] == 0, key

    t.pull(np.arange(1000, dtype=np.uint64))
    s = t.stats()
    assert (s["rows"], s["pulls"], s["ids_pulled"]) == (1000, 1, 1000)
    assert s["bytes_used"] >= 1000 * 8 * 4

    t.push(u64([1, 1, 2, 5000]), np.ones((4, 8), dtype=F32))
    s = t.stats()
    assert (s["pushes"], s["ids_pushed"], s["rows_updated"]) == (1, 4, 3)
    assert s["rows"] == len(t) == 1001
    t.push(u64([3]), np.ones((1, 8), dtype=F32))
    s = t.stats()
    assert (s["pushes"], s["ids_pushed"], s["rows_updated"]) == (2, 5, 4)
    assert s["pulls"] == 1

    # 1001 rows of 8 floats fill no 2 MiB row chunk and no large index: all on small pages.
    assert s["huge_page_bytes"] == 0

    t.lr = 0.5
    assert t.stats()["lr"] == pytest.approx(0.5, rel=1e-6)
    t.remove(np.arange(10, dtype=np.uint64))
    assert t.stats()["rows"] == len(t) == 991

    a = store.create_sparse_table("adam", 2, optimizer=optim.Adam(lr=0.1))
    assert "adam" in str(a.stats()["optimizer"]).lower()


def test_stats_count_the_rows_on_huge_pages(store):
    """Full row chunks are whole 2 MiB pages advised MADV_HUGEPAGE; stats() counts them."""
    t = store.create_sparse_table("big", 64)
    t.pull(np.arange(60_000, dtype=np.uint64))
    s = t.stats()
    thp = os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp:
        assert s["huge_page_bytes"] == 0
        return
    # 15,000 rows of 288 bytes a shard: at least one full chunk (7281 rows) each.
    assert s["huge_page_bytes"] >= 4 * (2 << 20)
    assert s["huge_page_bytes"] <= s["bytes_used"]
    assert s["huge_page_bytes"] % (2 << 20) == 0
    t.remove(np.arange(60_000, dtype=np.uint64))
    # Chunks stay (rows are freed into the free list), so their pages are still counted.
    assert t.stats()["huge_page_bytes"] == s["huge_page_bytes"]


def test_catalog(store):
    assert store.tables() == []
    assert "b" not in store
    b = store.create_sparse_table("b", 3)
    a = store.create_sparse_table("a", 3)
    d = store.create_dense_table("c", (2,))
    assert store.tables() == ["a", "b", "c"]
    assert "a" in store
    assert "c" in store
    assert "zz" not in store
    assert store.table("a").name == "a"
    assert isinstance(store.table("c"), pstore.DenseTable)
    assert isinstance(store.table("b"), pstore.SparseTable)
    # a looked-up table is the same table, not a copy
    b.push([1], np.ones((1, 3), dtype=F32))
    np.testing.assert_array_equal(store.table("b").pull([1]), b.pull([1]))
    assert len(store.table("b")) == 1
    assert d.name == "c"
    store.drop_table("b")
    assert store.tables() == ["a", "c"]
    assert "b" not in store
    with pytest.raises(pstore.UnknownTableError):
        store.table("b")
    with pytest.raises(pstore.UnknownTableError):
        store.drop_table("b")
    # the name is free again, and the new table starts empty
    b2 = store.create_sparse_table("b", 5)
    assert (b2.dim, len(b2)) == (5, 0)
    assert store.tables() == ["a", "b", "c"]
    assert a.dim == 3


def test_tables_are_independent(store):
    a = store.create_sparse_table("a", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    b = store.create_sparse_table("b", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    a.push([1], np.ones((1, 2), dtype=F32))
    assert len(b) == 0
    np.testing.assert_array_equal(b.pull([1]), [[0.0, 0.0]])
    np.testing.assert_array_equal(a.pull([1]), [[-1.0, -1.0]])


# --- batch helpers of pstore.torch (native) --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(0, 2**64 - 1) | st.integers(0, 20), max_size=300),
    dim=st.integers(1, 9),
)
def test_unique_inverse_and_sum_rows_against_numpy(ids: list[int], dim: int) -> None:
    from pstore import _native

    a = np.array(ids, dtype=np.uint64)
    unique, inverse = _native.unique_inverse(a)
    assert unique.dtype == np.uint64 and inverse.dtype == np.int64
    assert len(unique) == len(set(ids))
    _, first = np.unique(a, return_index=True)
    np.testing.assert_array_equal(unique, a[np.sort(first)])  # order of first appearance
    np.testing.assert_array_equal(unique[inverse], a)

    rng = np.random.default_rng(len(ids) * 31 + dim)
    src = rng.standard_normal((len(ids), dim)).astype(np.float32)
    want = np.zeros((len(unique), dim), np.float64)
    np.add.at(want, inverse, src)
    got = _native.sum_rows(src, inverse, len(unique))
    assert got.shape == (len(unique), dim) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_sum_rows_refuses_bad_input() -> None:
    from pstore import _native

    src = np.ones((3, 2), np.float32)
    with pytest.raises(pstore.ShapeError, match=r"index 2 is outside 0\.\.2"):
        _native.sum_rows(src, np.array([0, 1, 2], np.int64), 2)
    with pytest.raises(pstore.ShapeError, match="outside"):
        _native.sum_rows(src, np.array([0, -1, 1], np.int64), 2)
    with pytest.raises(pstore.ShapeError, match="3 gradient values for 2 positions"):
        _native.sum_rows(src[:, :1].copy(), np.array([0, 1], np.int64), 2)
    with pytest.raises(pstore.ShapeError, match="C-contiguous"):
        _native.sum_rows(np.ones((3, 4), np.float32)[:, ::2], np.array([0, 1, 1], np.int64), 2)


@pytest.mark.parametrize("dim", [64, 63, 16])
def test_a_large_pull_equals_small_pulls(dim: int) -> None:
    """A pull of 8 MiB and more (split over the pool's threads; past the last-level cache it is
    written with streaming stores, which a Rust test covers at any size) returns the same rows,
    created ones included, as many small pulls."""
    store = pstore.Store(threads=2)
    t = store.create_sparse_table(
        "t", dim, optimizer=optim.SGD(lr=0.1), initializer=init.Normal(0.0, 1.0), seed=3
    )
    rng = np.random.default_rng(dim)
    n = (8 << 20) // (4 * dim) + 777
    ids = rng.integers(0, 2 * n, size=n).astype(np.uint64)  # duplicates, and ids seen first here
    t.push(ids[: n // 3], rng.standard_normal((n // 3, dim)).astype(np.float32))
    big = t.pull(ids)
    assert big.shape == (n, dim) and big.nbytes >= 8 << 20
    small = np.concatenate([t.pull(ids[i : i + 1000]) for i in range(0, n, 1000)])
    np.testing.assert_array_equal(big, small)
    np.testing.assert_array_equal(big, t.pull(ids))


@pytest.mark.parametrize("dim", [64, 3])
def test_a_large_pull_starts_on_a_cache_line_and_behaves_as_an_array(dim: int) -> None:
    """A pull of 64 KiB or more is returned as a view that starts on a 64-byte boundary (so the
    pool's tasks never write the same cache line); it must still be an ordinary, writable,
    C-contiguous (n, dim) array of the right rows, and a new one each time."""
    store = pstore.Store(threads=2)
    t = store.create_sparse_table("t", dim, initializer=init.Normal(0.0, 1.0), seed=5)
    n = (64 << 10) // (4 * dim) + 5
    ids = np.arange(n, dtype=np.uint64) * 7919
    for _ in range(8):  # numpy hands out buffers at several alignments (16 bytes apart)
        big = t.pull(ids)
        assert big.ctypes.data % 64 == 0
        assert big.shape == (n, dim) and big.dtype == np.float32
        assert big.flags.c_contiguous and big.flags.writeable
        np.testing.assert_array_equal(big, np.concatenate([t.pull(ids[:5]), t.pull(ids[5:])]))
        again = t.pull(ids)
        assert not np.shares_memory(big, again)
        big[:] = 0.0  # writing to the returned rows never touches the table
        np.testing.assert_array_equal(again, t.pull(ids))
    small = t.pull(ids[:3])
    assert small.base is None and small.shape == (3, dim)
