"""Fixtures: a real PostgreSQL (LEASEQUEUE_TEST_DSN, else embedded), one schema per test."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dagster_leasequeue import LeaseQueue, LeaseQueueSettings, connection
from dagster_leasequeue.embedded import embedded_dsn

# The suite's own variables, kept when the package's settings are cleared.
_TEST_VARIABLES = {"LEASEQUEUE_TEST_DSN", "LEASEQUEUE_RELIABILITY_REPORT"}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--chaos-long",
        action="store_true",
        help="run the fault-injection scenarios in their long form (many more tasks and kills)",
    )


@pytest.fixture(scope="session")
def chaos_long(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--chaos-long"))


@pytest.fixture(scope="session")
def figures() -> Iterator[dict[str, dict[str, object]]]:
    """Measured figures of the fault-injection scenarios, written as JSON at the end of the
    session when LEASEQUEUE_RELIABILITY_REPORT names a file (docs/RELIABILITY.md quotes them)."""
    collected: dict[str, dict[str, object]] = {}
    yield collected
    report = os.environ.get("LEASEQUEUE_RELIABILITY_REPORT")
    if report and collected:
        Path(report).write_text(json.dumps(collected, indent=2, default=str) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    # The suite must not pick up a developer's own LEASEQUEUE_* settings or .env file.
    for name in list(os.environ):
        if name.startswith("LEASEQUEUE_") and name not in _TEST_VARIABLES:
            del os.environ[name]
    # A shell that starts the suite in the background (a CI script with `&`) leaves SIGINT
    # ignored, and Dagster's in-process runs give SIGTERM SIGINT's handler
    # (dagster._utils.interrupts): SIGTERM would stay ignored for the rest of the session,
    # and so in every process a test spawns, whose terminate() then does nothing (a
    # multiprocessing pool's workers hung its exit). Python's own handler, as in a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="session")
def dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    configured = os.environ.get("LEASEQUEUE_TEST_DSN")
    if configured:
        return configured
    return embedded_dsn(tmp_path_factory.mktemp("embedded") / "pgdata")


@pytest.fixture
def schema_name(dsn: str) -> Iterator[str]:
    name = f"lq_test_{uuid.uuid4().hex[:12]}"
    yield name
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


@pytest.fixture
def settings(tmp_path: Path) -> LeaseQueueSettings:
    return LeaseQueueSettings(
        lease_seconds=30,
        max_attempts=3,
        retry_backoff_base=0.5,
        retry_backoff_cap=5,
        data_dir=tmp_path / "unused",
        _env_file=None,
    )


@pytest.fixture
def make_queue(
    dsn: str, schema_name: str, settings: LeaseQueueSettings
) -> Iterator[Callable[..., LeaseQueue]]:
    opened: list[LeaseQueue] = []

    def make(**overrides: Any) -> LeaseQueue:
        merged = settings.model_copy(update=overrides) if overrides else settings
        queue = LeaseQueue(dsn, schema=schema_name, settings=merged)
        opened.append(queue)
        return queue

    yield make
    for queue in opened:
        queue.close()


@pytest.fixture
def queue(make_queue: Callable[..., LeaseQueue]) -> LeaseQueue:
    q = make_queue()
    q.install()
    return q


@pytest.fixture
def conflicts_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """Statements rolled back by a deadlock are not sent again: for the tests that show a
    deadlock cannot happen, which sending again would hide."""
    monkeypatch.setattr(connection, "CONFLICT_RETRIES", 0)
