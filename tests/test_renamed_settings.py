"""Settings renamed so that "retry" means one thing (running failed work again, `subq retry`; issue 43, point 3):
the provider's backoff and how long its failures are waited out are read under their new names, and still under
their deprecated ones (docs/configuration.md); a bad value names the setting, and nothing is built."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator import ConfigError, Profile
from coordinator.settings import RENAMED_PROFILE_KEYS, RENAMED_SETTINGS, load_settings


def test_the_backoff_is_read_under_its_new_and_its_deprecated_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = load_settings()
    monkeypatch.setenv("SUBQ_MODEL_RETRY_BASE_S", "0.25")
    monkeypatch.setenv("SUBQ_MODEL_RETRY_MAX_S", "4")
    old = load_settings()
    assert (old.model_backoff_base_s, old.model_backoff_max_s) == (0.25, 4.0)
    monkeypatch.setenv("SUBQ_MODEL_BACKOFF_BASE_S", "0.125")
    monkeypatch.setenv("SUBQ_MODEL_BACKOFF_MAX_S", "2")
    both = load_settings()
    assert (both.model_backoff_base_s, both.model_backoff_max_s) == (0.125, 2.0), "the new name wins"
    assert (defaults.model_backoff_base_s, defaults.model_backoff_max_s) == (0.5, 10.0)
    assert load_settings(model_backoff_base_s=1.5).model_backoff_base_s == 1.5, "by its name in Python"


@pytest.mark.parametrize("variable", [*RENAMED_SETTINGS, *RENAMED_SETTINGS.values()])
def test_a_bad_backoff_names_its_variable_under_either_name(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(variable, "-1")
    with pytest.raises(ConfigError) as refused:
        load_settings()
    new = next(new for new, old in RENAMED_SETTINGS.items() if variable in (new, old))
    assert str(refused.value).startswith(f"Invalid setting {new}: ")
    assert f"(read from {new} or {RENAMED_SETTINGS[new]}, its deprecated name)" in str(refused.value)


def test_a_profile_reads_its_wait_out_time_under_its_old_key_too(tmp_path: Path) -> None:
    assert RENAMED_PROFILE_KEYS == {"model_wait_out_s": "model_retry_for_s"}
    assert Profile.model_validate({"model_retry_for_s": 30}).model_wait_out_s == 30
    assert Profile.model_validate({"model_wait_out_s": 40}).model_wait_out_s == 40
    file = tmp_path / "profiles.toml"
    file.write_text("[profiles.main]\nmodel_retry_for_s = 90\n[profiles.new]\nmodel_wait_out_s = 45\n")
    loaded = load_settings(profiles_file=file)
    assert (loaded.profiles["main"].model_wait_out_s, loaded.profiles["new"].model_wait_out_s) == (90, 45)
    # Handed to a worker process as the new key (coordinator/local/fleet.py dumps profiles by field name).
    assert "model_wait_out_s" in loaded.profiles["main"].model_dump()
