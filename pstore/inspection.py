"""Reading stores and snapshots without opening them for training.

These are what ``pstore inspect`` shows, for use from Python (the module is not called
``inspect``: that would shadow the standard library's module when a file of this package is run
as a script): the chain of a snapshot, a check of
its files, and the contents of a store directory (which may be open in another process).
"""

from __future__ import annotations

import json
import os
from typing import Any

from pstore import _native

__all__ = ["inspect_store", "snapshot_chain", "verify_snapshot"]


def snapshot_chain(snapshot_dir: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """The manifests of a snapshot's chain, the full snapshot first, each with its directory.

    ``snapshot_dir`` may be an ``s3://BUCKET/PREFIX`` URI: its manifests are read from the
    object store (no part file is downloaded) and each comes with its URI.

    Raises :class:`InvalidArgumentError` if a directory has no manifest (it is not a snapshot)
    and :class:`CorruptError` if a manifest is unreadable, of another version, or names a parent
    that is not the snapshot found there.
    """
    return [(p, json.loads(m)) for p, m in _native.snapshot_chain(os.fspath(snapshot_dir))]


def verify_snapshot(snapshot_dir: str | os.PathLike[str]) -> int:
    """Check every file of a snapshot's chain against its manifest (size, then CRC-32).

    Returns the bytes checked; the first damaged or missing file raises :class:`CorruptError`
    naming it. An ``s3://BUCKET/PREFIX`` snapshot is downloaded with its chain into a staging
    directory (removed afterwards) and checked there.
    """
    return _native.verify_snapshot(os.fspath(snapshot_dir))


def inspect_store(path: str | os.PathLike[str]) -> dict[str, Any]:
    """What a store directory holds, read without opening it for writing.

    Keys: ``format``, ``version``, ``cycle`` (the last flush cycle), ``file_bytes``,
    ``snapshot`` (the record of the store's last snapshot, or None) and ``tables``: per table its
    ``name``, ``record`` (configuration, learning rate, ``seq``, counters), ``rows`` in the
    replica, and the ids ``changed_since_snapshot`` and ``removed_since_snapshot``.
    """
    info = _native.inspect_store(os.fspath(path))
    info["snapshot"] = json.loads(info["snapshot"]) if info["snapshot"] else None
    for t in info["tables"]:
        t["record"] = json.loads(t["record"])
    return info
