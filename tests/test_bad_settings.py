"""A malformed setting stops the start with one line naming its variable (and its file, for a file), and changes
nothing: bad JSON, JSON nested too deep, a negative rate, a file that is not UTF-8 text.

The settings are read for real, from the environment through `load_settings`, and once through the installed
`subq` script; tests/test_bad_input.py has the other bad settings, tests/test_config_file.py a file's reload.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from coordinator import ConfigError, Coordinator, Settings, load_settings
from coordinator.local.fleet import settings_env
from tests.helpers import state
from tests.test_bad_input import NO_TREE
from tests.test_console_script import script

# More levels than Python's recursion limit: the JSON and TOML parsers recurse once a level.
TOO_DEEP = "[" * 100_000
FILE_SETTINGS = ("SUBQ_TENANTS_FILE", "SUBQ_API_KEYS_FILE", "SUBQ_PROFILES_FILE")


def _refused(monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> ConfigError:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as refused:
        load_settings()
    assert "\n" not in str(refused.value)
    assert refused.value.field == variable
    return refused.value


@pytest.mark.parametrize(
    ("variable", "value", "message"),
    [
        ("SUBQ_PROVIDER_RPM", "abc", "Invalid setting SUBQ_PROVIDER_RPM: not valid JSON: Expecting value: line 1"),
        ("SUBQ_PROFILES", "abc", "Invalid setting SUBQ_PROFILES: not valid JSON: Expecting value: line 1"),
        ("SUBQ_PROFILES", "{", "Invalid setting SUBQ_PROFILES: not valid JSON: Expecting property name"),
        ("SUBQ_PROVIDER_RPM", TOO_DEEP, "Invalid setting SUBQ_PROVIDER_RPM: not valid JSON: nested too deep"),
        ("SUBQ_API_KEYS", TOO_DEEP, "Invalid setting SUBQ_API_KEYS: not valid JSON: nested too deep"),
        ("SUBQ_NOTIFY", TOO_DEEP, "Invalid setting SUBQ_NOTIFY: not valid JSON: nested too deep"),
    ],
)
def test_a_json_setting_that_does_not_parse_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, message: str
) -> None:
    assert str(_refused(monkeypatch, variable, value)).startswith(message)


def test_every_setting_given_bad_or_too_deep_json_is_refused_naming_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Any setting, not only those above: a field added with a JSON type must parse its text itself (NoDecode),
    or pydantic-settings' own decoding ends in a traceback naming no variable."""
    for name in Settings.model_fields:
        variable = f"SUBQ_{name.upper()}"
        for value in ("{", TOO_DEEP):
            with monkeypatch.context() as env:
                env.setenv(variable, value)
                try:
                    load_settings()
                except ConfigError as refused:
                    assert refused.field == variable and "\n" not in str(refused), (variable, str(refused))


def test_a_negative_provider_rate_is_refused_naming_the_provider_and_0_means_no_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = _refused(monkeypatch, "SUBQ_PROVIDER_RPM", '{"anthropic": 50, "openai": -5}')
    assert str(refused) == "Invalid setting SUBQ_PROVIDER_RPM (openai): Input should be greater than or equal to 0"
    monkeypatch.setenv("SUBQ_PROVIDER_RPM", '{"anthropic": 50, "openai": 0}')
    settings = load_settings()
    assert settings.provider_rpm == {"anthropic": 50, "openai": 0}
    assert json.loads(settings_env(settings)["SUBQ_PROVIDER_RPM"]) == settings.provider_rpm, "as a worker reads it"
    monkeypatch.setenv("SUBQ_PROVIDER_RPM", "")  # `VAR=` in an env file: unset, as SUBQ_API_KEYS'
    assert load_settings().provider_rpm == {}


@pytest.mark.parametrize("variable", FILE_SETTINGS)
@pytest.mark.parametrize(
    ("content", "says"),
    [
        (TOO_DEEP.encode(), "not valid JSON: nested too deep"),
        (b'{"a": "\xff"}', "not UTF-8 text (byte 0xff at offset 7)"),
    ],
)
def test_a_file_too_deep_or_not_utf8_is_refused_naming_the_variable_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variable: str, content: bytes, says: str
) -> None:
    path = tmp_path / "settings.json"
    path.write_bytes(content)
    assert str(_refused(monkeypatch, variable, str(path))) == f"Invalid setting {variable}: {path}: {says}"
    assert path.read_bytes() == content


@pytest.mark.parametrize(
    ("variable", "value", "line"),
    [
        ("SUBQ_PROVIDER_RPM", "abc", "Invalid setting SUBQ_PROVIDER_RPM: not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("SUBQ_PROFILES", "abc", "Invalid setting SUBQ_PROFILES: not valid JSON: Expecting value: line 1 column 1 (char 0)"),
        ("SUBQ_PROVIDER_RPM", '{"openai": -5}', "Invalid setting SUBQ_PROVIDER_RPM (openai): Input should be greater than or equal to 0"),
        ("SUBQ_TENANTS_FILE", "{tmp}/t.json", "Invalid setting SUBQ_TENANTS_FILE: {tmp}/t.json: not valid JSON: nested too deep"),
    ],
)  # fmt: skip
def test_the_script_stops_with_one_line_and_changes_nothing(
    idle_coordinator: Coordinator, tmp_path: Path, variable: str, value: str, line: str
) -> None:
    (tmp_path / "t.json").write_text(TOO_DEEP)
    env = {
        "SUBQ_REDIS_URL": idle_coordinator.settings.redis_url or "",
        "SUBQ_KEY_PREFIX": idle_coordinator.settings.key_prefix,
        "SUBQ_QUEUE": idle_coordinator.settings.queue,  # one no worker consumes: a published task would stay
        variable: value.replace("{tmp}", str(tmp_path)),
    }
    before = state(idle_coordinator, NO_TREE)
    proc = script("run", "A prompt that must not start", env=env)
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"subq: {line.replace('{tmp}', str(tmp_path))}\n"
    assert state(idle_coordinator, NO_TREE) == before


@pytest.mark.parametrize("command", [["worker"], ["api", "--port", "1"], ["flower", "--no-auth"], ["history"]])
@pytest.mark.parametrize("url", ["nonsense", "http://127.0.0.1:1/0"])
def test_a_redis_url_of_no_redis_scheme_is_one_line_from_every_command(command: list[str], url: str) -> None:
    """`subq worker` started Celery on it, which printed a warning that the URL carried no password and then a
    traceback (no such transport); `subq api` a traceback of its own. Every command refuses it alike."""
    proc = script(*command, env={"SUBQ_REDIS_URL": url})
    expected = "Invalid setting SUBQ_REDIS_URL: Redis URL must specify one of the following schemes"
    assert (proc.returncode, proc.stdout) == (1, ""), proc
    assert proc.stderr.startswith(f"subq: {expected}") and proc.stderr.count("\n") == 1, proc.stderr


def test_a_misspelled_or_deprecated_variable_is_named_at_start_and_changes_nothing(
    idle_coordinator: Coordinator,
) -> None:
    """SUBQ_API_KEY_FILE (for SUBQ_API_KEYS_FILE) left a server's scoped keys off without a word: the settings
    ignore names they do not know. Each such name is now one warning line, with the setting it is nearest."""
    env = {
        "SUBQ_REDIS_URL": idle_coordinator.settings.redis_url or "",
        "SUBQ_KEY_PREFIX": idle_coordinator.settings.key_prefix,
        "SUBQ_API_KEY_FILE": "/etc/subq/keys.toml",
        "subq_max_running_per_roots": "4",  # read in any case, as the settings read theirs
        "SUBQ_MODEL_RETRY_BASE_S": "0.5",
        "SUBQ_FLOWER_USER": "ops",  # read by `subq flower`, not a setting: no warning
    }
    before = state(idle_coordinator, NO_TREE)
    proc = script("history", env=env)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if "subq setting" in line or "deprecated" in line]
    assert warned == [
        "subq: SUBQ_API_KEY_FILE is not a subq setting and is ignored (did you mean SUBQ_API_KEYS_FILE?); "
        "docs/configuration.md lists them",
        "subq: SUBQ_MODEL_RETRY_BASE_S is deprecated: it is read as SUBQ_MODEL_BACKOFF_BASE_S; rename it",
        "subq: subq_max_running_per_roots is not a subq setting and is ignored (did you mean "
        "SUBQ_MAX_RUNNING_PER_ROOT?); docs/configuration.md lists them",
    ]
    assert state(idle_coordinator, NO_TREE) == before


def test_every_variable_the_docs_and_deploy_files_set_is_known() -> None:
    """No warning for a name the files a user copies set (the deploy files, `.env.example`, the compose file), nor
    for one the docs name, but the deprecated names and configuration.md's own misspelling; nor for the variables
    Kubernetes gives a pod for each Service of its namespace (the manifests' subq-api, subq-redis, subq-flower)."""
    import re

    from coordinator.settings import RENAMED_SETTINGS, unknown_variables

    root = Path(__file__).resolve().parent.parent
    copied = [*root.joinpath("deploy").rglob("*"), root / ".env.example", root / "docker-compose.yml"]
    documented = [*root.joinpath("docs").glob("*.md"), root / "README.md"]

    def names(files: list[Path]) -> set[str]:
        found: set[str] = set()
        for file in files:
            if file.is_file():
                found |= set(re.findall(r"\bSUBQ_[A-Z0-9_]*[A-Z0-9]\b", file.read_text(errors="replace")))
        return found

    set_by_files = names(copied)
    assert {"SUBQ_REDIS_URL", "SUBQ_FLOWER_PASSWORD", "SUBQ_KUBERNETES_REDIS_PASSWORD"} <= set_by_files
    assert unknown_variables(dict.fromkeys(set_by_files, "x")) == []
    on_purpose = {"SUBQ_API_KEY_FILE", *RENAMED_SETTINGS.values()}
    assert unknown_variables(dict.fromkeys(names(documented) - on_purpose, "x")) == []
    links = ["SUBQ_API_SERVICE_HOST", "SUBQ_API_SERVICE_PORT", "SUBQ_API_PORT", "SUBQ_REDIS_PORT_6379_TCP_ADDR"]
    links += ["SUBQ_REDIS_PORT_6379_TCP_PROTO", "SUBQ_FLOWER_SERVICE_PORT_HTTP", "SUBQ_FLOWER_PORT_5555_TCP"]
    assert unknown_variables(dict.fromkeys(links, "x")) == []
    assert unknown_variables({"SUBQ_API_KEY_FILE": "x", "PATH": "/bin", "SUBQX": "1"}) == [
        "SUBQ_API_KEY_FILE is not a subq setting and is ignored (did you mean SUBQ_API_KEYS_FILE?); "
        "docs/configuration.md lists them"
    ]
