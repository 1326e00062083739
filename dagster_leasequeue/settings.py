"""Settings, read from ``LEASEQUEUE_*`` environment variables and a ``.env`` file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import platformdirs
from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from .errors import ConfigurationError
from .validation import MAX_ATTEMPTS, MAX_DELAY_SECONDS, MAX_LEASE_SECONDS, validate_schema_name

ENV_PREFIX = "LEASEQUEUE_"


def default_data_dir() -> Path:
    """Where the embedded PostgreSQL keeps its data when ``LEASEQUEUE_DATA_DIR`` is unset."""
    return platformdirs.user_data_path("dagster-leasequeue") / "pgdata"


class LeaseQueueSettings(BaseSettings):
    """Configuration of a :class:`~dagster_leasequeue.LeaseQueue`.

    Every field can be set by an environment variable named ``LEASEQUEUE_`` plus the field
    name in capitals (``LEASEQUEUE_DSN``, ``LEASEQUEUE_LEASE_SECONDS``, ...) or by the same
    names in a ``.env`` file in the working directory. Keyword arguments win over both.

    Example:
        .. code-block:: python

            settings = LeaseQueueSettings(lease_seconds=60)
            with LeaseQueue.from_settings(settings) as queue:
                queue.install()
    """

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
        validate_default=True,
    )

    dsn: SecretStr | None = Field(
        default=None,
        description="PostgreSQL connection string. Unset: the embedded server under data_dir.",
    )
    schema_name: str = Field(
        default="leasequeue", description="Schema that holds the queue's tables."
    )
    lease_seconds: float = Field(
        default=300.0,
        gt=0,
        le=MAX_LEASE_SECONDS,
        description="Default lease of a claim, in seconds (at most a week).",
    )
    max_attempts: int = Field(
        default=5,
        ge=1,
        le=MAX_ATTEMPTS,
        description="Default number of claims before a task is dead.",
    )
    data_dir: Path = Field(
        default_factory=default_data_dir,
        description="Data directory of the embedded PostgreSQL server.",
    )
    connect_timeout: float = Field(
        default=5.0, gt=0, le=300, description="Seconds to wait for a connection before failing."
    )
    network_timeout: float | None = Field(
        default=None,
        ge=1,
        le=3600,
        description=(
            "Seconds a call may wait on a dead network path before its connection is "
            "dropped (TCP user timeout and keepalives). Unset: the lease length, at most 30."
        ),
    )
    pool_size: int = Field(
        default=4, ge=1, le=1000, description="Largest number of pooled connections."
    )
    retry_backoff_base: float = Field(
        default=1.0,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="Delay before the first retry after fail(), in seconds.",
    )
    retry_backoff_cap: float = Field(
        default=600.0,
        ge=0,
        le=MAX_DELAY_SECONDS,
        description="Longest delay between retries, in seconds.",
    )
    sweep_batch_size: int = Field(
        default=500, ge=1, le=100_000, description="Expired leases recovered per transaction."
    )
    payload_max_bytes: int = Field(
        default=1024 * 1024, ge=2, description="Largest encoded payload or result, in bytes."
    )
    notify: bool = Field(
        default=True, description="Send a NOTIFY with each enqueue to wake waiting workers."
    )
    prepared_statements: bool = Field(
        default=True,
        description=(
            "Let psycopg prepare frequent statements. Turn off behind PgBouncer in transaction "
            "mode older than 1.21, which cannot keep prepared statements."
        ),
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigurationError(_explain(exc)) from None

    @field_validator("schema_name")
    @classmethod
    def _check_schema_name(cls, value: str) -> str:
        return validate_schema_name(value)

    def network_timeout_seconds(self) -> float:
        """The network timeout in force: the setting, else the lease length, at most 30 s.

        At or below the lease, a worker cut off from the database finds its calls failing
        before another worker can have its task.
        """
        if self.network_timeout is not None:
            return self.network_timeout
        return min(self.lease_seconds, 30.0)

    def dsn_value(self) -> str | None:
        """The DSN as plain text, or None for the embedded server."""
        return self.dsn.get_secret_value() if self.dsn is not None else None


_SECRET_FIELDS = {"dsn"}


def _explain(exc: ValidationError) -> str:
    problems = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else "?"
        variable = f"{ENV_PREFIX}{field.upper()}"
        shown = "" if field in _SECRET_FIELDS else f" (got {error.get('input')!r})"
        problems.append(f"{field} / {variable}: {error['msg']}{shown}")
    return "invalid dagster-leasequeue settings: " + "; ".join(problems)
