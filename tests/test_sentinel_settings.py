"""The Redis Sentinel settings: each bad form stops a program at start with one line, and the one-Redis path is as it was.

The URLs and transport options Celery is given are checked here as strings;
tests/test_sentinel.py and tests/test_sentinel_fleet.py run them against real
sentinels.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from pydantic import SecretStr

from coordinator import ConfigError, Coordinator, Settings, load_settings
from coordinator.celery_app import PublishOnlyRedisBackend, PublishOnlySentinelBackend, make_app
from coordinator.ids import new_root_id
from coordinator.redis_clients import celery_url, describe, sentinel_transport_options, tls_options
from coordinator.store.base import AcknowledgedScript, AcknowledgedTransaction
from tests.helpers import start_worker_with
from tests.tls_kit import make_tls

ROOT = Path(__file__).resolve().parent.parent

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
    assert (
        celery_url(settings) == "sentinel://:p%40ss%3Aw%2Frd@10.0.0.1:26379;sentinel://:p%40ss%3Aw%2Frd@[fd00::2]:26379"
    )
    options = sentinel_transport_options(settings)
    assert options["master_name"] == "subq"
    assert _asking(options) == {"password": "sentinel-secret", "socket_connect_timeout": 1.0, "socket_timeout": 1.0}
    assert options["sentinel_kwargs"]["retry"].get_retries() == 0, "a silent sentinel is passed over at once"
    app = make_app(settings)
    assert app.conf.broker_url == celery_url(settings)
    broker = app.connection_for_write()
    for _ in range(2):  # kombu's move to each next sentinel address keeps the data password
        broker.maybe_switch_next()
        assert broker.password == "p@ss:w/rd", broker.hostname
    broker.release()
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
    with pytest.raises(
        StoreError, match="Redis is unreachable: no sentinel of SUBQ_REDIS_SENTINELS answers: 127.0.0.1:1: "
    ):
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


def _tls_files(folder: Path) -> dict[str, Path]:
    """A CA, a certificate and its key, a key of another certificate, and a file that is no PEM at all."""
    tls, other = make_tls(folder / "tls"), make_tls(folder / "other")
    junk = folder / "junk.pem"
    junk.write_text("not a certificate\n")
    return {"ca": tls.ca_file, "cert": tls.cert_file, "key": tls.key_file, "other_key": other.key_file, "junk": junk}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0", "SUBQ_REDIS_TLS": "true"},
         "Invalid setting SUBQ_REDIS_TLS: only used with Redis Sentinel; give it in SUBQ_REDIS_URL (rediss://"),
        ({"SUBQ_REDIS_URL": "redis://127.0.0.1:6379/0", "SUBQ_REDIS_TLS_CA_FILE": "{ca}"},
         "Invalid setting SUBQ_REDIS_TLS_CA_FILE: only used with Redis Sentinel; give it in SUBQ_REDIS_URL"),
        ({"SUBQ_REDIS_TLS": "maybe"}, "Invalid setting SUBQ_REDIS_TLS: Input should be a valid boolean"),
        ({"SUBQ_REDIS_TLS_CA_FILE": "{ca}"},
         "Invalid setting SUBQ_REDIS_TLS_CA_FILE: set without TLS; set SUBQ_REDIS_TLS=true as well"),
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CA_FILE": "{ca}.missing"},
         "Invalid setting SUBQ_REDIS_TLS_CA_FILE: Path does not point to a file"),
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CERT_FILE": "{cert}"},
         "Invalid setting SUBQ_REDIS_TLS_KEY_FILE: not set; SUBQ_REDIS_TLS_CERT_FILE needs it"),
        ({"SUBQ_REDIS_SENTINEL_TLS": "true", "SUBQ_REDIS_TLS_KEY_FILE": "{key}"},
         "Invalid setting SUBQ_REDIS_TLS_CERT_FILE: not set; SUBQ_REDIS_TLS_KEY_FILE needs it"),
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CA_FILE": "{junk}"},
         "Invalid setting SUBQ_REDIS_TLS_CA_FILE: {junk} holds no PEM certificate"),
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CERT_FILE": "{cert}", "SUBQ_REDIS_TLS_KEY_FILE": "{other_key}"},
         "Invalid setting SUBQ_REDIS_TLS_CERT_FILE: {cert} with SUBQ_REDIS_TLS_KEY_FILE {other_key} is not a PEM "
         "certificate and its key"),
        # A file that exists and that this process cannot read (root reads a secret's 0400 file, so a file whose
        # read fails for anyone stands in: the kernel answers EIO). It was a traceback: only SSLError was caught.
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CA_FILE": "/proc/self/mem"},
         "Invalid setting SUBQ_REDIS_TLS_CA_FILE: /proc/self/mem: cannot read it: "),
        ({"SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CERT_FILE": "/proc/self/mem", "SUBQ_REDIS_TLS_KEY_FILE": "{key}"},
         "Invalid setting SUBQ_REDIS_TLS_CERT_FILE: /proc/self/mem or SUBQ_REDIS_TLS_KEY_FILE {key}: cannot read it"),
    ],
)  # fmt: skip
def test_a_bad_tls_setting_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, env: dict[str, str], message: str
) -> None:
    files = _tls_files(tmp_path)
    if "SUBQ_REDIS_URL" not in env:
        monkeypatch.setenv("SUBQ_REDIS_SENTINELS", SENTINELS)
        monkeypatch.setenv("SUBQ_REDIS_SENTINEL_MASTER", "subq")
    for name, value in env.items():
        monkeypatch.setenv(name, value.format(**files))
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert str(caught.value).startswith(message.format(**files)), str(caught.value)
    assert "\n" not in str(caught.value)


def test_a_cli_given_a_bad_tls_file_stops_with_the_line_and_reads_nothing(tmp_path: Path) -> None:
    files = _tls_files(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SUBQ_")}
    env |= {"SUBQ_REDIS_SENTINELS": SENTINELS, "SUBQ_REDIS_SENTINEL_MASTER": "subq", "SUBQ_REDIS_TLS": "true",
            "SUBQ_REDIS_TLS_CA_FILE": str(files["junk"])}  # fmt: skip
    from tests.test_cli import cli  # the command's words, without a process of its own (1.2 s of CPU)

    proc = cli("status", new_root_id(), env={k: v for k, v in env.items() if k.startswith("SUBQ_")})
    assert proc.returncode == 1, proc
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"subq: Invalid setting SUBQ_REDIS_TLS_CA_FILE: {files['junk']} holds no PEM")
    assert proc.stdout == ""


def test_celery_and_every_client_are_given_tls_under_sentinel(tmp_path: Path) -> None:
    files = _tls_files(tmp_path)
    settings = Settings(
        redis_sentinels=SENTINELS, redis_sentinel_master="subq", redis_sentinel_password=SecretStr("s"),
        redis_tls=True, redis_tls_ca_file=files["ca"], redis_tls_cert_file=files["cert"],
        redis_tls_key_file=files["key"],
    )  # fmt: skip
    tls = {"ssl_cert_reqs": "required", "ssl_check_hostname": True, "ssl_ca_certs": str(files["ca"]),
           "ssl_certfile": str(files["cert"]), "ssl_keyfile": str(files["key"])}  # fmt: skip
    assert tls_options(settings) == tls
    app = make_app(settings)
    assert app.conf.broker_use_ssl == tls and app.conf.redis_backend_use_ssl == tls
    sentinel_kwargs = {"password": "s", "ssl": True, "socket_connect_timeout": 1.0, "socket_timeout": 1.0, **tls}
    assert _asking(app.conf.broker_transport_options) == sentinel_kwargs
    assert _asking(app.conf.result_backend_transport_options) == sentinel_kwargs
    assert describe(settings) == f"master 'subq' (TLS) of the sentinels {SENTINELS}"
    # Sentinels in the clear, nodes over TLS; and the other way round.
    clear_sentinels = settings.model_copy(update={"redis_sentinel_tls": False})
    assert "ssl" not in _asking(sentinel_transport_options(clear_sentinels))
    tls_sentinels_only = Settings(redis_sentinels=SENTINELS, redis_sentinel_master="subq", redis_sentinel_tls=True)
    assert sentinel_transport_options(tls_sentinels_only)["sentinel_kwargs"]["ssl"] is True
    assert "broker_use_ssl" not in make_app(tls_sentinels_only).conf.changes, "nodes in the clear"
    # `subq up` hands the same settings on to its credentials file.
    from coordinator.local.up import _redis_pairs

    assert _redis_pairs(settings) | {"SUBQ_REDIS_SENTINEL_PASSWORD": "s"} == {
        "SUBQ_REDIS_SENTINELS": SENTINELS, "SUBQ_REDIS_SENTINEL_MASTER": "subq", "SUBQ_REDIS_SENTINEL_PASSWORD": "s",
        "SUBQ_REDIS_TLS": "true", "SUBQ_REDIS_TLS_CA_FILE": str(files["ca"]),
        "SUBQ_REDIS_TLS_CERT_FILE": str(files["cert"]), "SUBQ_REDIS_TLS_KEY_FILE": str(files["key"]),
    }  # fmt: skip


def test_a_lost_broker_is_tried_again_at_most_a_second_apart_under_sentinel() -> None:
    """kombu's own rounds are 2 s, then 4, 6, ... apart; under Sentinel the consumer tries again within a second."""
    from kombu.exceptions import OperationalError

    from coordinator.celery_app import SENTINEL_RECONNECT_S, BrokerConnection

    app = make_app(Settings(redis_sentinels="127.0.0.1:1", redis_sentinel_master="subq"))
    conn = app.connection_for_read()
    assert isinstance(conn, BrokerConnection) and conn.transport_cls == "sentinel"
    waits_s: list[float] = []
    with pytest.raises(OperationalError):  # nothing listens on port 1: each round fails, two are waited for
        conn.ensure_connection(lambda exc, interval: waits_s.append(interval), 2)
    assert waits_s == [SENTINEL_RECONNECT_S["interval_start"], SENTINEL_RECONNECT_S["interval_max"]]
    conn.release()


def _asking(transport_options: dict[str, Any]) -> dict[str, Any]:
    """How a transport asks the sentinels (`sentinel_kwargs`), without its Retry object (compared apart)."""
    return {name: value for name, value in transport_options["sentinel_kwargs"].items() if name != "retry"}


def test_a_command_through_an_outage_asks_the_sentinels_once_a_retry_not_once_a_retry_of_a_retry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection closed under a command reconnects as the command is sent again, inside the command's retry:
    it reconnected with a retry of its own there, 35 tries inside each of the command's 35, and a command through
    an outage failed after 19 minutes of backoff, not 30 s. The reconnect inside a command is one try now; a
    connection's first connect (outside any command) still retries."""
    from coordinator.redis_clients import FAILOVER_RETRIES, redis_client

    monkeypatch.setattr("redis.retry.sleep", lambda _s: None)
    client = redis_client(Settings(redis_sentinels="127.0.0.1:1", redis_sentinel_master="mymaster"))
    conn = client.connection_pool.make_connection()
    tries: list[int] = []

    def no_master() -> None:
        tries.append(1)
        raise redis.ConnectionError("no sentinel answered")

    monkeypatch.setattr(conn, "_connect_retry", no_master)
    with pytest.raises(redis.ConnectionError):
        conn.connect_check_health()  # as send_command does, its socket closed by the command's last failure
    assert len(tries) == 1, "one try: the command's own retry is the loop"
    tries.clear()
    with pytest.raises(redis.ConnectionError):
        conn.connect()  # a first connect, as the pool makes it
    assert len(tries) == FAILOVER_RETRIES + 1
    client.close()


def test_a_worker_waits_out_a_broker_outage_however_long() -> None:
    """Celery's 100 reconnect tries ended a worker for good, and under Sentinel each sentinel's address is a try
    (about 30 s with three): every run in flight died with it, not handed back."""
    for settings in (
        Settings(redis_url="redis://127.0.0.1:1/0"),
        Settings(redis_sentinels="127.0.0.1:1,127.0.0.1:2", redis_sentinel_master="subq"),
    ):
        assert make_app(settings).conf.broker_connection_max_retries is None
