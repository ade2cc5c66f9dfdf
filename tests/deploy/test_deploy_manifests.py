"""The deployment files under deploy/ agree with the code they start.

Every YAML parses; every kvmesh container's command line is accepted by the real CLI parsers;
ports, probes, Services and flags name the same numbers; probe service names exist in the
protos; drain bounds fit the grace period; the mesh never retries Generate; every metric an
alert uses is defined in the Python sources.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvmesh.cli.main import build_parser
from kvmesh.cli.serve import ROLES

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SOURCE_ROOTS = ("kvmesh", "control_plane", "prefill_svc", "decode_svc", "kv_transfer")
# Values standing in for `$(VAR)` references Kubernetes expands from the container's env.
ENV_SAMPLES = {"POD_IP": "10.1.2.3", "POD_NAME": "kvmesh-decode-5d9c7-abcde"}
VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
METRIC = re.compile(r"\bkvmesh[_:][a-z0-9_:]+\b")
EXPOSITION_SUFFIXES = ("_bucket", "_count", "_sum", "_total", "_created")
TOKEN_SECRET = "kvmesh-cluster-token"
TOKEN_FILE = "/var/run/secrets/kvmesh/token"
INTERNAL_PORT = 50052  # the control plane's internal door (ControlService)


HELM_TEMPLATES = DEPLOY / "helm" / "kvmesh" / "templates"  # Go templates, not YAML


def yaml_files() -> list[Path]:
    return sorted(
        p
        for p in DEPLOY.rglob("*")
        if p.suffix in (".yaml", ".yml") and HELM_TEMPLATES not in p.parents
    )


def load(path: Path) -> list[Any]:
    with path.open() as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def k8s_objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in yaml_files():
        for doc in load(path):
            if isinstance(doc, dict) and "kind" in doc and "apiVersion" in doc:
                yield path, doc


def pod_specs() -> Iterator[tuple[Path, dict[str, Any], dict[str, Any]]]:
    """(file, workload object, pod spec) for every workload, patches included."""
    for path, obj in k8s_objects():
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        if isinstance(pod, dict):
            yield path, obj, pod


def kvmesh_containers() -> list[tuple[str, dict[str, Any], dict[str, Any], dict[str, Any]]]:
    """(label, workload, pod spec, container) for containers that run the kvmesh CLI.

    An overlay patch's container is merged over the base container of the same name (top-level
    fields replaced, as a strategic merge does for these fields)."""
    base = {
        (obj["metadata"]["name"], c["name"]): c
        for obj, pod in base_deployments().values()
        for c in pod.get("containers", [])
    }
    found = []
    for path, obj, pod in pod_specs():
        for patch in pod.get("containers", []):
            container = {**base.get((obj["metadata"]["name"], patch["name"]), {}), **patch}
            args = container.get("args") or []
            runs_cli = container.get("image", "").startswith("kvmesh") and not container.get(
                "command"
            )
            if args[:1] == ["serve"] or runs_cli:
                label = f"{path.relative_to(ROOT)}:{obj['metadata']['name']}/{container['name']}"
                found.append((label, obj, pod, container))
    return found


def base_deployments() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Deployments (not overlay patches) by name: (object, pod spec)."""
    out = {}
    for path, obj, pod in pod_specs():
        if "overlays" not in path.parts and obj["kind"] == "Deployment":
            out[obj["metadata"]["name"]] = (obj, pod)
    return out


def expand(args: list[str], container: dict[str, Any]) -> list[str]:
    """Replace `$(VAR)` like the kubelet does; every VAR must be in the container's env."""
    defined = {env["name"] for env in container.get("env", [])}
    out = []
    for arg in args:
        for name in VAR_REF.findall(arg):
            assert name in defined, f"{arg!r} uses $({name}) but the container env lacks it"
        out.append(VAR_REF.sub(lambda m: ENV_SAMPLES.get(m.group(1), "x"), arg))
    return out


def role_parser(role: str) -> argparse.ArgumentParser:
    """The parser `kvmesh serve ROLE` uses (skips when this installation lacks the role)."""
    module_name, _function = ROLES[role]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            pytest.skip(f"role {role!r}: {module_name} is not in this tree yet")
        raise
    if hasattr(module, "build_parser"):
        return module.build_parser()
    from kvmesh.service.options import parser

    return parser(role, transfer=role != "colocated")


def parse_or_fail(parser: argparse.ArgumentParser, argv: list[str], label: str) -> Any:
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            return parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"{label}: {argv} rejected: {stderr.getvalue().strip()}")


def parsed_command(
    label: str, container: dict[str, Any]
) -> tuple[argparse.Namespace, argparse.Namespace | None]:
    argv = expand(list(container.get("command", [])[1:]) + container.get("args", []), container)
    top = parse_or_fail(build_parser(), argv, label)
    if top.command != "serve":
        return top, None
    return top, parse_or_fail(role_parser(top.role), list(top.role_args), label)


def named_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}


def prestop_seconds(container: dict[str, Any]) -> float:
    pre = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in pre:
        return float(pre["sleep"]["seconds"])
    command = pre.get("exec", {}).get("command", [])
    return float(command[1]) if command[:1] == ["sleep"] else 0.0


# -- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_parses(path: Path) -> None:
    docs = load(path)
    assert docs, f"{path} is empty"


def test_kustomizations_name_existing_files() -> None:
    for path in DEPLOY.rglob("kustomization.yaml"):
        (kustomization,) = load(path)
        listed = list(kustomization.get("resources", []))
        listed += kustomization.get("components", [])
        patches = kustomization.get("patches", [])
        listed += [p if isinstance(p, str) else p["path"] for p in patches if "patch" not in p]
        for gen in kustomization.get("configMapGenerator", []):
            listed += gen.get("files", [])
        for entry in listed:
            assert (path.parent / entry).exists(), f"{path.relative_to(ROOT)} lists {entry}"


# -- command lines ---------------------------------------------------------------------------


CONTAINERS = kvmesh_containers()


def test_manifests_start_every_worker_role() -> None:
    roles = set()
    for label, _obj, _pod, container in CONTAINERS:
        args = container.get("args", [])
        if args[:1] == ["serve"]:
            roles.add(args[1])
        assert container.get("args"), f"{label}: no args"
    assert {"control", "prefill", "decode"} <= roles


@pytest.mark.parametrize("case", CONTAINERS, ids=[c[0] for c in CONTAINERS])
def test_container_command_is_accepted_by_the_cli(case: tuple[str, Any, Any, Any]) -> None:
    label, _obj, _pod, container = case
    top, role_args = parsed_command(label, container)
    if role_args is None:
        return
    assert role_args.cluster_token_file == TOKEN_FILE, f"{label}: the Secret's token file"
    assert not role_args.insecure_no_auth, f"{label}: internal calls unauthenticated"
    if top.role in ("prefill", "decode"):
        assert role_args.control == f"kvmesh-control:{INTERNAL_PORT}", f"{label}: --control"
        assert role_args.host == ENV_SAMPLES["POD_IP"], f"{label}: bind and register the pod IP"
        assert role_args.worker_id == ENV_SAMPLES["POD_NAME"], f"{label}: --worker-id POD_NAME"
        assert role_args.transfer_backend, f"{label}: name the transfer backend explicitly"
        # Pods do not share /dev/shm, so shm can never pair two pods.
        assert "shm" not in role_args.transfer_backend, f"{label}: shm across pods"


def test_control_plane_offers_only_cross_pod_backends() -> None:
    for label, _obj, _pod, container in CONTAINERS:
        top, role_args = parsed_command(label, container)
        if role_args is not None and top.role == "control":
            backends = role_args.transfer_backends.split(",")
            assert "shm" not in backends and "cuda_ipc" not in backends, label


# -- ports, probes, Services -----------------------------------------------------------------


def proto_service_names() -> set[str]:
    from kvmesh.v1 import generation_pb2, worker_pb2

    names = {""}
    for module in (generation_pb2, worker_pb2):
        names |= {s.full_name for s in module.DESCRIPTOR.services_by_name.values()}
    return names


def test_ports_flags_probes_and_annotations_agree() -> None:
    services = proto_service_names()
    for label, obj, pod, container in CONTAINERS:
        if obj["kind"] != "Deployment" or "ports" not in container:
            continue
        _top, role_args = parsed_command(label, container)
        assert role_args is not None
        ports = named_ports(container)
        assert set(ports) - {"http", "control", "kv-transfer"} == {"grpc", "metrics"}, label
        transfer_port = getattr(role_args, "transfer_port", None) or None  # 0: free ports
        assert transfer_port == ports.get("kv-transfer"), f"{label}: --transfer-port vs ports"
        if obj["metadata"]["name"] == "kvmesh-decode":  # a mesh needs the receiver's port named
            assert transfer_port is not None, f"{label}: the KV receiver on a declared port"
        if hasattr(role_args, "internal_port"):
            assert role_args.internal_port == ports["control"] == INTERNAL_PORT, label
        assert role_args.port == ports["grpc"], f"{label}: --port vs containerPort grpc"
        http_port = getattr(role_args, "http_port", None)
        assert http_port == ports.get("http"), f"{label}: --http-port vs containerPort http"
        assert role_args.metrics_port == ports["metrics"], f"{label}: --metrics-port"
        base_obj, base_pod = base_deployments()[obj["metadata"]["name"]]
        annotations = base_obj["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert int(annotations["prometheus.io/port"]) == ports["metrics"], label
        for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
            probe = container[kind]["grpc"]
            assert probe["port"] == ports["grpc"], f"{label}: {kind} port"
            assert probe.get("service", "") in services, f"{label}: {kind} {probe}"
        assert container["readinessProbe"]["grpc"].get("service"), f"{label}: readiness service"
        grace = pod.get("terminationGracePeriodSeconds", base_pod["terminationGracePeriodSeconds"])
        needed = prestop_seconds(container) + role_args.drain_seconds
        assert grace >= needed + 5, f"{label}: grace {grace}s < preStop + drain {needed}s + 5"


def test_services_target_named_container_ports() -> None:
    deployments = base_deployments()
    service_objects = [o for _p, o in k8s_objects() if o["kind"] == "Service"]
    assert service_objects
    for service in service_objects:
        selector = service["spec"]["selector"]
        pods = [
            pod
            for obj, pod in deployments.values()
            if selector.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
        ]
        assert pods, f"Service {service['metadata']['name']} selects no Deployment"
        for port in service["spec"]["ports"]:
            target = port["targetPort"]
            container_ports = {
                name: number
                for pod in pods
                for c in pod["containers"]
                for name, number in named_ports(c).items()
            }
            assert target in container_ports, f"{service['metadata']['name']}: {target}"
            if service["metadata"]["name"].startswith("kvmesh"):
                assert port["name"] == target, "Service port names follow the container's"
                assert port["port"] == container_ports[target]


def test_workers_reach_the_control_service_port() -> None:
    control = next(
        o for _p, o in k8s_objects() if o["kind"] == "Service" and o["metadata"]["name"] ==
        "kvmesh-control"
    )  # fmt: skip
    assert control["spec"]["publishNotReadyAddresses"] is True
    ports = {p["port"] for p in control["spec"]["ports"]}
    assert INTERNAL_PORT in ports and 50051 not in ports, "the internal door only"


def test_every_pod_mounts_the_cluster_token_secret() -> None:
    # Overlays patch args; mounts and volumes stay the base's.
    roles = ("kvmesh-control", "kvmesh-prefill", "kvmesh-decode")
    deployments = {name: spec for name, spec in base_deployments().items() if name in roles}
    assert set(deployments) == set(roles)
    for label, (_obj, pod) in deployments.items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        assert volumes["cluster-token"]["secret"]["secretName"] == TOKEN_SECRET, label
        for container in pod["containers"]:
            mount = {m["name"]: m for m in container["volumeMounts"]}["cluster-token"]
            assert mount["readOnly"] and TOKEN_FILE.startswith(mount["mountPath"] + "/"), label
        assert pod["serviceAccountName"] == label, label


def test_the_token_secret_comes_from_the_operator_not_a_file() -> None:
    (kustomization,) = load(DEPLOY / "k8s" / "base" / "kustomization.yaml")
    assert "secretGenerator" not in kustomization, "no render may need a file nobody has"
    assert "cluster-token" not in (ROOT / ".gitignore").read_text(), "no token file to ignore"
    comment = (DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text()
    assert f"kubectl create secret generic {TOKEN_SECRET} -n kvmesh" in comment


def test_only_worker_accounts_reach_the_internal_door() -> None:
    policies = {
        o["metadata"]["name"]: o for _p, o in k8s_objects() if o["kind"] == "AuthorizationPolicy"
    }
    rules = policies["kvmesh-control"]["spec"]["rules"]
    assert policies["kvmesh-control"]["spec"]["action"] == "ALLOW"
    internal = [r for r in rules if str(INTERNAL_PORT) in r["to"][0]["operation"].get("ports", [])]
    assert len(internal) == 1
    principals = internal[0]["from"][0]["source"]["principals"]
    assert sorted(p.rsplit("/", 1)[1] for p in principals) == ["kvmesh-decode", "kvmesh-prefill"]


def test_pod_disruption_budgets_cover_the_workers() -> None:
    selected = {
        o["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"]
        for _p, o in k8s_objects()
        if o["kind"] == "PodDisruptionBudget"
    }
    assert {"kvmesh-prefill", "kvmesh-decode"} <= selected


# -- mesh ------------------------------------------------------------------------------------


def test_mesh_retries_only_unavailable_and_never_generate() -> None:
    routes = [
        route
        for _p, o in k8s_objects()
        if o["kind"] == "VirtualService"
        for route in o["spec"].get("http", [])
    ]
    assert routes
    generate_routes = 0
    for route in routes:
        retries = route.get("retries", {})
        paths = [m.get("uri", {}).get("exact", "") for m in route.get("match", [])]
        if any(p.endswith("/Generate") for p in paths):
            generate_routes += 1
            assert retries.get("attempts") == 0, f"{route['name']}: Generate must not be retried"
        elif retries.get("attempts", 0) > 0:
            assert retries["retryOn"] == "unavailable", route["name"]
            assert "perTryTimeout" in retries, route["name"]
    assert generate_routes >= 1


# -- alerts ----------------------------------------------------------------------------------


def metric_names_in_code() -> set[str]:
    literal = re.compile(r"[\"'](kvmesh[_:][a-z0-9_:]+)[\"']")
    names: set[str] = set()
    for root in SOURCE_ROOTS:
        for path in (ROOT / root).rglob("*.py"):
            names |= set(literal.findall(path.read_text()))
    return names


def rule_expressions() -> Iterator[tuple[str, str]]:
    for path in sorted((DEPLOY / "prometheus").glob("*.yaml")):
        for doc in load(path):
            for group in doc["groups"]:
                for rule in group["rules"]:
                    yield rule.get("alert") or rule["record"], rule["expr"]


def test_alert_rules_use_metrics_defined_in_code() -> None:
    known = metric_names_in_code()
    assert "kvmesh:time_to_first_token_seconds" in known
    rules = list(rule_expressions())
    assert len(rules) >= 3
    for name, expr in rules:
        for metric in METRIC.findall(expr):
            bases = {metric} | {metric.removesuffix(s) for s in EXPOSITION_SUFFIXES}
            assert bases & known, f"rule {name}: {metric} is not defined in {SOURCE_ROOTS}"
