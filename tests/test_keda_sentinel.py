"""KEDA's `redis-sentinel` trigger of overlays/ha, taken step by step against real sentinels, Redis and workers.

No Kubernetes, KEDA or Go toolchain runs here, so this module does in Python what
KEDA's redis scaler does, in its order. It follows kedacore/keda v2.16.0 (commit
5c52d032931b8ecf855d0c298f8d5e48937aecd7, the oldest KEDA subq supports), whose
scaler behaves the same on main at 8b4f083c (v2.20.1-117; only the Lua script's
form changed), and the go-redis its go.mod pins (v9.7.0):

- pkg/scaling/scalers_builder.go:240: type `redis-sentinel` is
  `NewRedisScaler(ctx, isClustered=false, isSentinel=true, config)`.
- pkg/scalers/redis_scaler.go:48-75 (`redisConnectionInfo`, `redisMetadata`): each
  parameter is looked up by its names in the trigger's metadata, the
  TriggerAuthentication's parameters and the scale target's environment (through
  `<name>FromEnv`), in the order its tag gives, the first non-empty value after
  trimming winning (pkg/scalers/scalersconfig/typed_config.go:411-433,
  `configParamValue`): `address` before `addresses`; a list splits on "," with each
  item trimmed; integers parse as JSON; `listLength` defaults to 5,
  `activationListLength` and `databaseIndex` to 0. `validateRedisAddress`
  (redis_scaler.go:277) appends `hosts`/`ports` and needs one address;
  `SetEnableTLS` reads `enableTLS` (metadata) or `tls` (authentication), not both.
- redis_scaler.go:316-340 (`getRedisSentinelClient`): go-redis's FailoverClient on
  the addresses, `sentinelMaster`, `databaseIndex` and the credentials, pinged once.
  go-redis sentinel.go (v9.7.0): `NewFailoverClient` shuffles the sentinels;
  `MasterAddr` asks each in turn `SENTINEL get-master-addr-by-name <sentinelMaster>`,
  the first answer wins (an unknown name is an error, and the next is asked); every
  new connection asks again, and a `+switch-master` drops those to the old master.
- redis_scaler.go:123-136 and 207-222: the value is KEDA's Lua script on
  `listName` (LLEN for a list or a missing key), on the master, in `databaseIndex`.
- redis_scaler.go:249-274: active when value > `activationListLength`; the metric's
  target is an AverageValue of `listLength`, so the HPA asks for
  ceil(value / listLength) pods (within the ScaledObject's bounds).

The one rewrite is DNS (`_cluster_dns`): the trigger's address, the sentinels'
headless Service, resolves to the kit's sentinels instead of the sentinel pods.
The master's address is the one the sentinels give, unchanged.

subq publishes real work (a root agent and a fan-out, through the Celery app
`make_app` builds) onto the queue the manifests name, with no worker consuming;
the value KEDA's steps measure is checked against the tasks waiting and kombu's own
count of the queue, across a SIGKILL of the master, then real workers drain it.
What this cannot show: KEDA's Go code itself is not run, only followed.
"""

from __future__ import annotations

import base64
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from celery import Celery

from coordinator import Coordinator, Settings, TaskRecord, TaskStatus
from coordinator.celery_app import RUN_TASK
from coordinator.local.fleet import WorkerFleet
from tests.agents import agent, reply
from tests.helpers import eventually
from tests.sentinel_kit import MASTER_NAME, SentinelSet, sentinel_set, wait_relinked, wait_replicated
from tests.test_kubernetes import REDIS_PASSWORD_KEY, _kustomize, _one, _project, secret_data

# KEDA v2.16.0's script (pkg/scalers/redis_scaler.go:123), word for word.
KEDA_LIST_LENGTH_LUA = """
        local listName = KEYS[1]
        local listType = redis.call('type', listName).ok
        local cmd = {
            zset = 'zcard',
            set = 'scard',
            list = 'llen',
            hash = 'hlen',
            none = 'llen'
        }

        return redis.call(cmd[listType], listName)
"""
# KEDA's parsing orders (scalersconfig.TriggerMetadata, AuthParams, ResolvedEnv).
METADATA, AUTH, ENV = "triggerMetadata", "authParams", "resolvedEnv"
# listLength's default (redis_scaler.go: defaultListLength).
DEFAULT_LIST_LENGTH = "5"
# strconv.ParseBool's spellings.
GO_TRUE, GO_FALSE = ("1", "t", "T", "TRUE", "true", "True"), ("0", "f", "F", "FALSE", "false", "False")
# A Go int parsed by encoding/json: no sign but '-', no leading zero, no fraction or exponent.
GO_JSON_INT = re.compile(r"-?(0|[1-9][0-9]*)")
# go-redis's DialTimeout default; a sentinel on this host answers in a millisecond.
DIAL_TIMEOUT_S = 5.0
# kombu's redis transport keeps a priority's messages in `<queue>\x06\x16<step>` (kombu's Channel.sep).
KOMBU_PRIORITY_SEP = "\x06\x16"
# The fan-out published while no worker runs: more than one pod's share, so the HPA asks for two.
FAN_OUT = 40
WAIT_S = 60


class KedaError(Exception):
    """What KEDA would report for this trigger: its parse or its poll failed (its words)."""


@dataclass(frozen=True)
class SentinelTrigger:
    """A `redis-sentinel` trigger as KEDA's `redisMetadata` holds it once parsed and validated."""

    addresses: list[str]
    sentinel_master: str
    list_name: str
    list_length: int
    activation_list_length: int
    database_index: int
    enable_tls: bool
    username: str
    password: str
    sentinel_username: str
    sentinel_password: str


@dataclass(frozen=True)
class Poll:
    """One `GetMetricsAndActivity`: the master it read, the value, and whether the trigger is active."""

    master: tuple[str, int]
    value: int
    active: bool


def parse_trigger(metadata: dict[str, str], auth: dict[str, str], env: dict[str, str]) -> SentinelTrigger:
    """`parseRedisMetadata` and `Validate` of KEDA's redis scaler for one trigger."""
    param = TriggerParams(metadata, auth, env).value
    list_name = param("listName", METADATA)
    if not list_name:
        raise KedaError('missing required parameter "listName" in [triggerMetadata]')
    addresses = _addresses(param)
    enable_tls = _enable_tls(param)
    return SentinelTrigger(
        addresses=addresses,
        sentinel_master=param("sentinelMaster", f"{METADATA};{AUTH};{ENV}"),
        list_name=list_name,
        list_length=_go_int("listLength", param("listLength", METADATA) or DEFAULT_LIST_LENGTH),
        activation_list_length=_go_int("activationListLength", param("activationListLength", METADATA) or "0"),
        database_index=_go_int("databaseIndex", param("databaseIndex", METADATA) or "0"),
        enable_tls=enable_tls,
        username=param("username", f"{METADATA};{ENV};{AUTH}"),
        password=param("password", f"{METADATA};{ENV};{AUTH}"),
        sentinel_username=param("sentinelUsername", f"{METADATA};{AUTH};{ENV}"),
        sentinel_password=param("sentinelPassword", f"{METADATA};{AUTH};{ENV}"),
    )


@dataclass(frozen=True)
class TriggerParams:
    """A trigger's three sources of parameters: its metadata, the TriggerAuthentication's, the target's environment."""

    metadata: dict[str, str]
    auth: dict[str, str]
    env: dict[str, str]

    def value(self, names: str, order: str) -> str:
        """`configParamValue`: the first non-empty value, trimmed, of `names` (";" between them) in each source of
        `order` in turn; "" if none has one."""
        for source in order.split(";"):
            for name in names.split(";"):
                value = self._lookup(source, name)
                if value is not None and value.strip():
                    return value.strip()
        return ""

    def _lookup(self, source: str, name: str) -> str | None:
        if source == METADATA:
            return self.metadata.get(name)
        if source == AUTH:
            return self.auth.get(name)
        return self.env.get(self.metadata.get(f"{name}FromEnv", ""))  # the variable that `<name>FromEnv` names


def _addresses(param: Callable[[str, str], str]) -> list[str]:
    """`validateRedisAddress`: `address`/`addresses`, then each of `hosts` with its port; at least one."""
    addresses = _items(param("address;addresses", f"{METADATA};{AUTH};{ENV}"))
    hosts, ports = (
        _items(param("host;hosts", f"{METADATA};{ENV};{AUTH}")),
        _items(param("port;ports", f"{METADATA};{ENV};{AUTH}")),
    )
    if hosts and ports:
        if len(hosts) != len(ports):
            raise KedaError("not enough hosts or ports given. number of hosts should be equal to the number of ports")
        addresses += [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)]
    if not addresses or not addresses[0]:
        raise KedaError("no addresses or hosts given")
    return addresses


def _enable_tls(param: Callable[[str, str], str]) -> bool:
    """`SetEnableTLS`: the metadata's `enableTLS` (a Go bool) or the authentication's `tls`, not both."""
    tls_metadata, tls_auth = param("enableTLS", METADATA), param("tls", AUTH)
    if tls_metadata and tls_auth:
        raise KedaError("unable to set `tls` in both ScaledObject and TriggerAuthentication together")
    if tls_metadata and tls_metadata not in GO_TRUE + GO_FALSE:
        raise KedaError(f"EnableTLS parsing error {tls_metadata!r}")
    if tls_auth and tls_auth not in ("enable", "disable"):
        raise KedaError(f"error incorrect TLS value given, got {tls_auth}")
    return tls_metadata in GO_TRUE or tls_auth == "enable"


def _go_int(name: str, value: str) -> int:
    """An integer parameter, parsed as encoding/json parses a Go int."""
    if not GO_JSON_INT.fullmatch(value):
        raise KedaError(f"unable to set param {name!r} value {value!r}")
    return int(value)


def _items(value: str) -> list[str]:
    """A list parameter: split on ",", each item trimmed."""
    return [item.strip() for item in value.split(",")] if value else []


def poll(trigger: SentinelTrigger, dns: dict[str, list[tuple[str, int]]]) -> Poll:
    """One poll of KEDA's scaler: the master the sentinels name, then KEDA's script on `listName` there."""
    master = _master_addr(trigger, dns)
    client = redis.Redis(
        host=master[0],
        port=master[1],
        db=trigger.database_index,
        username=trigger.username or None,
        password=trigger.password or None,
        ssl=trigger.enable_tls,
        socket_connect_timeout=DIAL_TIMEOUT_S,
        socket_timeout=DIAL_TIMEOUT_S,
    )
    try:
        client.ping()  # getRedisSentinelClient: "confirm if connected"
        value = int(client.eval(KEDA_LIST_LENGTH_LUA, 1, trigger.list_name))
    finally:
        client.close()
    return Poll(master, value, value > trigger.activation_list_length)


def _master_addr(trigger: SentinelTrigger, dns: dict[str, list[tuple[str, int]]]) -> tuple[str, int]:
    """go-redis's `MasterAddr`: each sentinel address in shuffled order, the first that names the master wins."""
    addresses = list(trigger.addresses)
    random.shuffle(addresses)
    for address in addresses:
        try:
            answer = _ask_sentinel(dns.get(address, []), trigger)
        except redis.RedisError:
            continue
        if answer is not None:  # None: this sentinel knows no master of that name (redis.Nil), the next is asked
            host, port = answer
            return str(host), int(port)
    raise KedaError("redis: all sentinels specified in configuration are unreachable")


def _ask_sentinel(endpoints: list[tuple[str, int]], trigger: SentinelTrigger) -> Any:
    """SENTINEL get-master-addr-by-name on one address; Go's dialer tries its next IP only when a connect fails."""
    kind = redis.SSLConnection if trigger.enable_tls else redis.Connection
    for host, port in random.sample(endpoints, len(endpoints)):  # CoreDNS's loadbalance plugin shuffles them
        connection = kind(
            host=host,
            port=port,
            username=trigger.sentinel_username or None,
            password=trigger.sentinel_password or None,
            socket_connect_timeout=DIAL_TIMEOUT_S,
            socket_timeout=DIAL_TIMEOUT_S,
            decode_responses=True,
        )
        try:
            connection.connect()
        except redis.ConnectionError:
            continue
        try:
            connection.send_command("SENTINEL", "get-master-addr-by-name", trigger.sentinel_master)
            return connection.read_response()
        finally:
            connection.disconnect()
    raise redis.ConnectionError("no endpoint of this address accepts a connection")


def pods(value: int, trigger: SentinelTrigger) -> int:
    """What the HPA asks for on this metric alone: an AverageValue target of listLength per pod."""
    return math.ceil(value / trigger.list_length)


def _cluster_dns(docs: list[dict[str, Any]], kit: SentinelSet) -> dict[str, list[tuple[str, int]]]:
    """What cluster DNS answers for the sentinels' Service, with the kit's sentinels for the sentinel pods.

    The test's only rewrite. The Service is headless, so its full name resolves to the
    address of every pod it selects, and its port is theirs: here each pod of StatefulSet
    subq-sentinel is one of the kit's sentinels (127.0.0.1, a free port). Any other
    name resolves to nothing.
    """
    service, sentinels = _one(docs, "Service", "subq-sentinel"), _one(docs, "StatefulSet", "subq-sentinel")
    assert service["spec"]["clusterIP"] == "None", "headless: the name resolves to the pods themselves"
    pod = sentinels["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    (container,) = pod["spec"]["containers"]
    assert {"name": port["targetPort"], "containerPort": port["port"]} in container["ports"]
    assert sentinels["spec"]["replicas"] == len(kit.sentinels)
    name = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local:{port['port']}"
    return {name: [("127.0.0.1", sentinel.port) for sentinel in kit.sentinels]}


def _decoded(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, str]:
    data: dict[str, str] = _one(docs, kind, name).get("data", {})
    return {k: base64.b64decode(v).decode() for k, v in data.items()} if kind == "Secret" else data


def _container_env(docs: list[dict[str, Any]], scaled: dict[str, Any]) -> dict[str, str]:
    """KEDA's resolvedEnv (pkg/scaling/resolver/scale_resolvers.go:375): the scale target's container
    (envSourceContainerName, else the first), its envFrom, then its env."""
    target = _one(docs, "Deployment", scaled["spec"]["scaleTargetRef"]["name"])
    containers = target["spec"]["template"]["spec"]["containers"]
    wanted = scaled["spec"]["scaleTargetRef"].get("envSourceContainerName", containers[0]["name"])
    (container,) = [c for c in containers if c["name"] == wanted]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        kind, ref = ("ConfigMap", "configMapRef") if "configMapRef" in source else ("Secret", "secretRef")
        data = _decoded(docs, kind, source[ref]["name"])
        env.update({source.get("prefix", "") + name: value for name, value in data.items()})
    for variable in container.get("env", []):  # after envFrom: a variable of its own wins
        if "value" in variable:
            env[variable["name"]] = variable["value"]
        ref = variable.get("valueFrom", {})
        for kind, field in (("ConfigMap", "configMapKeyRef"), ("Secret", "secretKeyRef")):
            if field in ref:
                env[variable["name"]] = _decoded(docs, kind, ref[field]["name"])[ref[field]["key"]]
    return env


def _auth_params(docs: list[dict[str, Any]], trigger: dict[str, Any], env: dict[str, str]) -> dict[str, str]:
    """KEDA's authParams from the trigger's TriggerAuthentication: its Secret references and environment ones."""
    if "authenticationRef" not in trigger:
        return {}
    spec = _one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])["spec"]
    assert set(spec) <= {"secretTargetRef", "env"}, f"a source this test does not resolve: {sorted(spec)}"
    params = {
        ref["parameter"]: _decoded(docs, "Secret", ref["name"])[ref["key"]] for ref in spec.get("secretTargetRef", [])
    }
    params.update({ref["parameter"]: env[ref["name"]] for ref in spec.get("env", [])})
    return params


def _ended(children: list[TaskRecord]) -> list[TaskRecord] | None:
    return children if all(c.status.terminal for c in children) else None


def _kombu_waiting(app: Celery, queue: str) -> int:
    """kombu's own count of `queue`: every priority list of it (`Channel._size`), through subq's broker."""
    with app.connection_for_read() as connection:
        return int(connection.default_channel.queue_declare(queue, passive=True).message_count)


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """overlays/ha rendered as tests/test_kubernetes.py renders it."""
    project = _project(tmp_path_factory.mktemp("deploy") / "kubernetes")
    done = _kustomize(project / "overlays" / "ha")
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def test_kedas_steps_measure_the_subq_queue_on_the_master_the_sentinels_name(
    ha: list[dict[str, Any]], settings: Settings, tmp_path: Path
) -> None:
    scaled = _one(ha, "ScaledObject")
    (raw,) = [t for t in scaled["spec"]["triggers"] if t["type"] == "redis-sentinel"]
    env = _container_env(ha, scaled)  # the worker pod's environment: subq's own settings
    trigger = parse_trigger(raw["metadata"], _auth_params(ha, raw, env), env)
    # What subq's pods use, from the same manifests: the queue, the master's name, the passwords.
    queue = env.get("SUBQ_QUEUE", Settings.model_fields["queue"].default)
    assert trigger.list_name == queue
    assert trigger.sentinel_master == env["SUBQ_REDIS_SENTINEL_MASTER"] == MASTER_NAME
    same_password = trigger.password == env.get("SUBQ_REDIS_PASSWORD", "")
    same_sentinel_password = trigger.sentinel_password == env.get("SUBQ_REDIS_SENTINEL_PASSWORD", "")
    assert same_password and same_sentinel_password, "KEDA must authenticate as subq's pods do"
    # Both the Secret's one key, which every node and sentinel requires (issue 39). The kit's set has
    # no password, and this Redis answers AUTH with any password there: the polls below show KEDA's
    # steps, not a refusal (tests/test_kubernetes.py runs the in-cluster Redis's refusal for real).
    assert trigger.password == trigger.sentinel_password == secret_data(ha, "subq-secrets")[REDIS_PASSWORD_KEY] != ""
    # A pod's share is its SUBQ_WORKER_CONCURRENCY, and 100 waiting make 4 pods (docs/deploy.md, "Scale").
    assert trigger.list_length == int(env["SUBQ_WORKER_CONCURRENCY"]) and pods(100, trigger) == 4
    bounds = scaled["spec"]["minReplicaCount"], scaled["spec"]["maxReplicaCount"]

    with sentinel_set(tmp_path / "sentinels") as kit:
        dns = _cluster_dns(ha, kit)
        own = kit.settings(settings, key_prefix="subqkeda", queue=queue)
        coord = Coordinator(own)
        try:
            idle = poll(trigger, dns)
            assert idle == Poll(("127.0.0.1", kit.master_port()), 0, False)
            with pytest.raises(KedaError, match="all sentinels"):  # the master's name is what finds it
                poll(replace(trigger, sentinel_master="mymaster"), dns)

            # Work waits and no worker runs: a root agent, and a caller's fan-out (one group publish).
            roots = [coord.create_task(agent(reply("root done")), run=True).id]
            first = poll(trigger, dns)  # one message waiting is a backlog: it wakes a fleet scaled to zero
            assert (first.value, first.active) == (1, True)
            parent = coord.create_task("A fan-out")
            coord.delegate(parent.id, [{"description": f"c{n}", "message": agent(reply("ok"))} for n in range(FAN_OUT)])
            waiting = 1 + FAN_OUT
            backlog = poll(trigger, dns)
            assert backlog.value == waiting == _kombu_waiting(coord.app, queue) and backlog.active
            assert bounds[0] <= pods(backlog.value, trigger) == 2 <= bounds[1]
            # Without priorities, kombu keeps the queue in the one list KEDA reads. A message published with
            # one waits in a list of its own, which kombu counts and KEDA's listName does not: subq sends none.
            master = kit.master_client()
            assert master.keys(f"{queue}{KOMBU_PRIORITY_SEP}*") == []
            coord.app.send_task(RUN_TASK, kwargs={}, priority=9)
            assert (poll(trigger, dns).value, _kombu_waiting(coord.app, queue)) == (waiting, waiting + 1)
            assert master.delete(f"{queue}{KOMBU_PRIORITY_SEP}9") == 1
            master.close()

            # The master dies; the same steps find the one the sentinels promote, with the queue on it.
            wait_replicated(kit)
            promoted = kit.wait_promoted(kit.kill_master())
            wait_relinked(kit, 1)  # what follows stands through a second failover, which a loaded host can bring about
            roots.append(coord.create_task(agent(reply("published after the promotion")), run=True).id)
            waiting += 1
            after = poll(trigger, dns)
            assert after == Poll(("127.0.0.1", promoted), waiting, True)
            assert _kombu_waiting(coord.app, queue) == waiting

            # Real workers take it all: the value drains to 0 and the trigger goes inactive.
            with WorkerFleet(own, 1, tmp_path / "workers") as fleet:
                fleet.wait_ready()
                eventually(lambda: poll(trigger, dns).value == 0, "KEDA's value to drain to 0", WAIT_S)
                for root in roots:
                    assert coord.wait(root, WAIT_S).status == TaskStatus.COMPLETED
                children = eventually(lambda: _ended(coord.get_children(parent.id)), "the fan-out to end", WAIT_S)
                assert len(children) == FAN_OUT and {c.status for c in children} == {TaskStatus.COMPLETED}
                # The master the sentinels name now: on a loaded host a second failover may have followed.
                assert poll(trigger, dns) == Poll(("127.0.0.1", kit.master_port()), 0, False)
        finally:
            coord.close()
