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

from dataclasses import dataclass
from typing import Any

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "Optimizer"]


@dataclass(frozen=True)
class _Clip:
    def _clip(self) -> dict[str, Any]:
        return {"clip_value": self.clip_value, "clip_norm": self.clip_norm}  # type: ignore[attr-defined]


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

    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False
    clip_value: float | None = None
    clip_norm: float | None = None

    def _spec(self) -> dict[str, Any]:
        return {
            "kind": "sgd",
            "lr": self.lr,
            "momentum": self.momentum,
            "weight_decay": self.weight_decay,
            "nesterov": self.nesterov,
            **self._clip(),
        }


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

    lr: float
    initial_accumulator_value: float = 0.1
    eps: float = 1e-10
    weight_decay: float = 0.0
    clip_value: float | None = None
    clip_norm: float | None = None

    def _spec(self) -> dict[str, Any]:
        return {
            "kind": "adagrad",
            "lr": self.lr,
            "initial_accumulator_value": self.initial_accumulator_value,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            **self._clip(),
        }


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

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_value: float | None = None
    clip_norm: float | None = None

    def _spec(self) -> dict[str, Any]:
        b1, b2 = self.betas
        return {
            "kind": "adam",
            "lr": self.lr,
            "beta1": b1,
            "beta2": b2,
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            **self._clip(),
        }


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

    def _spec(self) -> dict[str, Any]:
        return {
            "kind": "ftrl",
            "lr": self.alpha,
            "beta": self.beta,
            "l1": self.l1,
            "l2": self.l2,
            **self._clip(),
        }


Optimizer = SGD | Adagrad | Adam | Ftrl
