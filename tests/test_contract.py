"""The gRPC wire contract of a store server, checked by an independent client.

Stubs are generated at test time from ``proto/pstore/v1/pstore.proto`` (and a hand-written
``grpc.health.v1`` proto), and every call under test goes through plain grpcio: the contract
file, not pstore's client, is what these tests trust. pstore's own client only reads rows back,
to compare. Every server binds to 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.resources
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
from _netutil import ServerProcess, child_env, free_port
from grpc_tools import protoc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import pstore
from pstore import init, optim
from pstore.server import Server

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto" / "pstore" / "v1" / "pstore.proto"
SERVICE = "pstore.v1.PStore"
TOKEN = "tok"
READ_TOKEN = "ro"
WRITE = (("authorization", f"Bearer {TOKEN}"),)
READ = (("authorization", f"Bearer {READ_TOKEN}"),)
TIMEOUT = 5.0
U64_MAX = 2**64 - 1
Code = grpc.StatusCode

HEALTH_PROTO = """\
syntax = "proto3";
package grpc.health.v1;
message HealthCheckRequest { string service = 1; }
message HealthCheckResponse {
  enum ServingStatus { UNKNOWN = 0; SERVING = 1; NOT_SERVING = 2; SERVICE_UNKNOWN = 3; }
  ServingStatus status = 1;
}
service Health {
  rpc Check(HealthCheckRequest) returns (HealthCheckResponse);
  rpc Watch(HealthCheckRequest) returns (stream HealthCheckResponse);
}
"""
STUB_MODULES = ("pstore_pb2", "pstore_pb2_grpc", "health_pb2", "health_pb2_grpc")


# ---------------------------------------------------------------------------------------------
# Helpers: configs written by hand from the serde definitions, arrays packed as the proto says.


def sgd(lr: float) -> dict[str, Any]:
    """An optimizer object of the config JSON (rust/src/optimizer/mod.rs OptimizerConfig)."""
    return {"kind": {"sgd": {"momentum": 0.0, "weight_decay": 0.0, "nesterov": False}}, "lr": lr}


def sparse_config(dim: int = 4, *, lr: float = 1.0, initializer: Any = None, seed: int = 0) -> str:
    """SparseTableConfig as JSON, lifecycle left to its serde default."""
    ini = {"constant": 0.5} if initializer is None else initializer
    return json.dumps({"dim": dim, "optimizer": sgd(lr), "initializer": ini, "seed": seed})


def dense_config(shape: list[int], *, lr: float = 0.5, initializer: Any = None) -> str:
    """DenseTableConfig as JSON."""
    ini = {"constant": 1.0} if initializer is None else initializer
    return json.dumps({"shape": shape, "optimizer": sgd(lr), "initializer": ini, "seed": 0})


def ids_bytes(ids: Any) -> bytes:
    """Ids as the wire carries them: little-endian u64."""
    return np.asarray(ids, dtype=np.uint64).astype("<u8").tobytes()


def f32_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float32).astype("<f4").tobytes()


def f16_bytes(values: Any) -> bytes:
    return np.asarray(values, dtype=np.float32).astype("<f2").tobytes()


def bf16_bytes(values: Any) -> bytes:
    """bfloat16 of finite float32 values, rounded to nearest even (as the proto says)."""
    bits = np.asarray(values, dtype=np.float32).astype("<f4").view("<u4").astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def u16_bytes(bits: Any) -> bytes:
    return np.asarray(bits, dtype=np.uint16).astype("<u2").tobytes()


def fails(method: Any, request: Any, metadata: Any = WRITE) -> grpc.RpcError:
    """The error a call must end with."""
    with pytest.raises(grpc.RpcError) as e:
        method(request, metadata=metadata, timeout=TIMEOUT)
    return e.value


def ok(method: Any, request: Any, metadata: Any = WRITE) -> Any:
    return method(request, metadata=metadata, timeout=TIMEOUT)


# ---------------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """Python stubs generated from the proto files now, imported from a temporary directory."""
    out = tmp_path_factory.mktemp("stubs")
    (out / "health.proto").write_text(HEALTH_PROTO)
    include = str(importlib.resources.files("grpc_tools") / "_proto")
    for proto in (PROTO, out / "health.proto"):
        argv = [
            "grpc_tools.protoc",
            f"-I{proto.parent}",
            f"-I{include}",
            f"--python_out={out}",
            f"--grpc_python_out={out}",
            str(proto),
        ]
        assert protoc.main(argv) == 0, f"protoc failed on {proto}"
    assert not any(n in sys.modules for n in STUB_MODULES)
    sys.path.insert(0, str(out))
    try:
        mods = {n: importlib.import_module(n) for n in STUB_MODULES}
        assert all(Path(m.__file__).parent == out for m in mods.values())
        yield SimpleNamespace(
            m=mods["pstore_pb2"],
            PStoreStub=mods["pstore_pb2_grpc"].PStoreStub,
            h=mods["health_pb2"],
            HealthStub=mods["health_pb2_grpc"].HealthStub,
        )
    finally:
        sys.path.remove(str(out))
        for n in STUB_MODULES:
            sys.modules.pop(n, None)


def start_server(**kw: Any) -> Server:
    kw.setdefault("token", TOKEN)
    return Server(pstore.Store(num_shards=4, threads=2), host="127.0.0.1", port=0, **kw)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    srv = start_server(read_token=READ_TOKEN)
    yield srv
    srv.stop(grace=5.0)


@pytest.fixture(scope="module")
def channel(server: Server) -> Iterator[grpc.Channel]:
    ch = grpc.insecure_channel(server.address)
    yield ch
    ch.close()


@pytest.fixture(scope="module")
def stub(api: SimpleNamespace, channel: grpc.Channel) -> Any:
    return api.PStoreStub(channel)


@pytest.fixture(scope="module")
def client(server: Server) -> pstore.client.RemoteStore:
    """pstore's own client, only to read back what the plain-grpcio calls did."""
    return pstore.connect([server.address], token=TOKEN, timeout=10.0)


@pytest.fixture
def fresh(api: SimpleNamespace) -> Iterator[SimpleNamespace]:
    """A server of its own (for the clocks, which are server-wide)."""
    srv = start_server(read_token=READ_TOKEN)
    ch = grpc.insecure_channel(srv.address)
    try:
        yield SimpleNamespace(server=srv, channel=ch, stub=api.PStoreStub(ch))
    finally:
        ch.close()
        srv.stop(grace=5.0)


def create(api: SimpleNamespace, stub: Any, name: str, config: str, kind: str = "SPARSE") -> Any:
    m = api.m
    req = m.CreateTableRequest(name=name, kind=getattr(m, kind), config_json=config)
    return ok(stub.CreateTable, req)


@functools.cache
def handle(client: Any, table: str) -> Any:
    """pstore's client's table (looked up once: each look-up is a GetTable call)."""
    return client.table(table)


@pytest.fixture(scope="module", autouse=True)
def _forget_handles() -> Iterator[None]:
    yield
    handle.cache_clear()


def observe(api: SimpleNamespace, stub: Any, client: Any, table: str, ids: Any) -> tuple:
    """What a failed call must not change: rows (read by pstore's client), seq, counters, lr."""
    rows = handle(client, table).pull(np.asarray(ids, dtype=np.uint64))
    info = ok(stub.GetTable, api.m.GetTableRequest(name=table))
    stats = json.loads(info.stats_json)
    return rows.tobytes(), info.seq, info.rows, info.lr, stats["pushes"], stats["ids_pushed"]


def observe_dense(api: SimpleNamespace, stub: Any, client: Any, table: str) -> tuple:
    values = handle(client, table).pull()
    info = ok(stub.GetTable, api.m.GetTableRequest(name=table))
    return values.tobytes(), info.seq, info.lr, json.loads(info.stats_json)["pushes"]


# ---------------------------------------------------------------------------------------------
# 1. Every method through an independent client


def test_create_table_from_a_hand_written_config(api, stub, client):
    m = api.m
    config = sparse_config(4, lr=1.0, initializer={"constant": 0.5}, seed=3)
    req = m.CreateTableRequest(name="hand", kind=m.SPARSE, config_json=config)
    info = ok(stub.CreateTable, req)
    assert (info.name, info.kind, info.dim, list(info.shape)) == ("hand", m.SPARSE, 4, [])
    assert (info.lr, info.rows, info.seq) == (1.0, 0, 0)
    assert (info.stale_policy, info.max_staleness) == (m.APPLY, 0)
    stored = json.loads(info.config_json)
    mine = json.loads(config)
    assert (stored["dim"], stored["initializer"], stored["seed"]) == (4, {"constant": 0.5}, 3)
    assert stored["optimizer"]["kind"] == mine["optimizer"]["kind"]
    assert stored["optimizer"]["lr"] == 1.0

    # pstore's client makes the very same config for the same table...
    client.create_sparse_table(
        "hand_via_client", 4, optimizer=optim.SGD(lr=1.0), initializer=init.Constant(0.5), seed=3
    )
    theirs = ok(stub.GetTable, m.GetTableRequest(name="hand_via_client"))
    assert json.loads(theirs.config_json) == stored
    # ...and sees the hand-made table as an ordinary one.
    t = client.sparse_table("hand")
    assert (t.dim, t.lr, t.seed) == (4, 1.0, 3)

    # Creating again with the same config is idempotent; the read-back JSON makes a twin.
    assert ok(stub.CreateTable, req).config_json == info.config_json
    copy = create(api, stub, "hand_copy", info.config_json)
    assert json.loads(copy.config_json) == stored

    # The same name with another config or kind: ALREADY_EXISTS, and the table is unchanged.
    other = m.CreateTableRequest(name="hand", kind=m.SPARSE, config_json=sparse_config(4, seed=4))
    assert fails(stub.CreateTable, other).code() == Code.ALREADY_EXISTS
    dense = m.CreateTableRequest(name="hand", kind=m.DENSE, config_json=dense_config([4]))
    assert fails(stub.CreateTable, dense).code() == Code.ALREADY_EXISTS
    assert ok(stub.GetTable, m.GetTableRequest(name="hand")).config_json == info.config_json


def test_pull_is_bit_identical_to_the_pstore_client(api, stub, client):
    m = api.m
    normal = {"normal": {"mean": 0.25, "std": 1.5}}
    create(api, stub, "normal", sparse_config(8, initializer=normal, seed=123))
    ids = np.array([0, 1, 7, 2**32, 2**63, U64_MAX, 12345678901234], dtype=np.uint64)

    r = ok(stub.Pull, m.PullRequest(table="normal", ids=ids_bytes(ids)))
    assert (r.dtype, r.dim, r.seq, len(r.rows)) == (m.FLOAT32, 8, 0, len(ids) * 8 * 4)
    rows = np.frombuffer(r.rows, dtype="<f4").reshape(len(ids), 8)
    assert len({row.tobytes() for row in rows}) == len(ids)  # distinct rows: a real comparison
    theirs = client.table("normal").pull(ids)
    assert np.ascontiguousarray(theirs, dtype="<f4").tobytes() == r.rows
    # An int64 id is the same bits as the u64 on the wire.
    assert client.table("normal").pull(ids.view(np.int64)).tobytes() == theirs.tobytes()
    # Pulling again gives the same bits (rows are a function of seed and id).
    assert ok(stub.Pull, m.PullRequest(table="normal", ids=ids_bytes(ids))).rows == r.rows

    # The 16-bit types are the float32 rows rounded to nearest even.
    r16 = ok(stub.Pull, m.PullRequest(table="normal", ids=ids_bytes(ids), dtype=m.FLOAT16))
    assert (r16.dtype, r16.dim) == (m.FLOAT16, 8)
    assert r16.rows == f16_bytes(rows)
    rb = ok(stub.Pull, m.PullRequest(table="normal", ids=ids_bytes(ids), dtype=m.BFLOAT16))
    assert (rb.dtype, rb.dim) == (m.BFLOAT16, 8)
    assert rb.rows == bf16_bytes(rows)
    assert rb.rows != r16.rows


def test_push_with_a_request_id_applies_exactly_once(api, stub, client):
    m = api.m
    create(api, stub, "sgd", sparse_config(4, lr=1.0, initializer={"constant": 0.5}))
    ids = np.array([3, 1, 2**63], dtype=np.uint64)
    g1 = np.array([[0.25] * 4, [-1.5, 2.0, 0.0, 0.125], [1.0, -0.5, 3.0, -2.0]], np.float32)
    pulled = ok(stub.Pull, m.PullRequest(table="sgd", ids=ids_bytes(ids)))
    assert pulled.seq == 0

    req = m.PushRequest(
        table="sgd",
        ids=ids_bytes(ids),
        grads=f32_bytes(g1),
        dtype=m.FLOAT32,
        request_id=m.RequestId(client=0xFEEDFACECAFEBEEF, seq=1),
        pulled_seq=pulled.seq,
    )
    first = ok(stub.Push, req)
    assert (first.applied, first.staleness, first.seq) == (True, 0, 1)
    expected = 0.5 - g1  # SGD, lr 1: exact in float32 for these values
    assert client.table("sgd").pull(ids).tobytes() == expected.tobytes()

    # The same request id again: the first answer, nothing applied.
    assert ok(stub.Push, req) == first
    assert client.table("sgd").pull(ids).tobytes() == expected.tobytes()
    info = ok(stub.GetTable, m.GetTableRequest(name="sgd"))
    assert (info.seq, json.loads(info.stats_json)["pushes"]) == (1, 1)

    # Eight copies of one request at once: one is applied, all get its answer.
    g2 = np.full((3, 4), 0.125, np.float32)
    req2 = m.PushRequest(
        table="sgd", ids=ids_bytes(ids), grads=f32_bytes(g2),
        request_id=m.RequestId(client=0xFEEDFACECAFEBEEF, seq=2), pulled_seq=pulled.seq,
    )  # fmt: skip
    answers = [f.result(timeout=TIMEOUT) for f in [
        stub.Push.future(req2, metadata=WRITE, timeout=TIMEOUT) for _ in range(8)
    ]]  # fmt: skip
    assert all(a == answers[0] for a in answers)
    assert (answers[0].applied, answers[0].staleness, answers[0].seq) == (True, 1, 2)
    expected = expected - g2
    assert client.table("sgd").pull(ids).tobytes() == expected.tobytes()

    # The id, not the body, is what is deduplicated: the same body with a new id applies.
    req3 = m.PushRequest()
    req3.CopyFrom(req2)
    req3.request_id.seq = 3
    third = ok(stub.Push, req3)
    assert (third.applied, third.staleness, third.seq) == (True, 2, 3)
    expected = expected - g2
    assert client.table("sgd").pull(ids).tobytes() == expected.tobytes()

    # Without a request id every push applies.
    no_id = m.PushRequest(table="sgd", ids=ids_bytes(ids), grads=f32_bytes(g2))
    assert [ok(stub.Push, no_id).seq for _ in range(2)] == [4, 5]
    expected = expected - 2 * g2
    assert client.table("sgd").pull(ids).tobytes() == expected.tobytes()


@pytest.mark.parametrize(("dtype", "encode"), [("FLOAT16", f16_bytes), ("BFLOAT16", bf16_bytes)])
def test_push_decodes_16_bit_gradients(api, stub, client, dtype, encode):
    m = api.m
    name = f"push_{dtype.lower()}"
    create(api, stub, name, sparse_config(4, lr=1.0, initializer={"constant": 0.5}))
    ids = np.array([5, 9], dtype=np.uint64)
    g = np.array([[0.5, -2.0, 1.5, 0.0078125], [-0.25, 3.0, 0.0, 96.0]], np.float32)
    assert len(encode(g)) == g.size * 2
    req = m.PushRequest(table=name, ids=ids_bytes(ids), grads=encode(g), dtype=getattr(m, dtype))
    assert ok(stub.Push, req).applied
    assert client.table(name).pull(ids).tobytes() == (0.5 - g).tobytes()


def test_dense_pull_and_push(api, stub, client):
    m = api.m
    info = create(api, stub, "dense", dense_config([2, 3], lr=0.5), kind="DENSE")
    assert (info.kind, info.dim, list(info.shape), info.lr) == (m.DENSE, 0, [2, 3], 0.5)
    assert json.loads(info.config_json)["shape"] == [2, 3]

    r = ok(stub.DensePull, m.DensePullRequest(table="dense"))
    assert (r.dtype, list(r.shape), r.seq) == (m.FLOAT32, [2, 3], 0)
    assert r.values == f32_bytes(np.ones(6))
    assert client.table("dense").pull().tobytes() == r.values

    g = np.array([1.0, -2.0, 0.5, 0.0, 4.0, -0.25], np.float32)
    req = m.DensePushRequest(
        table="dense", grad=f32_bytes(g), request_id=m.RequestId(client=7, seq=1), pulled_seq=0
    )
    first = ok(stub.DensePush, req)
    assert (first.applied, first.staleness, first.seq) == (True, 0, 1)
    expected = (1.0 - 0.5 * g).astype(np.float32)
    assert ok(stub.DensePush, req) == first  # a retry: applied once
    r = ok(stub.DensePull, m.DensePullRequest(table="dense"))
    assert (r.values, r.seq) == (expected.tobytes(), 1)
    assert client.table("dense").pull().tobytes() == expected.tobytes()
    assert client.table("dense").step == 1

    r16 = ok(stub.DensePull, m.DensePullRequest(table="dense", dtype=m.FLOAT16))
    assert (r16.dtype, r16.values) == (m.FLOAT16, f16_bytes(expected))
    # A gradient sent as bfloat16 is decoded as such.
    g16 = np.array([2.0, 2.0, 2.0, 2.0, 2.0, 2.0], np.float32)
    req16 = m.DensePushRequest(table="dense", grad=bf16_bytes(g16), dtype=m.BFLOAT16)
    assert ok(stub.DensePush, req16).seq == 2
    assert client.table("dense").pull().tobytes() == (expected - 1.0).tobytes()


def test_contains_and_remove(api, stub, client):
    m = api.m
    create(api, stub, "cr", sparse_config(2))
    ok(stub.Pull, m.PullRequest(table="cr", ids=ids_bytes([1, 2, 3])))
    probe = ids_bytes([1, 2, 3, 4])
    assert ok(stub.Contains, m.ContainsRequest(table="cr", ids=probe)).mask == b"\x01\x01\x01\x00"
    assert client.table("cr").contains(np.array([1, 2, 3, 4], np.uint64)).tolist() == [
        True, True, True, False,
    ]  # fmt: skip

    rid = m.RequestId(client=99, seq=1)
    req = m.RemoveRequest(table="cr", ids=ids_bytes([2, 4]), request_id=rid)
    assert ok(stub.Remove, req).removed == 1
    assert ok(stub.Contains, m.ContainsRequest(table="cr", ids=probe)).mask == b"\x01\x00\x01\x00"
    # Row 2 comes back; a retry of the remove gets the first answer and removes nothing.
    ok(stub.Pull, m.PullRequest(table="cr", ids=ids_bytes([2])))
    assert ok(stub.Remove, req).removed == 1
    assert ok(stub.Contains, m.ContainsRequest(table="cr", ids=probe)).mask == b"\x01\x01\x01\x00"
    # Without an id it removes again; empty ids answer an empty mask.
    no_id = m.RemoveRequest(table="cr", ids=ids_bytes([2, 3, 4]))
    assert ok(stub.Remove, no_id).removed == 2
    assert client.table("cr").contains(np.array([1, 2, 3], np.uint64)).tolist() == [
        True, False, False,
    ]  # fmt: skip
    assert ok(stub.Contains, m.ContainsRequest(table="cr", ids=b"")).mask == b""


def test_list_get_set_lr_drop_and_status(api, stub, client):
    m = api.m
    create(api, stub, "lr", sparse_config(2, lr=1.0, initializer={"constant": 0.5}))
    tables = {t.name: t for t in ok(stub.ListTables, m.ListTablesRequest()).tables}
    assert "lr" in tables
    assert tables["lr"] == ok(stub.GetTable, m.GetTableRequest(name="lr"))
    assert set(tables) == set(client.tables())

    info = ok(stub.SetLr, m.SetLrRequest(table="lr", lr=0.25))
    assert (info.name, info.lr) == ("lr", 0.25)
    assert ok(stub.GetTable, m.GetTableRequest(name="lr")).lr == 0.25
    assert client.sparse_table("lr").lr == 0.25
    ok(stub.Push, m.PushRequest(table="lr", ids=ids_bytes([1]), grads=f32_bytes([1.0, -2.0])))
    assert client.table("lr").pull(np.array([1], np.uint64)).tolist() == [[0.25, 1.0]]
    for bad in (0.0, -1.0, math.nan, math.inf):
        err = fails(stub.SetLr, m.SetLrRequest(table="lr", lr=bad))
        assert err.code() == Code.INVALID_ARGUMENT, bad
    assert ok(stub.GetTable, m.GetTableRequest(name="lr")).lr == 0.25

    status = ok(stub.Status, m.StatusRequest())
    assert status.protocol == 1
    assert status.version == pstore.__version__
    assert (status.path, status.durability, status.flush_lag_seconds) == ("", "memory", 0.0)
    assert status.max_message_bytes == 64 << 20
    assert status.uptime_seconds > 0
    names = {t.name for t in ok(stub.ListTables, m.ListTablesRequest()).tables}
    assert {t.name for t in status.tables} == names

    assert ok(stub.DropTable, m.DropTableRequest(name="lr")).dropped is True
    assert ok(stub.DropTable, m.DropTableRequest(name="lr")).dropped is False  # a retry
    assert fails(stub.GetTable, m.GetTableRequest(name="lr")).code() == Code.NOT_FOUND
    assert "lr" not in {t.name for t in ok(stub.ListTables, m.ListTablesRequest()).tables}
    assert ok(stub.Flush, m.FlushRequest()).durable is False  # an in-memory server


def test_an_answer_of_a_few_hundred_bytes_comes_without_a_nagle_delay(api, stub):
    """Accepted sockets have TCP_NODELAY: an answer of more than ~400 bytes used to wait ~40 ms
    for the client's delayed ACK (tonic ignores the builder's tcp_nodelay on an own listener)."""
    m = api.m
    create(api, stub, "latency", sparse_config(2))
    req = m.PullRequest(table="latency", ids=ids_bytes(np.arange(200)))  # a 1600-byte answer
    ok(stub.Pull, req)
    took = []
    for _ in range(9):
        t0 = time.perf_counter()
        ok(stub.Pull, req)
        took.append(time.perf_counter() - t0)
    assert sorted(took)[4] < 0.02, took


def test_health_service_reports_serving(api, channel):
    h = api.h
    health = api.HealthStub(channel)
    serving = h.HealthCheckResponse.SERVING
    for service in (SERVICE, ""):
        r = health.Check(h.HealthCheckRequest(service=service), metadata=WRITE, timeout=TIMEOUT)
        assert r.status == serving, service
    with pytest.raises(grpc.RpcError) as e:
        health.Check(h.HealthCheckRequest(service="no.such"), metadata=WRITE, timeout=TIMEOUT)
    assert e.value.code() == Code.NOT_FOUND


def test_clock_reports_and_waits(api, fresh):
    m, stub = api.m, fresh.stub

    def clock(metadata: Any = WRITE, **kw: Any) -> Any:
        return ok(stub.Clock, m.ClockRequest(**kw), metadata)

    r = clock(worker=0, num_workers=2, clock=1, advance=True)
    assert (list(r.clocks), r.min_clock, r.max_clock) == ([1, 0], 0, 1)
    # Reading the clocks is a read; reporting one is a write.
    assert list(clock(READ).clocks) == [1, 0]
    err = fails(stub.Clock, m.ClockRequest(worker=1, num_workers=2, clock=5, advance=True), READ)
    assert err.code() == Code.PERMISSION_DENIED
    err = fails(stub.Clock, m.ClockRequest(worker=2, num_workers=2, clock=1, advance=True))
    assert err.code() == Code.INVALID_ARGUMENT
    assert list(clock().clocks) == [1, 0]

    # BSP: worker 0 at clock 1 waits until worker 1 reaches 1 too.
    waiting = stub.Clock.future(
        m.ClockRequest(worker=0, num_workers=2, clock=1, wait=True, advance=True),
        metadata=WRITE, timeout=30,
    )  # fmt: skip
    time.sleep(0.3)
    assert not waiting.done()
    assert list(clock(worker=1, num_workers=2, clock=1, advance=True).clocks) == [1, 1]
    r = waiting.result(timeout=TIMEOUT)
    assert (list(r.clocks), r.min_clock, r.max_clock) == ([1, 1], 1, 1)
    # SSP: clock 3 with staleness 2 needs the slowest at >= 1: at once.
    r = clock(worker=0, num_workers=2, clock=3, wait=True, staleness=2, advance=True)
    assert (list(r.clocks), r.min_clock) == ([3, 1], 1)
    s = ok(stub.Status, m.StatusRequest(), READ)
    assert (list(s.clocks.clocks), s.clocks.min_clock, s.clocks.max_clock) == ([3, 1], 1, 3)


# ---------------------------------------------------------------------------------------------
# 2. Authentication


@pytest.mark.parametrize(
    "metadata",
    [
        (),
        (("authorization", "Bearer wrong"),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("authorization", f"Bearer {TOKEN[:-1]}"),),
        (("authorization", f"Basic {TOKEN}"),),
        (("authorization", TOKEN),),
        (("authorization", "Bearer "),),
    ],
    ids=["none", "wrong", "longer", "shorter", "basic", "no-scheme", "empty"],
)
def test_without_a_valid_token_every_call_is_unauthenticated(api, stub, client, metadata):
    m = api.m
    create(api, stub, "auth", sparse_config(2))
    ids = [1, 2]
    before = observe(api, stub, client, "auth", ids)
    calls = [
        (stub.Status, m.StatusRequest()),
        (stub.ListTables, m.ListTablesRequest()),
        (stub.GetTable, m.GetTableRequest(name="auth")),
        (stub.Pull, m.PullRequest(table="auth", ids=ids_bytes(ids))),
        (stub.Contains, m.ContainsRequest(table="auth", ids=ids_bytes(ids))),
        (stub.Push, m.PushRequest(table="auth", ids=ids_bytes(ids), grads=f32_bytes(np.ones(4)))),
        (stub.Remove, m.RemoveRequest(table="auth", ids=ids_bytes(ids))),
        (stub.SetLr, m.SetLrRequest(table="auth", lr=0.1)),
        (stub.DropTable, m.DropTableRequest(name="auth")),
        (stub.CreateTable, m.CreateTableRequest(name="auth_new", config_json=sparse_config(2))),
        (stub.Clock, m.ClockRequest()),
    ]
    for method, request in calls:
        assert fails(method, request, metadata).code() == Code.UNAUTHENTICATED, request
    assert observe(api, stub, client, "auth", ids) == before
    assert fails(stub.GetTable, m.GetTableRequest(name="auth_new")).code() == Code.NOT_FOUND


def test_a_read_only_token_reads_and_changes_nothing(api, stub, client, tmp_path):
    m = api.m
    create(api, stub, "ro", sparse_config(2))
    create(api, stub, "ro_dense", dense_config([3]), kind="DENSE")
    ids = [1, 2]
    ok(stub.Pull, m.PullRequest(table="ro", ids=ids_bytes(ids)))
    before = observe(api, stub, client, "ro", ids)
    dense_before = observe_dense(api, stub, client, "ro_dense")

    pulled = ok(stub.Pull, m.PullRequest(table="ro", ids=ids_bytes(ids)), READ)
    assert pulled.rows == before[0]
    assert ok(stub.Status, m.StatusRequest(), READ).protocol == 1
    assert ok(stub.GetTable, m.GetTableRequest(name="ro"), READ).name == "ro"
    assert "ro" in {t.name for t in ok(stub.ListTables, m.ListTablesRequest(), READ).tables}
    assert ok(stub.Contains, m.ContainsRequest(table="ro", ids=ids_bytes(ids)), READ).mask == (
        b"\x01\x01"
    )
    assert ok(stub.DensePull, m.DensePullRequest(table="ro_dense"), READ).values == dense_before[0]
    assert list(ok(stub.Clock, m.ClockRequest(), READ).clocks) == []

    snap = tmp_path / "snap"
    writes = [
        (stub.Push, m.PushRequest(table="ro", ids=ids_bytes(ids), grads=f32_bytes(np.ones(4)))),
        (stub.CreateTable, m.CreateTableRequest(name="ro_new", config_json=sparse_config(2))),
        (stub.DropTable, m.DropTableRequest(name="ro")),
        (stub.Remove, m.RemoveRequest(table="ro", ids=ids_bytes(ids))),
        (stub.Evict, m.EvictRequest(table="ro", not_updated_for_steps=1)),
        (stub.SetLr, m.SetLrRequest(table="ro", lr=0.5)),
        (stub.DensePush, m.DensePushRequest(table="ro_dense", grad=f32_bytes(np.ones(3)))),
        (stub.Flush, m.FlushRequest()),
        (stub.Snapshot, m.SnapshotRequest(dir=str(snap))),
        (stub.Clock, m.ClockRequest(worker=0, num_workers=1, clock=1, advance=True)),
    ]
    for method, request in writes:
        assert fails(method, request, READ).code() == Code.PERMISSION_DENIED, request
    assert observe(api, stub, client, "ro", ids) == before
    assert observe_dense(api, stub, client, "ro_dense") == dense_before
    assert fails(stub.GetTable, m.GetTableRequest(name="ro_new")).code() == Code.NOT_FOUND
    assert not snap.exists()
    assert list(ok(stub.Clock, m.ClockRequest()).clocks) == []


# ---------------------------------------------------------------------------------------------
# 3. Bad input: the right status, and nothing changed

BAD_IDS = [11, 12, 2**63 + 5]
BAD_DIM = 4


def valid_push(table: str = "bad") -> dict[str, Any]:
    grads = np.full((len(BAD_IDS), BAD_DIM), 0.25, np.float32)
    return {"table": table, "ids": ids_bytes(BAD_IDS), "grads": f32_bytes(grads), "dtype": 0}


def grads_with(value: float, at: int, dtype: int = 0) -> bytes:
    """Gradients (0.25 each) with one element replaced, as float32 (0) or float16 (1)."""
    g = np.full(len(BAD_IDS) * BAD_DIM, 0.25, np.float32)
    g[at] = value
    return f16_bytes(g) if dtype == 1 else f32_bytes(g)


def halves_with(bits: int, at: int) -> bytes:
    """bfloat16 gradients (0.25 each) with one element replaced by raw bits."""
    b = np.full(len(BAD_IDS) * BAD_DIM, 0x3E80, np.uint16)
    b[at] = bits
    return u16_bytes(b)


BAD_PUSHES: dict[str, tuple[grpc.StatusCode, Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "ids-one-byte-short": (Code.INVALID_ARGUMENT, lambda f: {**f, "ids": f["ids"][:-1]}),
    "ids-one-byte-long": (Code.INVALID_ARGUMENT, lambda f: {**f, "ids": f["ids"] + b"\0"}),
    "ids-one-id-short": (Code.INVALID_ARGUMENT, lambda f: {**f, "ids": f["ids"][:-8]}),
    "grads-one-value-short": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": f["grads"][:-4]}),
    "grads-one-value-long": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "grads": f["grads"] + f32_bytes([1.0])},
    ),
    "grads-odd-bytes": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": f["grads"][:-1]}),
    "grads-empty": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": b""}),
    "float32-bytes-labelled-float16": (Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 1}),
    "float16-bytes-labelled-float32": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "grads": f16_bytes(np.full(12, 0.25))},
    ),
    "nan-last": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": grads_with(math.nan, -1)}),
    "inf-first": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": grads_with(math.inf, 0)}),
    "minus-inf-middle": (Code.INVALID_ARGUMENT, lambda f: {**f, "grads": grads_with(-math.inf, 5)}),
    "float16-inf": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 1, "grads": grads_with(math.inf, 11, 1)},
    ),
    "float16-nan": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 1, "grads": grads_with(math.nan, 4, 1)},
    ),
    "bfloat16-nan": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 2, "grads": halves_with(0x7FC1, 7)},
    ),
    "bfloat16-minus-inf": (
        Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 2, "grads": halves_with(0xFF80, 11)},
    ),
    "dtype-3": (Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": 3}),
    "dtype-negative": (Code.INVALID_ARGUMENT, lambda f: {**f, "dtype": -1}),
    "unknown-table": (Code.NOT_FOUND, lambda f: {**f, "table": "no_such_table"}),
    "empty-table-name": (Code.NOT_FOUND, lambda f: {**f, "table": ""}),
    "dense-table": (Code.INVALID_ARGUMENT, lambda f: {**f, "table": "bad_dense"}),
}  # fmt: skip


@pytest.fixture(scope="module")
def bad_tables(api, stub, client) -> None:
    """A sparse table whose rows differ from their initial value, and a dense one."""
    create(api, stub, "bad", sparse_config(BAD_DIM, lr=1.0, initializer={"constant": 0.5}))
    create(api, stub, "bad_dense", dense_config([3]), kind="DENSE")
    g = np.arange(len(BAD_IDS) * BAD_DIM, dtype=np.float32) / 8
    ok(stub.Push, api.m.PushRequest(table="bad", ids=ids_bytes(BAD_IDS), grads=f32_bytes(g)))


@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_a_rejected_push_changes_nothing(api, stub, client, bad_tables, case):
    m = api.m
    code, mutate = BAD_PUSHES[case]
    rid = m.RequestId(client=0xBAD, seq=sorted(BAD_PUSHES).index(case))
    before = observe(api, stub, client, "bad", BAD_IDS)
    dense_before = observe_dense(api, stub, client, "bad_dense")
    err = fails(stub.Push, m.PushRequest(**mutate(valid_push()), request_id=rid))
    assert err.code() == code, err.details()
    assert observe(api, stub, client, "bad", BAD_IDS) == before
    assert observe_dense(api, stub, client, "bad_dense") == dense_before

    # The failed attempt is not remembered: its request id with a valid body applies.
    r = ok(stub.Push, m.PushRequest(**valid_push(), request_id=rid))
    assert (r.applied, r.seq) == (True, before[1] + 1)
    rows = np.frombuffer(before[0], np.float32).reshape(len(BAD_IDS), BAD_DIM)
    assert client.table("bad").pull(np.array(BAD_IDS, np.uint64)).tobytes() == (
        (rows - np.float32(0.25)).tobytes()
    )


@pytest.mark.parametrize("n_bytes", [1, 7, 9, 15, 23])
def test_ids_not_a_whole_number_of_u64_are_rejected_everywhere(
    api, stub, client, bad_tables, n_bytes
):
    m = api.m
    ids = ids_bytes(BAD_IDS)[:n_bytes]
    before = observe(api, stub, client, "bad", BAD_IDS)
    for method, request in [
        (stub.Pull, m.PullRequest(table="bad", ids=ids)),
        (stub.Contains, m.ContainsRequest(table="bad", ids=ids)),
        (stub.Remove, m.RemoveRequest(table="bad", ids=ids)),
        (stub.Remove, m.RemoveRequest(table="bad", ids=ids, request_id=m.RequestId(seq=n_bytes))),
    ]:
        assert fails(method, request).code() == Code.INVALID_ARGUMENT, request
    assert observe(api, stub, client, "bad", BAD_IDS) == before
    mask = ok(stub.Contains, m.ContainsRequest(table="bad", ids=ids_bytes(BAD_IDS))).mask
    assert mask == b"\x01" * len(BAD_IDS)


def test_unknown_dtypes_are_rejected(api, stub, client, bad_tables):
    m = api.m
    before = observe(api, stub, client, "bad", BAD_IDS)
    for dtype in (3, 4, -1, 2**31 - 1):
        req = m.PullRequest(table="bad", ids=ids_bytes(BAD_IDS), dtype=dtype)
        assert fails(stub.Pull, req).code() == Code.INVALID_ARGUMENT
        req = m.DensePullRequest(table="bad_dense", dtype=dtype)
        assert fails(stub.DensePull, req).code() == Code.INVALID_ARGUMENT
    assert observe(api, stub, client, "bad", BAD_IDS) == before


@pytest.mark.parametrize(
    "change",
    [
        {"grad": f32_bytes([1.0, 2.0])},
        {"grad": f32_bytes([1.0, 2.0, 3.0, 4.0])},
        {"grad": f32_bytes([1.0, 2.0, 3.0])[:-1]},
        {"grad": f32_bytes([1.0, math.nan, 3.0])},
        {"grad": f32_bytes([1.0, 2.0, -math.inf])},
        {"grad": u16_bytes([0x3C00, 0x7C00, 0x3C00]), "dtype": 1},
        {"dtype": 5},
        {"table": "bad"},
        {"table": "no_such_table"},
    ],
    ids=[
        "short", "long", "odd-bytes", "nan", "minus-inf", "float16-inf", "dtype-5",
        "sparse-table", "unknown-table",
    ],
)  # fmt: skip
def test_a_rejected_dense_push_changes_nothing(api, stub, client, bad_tables, change, request):
    m = api.m
    # Seqs increase as a client's do (a server refuses a seq more than 4096 below the newest
    # one the table applied from that client: it cannot know whether that one applied).
    seq = 1 + zlib.crc32(request.node.callspec.id.encode()) % 1024
    rid = m.RequestId(client=0xDE75E, seq=seq)
    before = observe_dense(api, stub, client, "bad_dense")
    sparse_before = observe(api, stub, client, "bad", BAD_IDS)
    fields = {"table": "bad_dense", "grad": f32_bytes([1.0, 2.0, 3.0]), **change}
    err = fails(stub.DensePush, m.DensePushRequest(**fields, request_id=rid))
    expected = Code.NOT_FOUND if fields["table"] == "no_such_table" else Code.INVALID_ARGUMENT
    assert err.code() == expected, err.details()
    assert observe_dense(api, stub, client, "bad_dense") == before
    assert observe(api, stub, client, "bad", BAD_IDS) == sparse_before
    # The same request id with a valid gradient applies.
    good = m.DensePushRequest(table="bad_dense", grad=f32_bytes([1.0, 2.0, 4.0]), request_id=rid)
    assert ok(stub.DensePush, good).applied
    values = np.frombuffer(before[0], np.float32) - np.float32(0.5) * np.float32([1, 2, 4])
    assert client.table("bad_dense").pull().tobytes() == values.tobytes()


def test_unknown_table_is_not_found_everywhere(api, stub):
    m = api.m
    t = "no_such_table"
    calls = [
        (stub.GetTable, m.GetTableRequest(name=t)),
        (stub.Pull, m.PullRequest(table=t, ids=ids_bytes([1]))),
        (stub.Push, m.PushRequest(table=t, ids=ids_bytes([1]), grads=f32_bytes([1.0] * 4))),
        (stub.Contains, m.ContainsRequest(table=t, ids=ids_bytes([1]))),
        (stub.Remove, m.RemoveRequest(table=t, ids=ids_bytes([1]))),
        (stub.Evict, m.EvictRequest(table=t, not_updated_for_steps=1)),
        (stub.DensePull, m.DensePullRequest(table=t)),
        (stub.DensePush, m.DensePushRequest(table=t, grad=f32_bytes([1.0]))),
        (stub.SetLr, m.SetLrRequest(table=t, lr=0.5)),
    ]
    for method, request in calls:
        assert fails(method, request).code() == Code.NOT_FOUND, request
    assert t not in {x.name for x in ok(stub.ListTables, m.ListTablesRequest()).tables}


GOOD = json.loads(sparse_config(4))
BAD_CONFIGS = {
    "not-json": ("SPARSE", "{"),
    "empty": ("SPARSE", ""),
    "array": ("SPARSE", "[]"),
    "truncated": ("SPARSE", sparse_config(4)[:-1]),
    "missing-optimizer": ("SPARSE", json.dumps({**GOOD, "optimizer": None})),
    "only-dim": ("SPARSE", '{"dim": 4}'),
    "dim-0": ("SPARSE", json.dumps({**GOOD, "dim": 0})),
    "dim-4097": ("SPARSE", json.dumps({**GOOD, "dim": 4097})),
    "dim-negative": ("SPARSE", json.dumps({**GOOD, "dim": -1})),
    "dim-string": ("SPARSE", json.dumps({**GOOD, "dim": "4"})),
    "lr-0": ("SPARSE", json.dumps({**GOOD, "optimizer": sgd(0.0)})),
    "lr-negative": ("SPARSE", json.dumps({**GOOD, "optimizer": sgd(-1.0)})),
    "unknown-optimizer": ("SPARSE", json.dumps({**GOOD, "optimizer": {"kind": "rms", "lr": 1}})),
    "nesterov-without-momentum": (
        "SPARSE",
        json.dumps({**GOOD, "optimizer": {**sgd(1.0), "kind": {"sgd": {
            "momentum": 0.0, "weight_decay": 0.0, "nesterov": True}}}}),
    ),
    "uniform-low-above-high": (
        "SPARSE", json.dumps({**GOOD, "initializer": {"uniform": {"low": 1.0, "high": 0.0}}}),
    ),
    "normal-negative-std": (
        "SPARSE", json.dumps({**GOOD, "initializer": {"normal": {"mean": 0.0, "std": -1.0}}}),
    ),
    "max-rows-0": (
        "SPARSE",
        json.dumps({**GOOD, "lifecycle": {"admit_after": 0, "max_rows": 0, "policy": "lru"}}),
    ),
    "seed-negative": ("SPARSE", json.dumps({**GOOD, "seed": -1})),
    "sparse-config-as-dense": ("DENSE", sparse_config(4)),
    "dense-empty-shape": ("DENSE", dense_config([])),
    "dense-zero-extent": ("DENSE", dense_config([3, 0])),
    "dense-too-many-elements": ("DENSE", dense_config([2**20, 2**20])),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_creates_nothing(api, stub, case):
    m = api.m
    kind, config = BAD_CONFIGS[case]
    before = ok(stub.ListTables, m.ListTablesRequest()).tables
    req = m.CreateTableRequest(name="bad_config", kind=getattr(m, kind), config_json=config)
    err = fails(stub.CreateTable, req)
    assert err.code() == Code.INVALID_ARGUMENT, err.details()
    assert fails(stub.GetTable, m.GetTableRequest(name="bad_config")).code() == Code.NOT_FOUND
    assert ok(stub.ListTables, m.ListTablesRequest()).tables == before


def test_bad_create_table_fields_create_nothing(api, stub):
    m = api.m
    good = sparse_config(4)
    for request in [
        m.CreateTableRequest(name="bad_fields", kind=5, config_json=good),
        m.CreateTableRequest(name="bad_fields", kind=-1, config_json=good),
        m.CreateTableRequest(name="bad_fields", config_json=good, stale_policy=9),
        m.CreateTableRequest(name="", config_json=good),
        m.CreateTableRequest(name="x" * 256, config_json=good),
        m.CreateTableRequest(name="bad\nfields", config_json=good),
    ]:
        assert fails(stub.CreateTable, request).code() == Code.INVALID_ARGUMENT, request
    names = {t.name for t in ok(stub.ListTables, m.ListTablesRequest()).tables}
    assert not any(n.startswith("bad_fields") or n.startswith("xxx") or n == "" for n in names)


def test_an_undecodable_request_is_internal_as_grpc_specifies(api, channel):
    """gRPC's status code table puts "error parsing request proto" under INTERNAL; the
    contract follows it (INVALID_ARGUMENT is for well-formed requests with bad content)."""
    for method, body in [
        ("Pull", b"\xff"),  # an invalid varint
        ("Push", b"\x0a\x05ab"),  # a string field running past the end
        ("Status", b"\x08"),  # a tag without its value
    ]:
        call = channel.unary_unary(f"/{SERVICE}/{method}")
        with pytest.raises(grpc.RpcError) as e:
            call(body, metadata=WRITE, timeout=TIMEOUT)
        assert e.value.code() == Code.INTERNAL, (method, e.value.details())
        assert "decode" in (e.value.details() or "")
    # The token is checked before the body is decoded.
    with pytest.raises(grpc.RpcError) as e:
        channel.unary_unary(f"/{SERVICE}/Pull")(b"\xff", timeout=TIMEOUT)
    assert e.value.code() == Code.UNAUTHENTICATED


@pytest.fixture(scope="module")
def small(api) -> Iterator[SimpleNamespace]:
    """A server that takes messages of at most 64 KiB."""
    srv = start_server(max_message=64 * 1024)
    ch = grpc.insecure_channel(srv.address)
    stub = api.PStoreStub(ch)
    create(api, stub, "small", sparse_config(2))
    try:
        yield SimpleNamespace(server=srv, stub=stub, client=pstore.connect([srv.address], TOKEN))
    finally:
        ch.close()
        srv.stop(grace=5.0)


def big_push(api: SimpleNamespace) -> Any:
    """A push of about 1 MiB: 65536 ids of dim 2."""
    ids = np.arange(65536, dtype=np.uint64)
    grads = np.full((len(ids), 2), 0.5, np.float32)
    return api.m.PushRequest(table="small", ids=ids_bytes(ids), grads=f32_bytes(grads))


def test_a_message_over_the_servers_limit_is_refused(api, small):
    m, stub = api.m, small.stub
    assert ok(stub.Status, m.StatusRequest()).max_message_bytes == 64 * 1024
    req = big_push(api)
    assert req.ByteSize() > 1 << 20
    err = fails(stub.Push, req)
    assert err.code() != Code.OK
    info = ok(stub.GetTable, m.GetTableRequest(name="small"))
    assert (info.seq, info.rows) == (0, 0)
    # The server goes on serving, requests under the limit included.
    assert ok(stub.Status, m.StatusRequest()).protocol == 1
    ids = np.arange(1000, dtype=np.uint64)
    r = ok(stub.Push, m.PushRequest(table="small", ids=ids_bytes(ids), grads=f32_bytes(
        np.ones((1000, 2))
    )))  # fmt: skip
    assert (r.applied, r.seq) == (True, 1)
    assert small.client.table("small").pull(ids[:3]).tolist() == [[-0.5, -0.5]] * 3


def test_a_message_over_the_limit_is_out_of_range(api, small):
    """tonic answers a message over the decoding limit OUT_OF_RANGE; the contract says so."""
    assert fails(small.stub.Push, big_push(api)).code() == Code.OUT_OF_RANGE


def test_a_pull_whose_answer_is_too_large_creates_no_rows(api, small):
    m, stub = api.m, small.stub
    create(api, stub, "wide", sparse_config(16))
    ids = np.arange(10**6, 10**6 + 2000, dtype=np.uint64)  # 16 KB asked, 128 KB to answer
    req = m.PullRequest(table="wide", ids=ids_bytes(ids))
    assert req.ByteSize() < 64 * 1024
    assert fails(stub.Pull, req).code() != Code.OK
    assert ok(stub.Status, m.StatusRequest()).protocol == 1
    assert ok(stub.GetTable, m.GetTableRequest(name="wide")).rows == 0
    mask = ok(stub.Contains, m.ContainsRequest(table="wide", ids=ids_bytes(ids[:10]))).mask
    assert mask == b"\x00" * 10


# ---------------------------------------------------------------------------------------------
# 4. Fuzzing the request decoding

# A failing example is reported as found, not shrunk: a shrink step may wait out a call's
# TIMEOUT, and shrinking at that pace can outlast pytest's timeout, which would then report a
# hang and lose the request that failed (a 300 s timeout here was seen once and not reproduced).
FUZZ_SETTINGS = settings(
    max_examples=200,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Snapshot and LoadSnapshot are left out: a random request could name any directory to write on
# this machine, or to read rows from.
RAW_METHODS = (
    "CreateTable", "GetTable", "ListTables", "DropTable", "Pull", "Push", "Contains", "Remove",
    "Evict", "DensePull", "DensePush", "SetLr", "Flush", "Clock", "Status", "BulkLoad",
    "ReplicaAck", "GetRouting", "SetRouting", "ExportSlots", "DropSlots", "Promote",
)  # fmt: skip
FUZZ_POOL = (0, 1, 2, 2**63, U64_MAX)
FUZZ_DIM = 2
# Every fuzzed call ends with an answer; these are the error codes the contract lists for bad
# requests of an in-memory server.
CONTRACT_ERRORS = {Code.INVALID_ARGUMENT, Code.NOT_FOUND, Code.ALREADY_EXISTS}


def fuzz_server(api: SimpleNamespace) -> SimpleNamespace:
    srv = start_server()
    ch = grpc.insecure_channel(srv.address)
    stub = api.PStoreStub(ch)
    m = api.m
    create(api, stub, "fz", sparse_config(FUZZ_DIM, lr=1.0, initializer={"constant": 0.5}))
    create(api, stub, "fz_dense", dense_config([3]), kind="DENSE")
    create(api, stub, "scratch", sparse_config(1))
    g = np.arange(len(FUZZ_POOL) * FUZZ_DIM, dtype=np.float32) / 4
    ok(stub.Push, m.PushRequest(table="fz", ids=ids_bytes(FUZZ_POOL), grads=f32_bytes(g)))
    client = pstore.connect([srv.address], token=TOKEN, timeout=10.0)
    sparse, dense = client.table("fz"), client.table("fz_dense")

    def rows() -> tuple:
        """The rows (read by pstore's client) and seqs of the two tables."""
        return (
            sparse.pull(np.array(FUZZ_POOL, dtype=np.uint64)).tobytes(),
            dense.pull().tobytes(),
            ok(stub.Pull, m.PullRequest(table="fz")).seq,
            ok(stub.DensePull, m.DensePullRequest(table="fz_dense")).seq,
        )

    def status() -> Any:
        return ok(stub.Status, m.StatusRequest())

    return SimpleNamespace(
        server=srv, channel=ch, stub=stub, client=client, sparse=sparse, dense=dense, rows=rows,
        status=status, store=srv.store, seen={}, outcomes={},
    )  # fmt: skip


def close_fuzz_server(f: SimpleNamespace) -> None:
    f.channel.close()
    f.server.stop(grace=5.0)


@pytest.fixture(scope="module")
def raw_fuzz(api) -> Iterator[SimpleNamespace]:
    f = fuzz_server(api)
    m = api.m
    methods = {x.name for x in m.DESCRIPTOR.services_by_name["PStore"].methods}
    # Replicate is server-streaming (a raw unary call cannot reach it): its bad requests are
    # in test_replicate_refuses_what_it_cannot_serve.
    # FreezeSlots makes later writes of the slots answer UNAVAILABLE "moving" (a fuzzed freeze
    # that succeeds would turn every later fuzzed push into that): its refusals are in
    # test_reshard_online.py.
    assert methods == {*RAW_METHODS, "Snapshot", "LoadSnapshot", "Replicate", "FreezeSlots"}, (
        "a new method: fuzz it or say why not"
    )
    rid = m.RequestId(client=5, seq=5)
    f.seeds = {
        k: v.SerializeToString()
        for k, v in {
            "CreateTable": m.CreateTableRequest(name="fz_new", config_json=sparse_config(2)),
            "GetTable": m.GetTableRequest(name="fz"),
            "ListTables": m.ListTablesRequest(),
            "DropTable": m.DropTableRequest(name="scratch"),
            "Pull": m.PullRequest(table="fz", ids=ids_bytes([1, 2]), dtype=m.FLOAT16),
            "Push": m.PushRequest(
                table="fz", ids=ids_bytes([1]), grads=f32_bytes([0.25, 0.5]), request_id=rid
            ),
            "Contains": m.ContainsRequest(table="fz", ids=ids_bytes([1, 7])),
            "Remove": m.RemoveRequest(table="scratch", ids=ids_bytes([1]), request_id=rid),
            "Evict": m.EvictRequest(table="scratch", not_updated_for_steps=3),
            "DensePull": m.DensePullRequest(table="fz_dense", dtype=m.BFLOAT16),
            "DensePush": m.DensePushRequest(table="fz_dense", grad=f32_bytes([1, 2, 3])),
            "SetLr": m.SetLrRequest(table="fz", lr=1.0),
            "Flush": m.FlushRequest(),
            "Clock": m.ClockRequest(worker=0, num_workers=1, clock=2),
            "Status": m.StatusRequest(),
            "ReplicaAck": m.ReplicaAckRequest(follower="f", replication_id=7, lsn=3),
            "GetRouting": m.GetRoutingRequest(),
            # Refused: an in-memory server is in no replica group (FAILED_PRECONDITION).
            "Promote": m.PromoteRequest(expected_primary="127.0.0.1:1", force=True),
            "ExportSlots": m.ExportSlotsRequest(
                table="fz", slots=m.SlotSet(starts=[0], ends=[16384])
            ),
            # Refused: the server holds no routing (or, after a fuzzed SetRouting, owns them).
            "DropSlots": m.DropSlotsRequest(slots=m.SlotSet(starts=[0], ends=[16384])),
            # Refused as it is (epoch 0); a mutation that installs a routing gives every slot
            # to this server alone (one position), so no later call is answered "moved".
            "SetRouting": m.SetRoutingRequest(
                routing=m.Routing(
                    slots=m.SlotOwners(epoch=0, servers=1, starts=[0], owners=[0]),
                    servers=[f.server.address],
                    index=0,
                )
            ),
            # Into "scratch", which rows() does not read: a fuzzed load that succeeds writes rows.
            "BulkLoad": m.BulkLoadRequest(
                table="scratch",
                config_json=sparse_config(1),
                ids=ids_bytes([1]),
                words=np.arange(8, dtype="<u4").tobytes(),
            ),
        }.items()
    }
    # Identity (de)serializers: the bytes go on the wire as they are.
    f.calls = {
        name: f.channel.unary_unary(
            f"/{SERVICE}/{name}", request_serializer=None, response_deserializer=None
        )
        for name in RAW_METHODS
    }
    try:
        yield f
    finally:
        close_fuzz_server(f)


def test_random_bytes_to_every_method_get_an_answer(raw_fuzz):
    @FUZZ_SETTINGS
    @given(
        method=st.sampled_from(RAW_METHODS),
        how=st.sampled_from(["bytes", "overwrite", "insert", "append", "truncate"]),
        noise=st.binary(max_size=48),
        pos=st.integers(0, 255),
    )
    def one(method: str, how: str, noise: bytes, pos: int) -> None:
        seed = raw_fuzz.seeds[method]
        p = pos % (len(seed) + 1)
        body = {
            "bytes": noise,
            "overwrite": seed[:p] + noise + seed[p + len(noise) :],
            "insert": seed[:p] + noise + seed[p:],
            "append": seed + noise,
            "truncate": seed[:p],
        }[how]
        if method == "Clock":
            # wait = false and advance = false (the last value of a field wins): no call may
            # wait, none may report a clock (see test_a_huge_num_workers_does_not_crash_...).
            body += b"\x20\x00\x30\x00"
        before = raw_fuzz.rows()
        try:
            answer = raw_fuzz.calls[method](body, metadata=WRITE, timeout=TIMEOUT)
            assert isinstance(answer, bytes)
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""
            # INTERNAL for bytes that do not decode: the known deviation of
            # test_an_undecodable_request_is_invalid_argument; anything else is a bug.
            undecodable = code == Code.INTERNAL and "decode" in details
            # Promote refuses a server that is in no replica group, as the fuzzed one is.
            no_group = method == "Promote" and code == Code.FAILED_PRECONDITION
            assert code in CONTRACT_ERRORS or undecodable or no_group, (method, body, code, details)
            # A failed call changed nothing (rows() is also a call the server must answer).
            assert raw_fuzz.rows() == before, (method, body, code, details)

    one()
    assert raw_fuzz.status().protocol == 1
    assert set(raw_fuzz.client.tables()) >= {"fz", "fz_dense"}


@pytest.fixture(scope="module")
def push_fuzz(api) -> Iterator[SimpleNamespace]:
    f = fuzz_server(api)
    try:
        yield f
    finally:
        close_fuzz_server(f)


# Finite gradients stay small enough that no row can overflow in a few hundred pushes.
F32_FINITE = st.floats(width=32, min_value=-(2.0**100), max_value=2.0**100)
F16_BITS = st.integers(0, 0xFFFF)  # every bit pattern: largest finite 65504, inf, NaN
BF16_BITS = st.integers(0, 0xFFFF).map(lambda u: u & 0xBFFF)  # finite, magnitude below 2
NON_FINITE = {0: [math.nan, math.inf, -math.inf], 1: [0x7C00, 0xFC00, 0x7E00, 0x7C01],
              2: [0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFC1]}  # fmt: skip


@st.composite
def push_fields(draw: st.DrawFn) -> dict[str, Any]:
    """A PushRequest's fields: mostly valid, each field sometimes wrong in its own way."""
    table = draw(st.sampled_from(["fz"] * 8 + ["fz_dense", "nope", "", "?"]))
    if table == "?":
        table = draw(st.text(max_size=6))
    dtype = draw(st.sampled_from([0, 0, 0, 1, 1, 2, 2, -1]))
    if dtype == -1:
        dtype = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.integers(0, 7)):
        ids = ids_bytes(draw(st.lists(st.sampled_from(FUZZ_POOL), max_size=4)))
    else:
        ids = draw(st.binary(max_size=40))
    n = len(ids) // 8
    if draw(st.integers(0, 7)):
        count = max(0, n * FUZZ_DIM + draw(st.sampled_from([0] * 6 + [-1, 1])))
        elements = {1: F16_BITS, 2: BF16_BITS}.get(dtype, F32_FINITE)
        values = draw(st.lists(elements, min_size=count, max_size=count))
        if values and draw(st.integers(0, 3)) == 0:
            at = draw(st.integers(0, count - 1))
            values[at] = draw(st.sampled_from(NON_FINITE.get(dtype, NON_FINITE[0])))
        grads = u16_bytes(values) if dtype in (1, 2) else f32_bytes(values)
    else:
        # Random bytes of an odd length: never a whole number of values.
        grads = draw(st.binary(max_size=39).map(lambda b: b if len(b) % 2 else b + b"\x01"))
    # Request ids from a small set, so some come back: retries of applied or rejected pushes.
    ids_in_use = st.sampled_from([(0, 0), (1, 2)]) | st.tuples(st.integers(0, 3), st.integers(0, 3))
    rid = draw(st.none() | ids_in_use)
    pulled = draw(st.none() | st.integers(0, U64_MAX))
    return {"table": table, "ids": ids, "grads": grads, "dtype": dtype, "rid": rid,
            "pulled": pulled}  # fmt: skip


def grads_f64(grads: bytes, dtype: int) -> np.ndarray:
    """Gradients decoded as the proto says (signalling NaNs convert quietly)."""
    with np.errstate(invalid="ignore"):
        if dtype == 0:
            return np.frombuffer(grads, "<f4").astype(np.float64)
        if dtype == 1:
            return np.frombuffer(grads, "<f2").astype(np.float64)
        bits = np.frombuffer(grads, "<u2").astype(np.uint32) << 16
        return bits.view(np.float32).astype(np.float64)


def predict_push(store: pstore.Store, f: dict[str, Any]) -> grpc.StatusCode:
    """What the contract says a push must answer."""
    if f["table"] not in store.tables():
        return Code.NOT_FOUND
    if not isinstance(store.table(f["table"]), pstore.SparseTable):
        return Code.INVALID_ARGUMENT
    if f["dtype"] not in (0, 1, 2) or len(f["ids"]) % 8:
        return Code.INVALID_ARGUMENT
    width = 4 if f["dtype"] == 0 else 2
    if len(f["grads"]) != len(f["ids"]) // 8 * FUZZ_DIM * width:
        return Code.INVALID_ARGUMENT
    if not np.isfinite(grads_f64(f["grads"], f["dtype"])).all():
        return Code.INVALID_ARGUMENT
    return Code.OK


def test_random_well_formed_pushes(api, push_fuzz):
    fz = push_fuzz

    @FUZZ_SETTINGS
    @given(f=push_fields())
    def one(f: dict[str, Any]) -> None:
        check_one_push(api, fz, f)

    one()
    assert fz.status().protocol == 1
    # The examples reached every branch: rejections, applied pushes, retries of applied ids.
    assert fz.outcomes.keys() >= {"rejected", "applied", "retried"}, fz.outcomes


def check_one_push(api: SimpleNamespace, fz: SimpleNamespace, f: dict[str, Any]) -> None:
    """Sends one push; checks its status against the contract, and what it did to the rows."""
    m, stub = api.m, fz.stub
    ids = np.frombuffer(f["ids"], "<u8") if len(f["ids"]) % 8 == 0 else np.zeros(0, np.uint64)
    watched = np.concatenate([np.array(FUZZ_POOL, np.uint64), ids.astype(np.uint64)])

    def state() -> tuple[np.ndarray, int]:
        return fz.sparse.pull(watched), ok(stub.Pull, m.PullRequest(table="fz")).seq

    before, seq = state()
    dense_before = fz.dense.pull().tobytes()
    req = m.PushRequest(table=f["table"], ids=f["ids"], grads=f["grads"], dtype=f["dtype"])
    if f["rid"] is not None:
        req.request_id.client, req.request_id.seq = f["rid"]
    if f["pulled"] is not None:
        req.pulled_seq = f["pulled"]
    expected = predict_push(fz.store, f)
    try:
        answer = ok(stub.Push, req)
        code = Code.OK
    except grpc.RpcError as e:
        answer, code = None, e.code()
    assert code == expected, (f, code)
    after, seq_after = state()
    assert fz.dense.pull().tobytes() == dense_before

    outcome = "rejected" if code != Code.OK else "retried" if f["rid"] in fz.seen else "applied"
    fz.outcomes[outcome] = fz.outcomes.get(outcome, 0) + 1
    if outcome != "applied":
        # Rejected, or a retry of an applied request id: nothing changes.
        assert after.tobytes() == before.tobytes(), f
        assert seq_after == seq
        if code == Code.OK:
            assert answer == fz.seen[f["rid"]]
        return
    if f["rid"] is not None:
        fz.seen[f["rid"]] = answer
    stale = 0 if f["pulled"] is None else max(0, seq - f["pulled"])
    bump = 1 if len(ids) else 0  # a push of no ids is not a push: it takes no sequence number
    assert (answer.applied, answer.staleness, answer.seq) == (True, stale, seq + bump)
    assert seq_after == seq + bump
    n_pool = len(FUZZ_POOL)
    untouched = ~np.isin(np.array(FUZZ_POOL, np.uint64), ids)
    assert after[:n_pool][untouched].tobytes() == before[:n_pool][untouched].tobytes()
    if len(np.unique(ids)) == len(ids):
        # SGD, lr 1, weight decay 0 in float64, rounded once (rust/src/optimizer/mod.rs).
        w = before[n_pool:].astype(np.float64)
        g = grads_f64(f["grads"], f["dtype"]).reshape(len(ids), FUZZ_DIM)
        want = (w - 1.0 * (g + 0.0 * w)).astype(np.float32)
        assert after[n_pool:].tobytes() == want.tobytes(), (f, before, after)


# ---------------------------------------------------------------------------------------------
# 5. Clients that go away, and a server in a process of its own


def test_a_client_vanishing_mid_call_leaves_the_server_serving(api, fresh):
    m, srv = api.m, fresh.server
    wait = m.ClockRequest(worker=0, num_workers=2, clock=1, wait=True, advance=True)

    # A waiting call cancelled by its client.
    ch1 = grpc.insecure_channel(srv.address)
    waiting = api.PStoreStub(ch1).Clock.future(wait, metadata=WRITE, timeout=60)
    time.sleep(0.3)
    assert not waiting.done()
    assert waiting.cancel() and waiting.cancelled()
    ch1.close()

    # A waiting call whose channel is closed under it.
    ch2 = grpc.insecure_channel(srv.address)
    wait2 = m.ClockRequest(worker=0, num_workers=2, clock=2, wait=True, advance=True)
    waiting2 = api.PStoreStub(ch2).Clock.future(wait2, metadata=WRITE, timeout=60)
    time.sleep(0.3)
    assert not waiting2.done()
    ch2.close()
    assert waiting2.exception(timeout=TIMEOUT).code() == Code.CANCELLED

    # Connections that send garbage, half a preface, or nothing, then go away.
    for junk in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n", b"", os.urandom(64)):
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT) as s:
            s.sendall(junk)

    stub = fresh.stub
    assert ok(stub.Status, m.StatusRequest()).protocol == 1
    r = ok(stub.Clock, m.ClockRequest())
    assert list(r.clocks) == [2, 0]  # the clocks the vanished calls reported before waiting
    r = ok(stub.Clock, m.ClockRequest(worker=1, num_workers=2, clock=2, wait=True, advance=True))
    assert (list(r.clocks), r.min_clock) == ([2, 2], 2)
    # The abandoned waits are gone: stopping does not wait for them.
    fresh.channel.close()
    t0 = time.monotonic()
    srv.stop(grace=10.0)
    assert time.monotonic() - t0 < 5.0
    assert not srv.running


@contextlib.contextmanager
def serve_process(
    api: SimpleNamespace, tmp_path: Path, prelude: str = ""
) -> Iterator[SimpleNamespace]:
    """``python -m pstore serve`` on a free port, token from $PSTORE_TOKEN, until it answers."""
    port = free_port()
    argv = ["serve", "--host", "127.0.0.1", "--port", str(port), "--log-interval", "0"]
    code = f"{prelude}import runpy, sys; sys.argv = ['pstore', *{argv!r}]; " + (
        "runpy.run_module('pstore', run_name='__main__', alter_sys=True)"
    )
    cmd = [sys.executable, "-m", "pstore", *argv] if not prelude else [sys.executable, "-c", code]
    env = child_env(PSTORE_TOKEN=TOKEN)
    env.pop("PSTORE_READ_TOKEN", None)
    log = tmp_path / "serve.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=err, stderr=err)
    ch = None
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the server exited: {log.read_text()}"
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            assert time.monotonic() < deadline, f"the server never listened: {log.read_text()}"
            time.sleep(0.05)
        ch = grpc.insecure_channel(f"127.0.0.1:{port}")
        stub = api.PStoreStub(ch)
        assert ok(stub.Status, api.m.StatusRequest()).protocol == 1
        yield SimpleNamespace(
            proc=proc, channel=ch, stub=stub, address=f"127.0.0.1:{port}", log=log
        )
    finally:
        if ch is not None:
            ch.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_a_real_server_process(api, tmp_path):
    m = api.m
    with serve_process(api, tmp_path) as sp:
        stub = sp.stub
        # The token came from $PSTORE_TOKEN.
        assert fails(stub.Status, m.StatusRequest(), ()).code() == Code.UNAUTHENTICATED
        wrong = (("authorization", "Bearer nope"),)
        assert fails(stub.Status, m.StatusRequest(), wrong).code() == Code.UNAUTHENTICATED
        health = api.HealthStub(sp.channel).Check(
            api.h.HealthCheckRequest(service=SERVICE), metadata=WRITE, timeout=TIMEOUT
        )
        assert health.status == api.h.HealthCheckResponse.SERVING

        create(api, stub, "proc", sparse_config(3, lr=1.0, initializer={"constant": 0.5}))
        ids = np.array([4, 2**63 + 1], np.uint64)
        g = np.array([[1.0, -1.0, 0.25], [0.5, 0.0, -3.0]], np.float32)
        req = m.PushRequest(
            table="proc", ids=ids_bytes(ids), grads=f32_bytes(g),
            request_id=m.RequestId(client=1, seq=1),
        )  # fmt: skip
        first = ok(stub.Push, req)
        assert ok(stub.Push, req) == first and first.seq == 1
        r = ok(stub.Pull, m.PullRequest(table="proc", ids=ids_bytes(ids)))
        assert r.rows == (0.5 - g).tobytes()
        remote = pstore.connect([sp.address], token=TOKEN, timeout=10.0)
        assert remote.table("proc").pull(ids).tobytes() == r.rows
        del remote
        sp.channel.close()

        sp.proc.send_signal(signal.SIGTERM)
        assert sp.proc.wait(timeout=60) == 0, sp.log.read_text()
    log = sp.log.read_text()
    assert "event=serving" in log and "auth=token" in log
    assert "signal=SIGTERM" in log and "event=stopped" in log


def test_a_huge_num_workers_does_not_crash_the_server(api, tmp_path):
    # The server runs with an address-space limit, so a huge allocation fails at once on any
    # machine instead of eating its memory.
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
    m = api.m
    with serve_process(api, tmp_path, prelude=limit) as sp:
        req = m.ClockRequest(worker=0, num_workers=2**32 - 1, clock=0, advance=True)
        with contextlib.suppress(grpc.RpcError):
            sp.stub.Clock(req, metadata=WRITE, timeout=30)
        try:
            assert ok(sp.stub.Status, m.StatusRequest()).protocol == 1
        except grpc.RpcError as e:
            with contextlib.suppress(subprocess.TimeoutExpired):
                sp.proc.wait(timeout=10)
            said = [x for x in sp.log.read_text().splitlines() if "fail" in x or "panic" in x]
            pytest.fail(f"no answer ({e.code()}); the server's exit code {sp.proc.poll()}: {said}")
        assert sp.proc.poll() is None


def test_replicate_refuses_what_it_cannot_serve(api, tmp_path) -> None:
    """An in-memory server keeps no log; a durable one refuses a follower with no name, and a
    follower refuses to be followed; each with a clear status, and the server goes on."""
    m = api.m
    mem = start_server()
    try:
        stub = api.PStoreStub(grpc.insecure_channel(mem.address))
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.Replicate(m.ReplicateRequest(follower="f"), metadata=WRITE)))
        assert e.value.code() == Code.FAILED_PRECONDITION, e.value.details()
        assert "durable" in (e.value.details() or "")
    finally:
        mem.stop(grace=1.0)
    store = pstore.Store(path=str(tmp_path / "d"), durability="sync")
    srv = pstore.server.Server(store, token=TOKEN)
    try:
        stub = api.PStoreStub(grpc.insecure_channel(srv.address))
        with pytest.raises(grpc.RpcError) as e:
            next(iter(stub.Replicate(m.ReplicateRequest(from_lsn=5), metadata=WRITE)))
        assert e.value.code() == Code.INVALID_ARGUMENT, e.value.details()
        assert "name itself" in (e.value.details() or "")
        with pytest.raises(grpc.RpcError) as e:
            stub.ReplicaAck(m.ReplicaAckRequest(follower="f", lsn=1), metadata=WRITE)
        assert e.value.code() == Code.INVALID_ARGUMENT, e.value.details()
        assert ok(stub.Status, m.StatusRequest()).replication_json
    finally:
        srv.stop(grace=1.0)
        store.close()


def test_slot_moves_freeze_export_drop_and_refuse_bad_sets(api, fresh):
    """The move RPCs from a client generated from the .proto: a frozen slot's writes answer
    UNAVAILABLE moving until thawed, reads go on, exports give the rows as BulkLoad takes them,
    bad slot sets and others' slots are refused, and a read token can do none of it."""
    m, stub = api.m, fresh.stub
    create(api, stub, "mv", sparse_config(2, lr=1.0, initializer={"constant": 0.0}))
    ids = [3, 5, 7]
    g = f32_bytes([1.0] * 6)
    ok(stub.Push, m.PushRequest(table="mv", ids=ids_bytes(ids), grads=g))
    every = m.SlotSet(starts=[0], ends=[16384])

    def pulled() -> bytes:
        rows: bytes = ok(stub.Pull, m.PullRequest(table="mv", ids=ids_bytes(ids))).rows
        return rows

    for bad, match in [
        (m.SlotSet(starts=[5], ends=[5]), "non-empty run"),
        (m.SlotSet(starts=[0], ends=[16385]), "non-empty run"),
        (m.SlotSet(starts=[0, 1], ends=[2]), "2 starts and 1 ends"),
    ]:
        e = fails(stub.FreezeSlots, m.FreezeSlotsRequest(slots=bad))
        assert e.code() == Code.INVALID_ARGUMENT and match in e.details(), e.details()
    e = fails(stub.FreezeSlots, m.FreezeSlotsRequest())
    assert e.code() == Code.INVALID_ARGUMENT and "needs its slots" in e.details()
    e = fails(stub.FreezeSlots, m.FreezeSlotsRequest(slots=every), metadata=READ)
    assert e.code() == Code.PERMISSION_DENIED
    assert ok(stub.FreezeSlots, m.FreezeSlotsRequest(slots=every)).frozen == 16384
    e = fails(stub.Push, m.PushRequest(table="mv", ids=ids_bytes(ids), grads=g))
    assert e.code() == Code.UNAVAILABLE and e.details().startswith("moving: "), e.details()
    assert pulled() == f32_bytes([-1.0] * 6)
    x = ok(stub.ExportSlots, m.ExportSlotsRequest(table="mv", slots=every))
    assert x.next_shard == x.shards and sorted(np.frombuffer(x.ids, "<u8").tolist()) == ids
    assert json.loads(x.config_json)["dim"] == 2 and x.seq == 1
    assert len(x.words) == len(ids) * 4 * (len(x.words) // (4 * len(ids)))
    e = fails(stub.ExportSlots, m.ExportSlotsRequest(table="nope", slots=every))
    assert e.code() == Code.NOT_FOUND
    # A server without a routing owns every slot: nothing is dropped.
    e = fails(stub.DropSlots, m.DropSlotsRequest(slots=every))
    assert e.code() == Code.INVALID_ARGUMENT and "holds no routing" in e.details()
    assert ok(stub.FreezeSlots, m.FreezeSlotsRequest(slots=every, thaw=True)).frozen == 0
    ok(stub.Push, m.PushRequest(table="mv", ids=ids_bytes(ids), grads=g))
    assert pulled() == f32_bytes([-2.0] * 6)
    # Request ids loaded as applied are answered, not applied.
    rid = m.RequestId(client=77, seq=1)
    e = fails(stub.BulkLoad, m.BulkLoadRequest(applied_request_ids=b"\x01" * 15))
    assert e.code() == Code.INVALID_ARGUMENT and "15 bytes" in e.details()
    pair = (77).to_bytes(8, "little") + (1).to_bytes(8, "little")
    ok(stub.BulkLoad, m.BulkLoadRequest(applied_request_ids=pair))
    a = ok(stub.Push, m.PushRequest(table="mv", ids=ids_bytes(ids), grads=g, request_id=rid))
    assert a.applied
    assert pulled() == f32_bytes([-2.0] * 6)


def _slot_rows(api: SimpleNamespace, stub: Any, table: str, slots: Any, **kw: Any) -> Any:
    """Every answer of an export of `table`'s rows in `slots` (kw: dirty=True for the delta)."""
    m, shard, out = api.m, 0, []
    while True:
        a = ok(stub.ExportSlots, m.ExportSlotsRequest(table=table, slots=slots, shard=shard, **kw))
        out.append(a)
        if a.next_shard >= a.shards:
            return out
        shard = a.next_shard


def _copy_delta(api: SimpleNamespace, src: Any, dst: Any, table: str, slots: Any) -> list[int]:
    """Loads the delta of `table`'s rows in `slots` from `src` into `dst`, as a move's freeze
    does; the ids it removes, sorted."""
    m, gone = api.m, []
    for x in _slot_rows(api, src, table, slots, dirty=True):
        gone += np.frombuffer(x.removed_ids, "<u8").tolist()
        load = m.BulkLoadRequest(
            table=table,
            config_json=x.config_json,
            ids=x.ids,
            words=x.words,
            removed_ids=x.removed_ids,
        )
        ok(dst.BulkLoad, load)
    return sorted(gone)


def _rows_by_id(answers: Any) -> dict[int, bytes]:
    """Each exported row's words (weights, optimizer state, step, version, ...) by its id."""
    rows = {}
    for a in answers:
        ids = np.frombuffer(a.ids, "<u8").tolist()
        if ids:
            width = len(a.words) // len(ids)
            rows.update({i: a.words[k * width : (k + 1) * width] for k, i in enumerate(ids)})
    return rows


@contextlib.contextmanager
def _old_and_new(api: SimpleNamespace) -> Iterator[tuple[Any, Any]]:
    """Two servers, a move's old and new owner, as stubs over channels closed at the end."""
    old, new = start_server(), start_server()
    chans = [grpc.insecure_channel(s.address) for s in (old, new)]
    try:
        yield api.PStoreStub(chans[0]), api.PStoreStub(chans[1])
    finally:
        for c in chans:
            c.close()
        old.stop(grace=1.0)
        new.stop(grace=1.0)


def test_a_pre_copy_records_writes_creations_and_removals_for_the_delta(api):
    """Decision 0114 from a client generated from the .proto: slots marked copying take writes
    (no "moving"); the rows pushed, pushed into being, created by a pull and removed after the
    mark come in the delta export (the removed as removed_ids) once the slots are frozen, and
    the new owner loaded with the pre-copy, then the delta, holds exactly the old owner's rows
    (weights, Adagrad state, step and version words); without the delta it does not. A dense
    table pushed during the copy comes in the delta, one not pushed does not. The delta is
    refused for slots not copying or not frozen, and a thaw forgets the record."""
    m = api.m
    adagrad = {"adagrad": {"initial_accumulator_value": 0.1, "eps": 1e-10, "weight_decay": 0.0}}
    config = json.dumps(
        {
            "dim": 2,
            "optimizer": {"kind": adagrad, "lr": 0.1},
            "initializer": {"constant": 0.25},
            "seed": 0,
        }
    )
    dense = json.dumps(
        {
            "shape": [3],
            "optimizer": {"kind": adagrad, "lr": 0.1},
            "initializer": {"constant": 1.0},
            "seed": 0,
        }
    )
    every = m.SlotSet(starts=[0], ends=[16384])
    with _old_and_new(api) as (a, b):
        for stub in (a, b):
            create(api, stub, "pc", config)
            create(api, stub, "dn", dense, "DENSE")
            create(api, stub, "quiet", dense, "DENSE")

        def push(ids: Any, value: float = 1.0) -> None:
            g = f32_bytes(np.full((len(ids), 2), value))
            ok(a.Push, m.PushRequest(table="pc", ids=ids_bytes(ids), grads=g))

        push(range(200))
        push(range(100), 0.5)
        # Not copying yet: no delta to give.
        e = fails(a.ExportSlots, m.ExportSlotsRequest(table="pc", slots=every, dirty=True))
        assert e.code() == Code.INVALID_ARGUMENT and "not being copied" in e.details(), e.details()
        assert ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every, copy=True)).frozen == 0
        # The pre-copy, while writes go on.
        for t in ("pc", "dn", "quiet"):
            for x in _slot_rows(api, a, t, every):
                if x.words:
                    load = m.BulkLoadRequest(
                        table=t, config_json=x.config_json, ids=x.ids, words=x.words
                    )
                    if x.dense:
                        load.dense_offset = x.dense_offset
                    ok(b.BulkLoad, load)
        push(range(10), 2.0)  # written
        push(range(2000, 2005))  # pushed into being
        ok(a.Pull, m.PullRequest(table="pc", ids=ids_bytes(range(1000, 1005))))  # created
        removed = list(range(50, 60))
        assert ok(a.Remove, m.RemoveRequest(table="pc", ids=ids_bytes(removed))).removed == 10
        g3 = f32_bytes([1.0, 2.0, 3.0])
        ok(a.DensePush, m.DensePushRequest(table="dn", grad=g3))
        # Still copying, not frozen: the delta is refused.
        e = fails(a.ExportSlots, m.ExportSlotsRequest(table="pc", slots=every, dirty=True))
        assert e.code() == Code.INVALID_ARGUMENT and "not frozen" in e.details(), e.details()
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every))
        e = fails(a.Push, m.PushRequest(table="pc", ids=ids_bytes([1]), grads=f32_bytes([1, 1])))
        assert e.code() == Code.UNAVAILABLE and e.details().startswith("moving: "), e.details()
        want = _rows_by_id(_slot_rows(api, a, "pc", every))
        assert len(want) == 200 + 5 + 5 - 10
        # Without the delta the new owner is behind.
        assert _rows_by_id(_slot_rows(api, b, "pc", every)) != want
        delta = _slot_rows(api, a, "pc", every, dirty=True)
        sent = sorted(i for x in delta for i in np.frombuffer(x.ids, "<u8").tolist())
        gone = sorted(i for x in delta for i in np.frombuffer(x.removed_ids, "<u8").tolist())
        assert sent == [*range(10), *range(1000, 1005), *range(2000, 2005)]
        assert gone == removed
        # A malformed removal list is refused and changes nothing.
        bad = m.BulkLoadRequest(table="pc", config_json=config, removed_ids=b"\x01" * 7)
        e = fails(b.BulkLoad, bad)
        assert e.code() == Code.INVALID_ARGUMENT, e.details()
        for x in delta:
            ok(
                b.BulkLoad,
                m.BulkLoadRequest(
                    table="pc",
                    config_json=x.config_json,
                    ids=x.ids,
                    words=x.words,
                    removed_ids=x.removed_ids,
                ),
            )
        assert _rows_by_id(_slot_rows(api, b, "pc", every)) == want
        # The dense table pushed during the copy comes whole; the quiet one not at all.
        (d,) = _slot_rows(api, a, "dn", every, dirty=True)
        assert d.dense and d.words == _slot_rows(api, a, "dn", every)[0].words
        (q,) = _slot_rows(api, a, "quiet", every, dirty=True)
        assert q.dense and not q.words
        load = m.BulkLoadRequest(table="dn", config_json=d.config_json, words=d.words)
        load.dense_offset = d.dense_offset
        ok(b.BulkLoad, load)
        pulled = [ok(s.DensePull, m.DensePullRequest(table="dn")).values for s in (a, b)]
        assert pulled[0] == pulled[1] != f32_bytes([1.0] * 3)
        # A thaw ends the copy and forgets the record; writes go on.
        assert ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every, thaw=True)).frozen == 0
        e = fails(a.ExportSlots, m.ExportSlotsRequest(table="pc", slots=every, dirty=True))
        assert e.code() == Code.INVALID_ARGUMENT and "not being copied" in e.details(), e.details()
        push([1])


def test_an_evict_during_a_move_reaches_the_new_owner_and_spares_frozen_slots(api):
    """An `Evict` while slots are copying removes old rows as usual and records them, so the
    delta removes them from the new owner too (it would keep them otherwise); while the slots
    are frozen it removes nothing there (their rows are on their way as they are)."""
    m = api.m
    config = sparse_config(2, lr=1.0, initializer={"constant": 0.5})
    every = m.SlotSet(starts=[0], ends=[16384])
    with _old_and_new(api) as (a, b):
        for stub in (a, b):
            create(api, stub, "ev", config)

        def push(ids: Any) -> None:
            g = f32_bytes(np.ones((len(ids), 2)))
            ok(a.Push, m.PushRequest(table="ev", ids=ids_bytes(ids), grads=g))

        push(range(100))
        push(range(50))  # rows 50..99 are one step behind
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every, copy=True))
        for x in _slot_rows(api, a, "ev", every):
            if x.words:
                load = m.BulkLoadRequest(
                    table="ev", config_json=x.config_json, ids=x.ids, words=x.words
                )
                ok(b.BulkLoad, load)
        evict = m.EvictRequest(table="ev", not_updated_for_steps=1)
        assert ok(a.Evict, evict).removed == 50
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every))
        # Frozen: nothing is evicted there, however old.
        time.sleep(2.1)  # rows carry their update time in whole seconds
        idle = m.EvictRequest(table="ev", not_updated_for_seconds=1.0)
        assert ok(a.Evict, idle).removed == 0
        want = _rows_by_id(_slot_rows(api, a, "ev", every))
        assert sorted(want) == list(range(50))
        assert _copy_delta(api, a, b, "ev", every) == list(range(50, 100))
        assert _rows_by_id(_slot_rows(api, b, "ev", every)) == want
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=every, thaw=True))
        assert ok(a.Evict, idle).removed == 50


def test_a_max_rows_budget_during_a_move_reaches_the_new_owner_and_spares_frozen_slots(api):
    """Decision 0122: the `max_rows` budget (LRU) that a push triggers while slots are copying
    evicts as usual and records the rows it takes there, so the delta removes them from the new
    owner too (it kept them otherwise); while the slots are frozen it evicts none of theirs (it
    takes other rows in their place); a thaw gives them back to it."""
    m = api.m
    config = json.loads(sparse_config(2, lr=1.0, initializer={"constant": 0.5}))
    config["lifecycle"] = {"admit_after": 0, "max_rows": 100, "policy": "lru"}
    config = json.dumps(config)
    half = m.SlotSet(starts=[0], ends=[8192])
    with _old_and_new(api) as (a, b):
        for stub in (a, b):
            create(api, stub, "bud", config)
        # Which ids fall in the moved half (a scratch table of the new owner, no budget).
        create(api, b, "probe", sparse_config(2))
        probe = np.arange(4000)
        ok(b.Pull, m.PullRequest(table="probe", ids=ids_bytes(probe)))
        inside = set(_rows_by_id(_slot_rows(api, b, "probe", half)))
        outside = [i for i in probe.tolist() if i not in inside]

        def push(ids: Any) -> None:
            g = f32_bytes(np.ones((len(ids), 2)))
            ok(a.Push, m.PushRequest(table="bud", ids=ids_bytes(ids), grads=g))

        def rows(stub: Any, slots: Any) -> dict[int, bytes]:
            return _rows_by_id(_slot_rows(api, stub, "bud", slots))

        every = m.SlotSet(starts=[0], ends=[16384])
        push(range(100))  # at the budget, all of one version
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=half, copy=True))
        for x in _slot_rows(api, a, "bud", half):
            if x.words:
                ok(
                    b.BulkLoad,
                    m.BulkLoadRequest(
                        table="bud", config_json=x.config_json, ids=x.ids, words=x.words
                    ),
                )
        # 20 new rows: the budget evicts down to 99, the 21 oldest (ids 0..20, ties by id).
        push(range(1000, 1020))
        held = rows(a, every)
        assert sorted(held) == list(range(21, 100)) + list(range(1000, 1020))
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=half))
        frozen = rows(a, half)
        assert frozen and set(frozen) <= set(held)
        # Frozen: new rows elsewhere make the budget take rows outside the half only.
        new = [i for i in outside if i >= 2000][:60]
        push(new)
        assert rows(a, half) == frozen
        after = rows(a, every)
        assert len(after) == 99 and set(frozen) <= set(after)
        assert all(i in outside for i in set(held) - set(after))
        # The delta removes what the budget evicted from the half during the copy.
        gone = _copy_delta(api, a, b, "bud", half)
        assert gone == [i for i in range(21) if i in inside]
        assert rows(b, half) == frozen
        # Thawed: the half's rows are the budget's again.
        ok(a.FreezeSlots, m.FreezeSlotsRequest(slots=half, thaw=True))
        push([i for i in outside if i >= 3000][:60])
        assert len(rows(a, every)) == 99 and len(rows(a, half)) < len(frozen)


# ---------------------------------------------------------------------------------------------
# The model server's answers, read by grpcio


def test_model_server_answers_are_plain_protobuf_whatever_their_size(api, tmp_path):
    """A model server sends a pull's rows from the buffer the lookup wrote, past tonic's
    (server/model.rs, net/splice.rs); grpcio and the protobuf library read an ordinary
    PullResponse with the in-process lookup's rows, at every size. Malformed pulls get
    INVALID_ARGUMENT naming the problem and the server goes on."""
    from pstore import serving

    dim = 8
    store = pstore.Store()
    t = store.create_sparse_table("emb", dim, optimizer=optim.SGD(lr=0.1), seed=3)
    t.pull(np.arange(20_000, dtype=np.uint64))
    store.snapshot(tmp_path / "snap")
    store.close()
    serving.export(tmp_path / "snap", tmp_path / "m")
    model = serving.ServingStore(tmp_path / "m")
    srv = model.serve()
    m = api.m
    ch = grpc.insecure_channel(srv.address, options=[("grpc.max_receive_message_length", -1)])
    try:
        stub = api.PStoreStub(ch)
        rng = np.random.default_rng(5)
        # Around the lookup's parallel split (2048) and the blocking pool's (8192).
        for n in (1, 2047, 2048, 4097, 8193, 50_000):
            ids = rng.integers(0, 25_000, n, dtype=np.uint64)  # some the artifact lacks
            a = ok(stub.Pull, m.PullRequest(table="emb", ids=ids_bytes(ids)))
            assert (a.dim, a.dtype, a.seq, a.version) == (dim, 0, model.generation, a.seq)
            assert a.rows == model.lookup("emb", ids, default="initial").astype("<f4").tobytes(), n
            half = ok(stub.Pull, m.PullRequest(table="emb", ids=ids_bytes(ids), dtype=1))
            assert half.rows == f16_bytes(model.lookup("emb", ids, default="initial")), n
        bad = {
            "ids": m.PullRequest(table="emb", ids=ids_bytes(range(5000))[:-3]),
            "dtype": m.PullRequest(table="emb", ids=ids_bytes(range(5000)), dtype=9),
            "nope": m.PullRequest(table="nope", ids=ids_bytes(range(5000))),
        }
        for what, req in bad.items():
            with pytest.raises(grpc.RpcError) as e:
                stub.Pull(req, timeout=TIMEOUT)
            code = Code.NOT_FOUND if what == "nope" else Code.INVALID_ARGUMENT
            assert e.value.code() == code and what in (e.value.details() or ""), what
        ids = np.arange(10_000, dtype=np.uint64)
        a = ok(stub.Pull, m.PullRequest(table="emb", ids=ids_bytes(ids)))
        assert a.rows == model.lookup("emb", ids).astype("<f4").tobytes()
    finally:
        ch.close()
        srv.stop(grace=1.0)
        model.close()


def test_a_follower_promoted_mid_move_thaws_the_frozen_slots_and_the_move_runs_again(api, tmp_path):
    """Decision 0125: a move froze every slot of a replica group's primary (FreezeSlots, as the
    driver's freeze; the freeze is on the follower before it is answered), then the primary
    is killed -9 and its follower promoted. The new primary thaws the slots: a push to them is
    applied at once (before, it was answered "moving" until the worker's call timed out). A
    routing that gives the slots away, as the interrupted move would publish next, is refused
    by the new primary with a clear error and changes nothing; the move run again against the
    new epoch moves every row with every push, the one taken after the promotion included."""
    from test_failover import _group

    m = api.m
    a, b = _group(tmp_path)
    d = ServerProcess()
    n = 2000
    ids = np.arange(n, dtype=np.int64)
    try:
        d.wait_ready()
        group = [a.address, b.address]
        admin = pstore.connect([group, d.address], ack="all", timeout=10.0)
        admin.publish_routing({"epoch": 1, "servers": 2, "ranges": [[0, 16384, 0]]})
        t = admin.create_sparse_table("t", 2, optimizer=optim.SGD(lr=1.0), initializer=init.Zeros())
        t.push(ids, np.ones((n, 2), np.float32))
        every = m.SlotSet(starts=[0], ends=[16384])
        ch = grpc.insecure_channel(a.address)
        try:
            stub = api.PStoreStub(ch)
            ok(stub.FreezeSlots, m.FreezeSlotsRequest(slots=every, copy=True))
            assert ok(stub.FreezeSlots, m.FreezeSlotsRequest(slots=every)).frozen == 16384
        finally:
            ch.close()
        # Frozen on the primary: a push waits for the move ("moving") until its call times out.
        quick = pstore.connect(
            [group, d.address], ack="all", timeout=1.0, retries=0, failover_timeout=1.0
        )
        with pytest.raises(pstore.ServerError, match="moving"):
            quick.sparse_table("t").push(ids[:10], np.ones((10, 2), np.float32))
        a.send(signal.SIGKILL)  # this pid only
        a.proc.wait(30)
        pstore.promote(b.address)
        # The new primary took the slots thawed: the push is applied at once, once.
        worker = pstore.connect(
            [group, d.address], ack="all", timeout=5.0, retries=0, failover_timeout=10.0
        )
        worker.sparse_table("t").push(ids, np.ones((n, 2), np.float32))
        np.testing.assert_array_equal(
            worker.sparse_table("t").pull(ids), np.full((n, 2), -2.0, np.float32)
        )
        # What the interrupted move would publish next is refused, and nothing changes.
        ch = grpc.insecure_channel(b.address)
        try:
            stub = api.PStoreStub(ch)
            held = ok(stub.GetRouting, m.GetRoutingRequest())
            given = m.Routing()
            given.CopyFrom(held)
            given.slots.epoch = held.slots.epoch + 1
            given.slots.owners[:] = [1] * len(given.slots.owners)
            e = fails(stub.SetRouting, m.SetRoutingRequest(routing=given))
            assert e.code() == Code.INVALID_ARGUMENT, e.details()
            assert "promoted" in e.details() and "move the slots again" in e.details()
            assert ok(stub.GetRouting, m.GetRoutingRequest()) == held
        finally:
            ch.close()
        # The move run again (against the new primary and its epoch) moves every row.
        report = admin.move_slots({"epoch": 0, "servers": 2, "ranges": [[0, 16384, 1]]})
        assert report["slots"] == 16384, report
        np.testing.assert_array_equal(
            admin.sparse_table("t").pull(ids), np.full((n, 2), -2.0, np.float32)
        )
        rows = [sum(int(x["rows"]) for x in s["tables"]) for s in admin.status()]
        assert rows == [0, n], rows
    finally:
        d.stop()
        b.stop()
        a.stop()
