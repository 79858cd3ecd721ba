"""Server-side optimizers against a numpy reference of the formulas in docs/API_SPEC.md.

The reference computes every update in float64 from float32-stored weights and optimizer state and
rounds the results to float32 once per update, as the spec says. Sparse pushes coalesce duplicate
ids (rows summed in float64, one update per unique id).
"""

import dataclasses
import math

import numpy as np
import pytest

import pstore
from pstore import init, optim

F32 = np.float32
F64 = np.float64
RTOL = 1e-6
ATOL = 1e-7


def lr_of(opt) -> float:
    """The learning rate of an optimizer config (Ftrl calls it alpha)."""
    return float(opt.alpha if isinstance(opt, optim.Ftrl) else opt.lr)


class Reference:
    """float64 reference of one optimizer over a float32 parameter block ``w`` of shape (rows, n).

    A sparse table maps each embedding row to a row of ``w``; a dense table is one row holding the
    whole flattened tensor, so clip_norm and the Adam step count are per table.
    """

    def __init__(self, opt, w: np.ndarray) -> None:
        self.opt = opt
        self.lr = lr_of(opt)
        self.w = np.array(w, dtype=F32)
        self.t = np.zeros(len(self.w), dtype=np.int64)
        zeros = np.zeros_like(self.w)
        self.buf = zeros.copy()
        self.m = zeros.copy()
        self.v = zeros.copy()
        self.z = zeros.copy()
        self.n = zeros.copy()
        acc = getattr(opt, "initial_accumulator_value", 0.0)
        self.sum = np.full_like(self.w, F32(acc))

    def push(self, rows: np.ndarray, grads: np.ndarray) -> None:
        """Coalesce duplicate ``rows`` (float64 sum) and update every unique row once."""
        uniq, inverse = np.unique(np.asarray(rows), return_inverse=True)
        g = np.zeros((len(uniq), self.w.shape[1]), dtype=F64)
        np.add.at(g, inverse.reshape(-1), np.asarray(grads, dtype=F64))
        self.update(uniq, g)

    def update(self, r: np.ndarray, g: np.ndarray) -> None:
        opt = self.opt
        lr = self.lr
        g = np.asarray(g, dtype=F64)
        if opt.clip_value is not None:
            g = np.clip(g, -opt.clip_value, opt.clip_value)
        if opt.clip_norm is not None:
            norm = np.sqrt(np.sum(g * g, axis=1, keepdims=True))
            # c / max(norm, c) is exactly 1.0 when norm <= c, else c / norm.
            g = g * (opt.clip_norm / np.maximum(norm, opt.clip_norm))
        w = self.w[r].astype(F64)
        wd = float(getattr(opt, "weight_decay", 0.0))
        if wd:
            g = g + wd * w
        if isinstance(opt, optim.SGD):
            d = g
            if opt.momentum > 0:
                buf = opt.momentum * self.buf[r].astype(F64) + g
                self.buf[r] = buf
                d = g + opt.momentum * buf if opt.nesterov else buf
            w = w - lr * d
        elif isinstance(opt, optim.Adagrad):
            s = self.sum[r].astype(F64) + g * g
            self.sum[r] = s
            w = w - lr * g / (np.sqrt(s) + opt.eps)
        elif isinstance(opt, optim.Adam):
            b1, b2 = (float(b) for b in opt.betas)
            self.t[r] += 1
            t = self.t[r].astype(F64)[:, None]
            m = b1 * self.m[r].astype(F64) + (1 - b1) * g
            v = b2 * self.v[r].astype(F64) + (1 - b2) * g * g
            self.m[r] = m
            self.v[r] = v
            w = w - (lr / (1 - b1**t)) * m / (np.sqrt(v) / np.sqrt(1 - b2**t) + opt.eps)
        elif isinstance(opt, optim.Ftrl):
            n = self.n[r].astype(F64)
            z = self.z[r].astype(F64)
            n_new = n + g * g
            sigma = (np.sqrt(n_new) - np.sqrt(n)) / lr
            z = z + g - sigma * w
            n = n_new
            shrunk = z - np.sign(z) * opt.l1
            w = np.where(
                np.abs(z) <= opt.l1, 0.0, -shrunk / ((opt.beta + np.sqrt(n)) / lr + opt.l2)
            )
            self.z[r] = z
            self.n[r] = n
        else:  # pragma: no cover - a new optimizer needs a reference
            raise AssertionError(f"no reference for {opt!r}")
        self.w[r] = w


OPTIMIZERS = {
    "sgd": lambda **kw: optim.SGD(lr=0.1, **kw),
    "sgd_wd": lambda **kw: optim.SGD(lr=0.1, weight_decay=0.05, **kw),
    "momentum": lambda **kw: optim.SGD(lr=0.05, momentum=0.9, **kw),
    "nesterov_wd": lambda **kw: optim.SGD(
        lr=0.05, momentum=0.8, nesterov=True, weight_decay=0.01, **kw
    ),
    "adagrad": lambda **kw: optim.Adagrad(lr=0.1, **kw),
    "adagrad_opts": lambda **kw: optim.Adagrad(
        lr=0.2, initial_accumulator_value=0.5, eps=1e-3, weight_decay=0.02, **kw
    ),
    "adam": lambda **kw: optim.Adam(lr=0.01, **kw),
    "adam_opts": lambda **kw: optim.Adam(
        lr=0.02, betas=(0.8, 0.99), eps=1e-4, weight_decay=0.01, **kw
    ),
    "ftrl": lambda **kw: optim.Ftrl(alpha=0.1, **kw),
    "ftrl_l1_l2": lambda **kw: optim.Ftrl(alpha=0.3, beta=0.5, l1=0.4, l2=0.2, **kw),
}

CLIPS = {
    "noclip": {},
    "clip_value": {"clip_value": 0.5},
    "clip_norm": {"clip_norm": 1.0},
    "clip_both": {"clip_value": 0.7, "clip_norm": 0.8},
}


def random_grads(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Normal gradients with a log-uniform scale per leading index, so clipping sometimes bites."""
    lead = (shape[0],) + (1,) * (len(shape) - 1)
    scale = np.exp(rng.uniform(np.log(0.05), np.log(3.0), size=lead))
    return (rng.standard_normal(shape) * scale).astype(F32)


def change_lr(table, ref: Reference, step: int) -> None:
    """At step 3 set ``table.lr``; at step 5 call ``set_lr``: both change the rate at run time."""
    if step == 3:
        new = ref.lr * 0.5
        table.lr = new
    elif step == 5:
        new = ref.lr * 3.0
        table.set_lr(new)
    else:
        return
    assert table.lr == pytest.approx(new, rel=1e-6)
    ref.lr = new


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_sparse_matches_reference(store, rng, name, clip):
    opt = OPTIMIZERS[name](**CLIPS[clip])
    dim, n_ids, batch = 8, 16, 24
    t = store.create_sparse_table(
        "emb", dim, optimizer=opt, initializer=init.Uniform(-0.5, 0.5), seed=11
    )
    # Random ids across the whole uint64 range; pull once to learn the initial rows.
    ids = rng.integers(0, np.iinfo(np.uint64).max, size=n_ids, dtype=np.uint64, endpoint=True)
    assert len(np.unique(ids)) == n_ids
    ref = Reference(opt, t.pull(ids))
    for step in range(8):
        change_lr(t, ref, step)
        rows = rng.integers(0, n_ids, size=batch)  # duplicates and untouched rows
        grads = random_grads(rng, (batch, dim))
        t.push(ids[rows], grads)
        ref.push(rows, grads)
        np.testing.assert_allclose(t.pull(ids), ref.w, rtol=RTOL, atol=ATOL, err_msg=f"step {step}")


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_dense_matches_reference(store, rng, name, clip):
    opt = OPTIMIZERS[name](**CLIPS[clip])
    shape = (4, 6)
    d = store.create_dense_table(
        "w", shape, optimizer=opt, initializer=init.Uniform(-0.5, 0.5), seed=5
    )
    w0 = d.pull()
    ref = Reference(opt, w0.reshape(1, -1))
    for step in range(8):
        change_lr(d, ref, step)
        grad = random_grads(rng, (1, *shape))[0]
        d.push(grad)
        ref.update(np.array([0]), grad.reshape(1, -1))
        assert d.step == step + 1
        np.testing.assert_allclose(
            d.pull(), ref.w.reshape(shape), rtol=RTOL, atol=ATOL, err_msg=f"step {step}"
        )


@pytest.mark.parametrize("name", ["adam", "adam_opts"])
def test_adam_step_count_is_per_row(store, rng, name):
    opt = OPTIMIZERS[name]()
    dim = 5
    t = store.create_sparse_table("emb", dim, optimizer=opt, initializer=init.Zeros())
    ids = np.array([10, 20, 30], dtype=np.uint64)
    ref = Reference(opt, t.pull(ids))
    # Row 10 is touched by every push; 20 from the third on; 30 only by the last one.
    schedule = [[0], [0, 0], [0, 1], [1, 0, 1], [2, 0]]
    for rows in schedule:
        grads = random_grads(rng, (len(rows), dim))
        before = t.pull(ids)
        t.push(ids[rows], grads)
        ref.push(np.array(rows), grads)
        after = t.pull(ids)
        np.testing.assert_allclose(after, ref.w, rtol=RTOL, atol=ATOL)
    # A row's first update has t == 1, where bias correction makes the step lr * g / (|g| + eps)
    # (no weight decay here): about lr in magnitude whatever the table's push count is.
    if name == "adam":
        moved = np.abs(after[2] - before[2])
        np.testing.assert_allclose(moved, opt.lr, rtol=1e-4)


def test_duplicates_are_coalesced_before_the_update(store):
    """Adagrad on [7, 7] must equal one update with the summed gradient, not two updates."""
    opt = optim.Adagrad(lr=0.5, initial_accumulator_value=0.1)
    t = store.create_sparse_table("emb", 2, optimizer=opt, initializer=init.Constant(1.0))
    g = np.array([[1.0, -2.0], [0.5, 1.0]], dtype=F32)
    t.push(np.array([7, 7], dtype=np.uint64), g)
    s = g.astype(F64).sum(axis=0)
    acc = 0.1 + s * s
    expected = (1.0 - 0.5 * s / (np.sqrt(acc) + 1e-10)).astype(F32)
    np.testing.assert_allclose(t.pull([7])[0], expected, rtol=RTOL)


def test_hand_computed_scalar_updates(store):
    """A few updates worked out by hand, independent of the vectorised reference."""
    one = np.array([0], dtype=np.uint64)

    def table(name, opt, value):
        return store.create_sparse_table(name, 1, optimizer=opt, initializer=init.Constant(value))

    def push(t, g):
        t.push(one, np.array([[g]], dtype=F32))
        return float(t.pull(one)[0, 0])

    t = table("nesterov", optim.SGD(lr=0.1, momentum=0.9, nesterov=True), 1.0)
    # buf = 0.5, d = 0.5 + 0.9 * 0.5 = 0.95; then buf = 0.95, d = 0.5 + 0.9 * 0.95 = 1.355
    assert push(t, 0.5) == pytest.approx(0.905, rel=1e-6)
    assert push(t, 0.5) == pytest.approx(0.905 - 0.1355, rel=1e-6)

    t = table("momentum", optim.SGD(lr=0.1, momentum=0.5), 0.0)
    assert push(t, 1.0) == pytest.approx(-0.1, rel=1e-6)  # buf = 1
    assert push(t, 1.0) == pytest.approx(-0.1 - 0.15, rel=1e-6)  # buf = 1.5

    t = table("adagrad", optim.Adagrad(lr=0.1), 1.0)
    assert push(t, 2.0) == pytest.approx(1.0 - 0.2 / math.sqrt(4.1), rel=1e-6)

    t = table("adam", optim.Adam(lr=0.01), 0.0)
    assert push(t, 3.0) == pytest.approx(-0.01 * 3.0 / (3.0 + 1e-8), rel=1e-6)

    t = table("ftrl", optim.Ftrl(alpha=0.5, beta=1.0, l1=0.1), 0.0)
    # n = 1, sigma = 2, z = 1, w = -(1 - 0.1) / ((1 + 1) / 0.5)
    assert push(t, 1.0) == pytest.approx(-0.225, rel=1e-6)
    sigma = (math.sqrt(1.04) - 1.0) / 0.5
    z = 1.0 - 0.2 - sigma * -0.225
    assert push(t, -0.2) == pytest.approx(-(z - 0.1) / ((1.0 + math.sqrt(1.04)) / 0.5), rel=1e-6)
    # |z| <= l1 snaps the weight to exactly zero.
    t = table("ftrl_zero", optim.Ftrl(alpha=0.5, l1=1.0), 0.3)
    assert push(t, 0.5) == 0.0

    t = table("clip_value", optim.SGD(lr=1.0, clip_value=0.25), 0.0)
    assert push(t, 10.0) == pytest.approx(-0.25, rel=1e-6)
    assert push(t, -0.1) == pytest.approx(-0.15, rel=1e-6)


def test_clip_norm_is_per_row_on_sparse_tables(store):
    t = store.create_sparse_table(
        "emb", 2, optimizer=optim.SGD(lr=1.0, clip_norm=1.0), initializer=init.Zeros()
    )
    grads = np.array([[3.0, 4.0], [0.3, 0.4]], dtype=F32)  # norms 5 and 0.5
    t.push(np.array([1, 2], dtype=np.uint64), grads)
    np.testing.assert_allclose(t.pull([1, 2]), [[-0.6, -0.8], [-0.3, -0.4]], rtol=RTOL)


def test_clip_norm_is_global_on_dense_tables(store):
    d = store.create_dense_table("w", (2, 2), optimizer=optim.SGD(lr=1.0, clip_norm=1.0))
    d.push(np.array([[3.0, 0.0], [0.0, 4.0]], dtype=F32))  # global norm 5
    np.testing.assert_allclose(d.pull(), [[-0.6, 0.0], [0.0, -0.8]], rtol=RTOL, atol=ATOL)


TORCH_CASES = {
    "sgd": ("SGD", {"lr": 0.1}),
    "sgd_wd": ("SGD", {"lr": 0.1, "weight_decay": 0.05}),
    "momentum": ("SGD", {"lr": 0.05, "momentum": 0.9}),
    "nesterov_wd": ("SGD", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 0.01}),
    "adagrad": ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),  # torch's default is 0
    "adagrad_opts": (
        "Adagrad",
        {"lr": 0.2, "initial_accumulator_value": 0.5, "eps": 1e-3, "weight_decay": 0.02},
    ),
    "adam": ("Adam", {"lr": 0.01}),
    "adam_opts": ("Adam", {"lr": 0.02, "betas": (0.8, 0.99), "eps": 1e-4, "weight_decay": 0.01}),
}


@pytest.mark.parametrize("name", TORCH_CASES)
def test_dense_matches_torch(store, rng, name):
    """Dense tables follow torch.optim (which computes in float32, hence rtol 1e-5)."""
    torch = pytest.importorskip("torch")
    cls_name, kwargs = TORCH_CASES[name]
    shape = (3, 7)
    d = store.create_dense_table(
        "w",
        shape,
        optimizer=getattr(optim, cls_name)(**kwargs),
        initializer=init.Normal(0.0, 1.0),
        seed=3,
    )
    param = torch.nn.Parameter(torch.from_numpy(d.pull()))
    opt = getattr(torch.optim, cls_name)([param], **kwargs)
    for step in range(10):
        if step == 5:
            d.lr = kwargs["lr"] * 0.5
            for group in opt.param_groups:
                group["lr"] = kwargs["lr"] * 0.5
        grad = rng.standard_normal(shape).astype(F32)
        d.push(grad)
        param.grad = torch.from_numpy(grad.copy())
        opt.step()
        np.testing.assert_allclose(
            d.pull(), param.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=f"step {step}"
        )


def test_optimizer_configs_are_frozen_dataclasses_with_documented_defaults():
    assert pstore.optim.SGD is optim.SGD
    sgd = optim.SGD(lr=0.1)
    assert (sgd.momentum, sgd.weight_decay, sgd.nesterov) == (0.0, 0.0, False)
    assert (sgd.clip_value, sgd.clip_norm) == (None, None)
    ada = optim.Adagrad(lr=0.1)
    assert (ada.initial_accumulator_value, ada.eps, ada.weight_decay) == (0.1, 1e-10, 0.0)
    adam = optim.Adam(lr=0.1)
    assert (tuple(adam.betas), adam.eps, adam.weight_decay) == ((0.9, 0.999), 1e-8, 0.0)
    ftrl = optim.Ftrl()
    assert (ftrl.alpha, ftrl.beta, ftrl.l1, ftrl.l2) == (0.05, 1.0, 0.0, 0.0)
    for cfg in (sgd, ada, adam, ftrl):
        assert dataclasses.is_dataclass(cfg)
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.clip_value = 1.0
    assert optim.SGD(lr=0.1, momentum=0.9) == optim.SGD(lr=0.1, momentum=0.9)


def test_table_reports_its_optimizer(store):
    opt = optim.Adam(lr=0.01, betas=(0.8, 0.9), clip_norm=2.0)
    t = store.create_sparse_table("emb", 3, optimizer=opt)
    assert t.optimizer == opt
    assert t.lr == pytest.approx(0.01, rel=1e-6)
    f = store.create_sparse_table("ftrl", 3, optimizer=optim.Ftrl(alpha=0.2))
    assert f.lr == pytest.approx(0.2, rel=1e-6)  # for Ftrl, lr is alpha
