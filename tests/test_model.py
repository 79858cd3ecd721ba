"""Model-based property test: a sparse table against a dict of numpy rows.

Random sequences of pull / push (duplicate ids, a small id space so collisions happen) / remove /
contains / len run on a real table and on the model; every observation must agree.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import pstore
from pstore import init, optim

F32 = np.float32
F64 = np.float64
DIM = 3
ID_SPACE = 8


class Model:
    """Rows and optimizer state per id, updated with the formulas of docs/API_SPEC.md."""

    def __init__(self, opt, initial_row) -> None:
        self.opt = opt
        self.initial_row = initial_row  # id -> float32 row
        self.rows: dict[int, np.ndarray] = {}
        self.acc: dict[int, np.ndarray] = {}

    def _ensure(self, i: int) -> None:
        if i not in self.rows:
            self.rows[i] = np.array(self.initial_row(i), dtype=F32)
            acc = getattr(self.opt, "initial_accumulator_value", 0.0)
            self.acc[i] = np.full(DIM, acc, dtype=F32)

    def pull(self, ids: list[int]) -> np.ndarray:
        for i in ids:
            self._ensure(i)
        return np.stack([self.rows[i] for i in ids])

    def push(self, ids: list[int], grads: np.ndarray) -> None:
        summed: dict[int, np.ndarray] = {}
        for i, g in zip(ids, grads.astype(F64), strict=True):
            summed[i] = summed[i] + g if i in summed else g
        for i, g in summed.items():
            self._ensure(i)
            w = self.rows[i].astype(F64)
            lr = self.opt.lr
            if isinstance(self.opt, optim.Adagrad):
                s = self.acc[i].astype(F64) + g * g
                self.acc[i] = s.astype(F32)
                w = w - lr * g / (np.sqrt(s) + self.opt.eps)
            else:
                w = w - lr * g
            self.rows[i] = w.astype(F32)

    def remove(self, ids: list[int]) -> int:
        gone = [i for i in set(ids) if i in self.rows]
        for i in gone:
            del self.rows[i]
            del self.acc[i]
        return len(gone)

    def contains(self, ids: list[int]) -> list[bool]:
        return [i in self.rows for i in ids]

    def __len__(self) -> int:
        return len(self.rows)


ids_st = st.lists(st.integers(0, ID_SPACE - 1), min_size=1, max_size=6)
grad_element = st.floats(-4.0, 4.0, width=32, allow_subnormal=False)


@st.composite
def push_op(draw):
    ids = draw(ids_st)
    grads = draw(arrays(np.float32, (len(ids), DIM), elements=grad_element))
    return ("push", ids, grads)


op_st = st.one_of(
    st.tuples(st.just("pull"), ids_st),
    push_op(),
    push_op(),  # pushes twice as often as the other operations
    st.tuples(st.just("remove"), st.lists(st.integers(0, ID_SPACE - 1), min_size=1, max_size=3)),
    st.tuples(st.just("contains"), ids_st),
    st.tuples(st.just("len")),
)

CASES = {
    "sgd_zeros": (optim.SGD(lr=1.0), init.Zeros()),
    "sgd_constant": (optim.SGD(lr=1.0), init.Constant(0.75)),
    "adagrad_constant": (optim.Adagrad(lr=0.5), init.Constant(-0.5)),
    "sgd_normal": (optim.SGD(lr=1.0), init.Normal(0.0, 1.0)),
    "adagrad_normal": (optim.Adagrad(lr=0.5, initial_accumulator_value=0.2), init.Normal(1.0, 0.5)),
}


def initial_rows(initializer, seed):
    """The model's initial value of a row.

    Zeros and Constant are known up front. For Normal the initial row is a pure function of
    (seed, id): it is taken from the first pull of that id on a twin table in another store.
    """
    if isinstance(initializer, init.Zeros):
        return lambda i: np.zeros(DIM, dtype=F32)
    if isinstance(initializer, init.Constant):
        return lambda i: np.full(DIM, initializer.value, dtype=F32)
    twin = pstore.Store(num_shards=1, threads=1).create_sparse_table(
        "twin", DIM, initializer=initializer, seed=seed
    )
    cache: dict[int, np.ndarray] = {}

    def row(i: int) -> np.ndarray:
        if i not in cache:
            cache[i] = twin.pull([i])[0]
        return cache[i]

    return row


@pytest.mark.parametrize("case", CASES)
@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(ops=st.lists(op_st, min_size=1, max_size=30))
def test_sparse_table_matches_model(case, ops):
    opt, initializer = CASES[case]
    seed = 5
    store = pstore.Store(num_shards=3, threads=2)
    t = store.create_sparse_table("emb", DIM, optimizer=opt, initializer=initializer, seed=seed)
    model = Model(opt, initial_rows(initializer, seed))
    for op in ops:
        kind = op[0]
        if kind == "pull":
            ids = op[1]
            fresh = [i for i in ids if i not in model.rows]
            got = t.pull(np.array(ids, dtype=np.uint64))
            expected = model.pull(ids)
            assert got.shape == (len(ids), DIM)
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7)
            for i in fresh:  # a (re-)created row starts exactly at its initial value
                np.testing.assert_array_equal(got[ids.index(i)], model.initial_row(i))
        elif kind == "push":
            _, ids, grads = op
            assert t.push(np.array(ids, dtype=np.int64), grads) is None
            model.push(ids, grads)
        elif kind == "remove":
            assert t.remove(np.array(op[1], dtype=np.uint64)) == model.remove(op[1])
        elif kind == "contains":
            got = t.contains(np.array(op[1], dtype=np.uint64))
            np.testing.assert_array_equal(got, model.contains(op[1]))
        else:
            assert len(t) == len(model)
        assert len(t) == len(model)
    everything = sorted(model.rows)
    if everything:
        np.testing.assert_allclose(
            t.pull(np.array(everything, dtype=np.uint64)),
            model.pull(everything),
            rtol=1e-6,
            atol=1e-7,
        )
