"""Settings from arguments, the environment and .env; a bad one names the variable to fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from dagster_leasequeue import ConfigurationError, LeaseQueue, LeaseQueueSettings

# Never connected to: a schema name is checked before any connection is made.
UNREACHABLE_DSN = "postgresql://nobody@127.0.0.1:1/none"


@pytest.mark.parametrize(
    "name",
    ['x"; DROP TABLE y', "Upper", "1starts_with_digit", "a" * 64, "spa ce", "ünï", ""],
)
def test_unsafe_schema_names_are_refused(name: str) -> None:
    with pytest.raises(ConfigurationError, match=r"schema name .* is not allowed"):
        LeaseQueue(UNREACHABLE_DSN, schema=name)


def test_settings_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LEASEQUEUE_LEASE_SECONDS", "42.5")
    monkeypatch.setenv("LEASEQUEUE_SCHEMA_NAME", "jobs")
    monkeypatch.setenv("LEASEQUEUE_DATA_DIR", str(tmp_path))
    settings = LeaseQueueSettings()
    assert (settings.lease_seconds, settings.schema_name, settings.data_dir) == (
        42.5,
        "jobs",
        tmp_path,
    )


def test_settings_from_dotenv(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / ".env").write_text("LEASEQUEUE_MAX_ATTEMPTS=9\nOTHER_APP_SETTING=1\n")
    monkeypatch.chdir(tmp_path)
    assert LeaseQueueSettings().max_attempts == 9


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("LEASEQUEUE_LEASE_SECONDS", "soon"),
        ("LEASEQUEUE_LEASE_SECONDS", "-1"),
        ("LEASEQUEUE_MAX_ATTEMPTS", "0"),
        ("LEASEQUEUE_POOL_SIZE", "many"),
        ("LEASEQUEUE_SCHEMA_NAME", "bad-name"),
        ("LEASEQUEUE_CONNECT_TIMEOUT", "0"),
    ],
)
def test_bad_settings_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigurationError, match=variable) as raised:
        LeaseQueueSettings()
    assert repr(value) in str(raised.value)


def test_retry_backoff_settings_are_bounded() -> None:
    with pytest.raises(ConfigurationError, match="LEASEQUEUE_RETRY_BACKOFF_CAP"):
        LeaseQueueSettings(retry_backoff_cap=1e300, _env_file=None)
