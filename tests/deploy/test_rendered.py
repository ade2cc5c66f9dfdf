"""deploy/ as a user applies it: rendered by `kubectl kustomize` and by Helm's engine, validated.

Every kustomization renders (components alone and in the overlays that use them), from a fresh
clone as from this checkout, and none holds a Secret: the pods mount the cluster-token Secret
the operator creates, so no render ships a token. Every core object passes
`kubernetes-validate --strict` against Kubernetes 1.30 and the newest schema the package ships;
Istio and KEDA objects pass models generated from their published CRD schemas, with no
field those schemas lack. The Helm chart renders the same objects as the kustomize base, the GPU
overlay and the production overlay, plus the token Secret the pods mount. Every kvmesh
container of every render is accepted by the kvmesh CLI.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest

from tests.deploy import rendering as r
from tests.deploy.test_deploy_manifests import (
    METRIC,
    metric_names_in_code,
    parsed_command,
    prestop_seconds,
)

OLDEST_K8S = "1.30.0"
OTEL_KINDS = {("ServiceAccount", "otel-collector"), ("Role", "otel-collector-pod-discovery"),
              ("RoleBinding", "otel-collector-pod-discovery"), ("Deployment", "otel-collector"),
              ("Service", "otel-collector")}  # fmt: skip
# apiVersion/kind -> the model generated from the project's published CRD schema.
CRD_MODELS = {
    ("security.istio.io/v1", "PeerAuthentication"): "cloudcoil.models.istio.security.v1",
    ("security.istio.io/v1", "AuthorizationPolicy"): "cloudcoil.models.istio.security.v1",
    ("networking.istio.io/v1", "DestinationRule"): "cloudcoil.models.istio.networking.v1",
    ("networking.istio.io/v1", "VirtualService"): "cloudcoil.models.istio.networking.v1",
    ("keda.sh/v1alpha1", "ScaledObject"): "cloudcoil.models.keda.v1alpha1",
}
CHART_AS_BASE = {"auth": {"token": r.SAMPLE_TOKEN}, "namespace": {"create": True}}


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[r.Obj]]:
    """Every renderable kustomization (by path under deploy/) and, where Helm's engine is
    installed, the chart's variants (by name, `helm...`)."""
    out = {}
    for folder in r.kustomizations():
        out[str(folder.relative_to(r.DEPLOY))] = r.kustomize(folder)
    if not r.have_helm():
        return out
    gpu = r.merge(CHART_AS_BASE, r.helm_values_file("values-gpu.yaml"))
    production = r.merge(
        gpu,
        {"mesh": {"enabled": True}, "autoscaling": {"enabled": True},
         "networkPolicy": {"enabled": True}},
    )  # fmt: skip
    out["helm-defaults"] = r.helm_template({})
    out["helm"] = r.helm_template(CHART_AS_BASE)
    out["helm-gpu"] = r.helm_template(gpu)
    out["helm-production"] = r.helm_template(production)
    out["helm-options"] = r.helm_template(
        {"auth": {"existingSecret": "my-token"}, "transferBackend": "gloo",
         "model": {"url": "https://models.example/m.gguf", "name": "m",
                   "storage": {"storageClassName": "nfs"}}}
    )  # fmt: skip
    return out


def chart_render(renders: dict[str, list[r.Obj]], name: str) -> list[r.Obj]:
    if name not in renders:
        r.require_helm()
    return renders[name]


def unique_objects(renders: dict[str, list[r.Obj]]) -> list[tuple[str, r.Obj]]:
    seen: dict[str, tuple[str, r.Obj]] = {}
    for name, objects in renders.items():
        for obj in objects:
            seen.setdefault(json.dumps(obj, sort_keys=True), (name, obj))
    return list(seen.values())


def label(name: str, obj: r.Obj) -> str:
    return f"{name}: {obj['kind']}/{obj['metadata']['name']}"


def without_otel(objects: list[r.Obj]) -> list[r.Obj]:
    """The objects of deploy/otel removed (the overlays add the collector; the chart does not)."""
    return [
        o
        for o in objects
        if (o["kind"], o["metadata"]["name"]) not in OTEL_KINDS
        and not o["metadata"]["name"].startswith("otel-collector-config")
    ]


# -- kustomize -------------------------------------------------------------------------------


def test_every_kustomization_renders_and_every_component_is_used(
    renders: dict[str, list[r.Obj]],
) -> None:
    used: set[Path] = set()
    for folder in r.kustomizations():
        assert renders[str(folder.relative_to(r.DEPLOY))], f"{folder}: renders nothing"
        doc = r.yaml.safe_load((folder / "kustomization.yaml").read_text())
        used |= {(folder / c).resolve() for c in doc.get("components", [])}
    components = {f.resolve() for f in r.kustomizations() if r.kind_of(f) == "Component"}
    assert len(components) >= 3, "mesh, autoscaling and network policies are components"
    assert components <= used, f"components no overlay uses: {components - used}"
    assert {"k8s/base", "k8s/overlays/cpu", "k8s/overlays/gpu"} <= set(renders)


def test_every_kustomization_renders_the_same_from_a_fresh_clone(
    renders: dict[str, list[r.Obj]], tmp_path: Path
) -> None:
    fresh = r.fresh_copy(tmp_path)
    copied = {p.relative_to(tmp_path) for p in fresh.rglob("*") if p.is_file()}
    tracked = {p for p in r.tracked_files() if (r.ROOT / p).is_file()}
    assert copied == tracked, "the copy holds exactly the tracked files"
    folders = sorted(p.parent for p in fresh.rglob("kustomization.yaml"))
    assert len(folders) >= 9
    for folder in folders:
        name = str(folder.relative_to(fresh))
        assert r.kustomize(folder) == renders[name], f"{name}: differs in a fresh clone"


def test_no_kustomization_ships_a_secret_and_the_pods_need_the_operators(
    renders: dict[str, list[r.Obj]],
) -> None:
    for folder in r.kustomizations():
        doc = r.yaml.safe_load((folder / "kustomization.yaml").read_text())
        assert "secretGenerator" not in doc, f"{folder}: generates a Secret"
    checked = 0
    for name, objects in kvmesh_renders(renders).items():
        if name.startswith("helm"):
            continue  # the chart makes the Secret: test_the_chart_makes_the_secret_the_pods_mount
        assert [o for o in objects if o["kind"] == "Secret"] == [], f"{name}: ships a Secret"
        for obj in objects:
            pod = obj.get("spec", {}).get("template", {}).get("spec", {})
            for volume in pod.get("volumes", []):
                if volume["name"] == "cluster-token":
                    secret = volume["secret"]
                    assert secret["secretName"] == r.TOKEN_SECRET, label(name, obj)
                    assert not secret.get("optional", False), f"{label(name, obj)}: optional"
                    checked += 1
    assert checked >= 3 * 5, "control, prefill and decode in base and every overlay"


def test_core_objects_validate_strictly(renders: dict[str, list[r.Obj]]) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="dev extra kubernetes-validate")
    newest = kv.latest_version()
    checked = 0
    for name, obj in unique_objects(renders):
        if (obj["apiVersion"], obj["kind"]) in CRD_MODELS:
            continue
        for version in (OLDEST_K8S, newest):
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as error:
                pytest.fail(f"{label(name, obj)} against {version}: {error}")
            checked += 1
    assert checked >= 40


def test_istio_and_keda_objects_match_their_crd_schemas(renders: dict[str, list[r.Obj]]) -> None:
    checked = set()
    for name, obj in unique_objects(renders):
        module_name = CRD_MODELS.get((obj["apiVersion"], obj["kind"]))
        if module_name is None:
            assert "istio.io" not in obj["apiVersion"] and "keda.sh" not in obj["apiVersion"], (
                f"{label(name, obj)}: no schema model for {obj['apiVersion']}"
            )
            continue
        module = pytest.importorskip(module_name, reason="dev extras cloudcoil-models-*")
        model = getattr(module, obj["kind"]).model_validate(obj)
        # The models keep only the fields the schema has: a lost field was a field too many.
        back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        difference = r.first_difference(back, obj)
        assert difference is None, f"{label(name, obj)}: not in the CRD schema: {difference}"
        checked.add(obj["kind"])
    assert checked == {kind for _v, kind in CRD_MODELS}


def test_peer_authentication_port_keys_are_strings(renders: dict[str, list[r.Obj]]) -> None:
    policies = [o for _n, o in unique_objects(renders) if o["kind"] == "PeerAuthentication"]
    ports = [p for o in policies for p in o["spec"].get("portLevelMtls", {})]
    assert ports and all(isinstance(p, str) and p.isdigit() for p in ports)


def containers(renders: dict[str, list[r.Obj]]) -> list[tuple[str, r.Obj]]:
    out = []
    for name, obj in unique_objects(renders):
        pod = obj.get("spec", {}).get("template", {}).get("spec")
        for container in (pod or {}).get("containers", []):
            if container.get("args", [])[:1] == ["serve"]:
                out.append((f"{label(name, obj)}/{container['name']}", container))
    return out


def test_every_rendered_kvmesh_container_is_accepted_by_the_cli(
    renders: dict[str, list[r.Obj]],
) -> None:
    found = containers(renders)
    roles = set()
    for where, container in found:
        top, role_args = parsed_command(where, container)
        roles.add(top.role)
        if top.role in ("prefill", "decode"):
            env = {e["name"]: e for e in container["env"]}
            source = env["KVMESH_MODEL"]["valueFrom"]["configMapKeyRef"]
            assert source == {"name": "kvmesh-model", "key": f"{top.role}-model"}, where
            assert role_args is not None and role_args.model == "x", f"{where}: --model"
    assert roles == {"control", "prefill", "decode"}


def kvmesh_renders(renders: dict[str, list[r.Obj]]) -> dict[str, list[r.Obj]]:
    """The renders that deploy kvmesh (deploy/otel alone does not)."""
    return {n: objs for n, objs in renders.items() if any(o["kind"] == "Job" for o in objs)}


def test_workers_mount_the_model_read_only(renders: dict[str, list[r.Obj]]) -> None:
    for name, objects in kvmesh_renders(renders).items():
        by_key = {r.key(o): o for o in objects}
        for role in ("prefill", "decode"):
            pod = by_key[("Deployment", "kvmesh", f"kvmesh-{role}")]["spec"]["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            claim = volumes["models"]["persistentVolumeClaim"]
            assert claim == {"claimName": "kvmesh-model", "readOnly": True}, name
            for c in pod["containers"] + pod["initContainers"]:
                mount = {m["name"]: m for m in c["volumeMounts"]}["models"]
                assert mount["readOnly"] is True, f"{name}: {role}/{c['name']}"
        job = by_key[("Job", "kvmesh", "kvmesh-model")]
        assert job["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"] == {
            "claimName": "kvmesh-model"
        }, name


def test_the_mesh_keeps_the_model_job_out_of_the_sidecar(
    renders: dict[str, list[r.Obj]],
) -> None:
    for name, objects in kvmesh_renders(renders).items():
        meshed = any(o["kind"] == "PeerAuthentication" for o in objects)
        job = {r.key(o): o for o in objects}[("Job", "kvmesh", "kvmesh-model")]
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert (labels.get("sidecar.istio.io/inject") == "false") == meshed, name


def test_only_prefill_pods_reach_the_decode_kv_receivers(renders: dict[str, list[r.Obj]]) -> None:
    policies = {
        o["metadata"]["name"]: o["spec"]
        for o in renders["k8s/components/network-policy"]
        if o["kind"] == "NetworkPolicy"
    }
    assert set(policies) == {"kvmesh-control", "kvmesh-prefill", "kvmesh-decode"}
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]
    any_port = [rule for rule in policies["kvmesh-decode"]["ingress"] if "ports" not in rule]
    (only,) = any_port
    (peer,) = only["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "kvmesh-prefill"}
    internal = [
        rule for rule in policies["kvmesh-control"]["ingress"]
        if {"port": 50052} in rule.get("ports", [])
    ]  # fmt: skip
    sources = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
               for peer in internal[0]["from"]}  # fmt: skip
    assert sources == {"kvmesh-prefill", "kvmesh-decode"}


def test_scaled_objects_use_metrics_the_code_defines(renders: dict[str, list[r.Obj]]) -> None:
    known = metric_names_in_code()
    scaled = [o for _n, o in unique_objects(renders) if o["kind"] == "ScaledObject"]
    assert {o["spec"]["scaleTargetRef"]["name"] for o in scaled} == {
        "kvmesh-prefill",
        "kvmesh-decode",
    }
    for obj in scaled:
        for trigger in obj["spec"]["triggers"]:
            query = trigger["metadata"]["query"]
            for metric in METRIC.findall(query):
                assert metric.removesuffix("_bucket") in known, f"{trigger['name']}: {metric}"
            role = obj["spec"]["scaleTargetRef"]["name"].removeprefix("kvmesh-")
            if "role=" in query:
                assert f'role="{role}"' in query, f"{trigger['name']}: another role's pods"


# -- Helm ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chart", "kustomization"),
    [("helm", "k8s/base"), ("helm-gpu", "k8s/overlays/gpu"),
     ("helm-production", "k8s/overlays/production")],
)  # fmt: skip
def test_the_chart_renders_what_kustomize_renders(
    renders: dict[str, list[r.Obj]], chart: str, kustomization: str
) -> None:
    ours = r.comparable(chart_render(renders, chart))
    theirs = r.comparable(without_otel(renders[kustomization]))
    assert sorted(ours) == sorted(theirs), f"{chart} vs {kustomization}: objects differ"
    for obj_key, obj in theirs.items():
        difference = r.first_difference(ours[obj_key], obj)
        assert difference is None, f"{chart} vs {kustomization} {obj_key}: {difference}"


@pytest.mark.parametrize("chart", ["helm", "helm-defaults", "helm-production"])
def test_the_chart_makes_the_secret_the_pods_mount(
    renders: dict[str, list[r.Obj]], chart: str
) -> None:
    objects = {r.key(o): o for o in chart_render(renders, chart)}
    secret = objects[r.token_secret_key()]
    assert secret["type"] == "Opaque" and set(secret["data"]) == {r.TOKEN_KEY}, chart
    if chart == "helm":
        assert base64.b64decode(secret["data"][r.TOKEN_KEY]).decode() == r.SAMPLE_TOKEN
    mounted = 0
    for obj in objects.values():
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        if "cluster-token" in volumes:
            assert volumes["cluster-token"]["secret"]["secretName"] == r.TOKEN_SECRET, chart
            mounted += 1
    assert mounted == 3, f"{chart}: control, prefill and decode mount the token"


def test_the_chart_values_reach_the_objects(renders: dict[str, list[r.Obj]]) -> None:
    objects = {r.key(o): o for o in chart_render(renders, "helm-options")}
    assert ("Secret", "kvmesh", r.TOKEN_SECRET) not in objects, "existingSecret: none made"
    assert ("Namespace", "", "kvmesh") not in objects, "namespace.create defaults to false"
    pod = objects[("Deployment", "kvmesh", "kvmesh-decode")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["cluster-token"]["secret"]["secretName"] == "my-token"
    assert "--transfer-backend=gloo" in pod["containers"][0]["args"]
    model = objects[("ConfigMap", "kvmesh", "kvmesh-model")]["data"]
    assert model["decode-model"] == "/models/checkpoints/m"
    assert model["url"] == "https://models.example/m.gguf"
    claim = objects[("PersistentVolumeClaim", "kvmesh", "kvmesh-model")]["spec"]
    assert claim["storageClassName"] == "nfs"


def test_without_a_token_the_chart_makes_a_random_one() -> None:
    def token() -> str:
        objects = {r.key(o): o for o in r.helm_template({})}
        return str(objects[("Secret", "kvmesh", r.TOKEN_SECRET)]["data"]["token"])

    first, second = token(), token()
    assert first != second
    assert len(base64.b64decode(first)) == 64


@pytest.mark.parametrize(
    ("values", "field"),
    [({"transferBackend": "shm"}, "/transferBackend"),
     ({"prefil": {"replicas": 3}}, "prefil"),
     ({"decode": {"replicas": "two"}}, "/decode/replicas"),
     ({"model": {"name": "../etc"}}, "/model/name")],
)  # fmt: skip
def test_the_chart_refuses_bad_values_naming_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(r.ChartError, match=re.escape(field)):
        r.helm_template(values)


def test_the_chart_lints_clean() -> None:
    r.helm_lint()


def test_the_helm_binary_and_helms_library_render_alike() -> None:
    if r.helm_binary() is None or r.helm_engine() is None:
        pytest.skip("needs both the helm binary and helm-python-sdk")
    cli = r.comparable(r.helm_template(CHART_AS_BASE, engine="cli"))
    sdk = r.comparable(r.helm_template(CHART_AS_BASE, engine="sdk"))
    assert cli == sdk


# -- mesh and policies against what the sidecar and the CNI really do -----------------------


def test_every_virtual_service_route_matches_the_port_it_routes_to(
    renders: dict[str, list[r.Obj]],
) -> None:
    """Istio applies a VirtualService's routes to EVERY port of its host unless a match names a
    port (pilot's TranslateRoute skips a route only for `match.port != listenPort`), and a
    route's destination port then overrides the port the caller dialled. Service `kvmesh` has
    gRPC 50051 and the OpenAI HTTP API 8000: an unported catch-all route sent in-mesh
    `POST /v1/chat/completions` on 8000 to the gRPC server on 50051 (and scrapes of
    kvmesh-control:9400 to 50052). Every match of a route must name its destination's port."""
    checked = 0
    for name, obj in unique_objects(renders):
        if obj["kind"] != "VirtualService":
            continue
        for route in obj["spec"].get("http", []):
            ports = {d["destination"]["port"]["number"] for d in route["route"]}
            assert len(ports) == 1, f"{label(name, obj)} {route['name']}: one port per route"
            matches = route.get("match") or [{}]
            for match in matches:
                assert match.get("port") in ports, (
                    f"{label(name, obj)} route {route['name']}: match {match} applies to every "
                    f"port of the host, not only {ports}"
                )
            checked += 1
    assert checked, "no VirtualService route rendered"


def test_meshed_pods_keep_their_metrics_on_the_metrics_port(
    renders: dict[str, list[r.Obj]],
) -> None:
    """Istio's injector merges metrics by default: it OVERWRITES `prometheus.io/port` with the
    agent's 15020 (`/stats/prometheus`). Scrapers (deploy/otel, KEDA's Prometheus) then go to
    15020, which the NetworkPolicies do not admit (production: no metrics, no autoscaling),
    and the PERMISSIVE 9400 of the PeerAuthentication is never used. Meshed kvmesh pods opt
    out (`prometheus.istio.io/merge-metrics: "false"`), so they are scraped on 9400."""
    for name, objects in kvmesh_renders(renders).items():
        if not any(o["kind"] == "PeerAuthentication" for o in objects):
            continue
        for obj in objects:
            template = obj.get("spec", {}).get("template", {}).get("metadata", {})
            annotations = template.get("annotations", {})
            if obj["kind"] == "Deployment" and obj["metadata"]["name"].startswith("kvmesh"):
                assert annotations.get("prometheus.io/port") == "9400", label(name, obj)
                assert annotations.get("prometheus.istio.io/merge-metrics") == "false", (
                    f"{label(name, obj)}: Istio would rewrite prometheus.io/port to 15020"
                )


def test_meshed_pods_sidecars_outlast_the_drain(renders: dict[str, list[r.Obj]]) -> None:
    """Istio's sidecar stops `terminationDrainDuration` (default 5 s) after SIGTERM, and every
    stream through it with it. A kvmesh pod drains for its preStop plus `--drain-seconds`: its
    sidecar must serve that long, and stop within the pod's grace period."""
    for name, objects in kvmesh_renders(renders).items():
        if not any(o["kind"] == "PeerAuthentication" for o in objects):
            continue
        for obj in objects:
            if obj["kind"] != "Deployment" or not obj["metadata"]["name"].startswith("kvmesh"):
                continue
            pod = obj["spec"]["template"]
            config = json.loads(pod["metadata"]["annotations"].get("proxy.istio.io/config", "{}"))
            drain = float(str(config.get("terminationDrainDuration", "5s")).removesuffix("s"))
            container = pod["spec"]["containers"][0]
            args = " ".join(container.get("args", []))
            drain_flag = re.search(r"--drain-seconds[= ](\d+)", args)
            needed = prestop_seconds(container) + (float(drain_flag.group(1)) if drain_flag else 0)
            grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
            assert needed <= drain <= grace, f"{label(name, obj)}: sidecar drain {drain}s"


def test_with_gloo_decode_pods_reach_prefill_pods() -> None:
    """gloo's pair connection goes from the peer with the higher address to the lower one's
    ephemeral listener (measured: a receiver on 127.0.0.3 connects to the sender on
    127.0.0.2), so for about half the prefill/decode pod pairs the DECODE pod opens the
    connection to the PREFILL pod. With `transferBackend: gloo` the prefill NetworkPolicy must
    admit decode pods (any port), or those transfers hang until the handshake times out."""
    objects = r.helm_template(
        {"transferBackend": "gloo", "networkPolicy": {"enabled": True},
         "auth": {"existingSecret": "t"}}
    )  # fmt: skip
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    decode = {"app.kubernetes.io/name": "kvmesh-decode"}
    from_decode = [
        rule for rule in policies["kvmesh-prefill"]["ingress"]
        if "ports" not in rule and any(
            p.get("podSelector", {}).get("matchLabels") == decode for p in rule.get("from", []))
    ]  # fmt: skip
    assert from_decode, "gloo: the prefill NetworkPolicy refuses the decode pods' connections"
