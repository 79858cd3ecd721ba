"""Optimizers applied inside the store.

Each is a small frozen description; the store applies it to the rows a push touches. Every
optimizer also takes ``clip_value`` (clamp each gradient element to ``[-c, c]``) and ``clip_norm``
(scale a row's gradient down to this L2 norm; a dense table's whole gradient), applied in that
order to the coalesced gradient before the update.

The formulas are those of ``torch.optim`` (SGD with dampening 0, Adagrad with lr_decay 0, Adam
without amsgrad) and FTRL-Proximal (McMahan et al. 2013). Adam on a sparse table counts steps per
row: a row's bias correction uses the number of pushes that touched that row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "Optimizer"]

# The fields every optimizer has besides those of its kind (the core's OptimizerConfig).
_COMMON = ("lr", "clip_value", "clip_norm")


@dataclass(frozen=True)
class _Clip:
    """What the optimizers share: their serde form, the one schema of the core's
    ``OptimizerConfig`` (``{"kind": {kind: {field: value}}, "lr": ..., "clip_value": ...,
    "clip_norm": ...}``; ``tests/test_schema.py`` checks the classes against it)."""

    _kind: ClassVar[str]

    def _kind_fields(self) -> dict[str, Any]:
        """This kind's fields, named as the core names them."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _COMMON}

    @classmethod
    def _from_kind_fields(cls, common: dict[str, Any], kind: dict[str, Any]) -> Any:
        """The optimizer of a serde form's common and kind fields (see ``_kind_fields``)."""
        return cls(**common, **kind)

    def _spec(self) -> dict[str, Any]:
        common = {name: getattr(self, name) for name in _COMMON}
        return {"kind": {self._kind: self._kind_fields()}, **common}


def _from_spec(spec: dict[str, Any]) -> Optimizer:
    """The optimizer of a serde form (``_Clip._spec``)."""
    ((kind, kind_fields),) = spec["kind"].items()
    optimizer: Optimizer = _KINDS[kind]._from_kind_fields(
        {k: spec[k] for k in _COMMON}, kind_fields
    )
    return optimizer


@dataclass(frozen=True)
class SGD(_Clip):
    """Stochastic gradient descent: ``w -= lr * d``.

    Parameters
    ----------
    lr : float
        Learning rate.
    momentum : float
        Heavy-ball momentum; ``buf = momentum * buf + g`` and ``d = buf`` (0 disables it).
    weight_decay : float
        L2 penalty added to the gradient: ``g += weight_decay * w``.
    nesterov : bool
        Nesterov momentum: ``d = g + momentum * buf``.
    """

    _kind: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    clip_value: float | None = None
    clip_norm: float | None = None


@dataclass(frozen=True)
class Adagrad(_Clip):
    """Adagrad: ``sum += g*g; w -= lr * (g / (sqrt(sum) + eps))``.

    Computed in float32, as ``torch.optim.Adagrad`` computes it (the other optimizers compute in
    float64 and round once); the coalesced gradient of duplicate ids is summed in float64 first.

    Parameters
    ----------
    lr : float
        Learning rate.
    initial_accumulator_value : float
        Starting value of ``sum``.
    eps : float
        Added to the denominator.
    weight_decay : float
        L2 penalty added to the gradient.
    """

    _kind: ClassVar[str] = "adagrad"
    lr: float
    initial_accumulator_value: float = 0.1
    eps: float = 1e-10
    weight_decay: float = 0.0
    clip_value: float | None = None
    clip_norm: float | None = None


@dataclass(frozen=True)
class Adam(_Clip):
    """Adam with bias correction (per-row step counts on sparse tables).

    Parameters
    ----------
    lr : float
        Learning rate.
    betas : tuple of float
        Decay rates of the first and second moment estimates.
    eps : float
        Added to the denominator.
    weight_decay : float
        L2 penalty added to the gradient (Adam, not AdamW).
    """

    _kind: ClassVar[str] = "adam"
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_value: float | None = None
    clip_norm: float | None = None

    def _kind_fields(self) -> dict[str, Any]:
        b1, b2 = self.betas
        return {"beta1": b1, "beta2": b2, "eps": self.eps, "weight_decay": self.weight_decay}

    @classmethod
    def _from_kind_fields(cls, common: dict[str, Any], kind: dict[str, Any]) -> Any:
        kind = dict(kind)
        betas = (kind.pop("beta1"), kind.pop("beta2"))
        return cls(**common, betas=betas, **kind)


@dataclass(frozen=True)
class Ftrl(_Clip):
    """FTRL-Proximal (McMahan et al. 2013), per coordinate; ``alpha`` is the learning rate.

    Parameters
    ----------
    alpha : float
        Learning rate.
    beta : float
        Smoothing term of the per-coordinate rate.
    l1 : float
        L1 strength; coordinates with ``|z| <= l1`` are exactly 0.
    l2 : float
        L2 strength.
    """

    _kind: ClassVar[str] = "ftrl"
    alpha: float = 0.05
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0
    clip_value: float | None = None
    clip_norm: float | None = None

    @property
    def lr(self) -> float:
        """The learning rate, ``alpha``."""
        return self.alpha

    def _kind_fields(self) -> dict[str, Any]:
        return {"beta": self.beta, "l1": self.l1, "l2": self.l2}

    @classmethod
    def _from_kind_fields(cls, common: dict[str, Any], kind: dict[str, Any]) -> Any:
        common = dict(common)
        return cls(alpha=common.pop("lr"), **common, **kind)


Optimizer = SGD | Adagrad | Adam | Ftrl

_KINDS: dict[str, type[SGD] | type[Adagrad] | type[Adam] | type[Ftrl]] = {
    c._kind: c for c in (SGD, Adagrad, Adam, Ftrl)
}
