"""Rating data sets for the demo: MovieLens-100k when it can be found, else a synthetic stand-in.

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

import numpy as np

__all__ = [
    "ML100K_ENV",
    "ML100K_MEMBER",
    "Ratings",
    "cache_dir",
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
