"""The Redis Sentinel settings: each bad form stops a program at start with one line, and the one-Redis path is as it was.

The URLs and transport options Celery is given are checked here as strings;
tests/test_sentinel.py and tests/test_sentinel_fleet.py run them against real
sentinels.
"""

from __future__ import annotations

import time

import pytest
import redis
from pydantic import SecretStr

from coordinator import ConfigError, Coordinator, Settings, load_settings
from coordinator.celery_app import PublishOnlyRedisBackend, PublishOnlySentinelBackend, make_app
from coordinator.redis_clients import celery_url, describe, sentinel_transport_options
from coordinator.store.base import AcknowledgedScript, AcknowledgedTransaction
from tests.helpers import start_worker_with

SENTINELS = "127.0.0.1:26379,127.0.0.1:26380,127.0.0.1:26381"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0", "SUBQ_REDIS_SENTINELS": SENTINELS,
             "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
            "Invalid setting SUBQ_REDIS_SENTINELS: set together with SUBQ_REDIS_URL; give one Redis",
        ),
        ({"SUBQ_REDIS_SENTINELS": "", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINELS: names no sentinel; give them as host:port,host:port,..."),
        ({"SUBQ_REDIS_SENTINELS": " , ", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINELS: names no sentinel"),
        ({"SUBQ_REDIS_SENTINELS": "127.0.0.1:26379,sentinel-1", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINELS: 'sentinel-1' is not host:port"),
        ({"SUBQ_REDIS_SENTINELS": "sentinel-0:http", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINELS: 'sentinel-0:http' is not host:port"),
        ({"SUBQ_REDIS_SENTINELS": "127.0.0.1:26379,,127.0.0.1:26380", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINELS: '' is not host:port"),
        ({"SUBQ_REDIS_SENTINELS": SENTINELS},
         "Invalid setting SUBQ_REDIS_SENTINEL_MASTER: not set; with SUBQ_REDIS_SENTINELS, name the master"),
        ({"SUBQ_REDIS_SENTINELS": SENTINELS, "SUBQ_REDIS_SENTINEL_MASTER": "my master"},
         "Invalid setting SUBQ_REDIS_SENTINEL_MASTER: 'my master' is not a master name"),
        ({"SUBQ_REDIS_SENTINELS": SENTINELS, "SUBQ_REDIS_SENTINEL_MASTER": "subq", "SUBQ_REDIS_MIN_REPLICAS": "-1"},
         "Invalid setting SUBQ_REDIS_MIN_REPLICAS: Input should be greater than or equal to 0"),
        ({"SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0", "SUBQ_REDIS_SENTINEL_MASTER": "subq"},
         "Invalid setting SUBQ_REDIS_SENTINEL_MASTER: only used with Redis Sentinel"),
        ({"SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0", "SUBQ_REDIS_PASSWORD": "pw"},
         "Invalid setting SUBQ_REDIS_PASSWORD: only used with Redis Sentinel; give it in SUBQ_REDIS_URL"),
    ],
)  # fmt: skip
def test_a_bad_sentinel_setting_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.field == message.split()[2].rstrip(":")


def test_a_worker_given_both_forms_stops_at_start_and_writes_nothing(settings: Settings) -> None:
    assert settings.redis_url
    probe = redis.Redis.from_url(settings.redis_url, decode_responses=True)
    try:
        proc = start_worker_with(
            settings,
            SUBQ_REDIS_SENTINELS=SENTINELS,
            SUBQ_REDIS_SENTINEL_MASTER="subq",
            SUBQ_KEY_PREFIX="subqbothforms",
            SUBQ_QUEUE="subq-both-forms",
        )
        assert proc.returncode != 0
        line = "subq worker: Invalid setting SUBQ_REDIS_SENTINELS: set together with SUBQ_REDIS_URL"
        assert line in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert probe.keys("subqbothforms*") == [] and probe.keys("subq-both-forms*") == [], "it wrote nothing"
    finally:
        probe.close()


def test_the_replica_default_follows_the_form() -> None:
    sentinel = Settings(redis_sentinels=SENTINELS, redis_sentinel_master="subq")
    assert sentinel.min_replicas() == 1
    assert Settings(redis_sentinels=SENTINELS, redis_sentinel_master="subq", redis_min_replicas=0).min_replicas() == 0
    assert Settings(redis_url="redis://127.0.0.1:6379/0").min_replicas() == 0
    assert Settings(redis_url="redis://127.0.0.1:6379/0", redis_min_replicas=2).min_replicas() == 2
    assert sentinel.sentinel_addresses() == [("127.0.0.1", 26379), ("127.0.0.1", 26380), ("127.0.0.1", 26381)]
    assert Settings(redis_sentinels="[::1]:26379", redis_sentinel_master="m").sentinel_addresses() == [("::1", 26379)]


def test_celery_is_given_the_sentinel_transport() -> None:
    settings = Settings(
        redis_sentinels="10.0.0.1:26379,[fd00::2]:26379",
        redis_sentinel_master="subq",
        redis_password=SecretStr("p@ss:w/rd"),
        redis_sentinel_password=SecretStr("sentinel-secret"),
    )
    assert celery_url(settings) == "sentinel://:p%40ss%3Aw%2Frd@10.0.0.1:26379;sentinel://[fd00::2]:26379"
    options = {"master_name": "subq", "sentinel_kwargs": {"password": "sentinel-secret"}}
    assert sentinel_transport_options(settings) == options
    app = make_app(settings)
    assert app.conf.broker_url == celery_url(settings)
    assert app.conf.broker_transport_options.items() >= options.items()
    assert app.conf.result_backend_transport_options.items() >= options.items()
    assert app.conf.result_backend.startswith(
        f"coordinator.celery_app:{PublishOnlySentinelBackend.__name__}+sentinel://"
    )
    assert "secret" not in describe(settings) and "p@ss" not in describe(settings)
    assert describe(settings) == "master 'subq' of the sentinels 10.0.0.1:26379,[fd00::2]:26379"
    assert describe(Settings(redis_url="redis://user:secret@10.0.0.1:6379/0")) == "redis://10.0.0.1:6379/0"


def test_one_redis_is_as_it_was(settings: Settings) -> None:
    """SUBQ_REDIS_URL: the URL itself for Celery, no transport option added, and no WAIT anywhere in the store."""
    assert settings.redis_url
    assert celery_url(settings) == settings.redis_url and sentinel_transport_options(settings) == {}
    app = make_app(settings)
    assert app.conf.broker_url == settings.redis_url
    assert app.conf.result_backend == f"coordinator.celery_app:{PublishOnlyRedisBackend.__name__}+{settings.redis_url}"
    assert "master_name" not in app.conf.broker_transport_options
    coord = Coordinator(settings.model_copy(update={"queue": "subq-nobody", "key_prefix": "subqonewait"}))
    try:
        assert coord.store.core.replicas is None
        assert not any(isinstance(s, AcknowledgedScript) for s in vars(coord.store.core.scripts).values())
        with coord.store.core._pipeline() as pipe:
            assert not isinstance(pipe, AcknowledgedTransaction)
        waits = int(coord.client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0))
        parent = coord.create_task("one Redis", todos="[ ] x")
        coord.delegate(parent.id, [{"description": "x", "message": "x"}])
        coord.cancel(parent.id, "done")
        assert int(coord.client.info("commandstats").get("cmdstat_wait", {}).get("calls", 0)) == waits
    finally:
        coord.close()


def test_subq_up_checks_the_sentinels_master_and_hands_the_sentinels_on() -> None:
    """`subq up` with sentinels: it asks them for the master at once (none answers here), and its credentials
    file names the sentinels, not a URL."""
    from coordinator import StoreError
    from coordinator.local.up import _check_redis, _redis_pairs

    nowhere = Settings(redis_sentinels="127.0.0.1:1", redis_sentinel_master="subq", redis_password=SecretStr("pw"))
    started = time.monotonic()
    with pytest.raises(StoreError, match="Redis is unreachable: No master found for 'subq'"):
        _check_redis(nowhere)
    assert time.monotonic() - started < 1, "asked once, without the failover retries (nor redis-py's own)"
    assert _redis_pairs(nowhere) == {
        "SUBQ_REDIS_SENTINELS": "127.0.0.1:1",
        "SUBQ_REDIS_SENTINEL_MASTER": "subq",
        "SUBQ_REDIS_PASSWORD": "pw",
    }
    assert _redis_pairs(Settings(redis_url="redis://127.0.0.1:6379/0")) == {
        "SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0"
    }
