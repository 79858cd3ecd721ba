"""Concurrent pushes, push_async ordering, readers during writes, and backpressure."""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import pstore
from pstore import init, optim

F32 = np.float32
F64 = np.float64
N_THREADS = 4

pytestmark = pytest.mark.timeout(120)


def run_in_threads(fns):
    """Start every fn at once (behind a barrier) and re-raise the first failure."""
    barrier = threading.Barrier(len(fns))

    def start(fn):
        barrier.wait(timeout=30)
        return fn()

    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(start, fn) for fn in fns]
        return [f.result(timeout=120) for f in futures]


def make_batches(rng, space, n_batches, batch, dim, exact):
    batches = []
    for _ in range(n_batches):
        rows = rng.integers(0, len(space), size=batch)  # overlapping ids, with duplicates
        if exact:
            grads = rng.integers(-8, 9, size=(batch, dim)).astype(F32) / 4
        else:
            grads = rng.standard_normal((batch, dim)).astype(F32)
        batches.append((rows, grads))
    return batches


@pytest.mark.parametrize("exact", [True, False], ids=["quarter_grads", "normal_grads"])
@pytest.mark.parametrize("use_async", [False, True], ids=["push", "push_async"])
def test_concurrent_sgd_pushes_sum_up(rng, exact, use_async):
    """4 threads push SGD(lr=1) gradients to overlapping ids: w == w0 - sum of every gradient."""
    dim, n_ids = 16, 100
    store = pstore.Store(num_shards=8, threads=2)
    t = store.create_sparse_table(
        "emb",
        dim,
        optimizer=optim.SGD(lr=1.0),
        initializer=init.Zeros() if exact else init.Uniform(-1.0, 1.0),
        seed=1,
    )
    space = (np.arange(n_ids, dtype=np.uint64) * 7919) ^ np.uint64(0xDEADBEEF)
    w0 = t.pull(space).astype(F64)
    work = [make_batches(rng, space, 150, 64, dim, exact) for _ in range(N_THREADS)]

    def worker(batches):
        def run():
            for rows, grads in batches:
                if use_async:
                    t.push_async(space[rows], grads)
                else:
                    t.push(space[rows], grads)

        return run

    run_in_threads([worker(b) for b in work])
    store.flush()

    total = np.zeros((n_ids, dim), dtype=F64)
    magnitude = np.abs(w0)
    touches = np.zeros(n_ids)
    for batches in work:
        for rows, grads in batches:
            np.add.at(total, rows, grads.astype(F64))
            np.add.at(magnitude, rows, np.abs(grads.astype(F64)))
            touches[np.unique(rows)] += 1
    got = t.pull(space)
    expected = w0 - total
    if exact:  # every partial sum is a small multiple of 1/4: float32 is exact in any order
        np.testing.assert_array_equal(got, expected)
    else:
        # each of the row's updates rounds once to float32, by at most half an ulp of a value
        # bounded by |w0| + sum|g|
        bound = touches[:, None] * magnitude * 2.0**-24 + 1e-12
        assert (np.abs(got - expected) <= bound).all()
    stats = t.stats()
    assert stats["pushes"] == N_THREADS * 150
    assert stats["ids_pushed"] == N_THREADS * 150 * 64


def non_commutative_table(store, name):
    return store.create_sparse_table(
        name,
        8,
        optimizer=optim.Adam(lr=0.05, clip_norm=2.0),
        initializer=init.Constant(0.25),
        seed=0,
    )


def test_push_async_applies_in_call_order(rng):
    """Adam depends on gradient order: async pushes then flush == the same pushes done in sync."""
    store = pstore.Store(num_shards=4, threads=2)
    a = non_commutative_table(store, "async")
    b = non_commutative_table(store, "sync")
    space = np.arange(20, dtype=np.uint64)
    batches = make_batches(rng, space, 200, 16, 8, exact=False)
    handles = [a.push_async(space[rows], grads) for rows, grads in batches]
    assert all(isinstance(h, pstore.PushHandle) for h in handles)
    store.flush()
    assert all(h.done() for h in handles)
    for rows, grads in batches:
        b.push(space[rows], grads)
    np.testing.assert_array_equal(a.pull(space), b.pull(space))
    assert a.stats()["pushes"] == 200


def test_push_async_order_per_thread(rng):
    """Each thread pushes asynchronously to its own table; each matches its sequential twin."""
    store = pstore.Store(num_shards=4, threads=2)
    space = np.arange(12, dtype=np.uint64)
    work = [make_batches(rng, space, 100, 8, 8, exact=False) for _ in range(N_THREADS)]
    tables = [non_commutative_table(store, f"t{i}") for i in range(N_THREADS)]

    def worker(table, batches):
        def run():
            handles = [table.push_async(space[rows], grads) for rows, grads in batches]
            handles[-1].wait(timeout=60)

        return run

    run_in_threads([worker(t, b) for t, b in zip(tables, work, strict=True)])
    store.flush()
    reference = pstore.Store(num_shards=1, threads=1)
    for i, (table, batches) in enumerate(zip(tables, work, strict=True)):
        twin = non_commutative_table(reference, f"t{i}")
        for rows, grads in batches:
            twin.push(space[rows], grads)
        np.testing.assert_array_equal(table.pull(space), twin.pull(space), err_msg=f"table {i}")


def test_push_handle_wait_and_done():
    store = pstore.Store(num_shards=2)
    t = store.create_sparse_table(
        "emb", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(1.0)
    )
    h = t.push_async([1, 2], np.ones((2, 4), dtype=F32))
    assert h.wait() is None
    assert h.done()
    assert h.wait(timeout=1.0) is None  # waiting again is harmless
    np.testing.assert_array_equal(t.pull([1, 2]), np.zeros((2, 4), dtype=F32))
    store.flush()
    store.flush()  # nothing pending


def test_push_async_copies_its_inputs():
    store = pstore.Store(num_shards=2)
    t = store.create_sparse_table("emb", 3, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    # Queue some work first, so the pushes below are likely still pending when the caller
    # overwrites its buffers.
    busy = store.create_sparse_table("busy", 256, optimizer=optim.Adam(lr=0.1))
    filler = np.ones((4096, 256), dtype=F32)
    for _ in range(8):
        busy.push_async(np.arange(4096, dtype=np.uint64), filler)
    ids = np.array([1, 2], dtype=np.uint64)
    grads = np.ones((2, 3), dtype=F32)
    handles = [t.push_async(ids, grads)]
    ids[:] = 7  # the caller may reuse its buffers right after the call
    grads[:] = 1000.0
    handles.append(t.push_async(ids, grads))
    ids[:] = 9
    grads[:] = -5.0
    for h in handles:
        h.wait(timeout=30)
    np.testing.assert_array_equal(t.pull([1, 2, 7]), [[-1.0] * 3, [-1.0] * 3, [-2000.0] * 3])
    assert not t.contains([9])[0]
    store.flush()


def test_readers_never_see_torn_rows(rng):
    """Every push adds 1 to whole rows: a row always has all elements equal and never shrinks."""
    dim, n_ids = 512, 32
    store = pstore.Store(num_shards=4, threads=2)
    t = store.create_sparse_table("emb", dim, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    space = np.arange(n_ids, dtype=np.uint64)
    t.pull(space)
    n_pushes, batch = 300, 48
    work = [rng.integers(0, n_ids, size=(n_pushes, batch)) for _ in range(3)]
    done = threading.Event()
    seen = {"pulls": 0}

    def writer(rows_per_push, use_async):
        def run():
            ones = np.full((batch, dim), -1.0, dtype=F32)
            for rows in rows_per_push:
                if use_async:
                    t.push_async(space[rows], ones)
                else:
                    t.push(space[rows], ones)

        return run

    def reader():
        last = np.zeros(n_ids, dtype=F32)
        while True:
            finished = done.is_set()
            rows = t.pull(space)
            first = rows[:, :1]
            torn = np.flatnonzero((rows != first).any(axis=1))
            assert torn.size == 0, f"torn rows {torn[:5]}: {rows[torn[0]][:8]}..."
            assert (first[:, 0] >= last).all(), "a row went backwards"
            last = first[:, 0]
            seen["pulls"] += 1
            if finished:
                return

    writers = [writer(work[0], False), writer(work[1], False), writer(work[2], True)]

    def writers_then_stop():
        try:
            run_in_threads(writers)
            store.flush()
        finally:
            done.set()

    run_in_threads([writers_then_stop, reader])
    assert seen["pulls"] > 1
    counts = np.zeros(n_ids)
    for w in work:
        np.add.at(counts, w.reshape(-1), 1)
    np.testing.assert_array_equal(t.pull(space), np.repeat(counts[:, None], dim, axis=1))


def test_dense_readers_see_whole_tensors():
    """A dense pull sees all of a push or none of it (every push adds 1 to every element)."""
    store = pstore.Store(num_shards=4, threads=2)
    d = store.create_dense_table("w", (256, 512), optimizer=optim.SGD(lr=1.0))
    done = threading.Event()
    minus_one = np.full((256, 512), -1.0, dtype=F32)

    def writer():
        try:
            for i in range(60):
                if i % 2:
                    d.push(minus_one)
                else:
                    d.push_async(minus_one)
            store.flush()
        finally:
            done.set()

    def reader():
        last = 0.0
        while True:
            finished = done.is_set()
            a = d.pull()
            assert a.min() == a.max(), "torn dense pull"
            assert a.flat[0] >= last
            last = a.flat[0]
            if finished:
                return

    run_in_threads([writer, reader])
    np.testing.assert_array_equal(d.pull(), 60.0)
    assert d.step == 60


def test_mixed_operations_from_many_threads(rng):
    """Pushes, pulls, removes, contains and table create/drop interleave without error or hang."""
    store = pstore.Store(num_shards=8, threads=2)
    t = store.create_sparse_table(
        "emb", 32, optimizer=optim.Adagrad(lr=0.1), initializer=init.Normal(0.0, 0.1)
    )
    space = np.arange(64, dtype=np.uint64)
    seeds = rng.integers(0, 2**32, size=N_THREADS)

    def worker(k, seed):
        def run():
            r = np.random.default_rng(seed)
            for step in range(150):
                ids = space[r.integers(0, len(space), size=16)]
                op = r.integers(0, 5)
                if op == 0:
                    t.push(ids, r.standard_normal((16, 32)).astype(F32))
                elif op == 1:
                    t.push_async(ids, r.standard_normal((16, 32)).astype(F32))
                elif op == 2:
                    rows = t.pull(ids)
                    assert rows.shape == (16, 32)
                    assert np.isfinite(rows).all()
                elif op == 3:
                    assert 0 <= t.remove(ids[:4]) <= 4
                else:
                    assert t.contains(ids).shape == (16,)
                if step % 50 == 0:
                    name = f"scratch{k}"
                    scratch = store.create_sparse_table(name, 4)
                    scratch.pull([1, 2])
                    store.drop_table(name)

        return run

    run_in_threads([worker(k, seed) for k, seed in enumerate(seeds)])
    store.flush()
    assert store.tables() == ["emb"]
    present = t.contains(space)
    assert len(t) == t.stats()["rows"] == int(present.sum())
    assert np.isfinite(t.pull(space)).all()


def test_wait_with_a_timeout(rng):
    """wait(timeout) returns once applied, or raises TimeoutError while the push is pending."""
    store = pstore.Store(num_shards=2, threads=1)
    t = store.create_sparse_table("emb", 256, optimizer=optim.Adam(lr=0.1))
    ids = np.arange(8192, dtype=np.uint64)
    grads = rng.standard_normal((8192, 256)).astype(F32)
    handles = [t.push_async(ids, grads) for _ in range(6)]
    try:
        handles[-1].wait(timeout=1e-4)
    except TimeoutError:
        pass
    else:
        assert handles[-1].done()
    store.flush()
    assert all(h.done() for h in handles)
    assert handles[-1].wait(timeout=0) is None
    assert t.stats()["pushes"] == 6


@pytest.mark.timeout(60)
@pytest.mark.parametrize("limit", [1 << 10, 64 << 10], ids=["below_one_push", "a_few_pushes"])
def test_push_async_backpressure(rng, limit):
    """With a tiny max_inflight_bytes many push_async calls block, not fail; flush completes."""
    store = pstore.Store(num_shards=4, threads=2, max_inflight_bytes=limit)
    dim, batch, n_pushes = 32, 64, 300  # 8 KiB of gradients per push
    t = store.create_sparse_table("emb", dim, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
    space = np.arange(50, dtype=np.uint64)
    batches = make_batches(rng, space, n_pushes, batch, dim, exact=True)

    def worker(part):
        def run():
            return [t.push_async(space[rows], grads) for rows, grads in part]

        return run

    results = run_in_threads([worker(batches[i::2]) for i in range(2)])
    store.flush()
    assert all(h.done() for handles in results for h in handles)
    expected = np.zeros((len(space), dim), dtype=F64)
    for rows, grads in batches:
        np.add.at(expected, rows, grads.astype(F64))
    np.testing.assert_array_equal(t.pull(space), -expected)
    assert t.stats()["pushes"] == n_pushes
