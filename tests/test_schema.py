"""The optimizers' and initialisers' schema has one source, the core's serde form: the Python
classes, table round trips and the docs are checked against it here."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest

import pstore
from pstore import _native, init, optim

SCHEMA = json.loads(_native.config_schema())
ROOT = Path(__file__).resolve().parent.parent
OPTIMIZER_CLASSES = {c._kind: c for c in (optim.SGD, optim.Adagrad, optim.Adam, optim.Ftrl)}
INITIALIZER_CLASSES = {
    c._kind: c for c in (init.Zeros, init.Constant, init.Uniform, init.Normal, init.TruncatedNormal)
}
# Python's names for a kind's fields where they differ from the core's.
PYTHON_NAMES = {"adam": {"betas": ("beta1", "beta2")}}

OPTIMIZERS = [
    optim.SGD(lr=0.5, momentum=0.9, weight_decay=0.01, nesterov=True, clip_value=3.0),
    optim.Adagrad(lr=0.2, initial_accumulator_value=0.3, eps=1e-6, weight_decay=0.1),
    optim.Adam(lr=0.01, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.2, clip_norm=1.5),
    optim.Ftrl(alpha=0.3, beta=0.5, l1=0.01, l2=0.02, clip_value=2.0, clip_norm=4.0),
]
INITIALIZERS = [
    init.Zeros(),
    init.Constant(0.25),
    init.Uniform(-0.5, 0.5),
    init.Normal(0.1, 0.2),
    init.TruncatedNormal(-0.1, 0.3),
]


def test_every_core_kind_has_one_python_class_and_no_more():
    assert set(SCHEMA["optimizer"]["kinds"]) == set(OPTIMIZER_CLASSES)
    assert set(SCHEMA["initializer"]) == set(INITIALIZER_CLASSES)
    assert {o._kind for o in OPTIMIZERS} == set(OPTIMIZER_CLASSES)
    assert {i._kind for i in INITIALIZERS} == set(INITIALIZER_CLASSES)


@pytest.mark.parametrize("kind", sorted(OPTIMIZER_CLASSES))
def test_an_optimizer_class_carries_exactly_the_core_fields(kind):
    cls = OPTIMIZER_CLASSES[kind]
    spec = next(o for o in OPTIMIZERS if o._kind == kind)._spec()
    assert sorted(k for k in spec if k != "kind") == SCHEMA["optimizer"]["common"]
    assert list(spec["kind"]) == [kind]
    assert sorted(spec["kind"][kind]) == SCHEMA["optimizer"]["kinds"][kind]
    # Every dataclass field is either common, a core field or a documented rename of core fields.
    core = set(SCHEMA["optimizer"]["kinds"][kind]) | set(SCHEMA["optimizer"]["common"])
    renames = PYTHON_NAMES.get(kind, {})
    for f in dataclasses.fields(cls):
        assert f.name in core or f.name in renames or (kind == "ftrl" and f.name == "alpha"), (
            f"{cls.__name__}.{f.name} is not in the core's schema"
        )


@pytest.mark.parametrize("kind", sorted(INITIALIZER_CLASSES))
def test_an_initializer_class_carries_exactly_the_core_fields(kind):
    cls = INITIALIZER_CLASSES[kind]
    assert sorted(f.name for f in dataclasses.fields(cls)) == SCHEMA["initializer"][kind]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o._kind)
@pytest.mark.parametrize("ini", INITIALIZERS, ids=lambda i: i._kind)
def test_configs_round_trip_through_the_core(opt, ini):
    store = pstore.Store(num_shards=2, threads=1)
    t = store.create_sparse_table("t", 4, optimizer=opt, initializer=ini, seed=3)
    d = store.create_dense_table("d", (2, 3), optimizer=opt, initializer=ini)
    assert t.optimizer == opt and d.optimizer == opt
    assert t.initializer == ini and d.initializer == ini


def test_a_field_the_core_does_not_know_is_refused_by_name():
    store = pstore.Store(num_shards=2, threads=1)
    spec = optim.SGD(lr=0.1)._spec()
    spec["kind"]["sgd"]["nestrov"] = True
    with pytest.raises(pstore.InvalidArgumentError, match="unknown field `nestrov`"):
        store._inner.create_sparse_table("t", 4, spec, init.Zeros()._spec(), 0)
    with pytest.raises(pstore.InvalidArgumentError, match="optimizer lr must be finite"):
        store.create_sparse_table("t", 4, optimizer=optim.SGD(lr=math.inf))
    assert "t" not in store


def test_the_docs_list_the_core_fields():
    fmt = (ROOT / "docs" / "FORMAT.md").read_text()
    for kind, fields in SCHEMA["optimizer"]["kinds"].items():
        m = re.search(rf'- `"{kind}"`: `\{{(.*?)\}}`', fmt)
        assert m, f"docs/FORMAT.md lists no fields of optimizer {kind!r}"
        assert sorted(re.findall(r'"(\w+)"', m.group(1))) == fields, kind
    for kind, fields in SCHEMA["initializer"].items():
        if not fields:
            assert f'`"{kind}"`' in fmt, kind
        elif fields == ["value"]:
            assert f'`{{"{kind}": v}}`' in fmt, kind
        else:
            m = re.search(rf'`\{{"{kind}": \{{(.*?)\}}\}}`', fmt)
            assert m and sorted(re.findall(r'"(\w+)"', m.group(1))) == fields, kind
    api = (ROOT / "docs" / "API_SPEC.md").read_text()
    for cls in [*OPTIMIZER_CLASSES.values(), *INITIALIZER_CLASSES.values()]:
        clip = ("clip_value", "clip_norm")
        names = [f.name for f in dataclasses.fields(cls) if f.name not in clip]
        assert signature(api, cls.__name__) == names, cls.__name__


def signature(text: str, name: str) -> list[str]:
    """The parameter names of the first ``name(...)`` in ``text`` (nested parentheses skipped)."""
    m = re.search(rf"(?:^|, ){name}\(", text, re.MULTILINE)
    assert m, f"no signature of {name}"
    depth, args, cur = 1, [], ""
    for ch in text[m.end() :]:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                break
        if depth == 1 and ch == ",":
            args.append(cur)
            cur = ""
        elif depth >= 1:
            cur += ch
    args.append(cur)
    return [a.split("=")[0].strip() for a in args if a.strip()]
