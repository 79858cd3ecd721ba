"""The Kubernetes manifests of deploy/kubernetes/ and the image of deploy/Dockerfile.

Every manifest is validated offline against the Kubernetes API schemas (kubernetes-validate,
strict: unknown fields fail), the pieces are checked against each other (names, labels, ports,
paths, the cluster file against the StatefulSet, the server's flags against `pstore serve`'s
own parser), and the server container's command line is run for real on 127.0.0.1 with its
paths moved to a temporary directory: it starts, answers the gRPC health check the probes make
without a token, serves metrics where the scrape annotations point, and flushes on SIGTERM.
No cluster and no image are needed.
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import kubernetes_validate
import numpy as np
import pytest
import yaml
from _netutil import child_env, free_port

import pstore
from pstore.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
K8S = DEPLOY / "kubernetes"


def _schema_versions() -> list[str]:
    """The oldest Kubernetes the manifests are written for (gRPC probes are GA from 1.27; or the
    oldest whose schemas this kubernetes-validate still ships) and the newest it ships."""
    shipped = kubernetes_validate.utils.all_versions()  # ascending, "1.27.0", ...

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(x) for x in v.split(".")[:2])

    oldest = next((v for v in shipped if key(v) >= (1, 27)), shipped[-1])
    return [oldest, shipped[-1]]


VERSIONS = _schema_versions()
CLUSTER_FILE = "/etc/pstore/cluster/cluster.json"
SERVING = 1  # grpc.health.v1.HealthCheckResponse.ServingStatus.SERVING


def manifests() -> dict[str, list[dict[str, Any]]]:
    """Every Kubernetes object of deploy/kubernetes/, by file (kustomization.yaml aside)."""
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            out[path.name] = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return out


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) in the manifests."""
    found = [
        d
        for docs in manifests().values()
        for d in docs
        if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in a command line."""
    assert args.count(name) == 1, (name, args)
    return args[args.index(name) + 1]


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def server() -> tuple[dict[str, Any], dict[str, Any]]:
    """The StatefulSet and its one container."""
    sts = one("StatefulSet")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    return sts, container


def serve_args() -> list[str]:
    """The server's arguments after ``pstore serve``."""
    _, c = server()
    assert c["command"] == ["pstore", "serve"]
    return list(c["args"])


# ---------------------------------------------------------------------------------------------
# Schemas


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("file", sorted(manifests()))
def test_every_manifest_is_valid_against_the_kubernetes_schemas(file: str, version: str) -> None:
    docs = manifests()[file]
    assert docs, f"{file} holds no object"
    for doc in docs:
        assert "namespace" not in doc["metadata"], f"{file}: manifests are namespace-agnostic"
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validation_catches_a_wrong_field() -> None:
    """The validation the test above relies on fails on a misspelt field and a wrong type."""
    sts = json.loads(json.dumps(server()[0]))
    sts["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)
    sts = json.loads(json.dumps(server()[0]))
    sts["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)


def test_the_kustomization_lists_the_server_objects_only() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kust["kind"] == "Kustomization"
    kinds = {
        d["kind"] for f in kust["resources"] for d in yaml.safe_load_all((K8S / f).read_text())
    }
    assert kinds == {"ConfigMap", "Service", "StatefulSet", "PodDisruptionBudget", "Deployment"}
    # The Secret template and the training Job are applied on their own (docs/KUBERNETES.md).
    assert set(manifests()) == {*kust["resources"], "secret.example.yaml", "train-job.yaml"}


# ---------------------------------------------------------------------------------------------
# The pieces agree


def test_the_service_and_budget_select_the_servers_and_only_them() -> None:
    sts, _ = server()
    svc, pdb, job = one("Service"), one("PodDisruptionBudget"), one("Job")
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    worker_labels = job["spec"]["template"]["metadata"]["labels"]
    controller_labels = one("Deployment")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["clusterIP"] == "None"  # headless: one DNS name per server
    assert sts["spec"]["serviceName"] == svc["metadata"]["name"]
    for selector in (
        svc["spec"]["selector"],
        sts["spec"]["selector"]["matchLabels"],
        pdb["spec"]["selector"]["matchLabels"],
    ):
        assert matches(selector, pod_labels), selector
        assert not matches(selector, worker_labels), selector
        assert not matches(selector, controller_labels), selector
    assert pdb["spec"]["maxUnavailable"] == 1


def test_the_cluster_file_lists_exactly_the_statefulsets_servers() -> None:
    sts, _ = server()
    svc = one("Service")
    cluster = json.loads(one("ConfigMap")["data"]["cluster.json"])
    name, service = sts["metadata"]["name"], svc["metadata"]["name"]
    port = int(flag(serve_args(), "--port"))
    want = [f"{name}-{i}.{service}:{port}" for i in range(sts["spec"]["replicas"])]
    # Replica groups of two, in the order of the pods' ordinals.
    assert cluster == {"servers": [want[i : i + 2] for i in range(0, len(want), 2)]}
    grpc_port = next(p for p in svc["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_port["port"] == port
    # Each pod names itself in the file: `--member $(POD_NAME).<service>:<port>`, POD_NAME
    # from the downward API (Kubernetes expands $(VAR) in args).
    _, c = server()
    assert flag(serve_args(), "--member") == f"$(POD_NAME).{service}:{port}"
    env = {e["name"]: e for e in c["env"]}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_server_command_line_is_pstore_serve() -> None:
    args = serve_args()
    parsed = build_parser().parse_args(["serve", *args])  # an unknown flag exits here
    assert parsed.func.__name__ == "_cmd_serve"
    assert parsed.host == "0.0.0.0"
    assert parsed.durability == "sync"
    assert parsed.path and parsed.token_file
    assert parsed.cluster == CLUSTER_FILE and parsed.index is None and parsed.follow is None


def test_probes_ports_and_mounts_agree_with_the_command_line() -> None:
    sts, c = server()
    args = serve_args()
    port, metrics = int(flag(args, "--port")), int(flag(args, "--metrics-port"))
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": port, "metrics": metrics}
    svc_ports = {p["name"]: p["port"] for p in one("Service")["spec"]["ports"]}
    assert svc_ports == ports
    # The probes ask the health service for the store's service: its name is the proto's.
    proto = (REPO / "proto" / "pstore" / "v1" / "pstore.proto").read_text()
    package = re.search(r"^package (\S+);", proto, re.M)
    service = re.search(r"^service (\w+) \{", proto, re.M)
    assert package and service
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"] == {"port": port, "service": f"{package[1]}.{service[1]}"}
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == metrics
    assert annotations["prometheus.io/path"] == "/metrics"
    # SIGTERM: the calls in flight get --grace seconds, and the flush comes after them.
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= 2 * float(
        flag(args, "--grace")
    )

    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}

    def mount_of(path: str) -> str:
        (m,) = (m for m in mounts if path.startswith(m.rstrip("/") + "/"))
        return m

    assert mounts[mount_of(flag(args, "--path"))] in claims  # the store on its own volume
    token_mount = mount_of(flag(args, "--token-file"))
    secret = volumes[mounts[token_mount]]["secret"]
    template = one("Secret")
    assert secret["secretName"] == template["metadata"]["name"]
    assert flag(args, "--token-file") == f"{token_mount}/{next(iter(template['stringData']))}"
    cluster_mount = mount_of(flag(args, "--cluster"))
    config = volumes[mounts[cluster_mount]]["configMap"]
    assert config["name"] == one("ConfigMap")["metadata"]["name"]
    assert flag(args, "--cluster") == f"{cluster_mount}/cluster.json"


def controller() -> tuple[dict[str, Any], dict[str, Any]]:
    """The controller's Deployment and its one container."""
    dep = one("Deployment", "pstore-controller")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, container


def test_the_controller_is_one_pod_of_pstore_controller_on_the_servers_cluster_file() -> None:
    dep, c = controller()
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"]["type"] == "Recreate"  # never two controllers at once
    assert c["command"] == ["pstore", "controller"]
    args = build_parser().parse_args(["controller", *c["args"]])  # an unknown flag exits here
    assert args.func.__name__ == "_cmd_controller"
    _, server_container = server()
    assert args.cluster == flag(serve_args(), "--cluster") == CLUSTER_FILE
    assert args.token_file == flag(serve_args(), "--token-file")
    assert args.status_host == "0.0.0.0"
    # The same ConfigMap and Secret as the servers, mounted at the same paths.
    spec = dep["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    server_volumes = {v["name"]: v for v in server()[0]["spec"]["template"]["spec"]["volumes"]}
    server_mounts = {m["mountPath"]: m["name"] for m in server_container["volumeMounts"]}
    for m in c["volumeMounts"]:
        assert server_volumes[server_mounts[m["mountPath"]]] == volumes[m["name"]]
    # The probes ask the status port the command line serves.
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"status": args.status_port}
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "status"}
    assert spec["securityContext"]["fsGroup"] == 10001  # the token's group may read it


def test_the_controller_container_serves_its_status(tmp_path: Path) -> None:
    """The controller's command line on 127.0.0.1, against a group whose two members are not
    running: it starts, answers the liveness probe's path, and reports the group unreachable
    without promoting anything."""
    _, c = controller()
    port = free_port()
    (tmp_path / "token").write_text("k8s-test-token\n")
    group = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    (tmp_path / "cluster.json").write_text(json.dumps({"servers": [group]}))
    swap = {
        CLUSTER_FILE: str(tmp_path / "cluster.json"),
        flag(c["args"], "--token-file"): str(tmp_path / "token"),
        "0.0.0.0": "127.0.0.1",
        flag(c["args"], "--status-port"): str(port),
    }
    log = tmp_path / "controller.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pstore", "controller", *[swap.get(a, a) for a in c["args"]]],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=child_env(),
        )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as r:
            status = json.load(r)
        (g,) = status["groups"]
        assert [m["address"] for m in g["members"]] == group
        assert all(m["role"] == "down" for m in g["members"])
        assert g["primary"] is None
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    text = log.read_text()
    assert code == 0, text
    assert "event=controlling" in text and "event=stopped signal=SIGTERM" in text
    assert "event=promoted" not in text


def test_the_worker_job_is_indexed_and_finds_the_servers() -> None:
    job = one("Job")
    spec = job["spec"]
    (c,) = spec["template"]["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert spec["completionMode"] == "Indexed"  # pods get JOB_COMPLETION_INDEX = their rank
    assert spec["completions"] == spec["parallelism"] == int(env["WORLD_SIZE"]["value"])
    assert env["PSTORE_JOB"]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.labels['batch.kubernetes.io/controller-uid']"
    )
    secret = one("Secret")
    ref = env["PSTORE_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (secret["metadata"]["name"], "token")
    configmap = one("ConfigMap")
    (vol,) = spec["template"]["spec"]["volumes"]
    assert vol["configMap"]["name"] == configmap["metadata"]["name"]
    (mount,) = c["volumeMounts"]
    assert mount["name"] == vol["name"]
    cluster = flag(c["args"], "--cluster")
    assert cluster == f"{mount['mountPath']}/cluster.json"
    assert "cluster.json" in configmap["data"]
    # The script is the example the image carries (deploy/Dockerfile copies examples/ there).
    script = c["command"][1]
    assert script.startswith("/opt/pstore/examples/")
    assert (REPO / "examples" / Path(script).name).is_file()
    assert "COPY examples /opt/pstore/examples" in (DEPLOY / "Dockerfile").read_text()


def test_the_worker_job_passes_arguments_the_example_takes() -> None:
    pytest.importorskip("torch")
    (c,) = one("Job")["spec"]["template"]["spec"]["containers"]
    path = REPO / "examples" / Path(c["command"][1]).name
    spec = importlib.util.spec_from_file_location("bsp_train_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.build_parser().parse_args(c["args"])  # a wrong argument exits here
    assert args.cluster == "/etc/pstore/cluster/cluster.json"


def test_the_dockerfile_copies_files_that_exist() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    ignore = [
        line
        for line in (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert ignore[0] == "*"  # everything is left out but what is named again below
    copies = [
        line.split()[1:-1]
        for line in text.splitlines()
        if line.startswith("COPY ") and "--from=" not in line
    ]
    assert copies
    for sources in copies:
        for src in sources:
            assert (REPO / src).exists(), src
            assert f"!{src}" in ignore, f"{src} is excluded from the build context"
    # The wheel's build needs what pyproject.toml and Cargo.toml name.
    assert "rust/build.rs" in (REPO / "Cargo.toml").read_text()
    named = {s for sources in copies for s in sources}
    assert {"Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "rust", "proto"} <= named
    assert "pstore" in named


# ---------------------------------------------------------------------------------------------
# The server's command line, run


def health(address: str, service: str) -> int:
    """What a Kubernetes gRPC probe asks: grpc.health.v1.Health/Check, with no token."""
    with grpc.insecure_channel(address) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        name = service.encode()
        request = b"\x0a" + bytes([len(name)]) + name if name else b""
        response = check(request, timeout=5.0)
    # HealthCheckResponse {status = 1 (varint)}; an absent field is 0, UNKNOWN.
    return response[1] if response[:1] == b"\x08" else 0


class Container:
    """The server container's command line on 127.0.0.1, its paths under ``root``."""

    def __init__(self, root: Path, port: int | None = None, token: str = "k8s-test-token") -> None:
        _, c = server()
        args = serve_args()
        self.port, self.metrics = port or free_port(), free_port()
        data_mount = next(m["mountPath"] for m in c["volumeMounts"] if m["name"] == "data")
        token_file = flag(args, "--token-file")
        self.data = root / "data"
        self.token_file = root / "token"
        if not self.token_file.exists():
            self.token_file.write_text(token + "\n")
        self.token = self.token_file.read_text().strip()
        self.address = f"127.0.0.1:{self.port}"
        # Its replica group: this server first (the primary), a follower's place second.
        self.cluster = root / "cluster.json"
        if not self.cluster.exists():
            group = [self.address, f"127.0.0.1:{free_port()}"]
            self.cluster.write_text(json.dumps({"servers": [group]}))
        swap = {
            "0.0.0.0": "127.0.0.1",
            flag(args, "--port"): str(self.port),
            flag(args, "--metrics-port"): str(self.metrics),
            token_file: str(self.token_file),
            flag(args, "--cluster"): str(self.cluster),
            flag(args, "--member"): self.address,
        }
        self.args = [
            swap.get(a, a.replace(data_mount, str(self.data), 1) if a.startswith("/") else a)
            for a in args
        ]
        assert not [a for a in self.args if a.startswith("/") and not a.startswith(str(root))]
        self.log = root / "server.log"
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pstore", "serve", *self.args],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=child_env(),
            )

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, self.log.read_text()
            try:
                if health(self.address, "pstore.v1.PStore") == SERVING:
                    return
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.1)

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()


def test_the_server_container_starts_answers_probes_and_flushes_on_sigterm(tmp_path: Path):
    srv = Container(tmp_path)
    try:
        srv.wait_serving()
        # The probes' check needs no token; the server's own calls do.
        assert health(srv.address, "") == SERVING
        with pytest.raises(pstore.AuthenticationError):
            pstore.connect([srv.address], retries=0).status()
        store = pstore.connect([srv.address], srv.token, retries=0)
        t = store.create_sparse_table("k8s", 2, initializer=pstore.init.Constant(0.0))
        t.push(np.array([7], np.int64), np.ones((1, 2), np.float32))
        store.close()
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.metrics}/metrics", timeout=5) as r:
            assert r.status == 200
            assert 'table="k8s"' in r.read().decode()
    finally:
        code = srv.stop()
    log = srv.log.read_text()
    assert code == 0, log
    assert "event=stopping signal=SIGTERM" in log and "event=stopped" in log
    # The same command line on the same volume and address (a StatefulSet pod's stable name;
    # the servers' tables are bound to the cluster's address list): the row is there.
    again = Container(tmp_path, srv.port)
    try:
        again.wait_serving()
        store = pstore.connect([again.address], again.token, retries=0)
        row = store.table("k8s").pull(np.array([7], np.int64))
        np.testing.assert_array_equal(row, np.full((1, 2), -0.01, np.float32))
        store.close()
    finally:
        assert again.stop() == 0


def test_the_secret_template_keeps_the_server_from_starting(tmp_path: Path) -> None:
    """Deployed as it is, the template's empty token stops the server with a clear error
    instead of serving without authentication."""
    template = one("Secret")["stringData"]["token"]
    assert template == ""
    (tmp_path / "token").write_text(template)
    srv = Container(tmp_path)
    try:
        code = srv.proc.wait(60)
    finally:
        if srv.proc.poll() is None:
            srv.stop()
    assert code == 2
    assert "is empty" in srv.log.read_text()
