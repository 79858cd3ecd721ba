"""Dense tables: shapes, pull copies, push and push_async, step count, initialisers."""

import numpy as np
import pytest

import pstore
from pstore import init, optim

F32 = np.float32
F64 = np.float64
SHAPES = [(7,), (1,), (3, 4), (2, 3, 4)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_shape_pull_and_defaults(store, shape):
    d = store.create_dense_table("w", shape)
    assert isinstance(d, pstore.DenseTable)
    assert d.name == "w"
    assert tuple(d.shape) == shape
    assert d.seed == 0
    assert d.step == 0
    assert d.initializer == init.Zeros()
    assert d.optimizer == optim.SGD(lr=0.01)
    a = d.pull()
    assert a.shape == shape
    assert a.dtype == np.float32
    assert a.flags.writeable
    np.testing.assert_array_equal(a, np.zeros(shape, dtype=F32))


def test_pull_is_a_copy(store):
    d = store.create_dense_table("w", (3, 4), initializer=init.Normal(0.0, 1.0))
    a = d.pull()
    b = d.pull()
    assert not np.shares_memory(a, b)
    np.testing.assert_array_equal(a, b)
    a[...] = 42.0
    np.testing.assert_array_equal(d.pull(), b)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_push_sgd_and_step(store, rng, shape):
    d = store.create_dense_table(
        "w", shape, optimizer=optim.SGD(lr=0.5), initializer=init.Constant(1.0)
    )
    expected = np.ones(shape, dtype=F32)
    for step in range(1, 4):
        grad = rng.integers(-8, 9, size=shape).astype(F32) / 4
        assert d.push(grad) is None
        expected -= 0.5 * grad  # exact: multiples of 1/8
        assert d.step == step
        np.testing.assert_array_equal(d.pull(), expected)


def test_push_accepts_non_contiguous_grad(store):
    d = store.create_dense_table("w", (3, 4), optimizer=optim.SGD(lr=1.0))
    grad = np.arange(12, dtype=F32).reshape(4, 3).T  # (3, 4), Fortran order
    assert not grad.flags.c_contiguous
    d.push(grad)
    np.testing.assert_array_equal(d.pull(), -grad)


def test_push_async(store, rng):
    d = store.create_dense_table("w", (5,), optimizer=optim.SGD(lr=1.0))
    grads = [rng.integers(-4, 5, size=5).astype(F32) for _ in range(10)]
    handles = [d.push_async(g) for g in grads]
    assert all(isinstance(h, pstore.PushHandle) for h in handles)
    for h in handles:
        assert h.wait(timeout=30) is None
        assert h.done()
    assert d.step == 10
    np.testing.assert_array_equal(d.pull(), -np.sum(grads, axis=0))


def test_push_async_copies_its_input(store):
    d = store.create_dense_table("w", (4,), optimizer=optim.SGD(lr=1.0))
    g = np.ones(4, dtype=F32)
    d.push_async(g)
    g[:] = 100.0
    store.flush()
    np.testing.assert_array_equal(d.pull(), -np.ones(4, dtype=F32))


def test_lr_at_run_time(store):
    d = store.create_dense_table("w", (2,), optimizer=optim.SGD(lr=1.0))
    assert d.lr == pytest.approx(1.0)
    d.push(np.ones(2, dtype=F32))
    d.lr = 0.5
    assert d.lr == pytest.approx(0.5)
    d.push(np.ones(2, dtype=F32))
    d.set_lr(0.25)
    assert d.lr == pytest.approx(0.25)
    d.push(np.ones(2, dtype=F32))
    np.testing.assert_array_equal(d.pull(), [-1.75, -1.75])
    assert isinstance(d.stats(), dict)


def test_initializers(store):
    shape = (200, 100)
    c = store.create_dense_table("c", shape, initializer=init.Constant(3.5)).pull()
    np.testing.assert_array_equal(c, 3.5)
    u = store.create_dense_table("u", shape, initializer=init.Uniform(-2.0, 1.0)).pull()
    assert u.min() >= -2.0
    assert u.max() <= 1.0
    assert u.astype(F64).mean() == pytest.approx(-0.5, abs=0.03)
    n = store.create_dense_table("n", shape, initializer=init.Normal(1.0, 3.0)).pull()
    assert n.astype(F64).mean() == pytest.approx(1.0, abs=0.1)
    assert n.astype(F64).std() == pytest.approx(3.0, rel=0.02)
    tn = store.create_dense_table("tn", shape, initializer=init.TruncatedNormal(0.0, 1.0)).pull()
    assert tn.min() >= -2.0
    assert tn.max() <= 2.0
    assert tn.astype(F64).std() == pytest.approx(0.8796, rel=0.03)


def test_initial_value_depends_on_seed(store):
    def make(name, seed, num_shards=4):
        s = pstore.Store(num_shards=num_shards)
        return s.create_dense_table(name, (64,), initializer=init.Normal(0.0, 1.0), seed=seed)

    a = make("w", 1).pull()
    np.testing.assert_array_equal(make("w", 1, num_shards=1).pull(), a)
    assert not np.array_equal(make("w", 2).pull(), a)
    assert len(np.unique(a)) == 64


def test_dense_adam_step_is_the_table_push_count(store, rng):
    """One Adam step from zero state moves every element by about lr (bias-corrected)."""
    d = store.create_dense_table("w", (8,), optimizer=optim.Adam(lr=0.01))
    d.push(rng.standard_normal(8).astype(F32) + 3.0)
    np.testing.assert_allclose(np.abs(d.pull()), 0.01, rtol=1e-4)
    assert d.step == 1
