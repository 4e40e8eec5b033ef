"""docker-compose.yml keeps its promises on paper (tests/test_compose.py runs it).

The file is valid against the Compose Specification's JSON schema (the copy that
check-jsonschema ships and maintains); every service has a healthcheck and a
restart policy and starts once Redis is healthy; every setting is a SUBQ_
variable from `.env`, no secret is written in the file or on a command line;
a worker has time to hand its runs back before Docker kills it; the build
context leaves out the virtual environment, git history and caches. The Redis
Sentinel variant (deploy/docker-compose.sentinel.yml), merged over it as Compose
merges files, is valid too, runs three data nodes with AOF and three sentinels,
and points every subq service at the sentinels (tests/test_sentinel_scripts.py
runs the start scripts it uses).
"""

from __future__ import annotations

import json
import re
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from coordinator.local.fleet import stop_timeout_s
from coordinator.redis_clients import password_warning
from coordinator.settings import DEFAULT_SHUTDOWN_GRACE_S, Settings
from tests import compose_file

ROOT = Path(__file__).resolve().parent.parent
# The Compose Specification's schema as check-jsonschema ships it (`--builtin-schema vendor.compose-spec`),
# read in-process: the CLI costs about ten seconds a run on a loaded CI host.
COMPOSE_SPEC = json.loads(files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text())
# Celery's warm shutdown after the runs are handed back, and the process exit.
STOP_MARGIN_S = 5
SUBQ_SERVICES = ("worker", "api", "flower")


def _schema_errors(compose: dict[str, Any]) -> list[str]:
    validator = jsonschema.validators.validator_for(COMPOSE_SPEC)(COMPOSE_SPEC)
    return [f"{error.json_path}: {error.message}" for error in validator.iter_errors(compose)]


def test_compose_file_is_valid_against_the_compose_spec() -> None:
    assert COMPOSE_SPEC["title"] == "Compose Specification"
    assert _schema_errors(compose_file.load()) == []


@pytest.mark.parametrize(
    ("change", "complaint"),
    [
        (lambda c: c["services"]["worker"].update(healtcheck={"test": ["CMD", "true"]}), "healtcheck"),
        (lambda c: c["services"]["api"]["depends_on"]["redis"].update(condition="healthy"), "healthy"),
        (lambda c: c["services"]["worker"].update(stop_grace_period=35), "35"),
    ],
    ids=["misspelt key", "unknown depends_on condition", "grace period not a duration"],
)
def test_the_schema_check_refuses_a_broken_file(change: Any, complaint: str) -> None:
    """The check can fail: a typo or a wrong value is refused, naming what is wrong."""
    broken = compose_file.load()
    change(broken)
    errors = _schema_errors(broken)
    assert errors and complaint in " ".join(errors), errors


def test_every_service_is_health_checked_restarted_and_waits_for_redis() -> None:
    services = compose_file.load()["services"]
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
    for name in SUBQ_SERVICES:
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"}}, name
    # The worker's check pings its own Celery node, by its container's host name (tests/test_worker_probe.py runs it).
    assert "python -m coordinator.worker_ping" in services["worker"]["healthcheck"]["test"][1]
    assert "celery@$$HOSTNAME" in services["worker"]["healthcheck"]["test"][1]
    assert "/readyz" in " ".join(services["api"]["healthcheck"]["test"])


def test_redis_keeps_its_aof_on_a_named_volume() -> None:
    compose = compose_file.load()
    redis = compose["services"]["redis"]
    conf_mount = next(v for v in redis["volumes"] if v.startswith("./deploy/redis.conf:"))
    assert conf_mount.split(":")[1] in redis["command"]
    assert "redis-data:/data" in redis["volumes"] and "redis-data" in compose["volumes"]
    conf = (ROOT / "deploy" / "redis.conf").read_text().split("\n")
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf
    assert "appendfsync everysec" in conf, "docs/architecture.md states the loss window of everysec"


def test_settings_come_from_the_env_file_by_subq_names_and_no_secret_is_written_down() -> None:
    services = compose_file.load()["services"]
    example = compose_file.read_env_file(ROOT / ".env.example")
    assert example, ".env.example documents the settings"
    known = {f"SUBQ_{name.upper()}" for name in Settings.model_fields} | {"SUBQ_FLOWER_USER", "SUBQ_FLOWER_PASSWORD"}
    known.add(REDIS_PASSWORD_VARIABLE)
    assert set(example) <= known, f"not subq settings: {set(example) - known}"
    for name in SUBQ_SERVICES:
        service = services[name]
        assert service["env_file"] == ".env", name
        assert set(service["environment"]) <= known, name
        assert service["environment"]["SUBQ_REDIS_URL"] == f"redis://:{REDIS_PASSWORD}@redis:6379/0"
        # No password, token or ${...} of one on a command line, where `ps` shows it to any local user.
        assert not re.search(r"password|token|secret|\$\{", " ".join(service["command"]), re.I), name
    text = compose_file.COMPOSE_FILE.read_text()
    assert "FLOWER_PASSWORD" not in text.replace("SUBQ_FLOWER_PASSWORD", ""), "one naming scheme: SUBQ_"
    gitignore = (ROOT / ".gitignore").read_text().split("\n")
    assert ".env" in gitignore, "the operator's .env holds secrets: never committed"


# Redis's password (issue 39): one variable of .env, which Compose refuses to start without. It is
# a SUBQ_ variable, so run_command strips it from a command's environment, and no setting of
# Settings, which ignores it.
REDIS_PASSWORD_VARIABLE = "SUBQ_COMPOSE_REDIS_PASSWORD"
REDIS_PASSWORD = "${SUBQ_COMPOSE_REDIS_PASSWORD:?set SUBQ_COMPOSE_REDIS_PASSWORD in .env}"


def test_redis_has_a_password_from_the_env_file_and_not_on_a_command_line() -> None:
    compose = compose_file.load()
    redis = compose["services"]["redis"]
    assert REDIS_PASSWORD_VARIABLE not in {f"SUBQ_{name.upper()}" for name in Settings.model_fields}
    assert redis["environment"] == {"REDISCLI_AUTH": REDIS_PASSWORD}, "redis-cli and the start read it there"
    # The password reaches redis-server as a config line on its stdin ("-"), not as an argument.
    shell, flag, script, *argv = redis["command"]
    assert (shell, flag) == ("sh", "-c") and argv[0] == "redis-server" and "$" not in " ".join(argv)
    assert 'exec redis-server "$$@" - <<CONF\nrequirepass $$REDISCLI_AUTH\nCONF' in script
    # A refusal fails the healthcheck: redis-cli exits 0 on an error reply unless given -e.
    assert redis["healthcheck"]["test"] == ["CMD", "redis-cli", "-e", "-p", "6379", "ping"]
    # Compose refuses to start without the password, naming it; with one, every service has it.
    with pytest.raises(ValueError, match=f"^{REDIS_PASSWORD_VARIABLE}: set {REDIS_PASSWORD_VARIABLE} in .env$"):
        compose_file.interpolate(REDIS_PASSWORD, {})
    for name in SUBQ_SERVICES:
        url = compose_file.interpolate(compose["services"][name]["environment"]["SUBQ_REDIS_URL"], {
            REDIS_PASSWORD_VARIABLE: "pw-1_x"
        })  # fmt: skip
        assert url == "redis://:pw-1_x@redis:6379/0"
        assert password_warning(Settings(redis_url=url)) is None, name
    example = compose_file.read_env_file(ROOT / ".env.example")
    assert example[REDIS_PASSWORD_VARIABLE] == "change-me", ".env.example names it, for the operator to fill in"


def test_workers_scale_and_have_time_to_hand_their_runs_back() -> None:
    """Docker kills a container its stop grace after SIGTERM; the runs' hand-back must fit inside it."""
    worker = compose_file.load()["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker, "--scale worker=N needs neither"
    grace_s = compose_file.seconds(worker["stop_grace_period"])
    example = compose_file.read_env_file(ROOT / ".env.example")
    shutdown_grace_s = int(example.get("SUBQ_SHUTDOWN_GRACE_S", DEFAULT_SHUTDOWN_GRACE_S))
    assert grace_s >= max(shutdown_grace_s, DEFAULT_SHUTDOWN_GRACE_S) + STOP_MARGIN_S, (grace_s, shutdown_grace_s)


@pytest.mark.parametrize("shutdown_grace_s", [0, DEFAULT_SHUTDOWN_GRACE_S, 300])
def test_subq_ups_workers_have_time_to_hand_their_runs_back(settings: Settings, shutdown_grace_s: int) -> None:
    """`subq up` and the demo stop their workers as a container runtime does: a fixed 20 s killed them before a
    run in a long call was handed back (at the default grace, 25 s, less 3)."""
    graced = settings.model_copy(update={"shutdown_grace_s": shutdown_grace_s})
    assert stop_timeout_s(graced) >= shutdown_grace_s + STOP_MARGIN_S


def test_every_subq_service_runs_the_image_of_the_wheel() -> None:
    services = compose_file.load()["services"]
    for name in SUBQ_SERVICES:
        assert services[name]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}, name
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    # The wheel alone is the Python client: the image's workers, API and Flower need the server extra.
    assert 'pip install --no-cache-dir "$(echo /tmp/dist/*.whl)[server,otel]"' in dockerfile
    assert "USER subq" in dockerfile


def test_build_context_leaves_out_the_venv_git_and_caches() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split("\n"))
    for entry in (".venv/", ".git/", "**/__pycache__/", ".mypy_cache/", ".pytest_cache/", ".env"):
        assert entry in ignored, entry
    # Nothing the Dockerfile copies is ignored.
    copied = {"pyproject.toml", "README.md", "coordinator/", "workers/"}
    assert not copied & ignored


# The Redis Sentinel variant: an override file on top of docker-compose.yml (docs/deploy.md, "Redis failover").
SENTINEL_OVERRIDE = ROOT / "deploy" / "docker-compose.sentinel.yml"
REDIS_NODES = ("redis", "redis-replica-1", "redis-replica-2")
SENTINEL_SERVICES = ("sentinel-1", "sentinel-2", "sentinel-3")


def _sentinel_compose() -> dict[str, Any]:
    """docker-compose.yml with the Sentinel variant merged over it, as Compose merges them (tests/compose_file.py)."""
    return {k: v for k, v in compose_file.load(SENTINEL_OVERRIDE).items() if not k.startswith("x-")}


# The Kubernetes component's folder of start scripts, mounted whole where its pods mount them.
SCRIPTS = "./deploy/kubernetes/components/redis-sentinel"
SCRIPTS_MOUNT = "/usr/local/etc/redis-sentinel"


def test_the_sentinel_variant_is_valid_and_runs_three_nodes_with_aof_and_three_sentinels() -> None:
    compose = _sentinel_compose()
    assert _schema_errors(compose) == []
    services = compose["services"]
    conf = "./deploy/redis.conf:/usr/local/etc/redis/redis.conf:ro"
    data_volumes = set()
    for name in REDIS_NODES:
        node = services[name]
        assert node["command"] == ["sh", f"{SCRIPTS_MOUNT}/redis-node.sh"], name
        assert f"{SCRIPTS}:{SCRIPTS_MOUNT}:ro" in node["volumes"], f"{name}: the component's start scripts"
        assert conf in node["volumes"], f"{name}: AOF on (deploy/redis.conf)"
        (data,) = [v.split(":")[0] for v in node["volumes"] if v.endswith(":/data")]
        data_volumes.add(data)
        assert node["environment"]["REDIS_NODE"] == name
        assert node["environment"]["REDIS_FIRST_MASTER"] == "redis:6379"
    assert len(data_volumes) == 3 and data_volumes <= set(compose["volumes"]), "each node its own AOF volume"
    for name in SENTINEL_SERVICES:
        sentinel = services[name]
        assert sentinel["environment"]["SENTINEL_NODE"] == name
        assert int(sentinel["environment"]["SENTINEL_DOWN_AFTER_MS"]) <= 5000
        assert sentinel["command"] == ["sh", f"{SCRIPTS_MOUNT}/sentinel.sh"], name
        assert f"{SCRIPTS}:{SCRIPTS_MOUNT}:ro" in sentinel["volumes"], name
    for name, service in services.items():
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] in ("CMD", "CMD-SHELL"), name
        for mount in service.get("volumes", []):
            source = mount.split(":")[0]
            assert not source.startswith("./") or (ROOT / source).exists(), f"{name}: {source} is missing"


def test_the_sentinel_variants_subq_services_follow_the_sentinels() -> None:
    services = _sentinel_compose()["services"]
    sentinel_env = services["sentinel-1"]["environment"]
    node_env = services["redis"]["environment"]
    expected = ",".join(f"{name}:{sentinel_env['SENTINEL_PORT']}" for name in SENTINEL_SERVICES)
    assert sentinel_env["SENTINELS"] == node_env["SENTINELS"] == expected.replace(",", " ")
    for name in SUBQ_SERVICES:
        env = services[name]["environment"]
        assert env["SUBQ_REDIS_URL"] == "", f"{name}: an empty SUBQ_REDIS_URL is unset"
        assert env["SUBQ_REDIS_SENTINELS"] == expected, name
        assert env["SUBQ_REDIS_SENTINEL_MASTER"] == sentinel_env["SENTINEL_MASTER"] == node_env["SENTINEL_MASTER"]
        assert env["SUBQ_REDIS_PASSWORD"] == env["SUBQ_REDIS_SENTINEL_PASSWORD"] == REDIS_PASSWORD, name
        given = {k: compose_file.interpolate(v, {REDIS_PASSWORD_VARIABLE: "pw"}) for k, v in env.items()}
        settings = Settings(**{k.removeprefix("SUBQ_").lower(): v for k, v in given.items()})
        assert settings.min_replicas() == 1 and settings.sentinel_addresses()[0] == ("sentinel-1", 26379)
        assert password_warning(settings) is None, name
        for sentinel in SENTINEL_SERVICES:
            assert services[name]["depends_on"][sentinel] == {"condition": "service_healthy"}, name
    # Every node and sentinel has the same password (their scripts write it into their config files).
    for name in (*REDIS_NODES, *SENTINEL_SERVICES):
        assert services[name]["environment"]["REDISCLI_AUTH"] == REDIS_PASSWORD, name
        assert "-e" in services[name]["healthcheck"]["test"], f"{name}: a refusal must fail the check"
    # The worker's check is docker-compose.yml's: it reads the sentinels from the settings above.
    assert services["worker"]["healthcheck"] == compose_file.load()["services"]["worker"]["healthcheck"]


def test_a_worker_container_may_start_the_command_sandbox() -> None:
    # bwrap needs unshare and mount (Docker's seccomp and AppArmor defaults forbid both) and an unmasked /proc.
    worker = compose_file.load()["services"]["worker"]
    assert set(worker["security_opt"]) == {"seccomp=unconfined", "apparmor=unconfined", "systempaths=unconfined"}
    assert (
        "apt-get install -y --no-install-recommends bubblewrap passt iproute2"
        in (ROOT / "deploy" / "Dockerfile").read_text()
    )
    # pasta gives a sandbox with the network its way out through a tap device.
    assert worker["devices"] == ["/dev/net/tun:/dev/net/tun"]
