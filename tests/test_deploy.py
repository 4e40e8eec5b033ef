"""docker-compose.yml keeps its promises (no Docker engine runs here, so its structure is checked).

Redis with AOF, a worker service that `--scale worker=N` can multiply (no fixed
name, no host port), Flower behind basic auth, every service on the same
SUBQ_REDIS_URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return data


def test_redis_runs_with_aof() -> None:
    redis = _compose()["services"]["redis"]
    conf_mount = next(v for v in redis["volumes"] if v.startswith("./deploy/redis.conf:"))
    assert conf_mount.split(":")[1] in redis["command"]
    conf = (ROOT / "deploy" / "redis.conf").read_text().split("\n")
    assert "appendonly yes" in conf and "maxmemory-policy noeviction" in conf


def test_worker_scales_and_flower_has_basic_auth() -> None:
    services = _compose()["services"]
    worker, flower = services["worker"], services["flower"]
    assert "container_name" not in worker and "ports" not in worker, "--scale worker=N needs neither"
    assert worker["command"][:4] == ["celery", "-A", "workers.app", "worker"]
    assert any(arg.startswith("--basic-auth=") for arg in flower["command"])
    assert "FLOWER_PASSWORD:?" in " ".join(flower["command"]), "no default password"
    api = services["api"]
    assert api["command"][:2] == ["subq", "api"] and "SUBQ_API_TOKEN:?" in api["environment"]["SUBQ_API_TOKEN"]
    urls = {s["environment"]["SUBQ_REDIS_URL"] for s in (worker, flower, api)}
    assert urls == {"redis://redis:6379/0"}
    dockerfile = (ROOT / worker["build"]["dockerfile"]).read_text()
    assert "pip install" in dockerfile and "USER subq" in dockerfile


def test_a_stopped_worker_has_time_to_hand_its_runs_back() -> None:
    """Docker kills a container its stop grace after SIGTERM; the runs' hand-back must fit inside it."""
    from coordinator.settings import DEFAULT_SHUTDOWN_GRACE_S

    worker = _compose()["services"]["worker"]
    grace_s = int(worker["stop_grace_period"].removesuffix("s"))
    assert grace_s > DEFAULT_SHUTDOWN_GRACE_S + 5, (grace_s, DEFAULT_SHUTDOWN_GRACE_S)
    conf = (ROOT / "deploy" / "redis.conf").read_text().split("\n")
    assert "appendfsync everysec" in conf, "docs/architecture.md states the loss window of everysec"
