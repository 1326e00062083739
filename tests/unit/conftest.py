"""The unit tier needs no database: a test here that asks for one fails at once.

Such a test belongs in tests/integration/. (The session ``dsn`` fixture of tests/conftest.py
would otherwise start an embedded PostgreSQL when LEASEQUEUE_TEST_DSN is unset.)
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def dsn() -> str:
    pytest.fail("a unit test asked for the database: move it to tests/integration/")
