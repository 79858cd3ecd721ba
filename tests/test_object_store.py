"""Snapshots to and restores from an object store (s3://), against a real S3-compatible server:
moto's server mode, started here on 127.0.0.1, with real `pstore serve` processes for the
cluster cases."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import numpy as np
import pytest
from _netutil import child_env, free_port
from test_cluster_snapshot import batch_ids, cluster_rows, declare, train
from test_snapshot import file_rows, read_tombstones

import pstore
from pstore.inspection import snapshot_chain, verify_snapshot

KEY_ID = "pstore-test-key"
SECRET = "pstore-test-secret"


class Moto:
    """`python -m moto.server` on 127.0.0.1 and a free port."""

    def __init__(self, **env: str) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **env},
        )
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=KEY_ID,
            aws_secret_access_key=SECRET,
            region_name="us-east-1",
        )

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def moto() -> Iterator[Moto]:
    server = Moto()
    yield server
    server.stop()


@pytest.fixture
def s3(moto: Moto, monkeypatch: pytest.MonkeyPatch):
    """The environment a user sets for an S3-compatible server (the servers started by the
    test inherit it), and a boto3 client of that server."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    return moto.client()


@pytest.fixture
def bucket(s3) -> str:
    name = f"pstore-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=name)
    return name


def keys(s3, bucket: str, prefix: str) -> list[str]:
    out: list[str] = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        out.extend(o["Key"] for o in page.get("Contents", []))
    return sorted(out)


def download(s3, bucket: str, prefix: str, dest: Path) -> Path:
    """The objects under `prefix`, as files under `dest` (with boto3, not pstore)."""
    for k in keys(s3, bucket, prefix + "/"):
        path = dest / k[len(prefix) + 1 :]
        path.parent.mkdir(parents=True, exist_ok=True)
        s3.download_file(bucket, k, str(path))
    return dest


def tables_of(snap: Path) -> dict[str, dict[int, tuple]]:
    """table -> id -> (step, version, updated_at, freq, weights, state) of a full snapshot."""
    m = json.loads((snap / "manifest.json").read_text())
    assert m["kind"] == "full"
    return {e["name"]: file_rows(snap, e) for e in m["tables"]}


def new_store(rng: np.random.Generator, path: Path | None = None) -> pstore.Store:
    store = pstore.Store(path, num_shards=8) if path else pstore.Store(num_shards=8)
    store.create_sparse_table("adagrad", 8, optimizer=pstore.optim.Adagrad(lr=0.1))
    store.create_sparse_table("adam", 4, optimizer=pstore.optim.Adam(lr=0.01))
    store.create_dense_table("bias", (3,), optimizer=pstore.optim.Adagrad(lr=0.1))
    return store


def step(store: pstore.Store, rng: np.random.Generator, n: int = 300) -> None:
    for name, dim in (("adagrad", 8), ("adam", 4)):
        ids = rng.choice(5000, size=n, replace=False).astype(np.uint64)
        t = store.table(name)
        t.pull(ids)
        t.push(ids, rng.standard_normal((n, dim)).astype(np.float32))
    store.table("bias").push(rng.standard_normal(3).astype(np.float32))


def test_embedded_snapshot_to_s3_restores_bit_exact(s3, bucket, tmp_path, rng):
    store = new_store(rng)
    for _ in range(4):
        step(store, rng)
    uri = f"s3://{bucket}/snaps/0001"  # nothing under snaps/ yet
    m = store.snapshot(uri)
    assert m["kind"] == "full" and m["bytes"] > 0
    objs = keys(s3, bucket, "snaps/")
    assert "snaps/0001/manifest.json" in objs
    assert any(k.endswith(".arrow") for k in objs)
    # What was uploaded is what a local snapshot of the same state holds, file for file.
    store.snapshot(tmp_path / "local")
    got = download(s3, bucket, "snaps/0001", tmp_path / "mirror")
    assert tables_of(got) == tables_of(tmp_path / "local")
    assert verify_snapshot(uri) == verify_snapshot(tmp_path / "local")

    restored = pstore.Store.restore(uri, num_shards=4)
    restored.snapshot(tmp_path / "again")
    # Weights, optimizer state, step, version, update time and count, bit for bit.
    assert tables_of(tmp_path / "again") == tables_of(tmp_path / "local")
    np.testing.assert_array_equal(restored.table("bias").pull(), store.table("bias").pull())
    # Training goes on identically.
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    step(store, a)
    step(restored, b)
    ids = np.arange(5000, dtype=np.uint64)
    for name in ("adagrad", "adam"):
        np.testing.assert_array_equal(restored.table(name).pull(ids), store.table(name).pull(ids))

    # A second snapshot into the same prefix is refused and changes nothing there.
    with pytest.raises(pstore.InvalidArgumentError, match=f"s3://{bucket}/snaps/0001 exists"):
        store.snapshot(uri)
    assert keys(s3, bucket, "snaps/") == objs


@pytest.mark.parametrize("kind", ["memory", "durable"])
def test_incremental_chain_with_tombstones_through_s3(s3, bucket, tmp_path, rng, kind):
    store = new_store(rng, tmp_path / "store" if kind == "durable" else None)
    step(store, rng)
    store.snapshot(f"s3://{bucket}/chain/0000")
    step(store, rng)
    gone1 = np.arange(0, 5000, 7, dtype=np.uint64)
    store.table("adagrad").remove(gone1)
    m1 = store.snapshot(f"s3://{bucket}/chain/0001", incremental=True)
    assert m1["kind"] == "incremental" and m1["parent"]["path"] == "0000"
    step(store, rng)
    gone2 = np.arange(3, 5000, 11, dtype=np.uint64)
    store.table("adam").remove(gone2)
    # An increment under another prefix of the bucket names its parent relatively.
    m2 = store.snapshot(f"s3://{bucket}/later/0002", incremental=True)
    assert m2["parent"]["path"] == "../chain/0001"
    e = next(t for t in m2["tables"] if t["name"] == "adam")
    inc = download(s3, bucket, "later/0002", tmp_path / "inc")
    assert set(read_tombstones(inc, e).tolist()) <= set(gone2.tolist())
    assert len(read_tombstones(inc, e)) > 0

    chain = snapshot_chain(f"s3://{bucket}/later/0002")
    assert [p for p, _ in chain] == [
        f"s3://{bucket}/chain/0000",
        f"s3://{bucket}/chain/0001",
        f"s3://{bucket}/later/0002",
    ]
    assert [c["kind"] for _, c in chain] == ["full", "incremental", "incremental"]

    restored = pstore.Store.restore(f"s3://{bucket}/later/0002", tmp_path / "restored")
    store.snapshot(tmp_path / "want")
    restored.snapshot(tmp_path / "got")
    assert tables_of(tmp_path / "got") == tables_of(tmp_path / "want")
    # Removed ids stay removed (unless a later step touched them again).
    for name, gone in (("adagrad", gone1), ("adam", gone2)):
        live = store.table(name).contains(gone)
        assert not live.all()
        np.testing.assert_array_equal(restored.table(name).contains(gone), live)
    np.testing.assert_array_equal(restored.table("bias").pull(), store.table("bias").pull())
    restored.close()

    # The last snapshot is local now: an increment into the bucket cannot build on it.
    with pytest.raises(pstore.InvalidArgumentError, match="cannot build on"):
        store.snapshot(f"s3://{bucket}/later/0003", incremental=True)
    assert keys(s3, bucket, "later/0003") == []
    store.snapshot(f"s3://{bucket}/later/0003")  # a full one is fine
    # ...and a local increment cannot build on a snapshot in the bucket.
    with pytest.raises(pstore.InvalidArgumentError, match="cannot build on"):
        store.snapshot(tmp_path / "local-inc", incremental=True)
    assert not (tmp_path / "local-inc").exists()
    if kind == "durable":
        store.close()


@pytest.fixture
def cluster(s3, cluster: Callable[[int], list[str]]) -> Callable[[int], list[str]]:
    """conftest's `cluster`, its servers started with the S3 environment."""
    return cluster


def test_cluster_snapshot_to_s3_restores_onto_3_servers_bit_exact(s3, bucket, cluster, tmp_path):
    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(8))
    full = src.snapshot(f"s3://{bucket}/cluster/0001")
    assert full["kind"] == "full" and len(full["parts"]) == 2
    objs = keys(s3, bucket, "cluster/0001/")
    assert "cluster/0001/cluster.json" in objs
    for i in range(2):
        assert f"cluster/0001/server-{i}/manifest.json" in objs
    train(src, range(8, 12))
    gone = np.unique(batch_ids(3))[:20]
    assert src.table("adagrad").remove(gone) == 20
    inc = src.snapshot(f"s3://{bucket}/cluster/0002", incremental=True)
    assert inc["kind"] == "incremental"
    assert inc["parent"] == {"id": full["id"], "path": "0001"}
    with pytest.raises(pstore.InvalidArgumentError, match="holds a cluster snapshot already"):
        src.snapshot(f"s3://{bucket}/cluster/0002")

    addrs = cluster(3)
    report = pstore.restore_cluster(f"s3://{bucket}/cluster/0002", addrs)
    assert report["parts"] == 2 and report["tables"] == 3
    dst = pstore.connect(addrs)
    assert not dst.table("adagrad").contains(gone).any()
    src.snapshot(tmp_path / "want")
    dst.snapshot(tmp_path / "got")
    want, got = cluster_rows(tmp_path / "want"), cluster_rows(tmp_path / "got")
    for name in ("adagrad", "sgd"):
        assert got[name] == want[name], name
    np.testing.assert_array_equal(dst.table("bias").pull(), src.table("bias").pull())


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pstore", *args],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=240,
    )


def test_cli_snapshot_restore_verify_and_reshard_through_s3(s3, bucket, cluster, tmp_path, rng):
    store = new_store(rng, tmp_path / "store")
    step(store, rng)
    store.close()
    uri = f"s3://{bucket}/cli/0001"
    r = run_cli("snapshot", "-q", str(tmp_path / "store"), uri)
    assert r.returncode == 0, r.stderr
    assert uri in r.stdout
    r = run_cli("inspect", "--verify", uri)
    assert r.returncode == 0, r.stderr
    r = run_cli("restore", "-q", uri, str(tmp_path / "restored"))
    assert r.returncode == 0, r.stderr
    assert "restored 1 snapshot(s)" in r.stdout
    with pstore.Store(tmp_path / "store") as a, pstore.Store(tmp_path / "restored") as b:
        ids = np.arange(5000, dtype=np.uint64)
        for name in ("adagrad", "adam"):
            np.testing.assert_array_equal(a.table(name).pull(ids), b.table(name).pull(ids))

    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(4))
    src.snapshot(f"s3://{bucket}/cli/cluster")
    addrs = cluster(3)
    r = run_cli("reshard", f"s3://{bucket}/cli/cluster", *addrs)
    assert r.returncode == 0, r.stderr
    dst = pstore.connect(addrs)
    ids = np.unique(np.concatenate([batch_ids(k) for k in range(4)]))
    np.testing.assert_array_equal(dst.table("sgd").pull(ids), src.table("sgd").pull(ids))

    r = run_cli("restore", "-q", "gs://bucket/x", str(tmp_path / "nope"))
    assert r.returncode != 0 and "gs://" in r.stderr
    assert not (tmp_path / "nope").exists()


def test_bad_locations_are_refused_with_the_uri_and_leave_nothing(s3, bucket, tmp_path, rng):
    store = new_store(rng)
    step(store, rng)
    for bad, says in [
        ("gs://bucket/x", "scheme gs:// is not supported"),
        (f"s3://{bucket}", "no prefix"),
        ("s3://Not_A_Bucket/x", "not a bucket name"),
        (f"s3://{bucket}/a/../b", "segment"),
    ]:
        with pytest.raises(pstore.InvalidArgumentError, match=says):
            store.snapshot(bad)
        with pytest.raises(pstore.InvalidArgumentError, match=says):
            pstore.Store.restore(bad)
    assert keys(s3, bucket, "") == []

    # A bucket that does not exist.
    missing = f"s3://no-such-{bucket}/snap"
    with pytest.raises(pstore.StorageError, match=f"{missing}.*bucket does not exist"):
        store.snapshot(missing)
    with pytest.raises(pstore.StorageError, match="bucket does not exist"):
        pstore.Store.restore(missing)
    # Nothing there, or no manifest: not a snapshot.
    with pytest.raises(pstore.InvalidArgumentError, match=f"s3://{bucket}/nothing is not a"):
        pstore.Store.restore(f"s3://{bucket}/nothing")
    store.snapshot(f"s3://{bucket}/s/0001")
    step(store, rng)
    store.snapshot(f"s3://{bucket}/s/0002", incremental=True)
    s3.delete_object(Bucket=bucket, Key="s/0001/manifest.json")
    with pytest.raises(pstore.InvalidArgumentError, match=f"s3://{bucket}/s/0001 is not a"):
        pstore.Store.restore(f"s3://{bucket}/s/0002")
    with pytest.raises(pstore.InvalidArgumentError, match=f"s3://{bucket}/s/0001 is not a"):
        snapshot_chain(f"s3://{bucket}/s/0002")
    # A damaged file: the error names its URI.
    store.snapshot(f"s3://{bucket}/d/0001")
    part = next(k for k in keys(s3, bucket, "d/0001/") if k.endswith("part-00000.arrow"))
    body = bytearray(s3.get_object(Bucket=bucket, Key=part)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.put_object(Bucket=bucket, Key=part, Body=bytes(body))
    with pytest.raises(pstore.CorruptError, match=f"s3://{bucket}/{part}"):
        pstore.Store.restore(f"s3://{bucket}/d/0001")
    with pytest.raises(pstore.CorruptError, match=f"s3://{bucket}/{part}"):
        verify_snapshot(f"s3://{bucket}/d/0001")
    # A restore into a durable store that fails leaves no store behind.
    with pytest.raises(pstore.CorruptError):
        pstore.Store.restore(f"s3://{bucket}/d/0001", tmp_path / "into")
    assert not (tmp_path / "into").exists()
    # Staging directories are removed, on success and on failure.
    staging = tmp_path / "staging"
    staging.mkdir()
    os.environ["PSTORE_STAGING_DIR"] = str(staging)
    try:
        with pytest.raises(pstore.CorruptError):
            pstore.Store.restore(f"s3://{bucket}/d/0001")
        store.snapshot(f"s3://{bucket}/e/0001")
        pstore.Store.restore(f"s3://{bucket}/e/0001")
    finally:
        del os.environ["PSTORE_STAGING_DIR"]
    assert list(staging.iterdir()) == []


def test_unreachable_endpoint_refused_credentials_and_none(s3, bucket, rng, monkeypatch):
    store = new_store(rng)
    step(store, rng)
    uri = f"s3://{bucket}/x"
    # Nothing listens there: a bounded number of retries, then a clear error.
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    with pytest.raises(pstore.StorageError, match=f"{uri}.*could not be reached"):
        store.snapshot(uri)
    with pytest.raises(pstore.StorageError, match=f"{uri}.*could not be reached"):
        pstore.Store.restore(uri)
    # A server that checks credentials and does not know these.
    strict = Moto(INITIAL_NO_AUTH_ACTION_COUNT="0")
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", strict.endpoint)
        with pytest.raises(pstore.StorageError, match=f"{uri}.*credentials were refused"):
            store.snapshot(uri)
        with pytest.raises(pstore.StorageError, match=f"{uri}.*credentials were refused"):
            pstore.Store.restore(uri)
    finally:
        strict.stop()
    # No credentials at all.
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(pstore.InvalidArgumentError, match=f"{uri}: no credentials"):
        store.snapshot(uri)
    # After the failures a full snapshot is taken, and an increment builds on it.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.meta.endpoint_url)
    store.snapshot(uri)
    step(store, rng)
    assert store.snapshot(f"s3://{bucket}/y", incremental=True)["parent"]["path"] == "x"


def test_cluster_bad_locations(s3, bucket, cluster):
    src = pstore.connect(cluster(2))
    declare(src)
    train(src, range(2))
    with pytest.raises(pstore.InvalidArgumentError, match="scheme gs://"):
        src.snapshot("gs://bucket/x")
    with pytest.raises(pstore.PstoreError, match="bucket does not exist"):
        src.snapshot(f"s3://no-such-{bucket}/c")
    with pytest.raises(pstore.InvalidArgumentError, match=f"s3://{bucket}/none is not a"):
        pstore.restore_cluster(f"s3://{bucket}/none", src.servers)
    src.snapshot(f"s3://{bucket}/c/0001")
    s3.delete_object(Bucket=bucket, Key="c/0001/server-1/manifest.json")
    addrs = cluster(2)
    with pytest.raises(pstore.InvalidArgumentError, match=r"part server-1 .* is missing"):
        pstore.restore_cluster(f"s3://{bucket}/c/0001", addrs)
    assert pstore.connect(addrs).tables() == []
