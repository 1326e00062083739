"""Drain strategies: how a worker claims tasks and concludes them.

A strategy opens a :class:`Drainer` in a worker process; the generic runner in
:mod:`benchmarks.harness.runner` calls ``claim()`` until it returns nothing, passing each claim to
``finish()``. The package's paths go through :class:`LeaseQueue`; the baselines run the seed's
raw SQL on one psycopg autocommit connection, against the same tables.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from psycopg import sql

from benchmarks.harness.db import (
    EFFECTS_TABLE,
    LEASE_SECONDS,
    connect,
    open_queue,
    supports_setting,
)
from dagster_leasequeue import Lease, sql as lq_sql

# The seed's statements, verbatim; the batch size is written into the text as a literal
# (LIMIT 100), as the seed had it.
SEED_CLAIM_ONE = """
    UPDATE tasks SET status = 'processing',
                     lease_expires_at = clock_timestamp() + interval '300 s'
    WHERE id = (SELECT id FROM tasks WHERE status = 'enqueued' AND queue = 'default'
                ORDER BY priority DESC, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)
    RETURNING id
"""
SEED_CLAIM_MANY = """
    WITH picked AS (
        SELECT id FROM tasks WHERE status = 'enqueued' AND queue = 'default'
        ORDER BY priority DESC, run_at, id LIMIT {limit} FOR UPDATE SKIP LOCKED
    )
    UPDATE tasks AS t SET status = 'processing',
                          lease_expires_at = clock_timestamp() + interval '300 s'
    FROM picked WHERE t.id = picked.id
    RETURNING t.id
"""
SEED_ACK_ONE = "UPDATE tasks SET status = 'done' WHERE id = %s"
# The seed's ack and its next claim as one UPDATE of both rows, each row's new values chosen
# by whether it is the acked one: the one-round-trip, one-commit loop without any of the
# package's guarantees (no fence, no token, no attempt count), on the seed's table. Not a
# path users take: it is what any loop of one statement a task can reach on the machine.
SEED_ACK_AND_CLAIM_ONE = """
    WITH picked AS (
        SELECT id FROM tasks WHERE status = 'enqueued' AND queue = 'default'
        ORDER BY priority DESC, run_at, id LIMIT 1 FOR UPDATE SKIP LOCKED
    )
    UPDATE tasks SET status = CASE WHEN id = %(acked)s THEN 'done' ELSE 'processing' END,
                     lease_expires_at = CASE WHEN id = %(acked)s THEN lease_expires_at
                                        ELSE clock_timestamp() + interval '300 s' END
    WHERE id = ANY (ARRAY[%(acked)s::bigint, (SELECT id FROM picked)])
    RETURNING id
"""
SEED_ACK_MANY = "UPDATE tasks SET status = 'done' WHERE id = ANY(%s)"


def seed_claim(batch: int) -> str:
    """The seed's claim of one task, or of ``batch`` tasks in one statement."""
    if batch == 1:
        return SEED_CLAIM_ONE
    return sql.SQL(SEED_CLAIM_MANY).format(limit=sql.Literal(batch)).as_string(None)


class Drainer(Protocol):
    """A worker's claim/conclude loop body, bound to its own connections."""

    def claim(self) -> Sequence[Any]:
        """Claim the next task or batch; empty when the queue is drained."""

    def finish(self, claimed: Sequence[Any]) -> None:
        """Conclude what :meth:`claim` returned."""

    def close(self) -> None: ...


class BareDrainer:
    """A drainer on one psycopg autocommit connection, no package code involved."""

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        self._conn = connect(dsn, schema, prepared=prepared)
        self._batch = batch

    def close(self) -> None:
        self._conn.close()


class SeedSqlDrainer(BareDrainer):
    """The baselines: the seed's raw SQL, one task or ``batch`` tasks per statement."""

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        super().__init__(dsn, schema, batch, prepared)
        self._claim = seed_claim(batch)

    def claim(self) -> list[int]:
        return [int(row[0]) for row in self._conn.execute(self._claim).fetchall()]

    def finish(self, claimed: Sequence[int]) -> None:
        if self._batch == 1:
            self._conn.execute(SEED_ACK_ONE, (claimed[0],))
        else:
            self._conn.execute(SEED_ACK_MANY, (list(claimed),))


class ChainedClaims:
    """Mixed into a drainer whose ``finish()`` claims the next tasks: ``claim()`` hands
    those out, and claims anew only when there are none."""

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        super().__init__(dsn, schema, batch, prepared)  # type: ignore[call-arg]
        self._next: list[Any] = []

    def claim(self) -> list[Any]:
        if self._next:
            claimed, self._next = self._next, []
            return claimed
        return super().claim()  # type: ignore[misc,no-any-return]


class SeedChainDrainer(ChainedClaims, SeedSqlDrainer):
    """The seed's SQL with each ack claiming the next task in the same statement
    (SEED_ACK_AND_CLAIM_ONE); the first task is claimed alone."""

    def finish(self, claimed: Sequence[int]) -> None:
        (acked,) = claimed
        rows = self._conn.execute(SEED_ACK_AND_CLAIM_ONE, {"acked": acked}).fetchall()
        self._next = [int(row[0]) for row in rows if row[0] != acked]


class PackageSqlDrainer(BareDrainer):
    """The package's own claim and fenced-ack statements on one bare connection.

    Not a user-facing path: it splits the package's cost into its SQL (this, against the
    seed SQL) and its Python layer (the package's path, against this).
    """

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        super().__init__(dsn, schema, batch, prepared)
        self._schema = schema
        self._claim = lq_sql.compose_claim(schema, batch)
        self._ack = lq_sql.compose(lq_sql.ACK if batch == 1 else lq_sql.ACK_MANY, schema)
        self._params = {
            "queue": "default",
            "worker_id": f"bench-sql-worker:{schema}",
            "lease_seconds": None,
            "default_lease": LEASE_SECONDS,
        }
        self._token_column: int | None = None

    def claim(self) -> list[tuple[int, int]]:
        cursor = self._conn.execute(self._claim, self._params)
        rows = cursor.fetchall()
        if rows and self._token_column is None:
            # Looked up by name: the claim's columns differ between measured revisions.
            names = [column.name for column in cursor.description or ()]
            self._token_column = names.index("lease_token")
        return [(int(row[0]), int(row[self._token_column or 0])) for row in rows]

    def finish(self, claimed: Sequence[tuple[int, int]]) -> None:
        if self._batch == 1:
            ((task_id, token),) = claimed
            self._conn.execute(self._ack, {"task_id": task_id, "token": token, "result": None})
            return
        ids, tokens = zip(*claimed, strict=True)
        params = {
            "task_ids": list(ids),
            "tokens": list(tokens),
            "results": [None] * len(ids),
            "channel": lq_sql.notify_channel(self._schema),
        }
        self._conn.execute(self._ack, params)


class PackageDrainer:
    """The package's one-at-a-time path: ``claim()`` then ``lease.ack()``."""

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        overrides = None if prepared else {"prepared_statements": False}
        self.queue = open_queue(dsn, schema, overrides=overrides)
        self.batch = batch

    def claim(self) -> list[Lease]:
        if self.batch == 1:
            lease = self.queue.claim()
            return [] if lease is None else [lease]
        return self.queue.claim_many(self.batch)

    def finish(self, claimed: Sequence[Lease]) -> None:
        for lease in claimed:
            lease.ack()

    def close(self) -> None:
        self.queue.close()


class BatchedPackageDrainer(PackageDrainer):
    """``claim_many(batch)`` then one ``queue.ack_many(leases)``."""

    def finish(self, claimed: Sequence[Lease]) -> None:
        self.queue.ack_many(claimed)


class ChainedPackageDrainer(ChainedClaims, PackageDrainer):
    """The worker loop of ``run_worker``: each ack claims the next task in the same
    statement (``lease.ack_and_claim()``, or ``ack_many_and_claim`` for a batch)."""

    def finish(self, claimed: Sequence[Lease]) -> None:
        if self.batch > 1:
            self._next = self.queue.ack_many_and_claim(claimed, limit=self.batch)
            return
        (lease,) = claimed
        following = lease.ack_and_claim()
        self._next = [] if following is None else [following]


class ChainedAttemptDrainer(ChainedPackageDrainer):
    """The worker loop through attempts: each attempt's conclusion claims the next task
    (``attempt(lease=..., claim_next=True)``), nothing written inside, as ``lq_attempt``."""

    def finish(self, claimed: Sequence[Lease]) -> None:
        (lease,) = claimed
        with self.queue.attempt(lease=lease, claim_next=True) as attempt:
            pass
        self._next = [] if attempt.claimed is None else [attempt.claimed]


class AttemptPackageDrainer(PackageDrainer):
    """The idempotency path on the no-op tasks of the other drains.

    Each lease is concluded by ``queue.attempt(lease=lease)`` with nothing written inside,
    so what it adds to ``lq_one`` is the attempt's own bookkeeping: the record that it
    started, then the success mark with the fenced ack.
    """

    def finish(self, claimed: Sequence[Lease]) -> None:
        for lease in claimed:
            with self.queue.attempt(lease=lease):
                pass


def effect_statement(schema: str) -> str:
    """One row per task in the effects table: the trivial effect of the ``_effect`` drains."""
    return (
        sql.SQL("INSERT INTO {} (task_id) VALUES (%s)")
        .format(sql.Identifier(schema, EFFECTS_TABLE))
        .as_string(None)
    )


class _EffectDrainer(PackageDrainer):
    """A package drainer that writes the one-row effect of the ``_effect`` drains."""

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        super().__init__(dsn, schema, batch, prepared)
        # Rendered once, as a worker would hold its statement.
        self._effect = effect_statement(schema)


class EffectPackageDrainer(_EffectDrainer):
    """``lq_one`` with one row written per task before the ack, without the attempts.

    The row is written on a connection of the worker's own, as a worker that acks after
    its effect (at least once) would: the baseline for ``lq_attempt_effect``.
    """

    def __init__(self, dsn: str, schema: str, batch: int, prepared: bool) -> None:
        super().__init__(dsn, schema, batch, prepared)
        self._conn = connect(dsn, prepared=prepared)

    def finish(self, claimed: Sequence[Lease]) -> None:
        for lease in claimed:
            self._conn.execute(self._effect, (lease.task_id,))
            lease.ack()

    def close(self) -> None:
        self._conn.close()
        super().close()


class AttemptEffectPackageDrainer(_EffectDrainer):
    """The idempotency path with the same one-row effect, written through the attempt's
    connection, so it commits with the success mark and the fenced ack."""

    def finish(self, claimed: Sequence[Lease]) -> None:
        for lease in claimed:
            with self.queue.attempt(lease=lease) as attempt:
                if not attempt.duplicate:
                    attempt.connection.execute(self._effect, (lease.task_id,))


@dataclass(frozen=True)
class Strategy:
    """A named way to drain, and what it is compared with (None: it is a baseline)."""

    name: str
    label: str
    baseline: str | None
    batch_size: int  # 0: the run's --batch (100 by default)
    opener: Callable[[str, str, int, bool], Drainer]
    analysis: bool = False  # splits a cost; not a path users take
    prepared: bool = True
    requires: str | None = None  # a package setting the variant needs
    lean: bool = False  # on a table of the seed's own shape (db.LEAN_TASKS)

    def open(self, dsn: str, schema: str, batch: int) -> Drainer:
        return self.opener(dsn, schema, self.batch_size or batch, self.prepared)

    @property
    def is_package(self) -> bool:
        return isinstance(self.opener, type) and issubclass(self.opener, PackageDrainer)

    @property
    def available(self) -> bool:
        return self.requires is None or supports_setting(self.requires)


STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("raw_one", "seed SQL, 1 per transaction", None, 1, SeedSqlDrainer),
        Strategy("raw_batch", "seed SQL, batch per statement", None, 0, SeedSqlDrainer),
        Strategy("lq_one", "claim() + lease.ack()", "raw_one", 1, PackageDrainer),
        Strategy("lq_batch", "claim_many + ack_many", "raw_batch", 0, BatchedPackageDrainer),
        Strategy("raw_one_lean", "raw_one, seed-shaped table", None, 1, SeedSqlDrainer, lean=True),
        Strategy(
            "raw_batch_lean", "raw_batch, seed-shaped table", None, 0, SeedSqlDrainer, lean=True
        ),
        Strategy(
            "raw_chain_lean",
            "seed SQL, ack and next claim in one statement",
            "raw_one_lean",
            1,
            SeedChainDrainer,
            analysis=True,
            lean=True,
        ),
        Strategy("lq_chain", "lease.ack_and_claim()", "raw_one_lean", 1, ChainedPackageDrainer),
        Strategy(
            "lq_chain_batch",
            "ack_many_and_claim",
            "raw_batch_lean",
            0,
            ChainedPackageDrainer,
        ),
        Strategy(
            "lq_chain_attempt", "attempt(claim_next=True)", "lq_chain", 1, ChainedAttemptDrainer
        ),
        Strategy("lq_attempt", "claim() + attempt(lease)", "lq_one", 1, AttemptPackageDrainer),
        Strategy("lq_one_effect", "lq_one, a row written first", "lq_one", 1, EffectPackageDrainer),
        Strategy(
            "lq_attempt_effect",
            "lq_attempt, the row written inside",
            "lq_one_effect",
            1,
            AttemptEffectPackageDrainer,
        ),
        Strategy("sql_one", "package SQL, bare psycopg", "raw_one", 1, PackageSqlDrainer, True),
        Strategy(
            "sql_batch", "package SQL batch, bare psycopg", "raw_batch", 0, PackageSqlDrainer, True
        ),
        # Variants for the latency table: no prepared statements.
        Strategy(
            "raw_one_unprepared", "raw_one, not prepared", None, 1, SeedSqlDrainer, prepared=False
        ),
        Strategy(
            "lq_one_unprepared",
            "lq_one, prepared_statements=False",
            "raw_one_unprepared",
            1,
            PackageDrainer,
            prepared=False,
            requires="prepared_statements",
        ),
    )
}
DRAIN_ORDER = (
    "raw_one",
    "raw_batch",
    "raw_one_lean",
    "raw_batch_lean",
    "raw_chain_lean",
    "sql_one",
    "sql_batch",
    "lq_one",
    "lq_batch",
    "lq_chain",
    "lq_chain_batch",
    "lq_chain_attempt",
    "lq_attempt",
    "lq_one_effect",
    "lq_attempt_effect",
)
