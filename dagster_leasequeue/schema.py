"""Creating and migrating the queue's schema."""

from __future__ import annotations

from typing import Any

import psycopg

from . import migrations, sql
from .errors import ConfigurationError, SchemaNotInstalled


def installed_version(conn: psycopg.Connection[Any], schema: str) -> int:
    """The migration version the schema is at; 0 when it was never installed."""
    qualified = sql.compose("{schema}.schema_version", schema)
    row = conn.execute(sql.VERSION_TABLE_EXISTS, {"qualified": qualified}).fetchone()
    if not row or not row[0]:
        return 0
    version = conn.execute(sql.compose(sql.CURRENT_VERSION, schema)).fetchone()
    return int(version[0]) if version else 0


def install(conn: psycopg.Connection[Any], schema: str) -> int:
    """Create the schema or bring it to the latest version; return the migrations applied.

    Several processes may call this at once: an advisory lock lets one migrate while the
    others wait, and find nothing left to do. When the schema is already current nothing is
    written, so a role without DDL rights can call it too.
    """
    current = installed_version(conn, schema)
    _refuse_newer(current, schema)
    if current == migrations.LATEST_VERSION:
        return 0
    applied = 0
    with conn.transaction():
        conn.execute(sql.ADVISORY_XACT_LOCK, {"namespace": sql.INSTALL_LOCK, "schema": schema})
        conn.execute(sql.compose(sql.CREATE_SCHEMA, schema))
        conn.execute(sql.compose(sql.CREATE_VERSION_TABLE, schema))
        row = conn.execute(sql.compose(sql.CURRENT_VERSION, schema)).fetchone()
        current = int(row[0]) if row else 0
        _refuse_newer(current, schema)
        for migration in migrations.MIGRATIONS:
            if migration.version <= current:
                continue
            for statement in migration.statements:
                conn.execute(sql.compose(statement, schema))
            conn.execute(
                sql.compose(sql.RECORD_VERSION, schema),
                {"version": migration.version, "description": migration.description},
            )
            applied += 1
    return applied


def require_installed(conn: psycopg.Connection[Any], schema: str) -> None:
    """Raise SchemaNotInstalled unless the schema is at the version this release expects."""
    current = installed_version(conn, schema)
    _refuse_newer(current, schema)
    if current < migrations.LATEST_VERSION:
        raise not_installed(schema, current)


def not_installed(schema: str, current: int = 0) -> SchemaNotInstalled:
    state = "is not installed" if current == 0 else f"is at version {current}"
    return SchemaNotInstalled(
        f"queue schema {schema!r} {state} in this database (this release needs version "
        f"{migrations.LATEST_VERSION}): call LeaseQueue.install() first"
    )


def _refuse_newer(current: int, schema: str) -> None:
    if current > migrations.LATEST_VERSION:
        raise ConfigurationError(
            f"queue schema {schema!r} is at version {current}, newer than this release of "
            f"dagster-leasequeue knows ({migrations.LATEST_VERSION}): upgrade dagster-leasequeue"
        )
