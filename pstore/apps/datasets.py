"""Data sets for the demos: ratings (MovieLens-100k or a synthetic stand-in), Criteo-like clicks.

MovieLens-100k is not downloaded from its home site. The ``recbole`` wheel on PyPI ships it as
``recbole/dataset_example/ml-100k/ml-100k.inter``, a tab-separated file with the header
``user_id:token  item_id:token  rating:float  timestamp:float``. :func:`find_ml100k` looks for that
file, in this order:

1. an explicit path (``--data PATH``): a ``.inter`` file, a wheel, or a directory holding either;
2. the environment variable ``PSTORE_ML100K`` (same forms);
3. an installed ``recbole`` package (located with :func:`importlib.util.find_spec`; recbole itself
   is never imported, since it imports torch);
4. a ``recbole-*.whl`` in the cache directory (``$XDG_CACHE_HOME/pstore``, else
   ``~/.cache/pstore``), read with :mod:`zipfile` without extracting it.

Only when asked to (:func:`fetch_ml100k`, the demo's ``--fetch``) is the wheel downloaded into the
cache directory, with ``python -m pip download --no-deps recbole``.

When none is found, :func:`synthetic_ratings` makes a seeded data set of the same shape with a
planted low-rank signal.

For click-through-rate models, :func:`criteo_like` makes a seeded data set shaped like the Criteo
display-advertising logs (13 numeric and 26 categorical fields, Zipf-skewed ids, vocabularies of
up to millions of ids per field) whose labels come from a planted factorization machine, so the
best achievable AUC is known (:attr:`CTRData.oracle_auc`); :func:`auc` scores predictions.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "CRITEO_CARDINALITIES",
    "ML100K_ENV",
    "ML100K_MEMBER",
    "N_DENSE",
    "CTRData",
    "Ratings",
    "auc",
    "cache_dir",
    "criteo_like",
    "fetch_ml100k",
    "find_ml100k",
    "load_ml100k",
    "load_ratings",
    "parse_inter",
    "synthetic_ratings",
    "train_test_split",
]

ML100K_ENV = "PSTORE_ML100K"
"""Environment variable naming a ``.inter`` file, a recbole wheel, or a directory holding either."""

ML100K_MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"
"""Path of the MovieLens-100k interactions inside the recbole wheel (and package)."""

_INTER_NAME = "ml-100k.inter"
_WHEEL_GLOB = "recbole-*.whl"


@dataclass(frozen=True)
class Ratings:
    """Explicit ratings as parallel arrays.

    Attributes
    ----------
    users, items : numpy.ndarray
        int64 arrays of dense ids, ``0 <= users < n_users`` and ``0 <= items < n_items``.
    ratings : numpy.ndarray
        float32 ratings, same length as ``users``.
    n_users, n_items : int
        Sizes of the id spaces.
    name : str
        Short name of the data set (``"ml-100k"`` or ``"synthetic"``).
    source : str
        Where the data came from, for humans.
    """

    users: np.ndarray
    items: np.ndarray
    ratings: np.ndarray
    n_users: int
    n_items: int
    name: str
    source: str

    def __len__(self) -> int:
        return len(self.ratings)

    def subset(self, index: np.ndarray) -> Ratings:
        """Return the ratings at ``index`` (same id spaces, name and source)."""
        return Ratings(
            users=self.users[index],
            items=self.items[index],
            ratings=self.ratings[index],
            n_users=self.n_users,
            n_items=self.n_items,
            name=self.name,
            source=self.source,
        )


def cache_dir() -> Path:
    """Return pstore's cache directory: ``$XDG_CACHE_HOME/pstore``, else ``~/.cache/pstore``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pstore"


def parse_inter(text: str | bytes, name: str = "ml-100k", source: str = "") -> Ratings:
    """Parse a recbole ``.inter`` file into :class:`Ratings`.

    Parameters
    ----------
    text : str or bytes
        The file's content: a header line of ``field:type`` names separated by tabs, then one
        interaction per line. The ``user_id``, ``item_id`` and ``rating`` columns are used, in
        whatever order they appear; other columns are ignored.
    name, source : str
        Stored in the result.

    Returns
    -------
    Ratings
        User and item tokens mapped to dense ids in sorted token order.

    Raises
    ------
    ValueError
        If a column is missing, a line is short, or a rating is not a number.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    lines = text.splitlines()
    if not lines:
        raise ValueError("empty .inter file")
    header = [field.split(":", 1)[0].strip() for field in lines[0].split("\t")]
    try:
        cols = [header.index(field) for field in ("user_id", "item_id", "rating")]
    except ValueError:
        raise ValueError(
            f"the .inter header must name user_id, item_id and rating; got {lines[0]!r}"
        ) from None
    width = max(cols) + 1
    rows = [line.split("\t") for line in lines[1:] if line.strip()]
    for lineno, row in enumerate(rows, start=2):
        if len(row) < width:
            raise ValueError(f"line {lineno}: expected at least {width} fields, got {len(row)}")
    if not rows:
        raise ValueError("the .inter file has no interactions")
    user_tokens = np.array([row[cols[0]].strip() for row in rows])
    item_tokens = np.array([row[cols[1]].strip() for row in rows])
    ratings = np.array([row[cols[2]] for row in rows], dtype=np.float64).astype(np.float32)
    if not np.isfinite(ratings).all():
        raise ValueError("the .inter file has a non-finite rating")
    user_vocab, users = np.unique(_numeric_order(user_tokens), return_inverse=True)
    item_vocab, items = np.unique(_numeric_order(item_tokens), return_inverse=True)
    return Ratings(
        users=users.astype(np.int64).ravel(),
        items=items.astype(np.int64).ravel(),
        ratings=ratings,
        n_users=len(user_vocab),
        n_items=len(item_vocab),
        name=name,
        source=source,
    )


def _numeric_order(tokens: np.ndarray) -> np.ndarray:
    """Tokens as int64 when they are all integers (so ids sort numerically), else unchanged."""
    try:
        return tokens.astype(np.int64)
    except ValueError:
        return tokens


def _wheel_member(wheel: Path) -> str | None:
    """Name of the ml-100k ``.inter`` member in ``wheel``, or None."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            names = zf.namelist()
    except (OSError, zipfile.BadZipFile):
        return None
    if ML100K_MEMBER in names:
        return ML100K_MEMBER
    return next((n for n in names if n.endswith("/" + _INTER_NAME)), None)


def _resolve(path: Path) -> Path | None:
    """The ``.inter`` file or wheel that ``path`` names or holds, or None."""
    if path.is_file():
        if path.suffix in (".whl", ".zip"):
            return path if _wheel_member(path) else None
        return path
    if path.is_dir():
        for candidate in (
            path / _INTER_NAME,
            path / "ml-100k" / _INTER_NAME,
            path / ML100K_MEMBER,
            path / "dataset_example" / "ml-100k" / _INTER_NAME,
        ):
            if candidate.is_file():
                return candidate
        for wheel in sorted(path.glob(_WHEEL_GLOB), reverse=True):
            if _wheel_member(wheel):
                return wheel
    return None


def find_ml100k(data: str | os.PathLike[str] | None = None) -> Path | None:
    """Find MovieLens-100k without touching the network.

    Parameters
    ----------
    data : str or path-like, optional
        A ``.inter`` file, a wheel (zip) holding ``ml-100k.inter``, or a directory holding either.
        When given, only this place is searched.

    Returns
    -------
    pathlib.Path or None
        A ``.inter`` file or a wheel to pass to :func:`load_ml100k`; None when ``data`` is None and
        nothing was found in the environment variable, the installed ``recbole`` package or the
        cache directory.

    Raises
    ------
    FileNotFoundError
        If ``data`` (or ``$PSTORE_ML100K``) is set but holds no MovieLens-100k file.
    """
    if data is not None:
        found = _resolve(Path(data).expanduser())
        if found is None:
            raise FileNotFoundError(f"no MovieLens-100k .inter file or recbole wheel at {data}")
        return found
    env = os.environ.get(ML100K_ENV)
    if env:
        found = _resolve(Path(env).expanduser())
        if found is None:
            raise FileNotFoundError(
                f"{ML100K_ENV}={env} holds no MovieLens-100k .inter file or recbole wheel"
            )
        return found
    try:
        spec = importlib.util.find_spec("recbole")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            candidate = Path(location) / "dataset_example" / "ml-100k" / _INTER_NAME
            if candidate.is_file():
                return candidate
    cache = cache_dir()
    if cache.is_dir():
        for wheel in sorted(cache.glob(_WHEEL_GLOB), reverse=True):
            if _wheel_member(wheel):
                return wheel
    return None


def fetch_ml100k(directory: str | os.PathLike[str] | None = None) -> Path:
    """Download the recbole wheel from PyPI into ``directory`` (default :func:`cache_dir`).

    Runs ``python -m pip download --no-deps recbole -d DIRECTORY`` with the running interpreter,
    so pip's own configuration (index, proxy, certificates) applies.

    Returns
    -------
    pathlib.Path
        The downloaded wheel.

    Raises
    ------
    RuntimeError
        If pip fails or the wheel holds no ``ml-100k.inter``.
    """
    target = Path(directory) if directory is not None else cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "recbole", "-d", str(target)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr.strip()}")
    for wheel in sorted(target.glob(_WHEEL_GLOB), reverse=True):
        if _wheel_member(wheel):
            return wheel
    raise RuntimeError(f"pip downloaded no recbole wheel holding {_INTER_NAME} into {target}")


def load_ml100k(path: str | os.PathLike[str]) -> Ratings:
    """Load MovieLens-100k from a ``.inter`` file, a wheel, or a directory holding either.

    Parameters
    ----------
    path : str or path-like
        See :func:`find_ml100k`.

    Returns
    -------
    Ratings
        ``name`` is ``"ml-100k"``; ``source`` names the file (and wheel member).
    """
    found = find_ml100k(path)
    assert found is not None
    if found.suffix in (".whl", ".zip"):
        member = _wheel_member(found)
        assert member is not None
        with zipfile.ZipFile(found) as zf:
            text = zf.read(member)
        return parse_inter(text, source=f"{found}!{member}")
    return parse_inter(found.read_bytes(), source=str(found))


def synthetic_ratings(
    n_users: int = 943,
    n_items: int = 1682,
    n_ratings: int = 100_000,
    rank: int = 8,
    noise: float = 0.75,
    seed: int = 0,
) -> Ratings:
    """A seeded MovieLens-100k look-alike with a planted low-rank signal.

    Users and items are drawn with skewed (log-normal) activity and popularity, each pair at most
    once. A rating is ``3.5 + b_u + b_i + <p_u, q_i> + noise``, rounded and clipped to 1..5, with
    user biases of std 0.35, item biases of std 0.45 and a signal ``<p_u, q_i>`` of std about 0.75:
    a model that learns the biases and factors beats the global mean by a wide margin.

    Parameters
    ----------
    n_users, n_items, n_ratings : int
        Sizes; ``n_ratings`` must be at most a third of ``n_users * n_items``.
    rank : int
        Rank of the planted signal.
    noise : float
        Standard deviation of the Gaussian noise added before rounding.
    seed : int
        Seed of every random draw.

    Returns
    -------
    Ratings
        ``name`` is ``"synthetic"``.
    """
    if n_ratings > n_users * n_items // 3:
        raise ValueError("n_ratings must be at most a third of n_users * n_items")
    rng = np.random.default_rng(seed)
    user_weight = rng.lognormal(0.0, 1.0, n_users)
    item_weight = rng.lognormal(0.0, 1.3, n_items)
    # Every user rates at least a few items, as in MovieLens (20 there).
    floor = min(20, n_ratings // (2 * n_users))
    base_users = np.repeat(np.arange(n_users, dtype=np.int64), floor)
    pairs = np.empty(0, dtype=np.int64)
    while len(pairs) < n_ratings:
        draw = 2 * (n_ratings - len(pairs)) + 1000
        users = rng.choice(n_users, size=draw, p=user_weight / user_weight.sum())
        if len(pairs) == 0:
            users[: len(base_users)] = base_users
        items = rng.choice(n_items, size=draw, p=item_weight / item_weight.sum())
        new = users.astype(np.int64) * n_items + items
        _, first = np.unique(np.concatenate([pairs, new]), return_index=True)
        pairs = np.concatenate([pairs, new])[np.sort(first)]
    pairs = pairs[:n_ratings]
    users, items = np.divmod(pairs, n_items)

    scale = 0.75 / np.sqrt(rank)
    p = rng.normal(0.0, np.sqrt(scale), (n_users, rank))
    q = rng.normal(0.0, np.sqrt(scale), (n_items, rank))
    b_u = rng.normal(0.0, 0.35, n_users)
    b_i = rng.normal(0.0, 0.45, n_items)
    signal = 3.5 + b_u[users] + b_i[items] + np.einsum("nk,nk->n", p[users], q[items])
    ratings = np.clip(np.rint(signal + rng.normal(0.0, noise, n_ratings)), 1, 5)
    order = rng.permutation(n_ratings)
    return Ratings(
        users=users[order],
        items=items[order],
        ratings=ratings[order].astype(np.float32),
        n_users=n_users,
        n_items=n_items,
        name="synthetic",
        source=f"seed {seed}, planted rank-{rank} signal, noise std {noise}",
    )


def load_ratings(
    data: str | os.PathLike[str] | None = None,
    fetch: bool = False,
    seed: int = 0,
    log: Callable[[str], object] | None = None,
) -> Ratings:
    """Load MovieLens-100k if it can be found (or fetched), else make synthetic ratings.

    Parameters
    ----------
    data : str or path-like, optional
        ``"synthetic"`` forces the synthetic data set; any other value is a place holding
        MovieLens-100k (see :func:`find_ml100k`) and must exist.
    fetch : bool
        Download the recbole wheel into the cache directory when MovieLens-100k is not found.
    seed : int
        Seed of the synthetic data set.
    log : callable, optional
        Called with a line of text before a download starts.

    Returns
    -------
    Ratings
    """
    if data is not None and str(data) == "synthetic":
        return synthetic_ratings(seed=seed)
    found = find_ml100k(data)
    if found is None and fetch:
        if log is not None:
            log(f"fetching the recbole wheel (it ships MovieLens-100k) into {cache_dir()} ...")
        found = fetch_ml100k()
    if found is None:
        return synthetic_ratings(seed=seed)
    return load_ml100k(found)


def train_test_split(
    ratings: Ratings, test_fraction: float = 0.1, seed: int = 0
) -> tuple[Ratings, Ratings]:
    """Split ``ratings`` with a seeded permutation.

    Parameters
    ----------
    ratings : Ratings
    test_fraction : float
        Share of the ratings that goes to the test set, in (0, 1).
    seed : int

    Returns
    -------
    (Ratings, Ratings)
        The train and test sets.
    """
    if not 0.0 < test_fraction < 1.0:
        raise ValueError("test_fraction must lie in (0, 1)")
    perm = np.random.default_rng(seed).permutation(len(ratings))
    n_test = max(1, round(len(ratings) * test_fraction))
    return ratings.subset(perm[n_test:]), ratings.subset(perm[:n_test])


# --- Criteo-shaped click data ---------------------------------------------------------------------

CRITEO_CARDINALITIES: tuple[int, ...] = (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
)  # fmt: skip
"""Ids per categorical field, about those commonly reported for the Criteo display-advertising
(Kaggle) training set: 26 fields from 3 to about 10 million ids, about 33.8 million in all."""

N_DENSE = 13
"""Numeric fields of a Criteo-shaped data set."""

_PLANTED_DIM = 4  # width of the planted factorization machine's vectors
_FIRST_ORDER_VAR = 0.6  # expected variance of the sum of the first-order weights
_PAIRWISE_VAR = 0.6  # expected variance of the pairwise term
_DENSE_STD = 0.5  # about the std of the numeric fields' linear term
_MEAN_LOGIT = -1.45  # the planted logit's mean over the id laws
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


@dataclass(frozen=True)
class CTRData:
    """Click-through data shaped like Criteo's: numeric and categorical fields, 0/1 labels.

    Attributes
    ----------
    dense : numpy.ndarray
        float32 ``(n, 13)``: the numeric fields, ``log1p`` of non-negative counts.
    sparse : numpy.ndarray
        int64 ``(n, 26)``: raw per-field ids, ``0 <= sparse[:, f] < cardinalities[f]``.
    labels : numpy.ndarray
        float32 ``(n,)`` of 0.0 and 1.0 (clicked).
    probs : numpy.ndarray
        float32 ``(n,)``: the planted model's true click probability of each sample.
    cardinalities : tuple of int
        Ids per categorical field.
    oracle_auc : float
        AUC of ``probs`` against ``labels``: what a model that knew the planted one would score
        on these samples (NaN when they hold only one class).
    name : str
        Short name (``"criteo-like"``).
    source : str
        How the data was made, for humans.
    """

    dense: np.ndarray
    sparse: np.ndarray
    labels: np.ndarray
    probs: np.ndarray
    cardinalities: tuple[int, ...]
    oracle_auc: float
    name: str
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def n_fields(self) -> int:
        """Number of categorical fields."""
        return len(self.cardinalities)

    @property
    def n_dense(self) -> int:
        """Number of numeric fields."""
        return int(self.dense.shape[1])

    @property
    def ctr(self) -> float:
        """Share of positive labels."""
        return float(np.mean(self.labels, dtype=np.float64)) if len(self) else float("nan")

    def subset(self, index: np.ndarray) -> CTRData:
        """The samples at ``index``, with ``oracle_auc`` computed on them."""
        labels = self.labels[index]
        probs = self.probs[index]
        return CTRData(
            dense=self.dense[index],
            sparse=self.sparse[index],
            labels=labels,
            probs=probs,
            cardinalities=self.cardinalities,
            oracle_auc=_auc_or_nan(labels, probs),
            name=self.name,
            source=self.source,
        )

    def split(self, test_fraction: float = 0.1, seed: int = 0) -> tuple[CTRData, CTRData]:
        """Split with a seeded permutation into (train, test), like :func:`train_test_split`.

        Parameters
        ----------
        test_fraction : float
            Share of the samples that goes to the test set, in (0, 1).
        seed : int

        Returns
        -------
        (CTRData, CTRData)
            The train and test sets, each with its own ``oracle_auc``.
        """
        if not 0.0 < test_fraction < 1.0:
            raise ValueError("test_fraction must lie in (0, 1)")
        if len(self) < 2:
            raise ValueError("need at least 2 samples to split")
        perm = np.random.default_rng(seed).permutation(len(self))
        n_test = min(len(self) - 1, max(1, round(len(self) * test_fraction)))
        return self.subset(np.sort(perm[n_test:])), self.subset(np.sort(perm[:n_test]))


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic): a bijection of uint64."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix64_int(x: int) -> int:
    """:func:`_mix64` of one Python int (kept exact with a 64-bit mask)."""
    z = (x + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _key(*parts: int) -> int:
    """A 64-bit key hashed from small non-negative ints (seed, field, purpose, ...)."""
    k = 0x5D1A_7C0F_3E29_B481
    for p in parts:
        k = _mix64_int(k ^ (p & _MASK64))
    return k


def _permute(x: np.ndarray, n: int, key: int) -> np.ndarray:
    """A keyed pseudo-random permutation of ``0..n-1`` applied to ``x`` (uint64 values < n).

    A 4-round Feistel network on the smallest even number of bits covering ``n``, cycle-walked
    until the value falls below ``n``: a bijection of ``0..n-1`` that needs no table.
    """
    if n <= 1:
        return x.copy()
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    round_keys = [np.uint64(_key(key, r)) for r in range(4)]

    def encrypt(v: np.ndarray) -> np.ndarray:
        left, right = v >> half, v & mask
        for rk in round_keys:
            left, right = right, left ^ (_mix64(right ^ rk) & mask)
        return (left << half) | right

    y = encrypt(x)
    walk = np.flatnonzero(y >= np.uint64(n))
    while len(walk):
        y[walk] = encrypt(y[walk])
        walk = walk[y[walk] >= np.uint64(n)]
    return y


def _normals(ids: np.ndarray, key: int, k: int) -> np.ndarray:
    """``(len(ids), k)`` float64 standard normals, a function of ``(key, id)`` alone.

    Each 64-bit hash of ``(key, slot, id)`` gives two 32-bit uniforms and, by Box-Muller, two
    normals.
    """
    out = np.empty((len(ids), k), dtype=np.float64)
    scale = 1.0 / 2.0**32
    for j in range(0, k, 2):
        h = _mix64(ids ^ np.uint64(_key(key, j)))
        u1 = ((h >> np.uint64(32)).astype(np.float64) + 0.5) * scale
        u2 = ((h & np.uint64(0xFFFFFFFF)).astype(np.float64) + 0.5) * scale
        r = np.sqrt(-2.0 * np.log(u1))
        out[:, j] = r * np.cos(2.0 * np.pi * u2)
        if j + 1 < k:
            out[:, j + 1] = r * np.sin(2.0 * np.pi * u2)
    return out


class _Zipf:
    """A Zipf law truncated to ranks ``0..n-1``: ``P(rank r) = (r + 1) ** -a / Z``.

    The first :attr:`EXACT` ranks are exact (a cumulative table); beyond them the law is the
    continuous density ``x ** -a`` on ``[EXACT + 0.5, n + 0.5)``, rank ``r`` taking the mass of
    ``[r + 0.5, r + 1.5)`` (the midpoint rule: relative error below 1e-4 there).
    """

    EXACT = 64

    def __init__(self, n: int, a: float) -> None:
        self.n, self.a = n, a
        self.h = min(n, self.EXACT)
        self.cum_head = np.cumsum(np.arange(1, self.h + 1, dtype=np.float64) ** -a)
        self.head_mass = float(self.cum_head[-1])
        self.lo = self.h + 0.5
        tail = self._integral(n + 0.5) - self._integral(self.lo) if n > self.h else 0.0
        self.total = self.head_mass + float(tail)
        # A look-up table over [0, head_mass) in cells narrower than the rarest exact rank's
        # mass, so a cell holds at most one rank boundary: the cell's first rank, plus one when
        # t lies past that boundary. Much faster than a binary search per draw.
        cells = int(2.0 * self.head_mass / float(self.h**-a)) + 1
        if cells <= 1 << 16:
            starts = np.arange(cells, dtype=np.float64) * (self.head_mass / cells)
            self.lut: np.ndarray | None = np.searchsorted(self.cum_head, starts, side="right")
            self.cells = cells
        else:
            self.lut = None

    def _integral(self, x: float | np.ndarray) -> Any:
        """An antiderivative of ``x ** -a``."""
        return np.log(x) if self.a == 1.0 else np.power(x, 1.0 - self.a) / (1.0 - self.a)

    def ranks(self, u: np.ndarray) -> np.ndarray:
        """int64 ranks from uniforms ``u`` in [0, 1), by inverse CDF."""
        t = u * self.total
        if self.lut is None:
            ranks = np.searchsorted(self.cum_head, t, side="right").astype(np.int64)
        else:
            cell = np.minimum(t * (self.cells / self.head_mass), self.cells - 1).astype(np.int64)
            ranks = np.take(self.lut, cell).astype(np.int64)
            bound = np.take(self.cum_head, np.minimum(ranks, self.h - 1))
            ranks += (t >= bound) & (ranks < self.h)
        tail = np.flatnonzero(t >= self.head_mass)
        if self.n > self.h and len(tail):
            c = self._integral(self.lo) + (t[tail] - self.head_mass)
            if self.a == 1.0:
                x = np.exp(c)
            else:
                x = np.power(np.maximum(c * (1.0 - self.a), 0.0), 1.0 / (1.0 - self.a))
            ranks[tail] = np.floor(x - 0.5).astype(np.int64)
        return np.clip(ranks, 0, self.n - 1)

    def probs(self, m: int) -> np.ndarray:
        """Probabilities of ranks ``0..m-1`` (``m <= n``)."""
        r = np.arange(m, dtype=np.float64)
        p = (r + 1.0) ** -self.a
        tail = r >= self.h
        p[tail] = self._integral(r[tail] + 1.5) - self._integral(r[tail] + 0.5)
        return p / self.total


# Ranks below this get their id and planted parameters from a per-field table (computed once);
# rarer ranks are hashed sample by sample.
_TABLE_RANKS = 8192


def criteo_like(
    n_samples: int,
    *,
    seed: int = 0,
    cardinalities: tuple[int, ...] | list[int] | None = None,
    scale: float = 1.0,
    zipf_a: float = 1.05,
    signal: float = 1.0,
) -> CTRData:
    """A seeded Criteo-shaped click data set with labels from a planted model.

    **Fields.** 26 categorical fields with ``cardinalities`` ids each (default
    :data:`CRITEO_CARDINALITIES`, 33.8 million ids, times ``scale``). In field ``f`` an id's
    popularity rank follows a Zipf law truncated to the field, ``P(rank r) ~ (r + 1) ** -zipf_a``
    (drawn by inverse CDF), and ranks are mapped to ids by a keyed permutation of the field
    (a Feistel network, so popular ids are scattered over ``0..card_f - 1``). 13 numeric fields
    are ``log1p`` of counts drawn from per-field log-normal laws, each zero with some probability.

    **Labels.** The planted model is a factorization machine,
    ``logit = bias + sum_f w_f(x_f) + sum_{f<g} <v_f(x_f), v_g(x_g)> + beta . dense``, with
    ``label ~ Bernoulli(sigmoid(logit))``. The per-id weights ``w_f(id)`` and 4-dim vectors
    ``v_f(id)`` are normals derived from a 64-bit hash of ``(seed, f, id)`` (SplitMix64 and
    Box-Muller), never stored: memory stays proportional to ``n_samples`` whatever the
    cardinalities. Fields differ in how much they matter (seeded per-field scales), and the
    bias is set from the id laws so that the mean logit is the same for every seed. With the
    defaults about a quarter of the labels are positive and the oracle AUC (of the true
    probabilities) is about 0.78; a model can learn the weights of frequent ids, not those of
    ids it sees once.

    The planted model depends on ``seed``, the cardinalities, ``zipf_a`` and ``signal``, not on
    ``n_samples``.

    Parameters
    ----------
    n_samples : int
        Number of samples.
    seed : int
        Seed of the planted model and of every draw; the same arguments give the same data.
    cardinalities : sequence of int, optional
        Ids per categorical field (any number of fields >= 1); default
        :data:`CRITEO_CARDINALITIES`.
    scale : float
        Multiplies every cardinality (rounded, at least 2) -- e.g. ``0.001`` for a small test
        set of the same shape.
    zipf_a : float
        Exponent of the id popularity law (> 0); larger is more skewed.
    signal : float
        Multiplies the planted logit around its mean: 0 makes labels independent of the
        features, larger values raise the oracle AUC.

    Returns
    -------
    CTRData
        ``name`` is ``"criteo-like"``.
    """
    if isinstance(n_samples, bool) or not isinstance(n_samples, int | np.integer) or n_samples < 1:
        raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
    if not zipf_a > 0.0:
        raise ValueError(f"zipf_a must be > 0, got {zipf_a!r}")
    if not scale > 0.0:
        raise ValueError(f"scale must be > 0, got {scale!r}")
    if not (signal >= 0.0 and np.isfinite(signal)):
        raise ValueError(f"signal must be finite and >= 0, got {signal!r}")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    base = CRITEO_CARDINALITIES if cardinalities is None else tuple(cardinalities)
    if not base or any(int(c) < 1 for c in base):
        raise ValueError("cardinalities must be a non-empty sequence of positive ints")
    cards = tuple(max(2, round(int(c) * scale)) if scale != 1.0 else int(c) for c in base)
    n = int(n_samples)
    seed = int(seed)
    n_fields = len(cards)
    k = _PLANTED_DIM

    # The planted model's constants come from their own stream, so they do not depend on n.
    model_rng = np.random.default_rng([seed, 1])
    # Per-field importance: the std of the first-order weights and of the planted vectors. The
    # expected variances of the first-order sum and of the pairwise term are fixed, whatever
    # the number of fields.
    importance = model_rng.uniform(0.05, 1.0, n_fields) ** 2
    importance /= importance.sum()
    w_std = np.sqrt(_FIRST_ORDER_VAR * importance)
    # v_f's std**2 is gamma * sqrt(importance_f): the pairwise term's variance is
    # k gamma**2 sum_{f<g} sqrt(importance_f importance_g) = k gamma**2 (S**2 - 1) / 2.
    root = np.sqrt(importance)
    pair_weight = 0.5 * (root.sum() ** 2 - 1.0)
    gamma = np.sqrt(_PAIRWISE_VAR / (k * pair_weight)) if n_fields > 1 else 0.0
    v_std = np.sqrt(gamma * root)
    scales = np.concatenate([w_std[:, None], np.repeat(v_std[:, None], k, axis=1)], axis=1)
    mu = model_rng.uniform(0.0, 4.0, N_DENSE)
    sigma = model_rng.uniform(0.5, 1.5, N_DENSE)
    p_zero = model_rng.uniform(0.0, 0.4, N_DENSE)
    beta = model_rng.normal(0.0, _DENSE_STD / np.sqrt(N_DENSE), N_DENSE) / sigma

    rng = np.random.default_rng([seed, 2])
    sparse = np.empty((n, n_fields), dtype=np.int64)
    first = np.zeros(n, dtype=np.float64)
    v_sum = np.zeros((n, k), dtype=np.float64)
    v_sq = np.zeros(n, dtype=np.float64)
    mean_w = 0.0  # expected first-order sum and per-field expected vectors (table ranks only)
    mean_v = np.zeros((n_fields, k))
    for f, card in enumerate(cards):
        zipf = _Zipf(card, zipf_a)
        perm_key, param_key = _key(seed, f, 1), _key(seed, f, 2)
        m = min(card, _TABLE_RANKS)
        table_ids = _permute(np.arange(m, dtype=np.uint64), card, perm_key)
        table = _normals(table_ids, param_key, 1 + k) * scales[f]
        table_sq = np.einsum("mk,mk->m", table[:, 1:], table[:, 1:])
        p_table = zipf.probs(m)
        mean_w += float(p_table @ table[:, 0])
        mean_v[f] = p_table @ table[:, 1:]

        ranks = zipf.ranks(rng.random(n))
        if card <= m:  # np.take: much faster than fancy indexing for rows
            ids = np.take(table_ids, ranks)
            z = np.take(table, ranks, axis=0)
            z_sq = np.take(table_sq, ranks)
        else:
            tail = np.flatnonzero(ranks >= m)
            r = np.minimum(ranks, m - 1)
            ids = np.take(table_ids, r)
            z = np.take(table, r, axis=0)
            z_sq = np.take(table_sq, r)
            ids[tail] = _permute(ranks[tail].astype(np.uint64), card, perm_key)
            z[tail] = _normals(ids[tail], param_key, 1 + k) * scales[f]
            z_sq[tail] = np.einsum("nk,nk->n", z[tail, 1:], z[tail, 1:])
        sparse[:, f] = ids.view(np.int64)
        first += z[:, 0]
        v_sum += z[:, 1:]
        v_sq += z_sq
    pairwise = 0.5 * (np.einsum("nk,nk->n", v_sum, v_sum) - v_sq)
    vs = mean_v.sum(axis=0)
    mean_pairwise = 0.5 * (float(vs @ vs) - float(np.einsum("fk,fk->", mean_v, mean_v)))

    # Numeric fields: log1p of log-normal counts, some zero; a planted linear effect.
    counts = np.floor(
        np.exp(mu + sigma * rng.standard_normal((n, N_DENSE), dtype=np.float32)).astype(np.float32)
    )
    counts[rng.random((n, N_DENSE), dtype=np.float32) < p_zero] = 0.0
    dense = np.log(counts + np.float32(1.0))
    linear = (dense - mu) @ beta
    # E[log1p(floor(exp(mu + sigma Z)))] by Gauss-Hermite quadrature, for the bias.
    nodes, weights = np.polynomial.hermite_e.hermegauss(64)
    e_dense = (
        (1.0 - p_zero)
        * (np.log1p(np.floor(np.exp(mu[:, None] + sigma[:, None] * nodes))) @ weights)
        / np.sqrt(2.0 * np.pi)
    )
    mean_linear = float((e_dense - mu) @ beta)

    centre = mean_w + mean_pairwise + mean_linear
    logit = _MEAN_LOGIT + signal * (first + pairwise + linear - centre)
    probs = 1.0 / (1.0 + np.exp(-logit))
    labels = (rng.random(n) < probs).astype(np.float32)
    return CTRData(
        dense=dense,
        sparse=sparse,
        labels=labels,
        probs=probs.astype(np.float32),
        cardinalities=cards,
        oracle_auc=_auc_or_nan(labels, probs),
        name="criteo-like",
        source=(
            f"seed {seed}, {n_fields} categorical fields ({sum(cards):,} ids), Zipf({zipf_a:g}) "
            f"ids, {N_DENSE} numeric fields, planted FM labels (signal {signal:g})"
        ),
    )


def auc(labels: npt.ArrayLike, scores: npt.ArrayLike) -> float:
    """Area under the ROC curve of ``scores`` for binary ``labels`` (Mann-Whitney U).

    Ties count one half: samples are ranked by score, tied scores share their average rank,
    and the AUC is ``(sum of positives' ranks - P (P + 1) / 2) / (P N)``. Vectorised, O(n log n).

    Parameters
    ----------
    labels : array-like
        0/1 (or boolean) labels.
    scores : array-like
        Scores of the same length; higher means more likely positive.

    Returns
    -------
    float

    Raises
    ------
    ValueError
        If the lengths differ, a label is not 0 or 1, a score is NaN, or only one class is
        present.
    """
    y = np.asarray(labels).reshape(-1)
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if y.shape != s.shape:
        raise ValueError(f"labels and scores differ in length: {y.shape[0]} vs {s.shape[0]}")
    if y.dtype != np.bool_:
        if not np.isin(y, (0, 1)).all():
            raise ValueError("labels must be 0 or 1")
        y = y == 1
    if np.isnan(s).any():
        raise ValueError("scores hold NaN")
    n_pos = int(np.count_nonzero(y))
    n_neg = len(y) - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("the AUC needs both positive and negative labels")
    order = np.argsort(s, kind="stable")
    sorted_s = s[order]
    # Tie groups: [start, end) in sorted order; each member's rank is the group's average
    # 1-based rank, (start + 1 + end) / 2.
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    group_rank = (starts + 1 + ends) / 2.0
    ranks = np.repeat(group_rank, ends - starts)
    pos_rank_sum = float(ranks[y[order]].sum())
    return (pos_rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def _auc_or_nan(labels: np.ndarray, scores: np.ndarray) -> float:
    """:func:`auc`, or NaN when only one class is present."""
    y = np.asarray(labels)
    if len(y) == 0 or y.min() == y.max():
        return float("nan")
    return auc(y, scores)
