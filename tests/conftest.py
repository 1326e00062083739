"""Fixtures: a real PostgreSQL (LEASEQUEUE_TEST_DSN, else embedded), one schema per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from dagster_leasequeue import LeaseQueue, LeaseQueueSettings
from dagster_leasequeue.embedded import embedded_dsn


def pytest_configure(config: pytest.Config) -> None:
    # The suite must not pick up a developer's own LEASEQUEUE_* settings or .env file.
    for name in list(os.environ):
        if name.startswith("LEASEQUEUE_") and name != "LEASEQUEUE_TEST_DSN":
            del os.environ[name]


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
