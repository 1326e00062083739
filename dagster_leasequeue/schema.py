"""Creating and migrating the queue's schema."""

from __future__ import annotations

import logging
import re
import time
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from . import migrations, sql
from .errors import ConfigurationError, LeaseQueueError, SchemaNotInstalled

logger = logging.getLogger(__name__)

# A migration that waits for a lock on a table holds every statement of the workers up
# behind it (PostgreSQL queues lock requests in order): behind a long read of the tasks,
# a migration that alters them would stop the whole queue until that read ends. So each
# try at a migration's locks gives up after MIGRATION_LOCK_TIMEOUT, undoes itself, and
# tries again after a pause, for up to MIGRATION_DEADLINE_SECONDS; then install() raises.
MIGRATION_LOCK_TIMEOUT = "2s"
MIGRATION_DEADLINE_SECONDS = 300.0


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
    written, so a role without DDL rights can call it too. ``conn`` is in autocommit.
    """
    current = installed_version(conn, schema)
    _refuse_newer(current, schema)
    if current == migrations.LATEST_VERSION:
        return 0
    # A new schema's tables are used by nobody yet: every migration, an index built
    # concurrently on a live table included, runs in the one transaction.
    fresh = current == 0
    applied = 0
    while True:
        pending = [m for m in migrations.MIGRATIONS if m.version > current]
        if not pending:
            return applied
        if pending[0].concurrently and not fresh:
            applied += _apply_concurrently(conn, schema, pending[0])
        else:
            applied += _apply_when_unlocked(conn, schema, fresh)
        current = installed_version(conn, schema)


def _apply_when_unlocked(conn: psycopg.Connection[Any], schema: str, fresh: bool) -> int:
    """_apply_in_transaction, tried again while the locks it needs are held elsewhere."""
    deadline = time.monotonic() + MIGRATION_DEADLINE_SECONDS
    pause = 0.5
    while True:
        try:
            return _apply_in_transaction(conn, schema, fresh)
        except pg_errors.LockNotAvailable as exc:
            if time.monotonic() + pause > deadline:
                raise LeaseQueueError(
                    f"install() could not take the locks its migrations need on schema "
                    f"{schema!r} within {MIGRATION_DEADLINE_SECONDS:g} s: other sessions "
                    "hold them (long queries or open transactions on the queue's tables, or "
                    "another install(): see pg_stat_activity). The schema stays at version "
                    f"{installed_version(conn, schema)}; call install() again at a quieter "
                    "moment"
                ) from exc
            logger.info("install() found a lock held on schema %r; trying again", schema)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _apply_in_transaction(conn: psycopg.Connection[Any], schema: str, fresh: bool) -> int:
    """Apply, in one transaction, the pending migrations up to one to run concurrently."""
    applied = 0
    with conn.transaction():
        # SET LOCAL: it ends with the transaction (PgBouncer hands the session on).
        conn.execute(f"SET LOCAL lock_timeout = '{MIGRATION_LOCK_TIMEOUT}'")
        conn.execute(sql.ADVISORY_XACT_LOCK, {"namespace": sql.INSTALL_LOCK, "schema": schema})
        conn.execute(sql.compose(sql.CREATE_SCHEMA, schema))
        conn.execute(sql.compose(sql.CREATE_VERSION_TABLE, schema))
        row = conn.execute(sql.compose(sql.CURRENT_VERSION, schema)).fetchone()
        current = int(row[0]) if row else 0
        _refuse_newer(current, schema)
        for migration in migrations.MIGRATIONS:
            if migration.version <= current:
                continue
            if migration.concurrently and not fresh:
                break
            for statement in migration.statements:
                if migration.concurrently:
                    statement = statement.replace(" CONCURRENTLY", "", 1)
                conn.execute(sql.compose(statement, schema))
            _record(conn, schema, migration)
            applied += 1
    return applied


def _apply_concurrently(
    conn: psycopg.Connection[Any], schema: str, migration: migrations.Migration
) -> int:
    """Run a migration's statements outside a transaction, then record it.

    Its statements build indexes without blocking writes, and may have been interrupted
    before (a crash, a cancelled deploy): an index left invalid by that is dropped and built
    again; one already built is kept (IF NOT EXISTS).
    """
    lock = {"namespace": sql.INSTALL_LOCK, "schema": schema}
    conn.execute(sql.ADVISORY_LOCK, lock)
    try:
        if installed_version(conn, schema) >= migration.version:
            return 0  # another process applied it while this one waited
        for statement in migration.statements:
            index = _INDEX_NAME.search(statement)
            if (
                index
                and conn.execute(
                    sql.INVALID_INDEX, {"schema": schema, "index": index.group(1)}
                ).fetchone()
            ):
                conn.execute(sql.compose_index(sql.DROP_INDEX_CONCURRENTLY, schema, index.group(1)))
            conn.execute(sql.compose(statement, schema))
        with conn.transaction():
            _record(conn, schema, migration)
        return 1
    finally:
        conn.execute(sql.ADVISORY_UNLOCK, lock)


_INDEX_NAME = re.compile(r"IF NOT EXISTS (\w+)")


def _record(conn: psycopg.Connection[Any], schema: str, migration: migrations.Migration) -> None:
    conn.execute(
        sql.compose(sql.RECORD_VERSION, schema),
        {"version": migration.version, "description": migration.description},
    )


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
