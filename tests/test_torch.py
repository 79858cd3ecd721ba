"""pstore.torch: Embedding and EmbeddingBag backed by a store, against torch's own modules."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import pstore

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import pstore.torch as pt  # noqa: E402

DIM = 6


def _store_and_table(
    seed: int = 0, lr: float = 1.0, dim: int = DIM
) -> tuple[pstore.Store, pstore.SparseTable]:
    store = pstore.Store()
    t = store.create_sparse_table(
        "emb",
        dim,
        optimizer=pstore.optim.SGD(lr=lr),
        initializer=pstore.init.Normal(0.0, 1.0),
        seed=seed,
    )
    return store, t


def _torch_copy(
    t: pstore.SparseTable, n: int, cls: type = nn.EmbeddingBag, **kw: object
) -> nn.Module:
    """A torch module whose row i is the store's row of id i (ids 0..n-1)."""
    m = cls(n, t.dim, **kw)
    with torch.no_grad():
        m.weight.copy_(torch.from_numpy(t.pull(np.arange(n))))
    return m


class _Recorder:
    """A table that records what a module pushes (and applies it to the real table)."""

    def __init__(self, t: pstore.SparseTable) -> None:
        self.t = t
        self.name = t.name
        self.dim = t.dim
        self.seen: list[tuple[np.ndarray, np.ndarray]] = []

    def pull(self, ids: np.ndarray) -> np.ndarray:
        return self.t.pull(ids)

    def contains(self, ids: np.ndarray) -> np.ndarray:
        return self.t.contains(ids)

    def initial_rows(self, ids: np.ndarray) -> np.ndarray:
        return self.t.initial_rows(ids)

    def push_async(self, ids: np.ndarray, grads: np.ndarray) -> pstore.PushHandle:
        self.seen.append((np.asarray(ids).copy(), np.asarray(grads).copy()))
        return self.t.push_async(ids, grads)


def _dense(seen: list[tuple[np.ndarray, np.ndarray]], n: int) -> np.ndarray:
    g = np.zeros((n, DIM), np.float32)
    for ids, grads in seen:
        np.add.at(g, ids.astype(np.int64), grads)
    return g


# torch takes per_sample_weights only with mode="sum".
@pytest.mark.parametrize(
    ("mode", "weighted"), [("sum", False), ("mean", False), ("max", False), ("sum", True)]
)
def test_bag_output_and_gradients_equal_torch(mode: str, weighted: bool) -> None:
    n = 40
    _store, t = _store_and_table()
    ref = _torch_copy(t, n, mode=mode)
    rec = _Recorder(t)
    ours = pt.EmbeddingBag(rec, mode=mode)
    seen = rec.seen
    rng = np.random.default_rng(1)
    ids = torch.from_numpy(rng.integers(0, n, 50))  # duplicates within and across bags
    offsets = torch.tensor([0, 3, 3, 10, 22, 22, 40])  # bags 1 and 5 are empty
    w = torch.from_numpy(rng.random(50).astype(np.float32)) if weighted else None
    target = torch.from_numpy(rng.standard_normal((7, DIM)).astype(np.float32))

    out_ref = ref(ids, offsets, per_sample_weights=w)
    out = ours(ids, offsets, per_sample_weights=w)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=0)
    ((out_ref * target).sum()).backward()
    ((out * target).sum()).backward()
    ours.flush()
    assert len(seen) == 1
    ids_pushed, _ = seen[0]
    assert len(np.unique(ids_pushed)) == len(ids_pushed), "each id pushed once"
    assert set(ids_pushed.tolist()) == set(ids.tolist())
    np.testing.assert_allclose(_dense(seen, n), ref.weight.grad.numpy(), rtol=1e-6, atol=1e-6)


def test_fixed_size_bags_and_embedding_equal_torch() -> None:
    n = 30
    _store, t = _store_and_table(seed=3)
    rec = _Recorder(t)
    seen = rec.seen
    ids = torch.tensor([[1, 2, 2, 29], [0, 0, 0, 0], [7, 8, 9, 1]])
    ref_bag = _torch_copy(t, n, mode="mean")
    bag = pt.EmbeddingBag(rec, mode="mean")
    with torch.no_grad():
        torch.testing.assert_close(bag(ids), ref_bag(ids), rtol=0, atol=0)

    ref_emb = _torch_copy(t, n, cls=nn.Embedding)
    emb = pt.Embedding(rec, staleness=0)
    out = emb(ids)
    assert out.shape == (3, 4, DIM)
    torch.testing.assert_close(out, ref_emb(ids), rtol=0, atol=0)
    (out**2).sum().backward()
    (ref_emb(ids) ** 2).sum().backward()
    np.testing.assert_allclose(_dense(seen, n), ref_emb.weight.grad.numpy(), rtol=1e-6)


def test_pushes_reach_the_optimizer_and_sync_mode_sees_them() -> None:
    _store, t = _store_and_table(lr=0.5)
    emb = pt.Embedding(t, staleness=0)
    ids = torch.tensor([5, 5, 9])
    before = t.pull(np.array([5, 9]))
    emb(ids).sum().backward()
    # d(sum)/d(row) = number of occurrences; SGD lr 0.5 applies it at once (staleness 0).
    np.testing.assert_allclose(t.pull(np.array([5, 9])), before - 0.5 * np.array([[2.0], [1.0]]))
    assert emb.pushes == 1


def test_async_pushes_are_bounded_by_staleness_and_flush_waits() -> None:
    _store, t = _store_and_table(lr=0.1)
    emb = pt.Embedding(t, staleness=2, share_threads=False)
    for _ in range(5):
        emb(torch.tensor([1, 2, 3])).sum().backward()
        assert len(emb._pending) <= 3
    emb.flush()
    assert not emb._pending
    assert t.stats()["pushes"] == 5


@pytest.fixture
def two_torch_threads():  # type: ignore[no-untyped-def]
    """torch on two threads (what a 2-core CI machine has anyway), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("two_torch_threads")
def test_store_work_shares_torchs_threads() -> None:
    from pstore import _native

    assert pt._OPENMP is not None and "libgomp" in pt._OPENMP
    assert _native.openmp_bound() == pt._OPENMP
    _store, t = _store_and_table(lr=1.0)
    emb = pt.Embedding(t, staleness=2)
    assert emb.shares_threads and "share_threads=True" in repr(emb)
    before = t.pull(np.array([1, 2]))
    for step in range(1, 4):
        emb(torch.tensor([1, 2, 2])).sum().backward()
        # Applied in the backward pass, on this thread, which leaves its team afterwards.
        assert not emb._pending and not _native.openmp_joined()
        np.testing.assert_allclose(t.pull(np.array([1, 2])), before - step * np.array([[1], [2]]))
    assert not pt.Embedding(t, share_threads=False).shares_threads
    assert not pt.Embedding(_Recorder(t)).shares_threads  # not an embedded store's table
    torch.set_num_threads(1)  # one torch thread: the other cores are the store pool's
    assert not emb.shares_threads
    with pytest.raises(pstore.InvalidArgumentError, match="share_threads"):
        pt.Embedding(t, share_threads=1)  # type: ignore[arg-type]


@pytest.mark.usefixtures("two_torch_threads")
def test_shared_threads_train_the_same_rows_as_the_own_pool() -> None:
    """Batches large enough for the parallel path (a batch's shards on the team): Adagrad rows
    equal bit for bit to those of the store's own pool."""
    rng = np.random.default_rng(4)
    batches = [torch.from_numpy(rng.integers(0, 30_000, (4000, 6))) for _ in range(3)]
    rows = []
    for share in (True, False):
        store = pstore.Store()
        t = store.create_sparse_table(
            "emb",
            8,
            optimizer=pstore.optim.Adagrad(lr=0.1),
            initializer=pstore.init.Normal(0.0, 0.1),
            seed=3,
        )
        emb = pt.Embedding(t, staleness=0, share_threads=share)
        assert emb.shares_threads is share
        for ids in batches:
            (emb(ids) ** 2).sum().backward()
        emb.flush()
        rows.append(t.pull(np.arange(30_000)))
        assert t.stats()["pushes"] == 3
    np.testing.assert_array_equal(rows[0], rows[1])


@pytest.mark.usefixtures("two_torch_threads")
def test_bad_input_on_the_team_changes_nothing() -> None:
    from pstore import _native

    _store, t = _store_and_table()
    ids = np.arange(5000, dtype=np.uint64)
    before = t.pull(ids)
    grads = np.ones((5000, DIM), np.float32)
    grads[4321, 2] = np.nan
    _native.openmp_join(True)
    try:
        with pytest.raises(pstore.NonFiniteError):
            t.push(ids, grads)
        with pytest.raises(pstore.ShapeError):
            t.push(ids, grads[:10])
        np.testing.assert_array_equal(t.pull(ids), before)
    finally:
        _native.openmp_join(False)
    with pytest.raises(ValueError, match="OpenMP runtime"):
        _native.openmp_bind("no-such-libgomp.so.1")


def test_prefetched_rows_are_the_ones_a_pull_gives() -> None:
    _store, t = _store_and_table(seed=5)
    rec = _Recorder(t)
    emb = pt.Embedding(rec, staleness=1)
    ids = torch.tensor([[3, 4, 4], [9, 3, 1]])
    want = torch.from_numpy(t.pull(np.array([3, 4, 9, 1])))
    emb.prefetch(ids)
    out = emb(ids)
    assert emb.prefetch_hits == 1
    torch.testing.assert_close(out[0, 0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1, 0], want[2], rtol=0, atol=0)
    out.sum().backward()
    emb.flush()
    # The gradient goes to the prefetched keys, each once, as without a prefetch.
    ((keys, grads),) = rec.seen
    assert sorted(keys.tolist()) == [1, 3, 4, 9]
    counts = {1: 1, 3: 2, 4: 2, 9: 1}
    np.testing.assert_array_equal(grads[:, 0], [counts[k] for k in keys.tolist()])


@pytest.mark.parametrize("share", [False, True])
def test_prefetch_keeps_the_staleness_bound(share: bool) -> None:
    """SGD lr 1 with gradient 1 per row: a row's value tells how many pushes it has seen. The
    prefetch of batch k (made after batch k-1's forward pass, before its backward pass) waits
    for pushes 1..k-2, so batch k sees k-2 or k-1 pushes; the staleness-1 bound is k-1 - 1."""
    _store, t = _store_and_table(seed=1)
    emb = pt.Embedding(t, staleness=1, share_threads=share)
    ids = torch.tensor([7, 8])
    start = torch.from_numpy(t.pull(np.array([7, 8])))
    nxt = ids.clone()
    seen = []
    for _ in range(29):
        out = emb(nxt)
        seen.append(round(float((start - out.detach())[0, 0])))
        nxt = ids.clone()  # a new tensor with the same ids
        emb.prefetch(nxt)
        out.sum().backward()
    emb.flush()
    assert emb.prefetch_hits == 28
    for k, pushes in enumerate(seen, start=1):
        assert max(0, k - 2) <= pushes <= k - 1, (k, seen)
    np.testing.assert_allclose(t.pull(np.array([7, 8])), start.numpy() - 29, rtol=1e-6)


def test_a_prefetch_is_used_only_by_the_same_ids() -> None:
    _store, t = _store_and_table(seed=2)
    emb = pt.Embedding(t, staleness=1)
    emb.prefetch(torch.tensor([1, 2]))
    out = emb(torch.tensor([1, 3]))  # other ids: the prefetch is dropped, the pull done
    assert emb.prefetch_hits == 0 and emb._prefetched is None
    torch.testing.assert_close(out, torch.from_numpy(t.pull(np.array([1, 3]))), rtol=0, atol=0)
    emb.prefetch(torch.tensor([1, 2]))
    emb.flush()  # flush() drops it: the next forward pass reads every push
    assert emb._prefetched is None
    emb.prefetch(torch.tensor([4, 5]))
    emb(torch.tensor([4, 5]))  # equal values in another tensor count
    assert emb.prefetch_hits == 1
    sync = pt.Embedding(t, staleness=0)
    sync.prefetch(torch.tensor([1, 2]))  # synchronous: nothing to overlap, a no-op
    assert sync._prefetched is None
    with torch.no_grad():
        emb.prefetch(torch.tensor([1, 2]))
    assert emb._prefetched is None
    with pytest.raises(pstore.DtypeError):
        emb.prefetch(torch.tensor([1.0]))


def test_a_failed_prefetch_raises_in_the_forward_pass() -> None:
    class Failing:
        name, dim = "failing", 2

        def pull(self, ids: np.ndarray) -> np.ndarray:
            raise pstore.InvalidArgumentError("the table is gone")

        def push_async(self, ids: np.ndarray, grads: np.ndarray) -> None:
            raise AssertionError("never reached")

    emb = pt.Embedding(Failing(), staleness=1)
    emb.prefetch(torch.tensor([1, 2]))
    with pytest.raises(pstore.InvalidArgumentError, match="the table is gone"):
        emb(torch.tensor([1, 2]))
    emb.prefetch(torch.tensor([1, 2]))
    emb.flush()  # an unused prefetch's error is dropped with it


def test_no_grad_pulls_without_pushing() -> None:
    _store, t = _store_and_table()
    emb = pt.EmbeddingBag(t, mode="sum")
    with torch.no_grad():
        out = emb(torch.tensor([1, 2]), torch.tensor([0]))
    assert not out.requires_grad
    assert emb.pushes == 0
    # Evaluation creates no rows: unseen ids read their initial value.
    assert len(t) == 0
    np.testing.assert_array_equal(out.numpy()[0], t.initial_rows(np.array([1, 2])).sum(0))
    t.pull(np.array([1]))
    with torch.no_grad():
        again = emb(torch.tensor([1, 2]), torch.tensor([0]))
    assert len(t) == 1
    torch.testing.assert_close(again, out, rtol=0, atol=0)


def test_bad_input() -> None:
    _store, t = _store_and_table()
    with pytest.raises(pstore.InvalidArgumentError):
        pt.EmbeddingBag(t, mode="median")
    with pytest.raises(pstore.InvalidArgumentError):
        pt.Embedding(t, staleness=-1)
    with pytest.raises(pstore.InvalidArgumentError):
        pt.Embedding(object())
    with pytest.raises(pstore.DtypeError):
        pt.Embedding(t)(torch.tensor([1.0, 2.0]))


def test_a_short_training_run_learns() -> None:
    """Logistic regression on bags of ids, weights in the store: the loss falls."""
    store = pstore.Store()
    t = store.create_sparse_table(
        "w", 1, optimizer=pstore.optim.Adagrad(lr=0.3), initializer=pstore.init.Zeros()
    )
    rng = np.random.default_rng(0)
    truth = rng.standard_normal(200).astype(np.float32)
    bag = pt.EmbeddingBag(t, mode="sum", staleness=1)
    bias = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([bias], lr=0.1)
    losses = []
    for _ in range(200):
        ids = rng.integers(0, 200, (64, 5))
        y = torch.from_numpy((truth[ids].sum(1) > 0).astype(np.float32))
        logit = bag(torch.from_numpy(ids))[:, 0] + bias
        loss = nn.functional.binary_cross_entropy_with_logits(logit, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    bag.flush()
    assert np.mean(losses[-20:]) < 0.7 * np.mean(losses[:5])


def test_importing_pstore_does_not_import_torch() -> None:
    code = "import sys, pstore, pstore.serving, pstore.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_same_module_trains_a_remote_store_alike() -> None:
    """Two server processes on loopback: the rows after the same steps equal the embedded
    store's (SGD, synchronous mode, same initial rows)."""
    from _netutil import start_servers, stop_all

    procs = start_servers(2)
    try:
        remote = pstore.connect([p.address for p in procs])
        embedded = pstore.Store()
        tables = [
            s.create_sparse_table(
                "emb",
                DIM,
                optimizer=pstore.optim.SGD(lr=0.1),
                initializer=pstore.init.Normal(0.0, 1.0),
                seed=5,
            )
            for s in (remote, embedded)
        ]
        rng = np.random.default_rng(2)
        batches = [torch.from_numpy(rng.integers(0, 500, 64)) for _ in range(5)]
        offsets = torch.arange(0, 64, 4)
        for t in tables:
            bag = pt.EmbeddingBag(t, mode="mean", staleness=0)
            for ids in batches:
                (bag(ids, offsets) ** 2).sum().backward()
            bag.flush()
        ids = np.unique(np.concatenate([b.numpy() for b in batches]))
        np.testing.assert_allclose(tables[0].pull(ids), tables[1].pull(ids), rtol=1e-6)
        assert tables[0].stats()["pushes"] >= 5
    finally:
        assert stop_all(procs) == [0, 0]
