"""Every SQL statement dagster-leasequeue runs, in one reviewable place.

Statements are templates over ``{schema}``, composed with :class:`psycopg.sql.Identifier`
so a schema name is always quoted. Times always come from ``clock_timestamp()``: the
database's clock at the moment of the statement, never the client's and never the start
of a transaction (``now()``), so a claim made late in a long transaction still gets its
full lease.

Migrations are numbered; :mod:`dagster_leasequeue.schema` applies the ones a database
lacks. Never edit a released migration: append a new one.

Upgrades must not stop a running queue. From migration 5 on, a migration that builds an
index on ``tasks`` does it with ``CREATE INDEX CONCURRENTLY``, outside the migration's
transaction (it cannot run inside one): a plain ``CREATE INDEX`` takes a lock that blocks
every claim, ack and enqueue until the whole table is read. Such a statement must also be
safe to run again (``IF NOT EXISTS``, and a check for an invalid index left by an
interrupted build), since its effect is not rolled back with the version record.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from psycopg import sql

# First keys of the two-key advisory locks this package takes, one per purpose, so that no
# name a user picks can make two purposes collide.
INSTALL_LOCK = 0x6C7101
SWEEP_LOCK = 0x6C7102


class Migration(NamedTuple):
    version: int
    description: str
    statements: tuple[str, ...]


# What an attempt is an attempt at, as one text: a task without idempotency key is its own
# work ("task:" + id); a key the caller chose is its own space ("key:" + key); else the
# task's queue and idempotency key ("queue:" + the queue's length + ":" + queue + ":" +
# key). The prefixes
# and the length make it injective: no key a caller chooses reaches another's space.
# dagster_leasequeue.attempts.attempt_identity computes the same text in Python.
_ATTEMPT_IDENTITY = """
    CASE WHEN key IS NULL THEN 'task:' || task_id
         WHEN queue IS NULL THEN 'key:' || key
         ELSE 'queue:' || length(queue) || ':' || queue || ':' || key END
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "tasks, recovery events and attempts",
        (
            # fillfactor leaves room on each page so the hot updates (claim, renew, ack)
            # can stay on the same page.
            """
            CREATE TABLE {schema}.tasks (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                queue text NOT NULL,
                status text NOT NULL DEFAULT 'enqueued'
                    CHECK (status IN ('enqueued', 'processing', 'done', 'dead', 'cancelled')),
                priority integer NOT NULL DEFAULT 0,
                payload jsonb NOT NULL,
                result jsonb,
                idempotency_key text,
                attempts integer NOT NULL DEFAULT 0 CHECK (attempts >= 0),
                max_attempts integer NOT NULL CHECK (max_attempts >= 1),
                lease_seconds double precision CHECK (lease_seconds > 0),
                run_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                lease_token bigint,
                lease_expires_at timestamptz,
                worker_id text,
                last_error text,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                finished_at timestamptz
            ) WITH (fillfactor = 80)
            """,
            # The claim path: only waiting rows, in the claim's ORDER BY.
            """
            CREATE INDEX tasks_claim_idx ON {schema}.tasks (queue, priority DESC, run_at, id)
                WHERE status = 'enqueued'
            """,
            # The sweep path: only rows under lease, however many finished rows pile up.
            # lease_expires_at is deliberately not indexed so that renewals stay HOT updates.
            """
            CREATE INDEX tasks_processing_idx ON {schema}.tasks (id)
                WHERE status = 'processing'
            """,
            """
            CREATE UNIQUE INDEX tasks_idempotency_idx ON {schema}.tasks (queue, idempotency_key)
                WHERE idempotency_key IS NOT NULL AND status IN ('enqueued', 'processing')
            """,
            # Fencing tokens: one new value per claim, increasing, never reused.
            "CREATE SEQUENCE {schema}.lease_tokens AS bigint",
            """
            CREATE TABLE {schema}.recovery_events (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                task_id bigint NOT NULL,
                queue text NOT NULL,
                action text NOT NULL CHECK (action IN ('requeued', 'dead')),
                attempt integer NOT NULL,
                worker_id text,
                lease_expires_at timestamptz NOT NULL,
                recovered_at timestamptz NOT NULL DEFAULT clock_timestamp()
            )
            """,
            """
            CREATE TABLE {schema}.attempts (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                key text NOT NULL,
                attempt integer NOT NULL,
                task_id bigint,
                worker_id text,
                outcome text NOT NULL
                    CHECK (outcome IN ('running', 'succeeded', 'failed', 'skipped', 'abandoned')),
                error text,
                result jsonb,
                started_at timestamptz NOT NULL DEFAULT clock_timestamp(),
                finished_at timestamptz
            )
            """,
            "CREATE INDEX attempts_key_idx ON {schema}.attempts (key)",
            # At most one success per key: two attempts of a key may run at once.
            """
            CREATE UNIQUE INDEX attempts_success_idx ON {schema}.attempts (key)
                WHERE outcome = 'succeeded'
            """,
        ),
    ),
    Migration(
        2,
        "autovacuum tuned for a high-churn queue table",
        (
            # Every claim and ack leaves a dead tuple; vacuum after 2% of the table changed
            # instead of the default 20%, so a busy queue stays small and its indexes lean.
            """
            ALTER TABLE {schema}.tasks SET (
                autovacuum_vacuum_scale_factor = 0.02,
                autovacuum_analyze_scale_factor = 0.05,
                autovacuum_vacuum_insert_scale_factor = 0.05
            )
            """,
        ),
    ),
    Migration(
        3,
        "dead tasks indexed, so live counts never read finished rows",
        (
            # Small (dead tasks are few) and written only when a task dies or is retried.
            """
            CREATE INDEX tasks_dead_idx ON {schema}.tasks (queue)
                WHERE status = 'dead'
            """,
        ),
    ),
    Migration(
        4,
        "an attempt's success mark and fenced ack as one function",
        (
            # Called in the same round trip as the attempt's COMMIT (see CONCLUDE_ATTEMPT):
            # raising when the fence fails is what keeps that COMMIT from running. Its
            # statements are the attempt's success mark (its own row, by id) and the fenced
            # ACK, as they stood at this version.
            """
            CREATE FUNCTION {schema}.conclude_attempt(
                p_attempt_id bigint, p_task_id bigint, p_token bigint, p_result jsonb
            ) RETURNS void LANGUAGE plpgsql AS $$
            BEGIN
                IF p_attempt_id IS NOT NULL THEN
                    UPDATE {schema}.attempts
                    SET outcome = 'succeeded', result = p_result,
                        finished_at = clock_timestamp()
                    WHERE id = p_attempt_id;
                END IF;
                IF p_task_id IS NOT NULL THEN
                    UPDATE {schema}.tasks
                    SET status = 'done', result = p_result, lease_expires_at = NULL,
                        finished_at = clock_timestamp(), updated_at = clock_timestamp()
                    WHERE id = p_task_id AND lease_token = p_token
                        AND status = 'processing';
                    IF NOT FOUND THEN
                        RAISE EXCEPTION 'the lease on task % under token % is gone',
                            p_task_id, p_token
                            USING ERRCODE = 'LQ001';
                    END IF;
                END IF;
            END
            $$
            """,
        ),
    ),
    Migration(
        5,
        "attempts identified by queue and idempotency key, or by the task itself",
        (
            # queue NULL: a key the caller chose; key NULL: a task without idempotency key.
            """
            ALTER TABLE {schema}.attempts
                ADD COLUMN queue text,
                ADD COLUMN identity text,
                ALTER COLUMN key DROP NOT NULL
            """,
            # Until now a leased attempt's key was the task's idempotency key, else
            # "<queue>:<task id>", in one space with the keys callers chose. Records that
            # name their task and carry its default key move to that task's space; the
            # rest (a key chosen by the caller, or a task since purged) keep their key.
            """
            UPDATE {schema}.attempts AS a
            SET queue = t.queue,
                key = CASE WHEN a.key = t.idempotency_key THEN a.key END
            FROM {schema}.tasks AS t
            WHERE a.task_id = t.id
              AND (a.key = t.idempotency_key
                   OR (t.idempotency_key IS NULL AND a.key = t.queue || ':' || t.id))
            """,
            "UPDATE {schema}.attempts SET identity = " + _ATTEMPT_IDENTITY,
            "ALTER TABLE {schema}.attempts ALTER COLUMN identity SET NOT NULL",
            "DROP INDEX {schema}.attempts_success_idx",
            "DROP INDEX {schema}.attempts_key_idx",
            "CREATE INDEX attempts_identity_idx ON {schema}.attempts (identity)",
            """
            CREATE UNIQUE INDEX attempts_success_idx ON {schema}.attempts (identity)
                WHERE outcome = 'succeeded'
            """,
        ),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version

# -- schema management -------------------------------------------------------------------

VERSION_TABLE_EXISTS = "SELECT to_regclass(%(qualified)s) IS NOT NULL"
CURRENT_VERSION = "SELECT coalesce(max(version), 0) FROM {schema}.schema_version"
# Taken inside a transaction, released at its end; the namespace says what it guards.
ADVISORY_XACT_LOCK = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(schema)s))"

CREATE_SCHEMA = "CREATE SCHEMA IF NOT EXISTS {schema}"
CREATE_VERSION_TABLE = """
    CREATE TABLE IF NOT EXISTS {schema}.schema_version (
        version integer PRIMARY KEY,
        description text NOT NULL,
        applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
"""
RECORD_VERSION = """
    INSERT INTO {schema}.schema_version (version, description)
    VALUES (%(version)s, %(description)s)
"""

# What a worker role needs, and no more: no DELETE, no TRUNCATE, no DDL. Producers,
# workers, sweepers and the Dagster resource (with install_schema=False) all run with it.
WORKER_GRANTS = (
    "GRANT USAGE ON SCHEMA {schema} TO {role}",
    "GRANT SELECT ON {schema}.schema_version TO {role}",
    "GRANT SELECT, INSERT, UPDATE ON {schema}.tasks, {schema}.attempts,"
    " {schema}.recovery_events TO {role}",
    "GRANT USAGE ON ALL SEQUENCES IN SCHEMA {schema} TO {role}",
    "GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA {schema} TO {role}",
)

# -- producing ----------------------------------------------------------------------------

# run_at: an explicit time, else now plus the delay (0 when none), on the database clock.
_RUN_AT = (
    "coalesce(%(run_at)s::timestamptz, "
    "clock_timestamp() + make_interval(secs => coalesce(%(delay)s, 0)))"
)

# Enqueues end with one NOTIFY on the schema's channel, a hint that wakes waiting workers.
# The CTE that sends it is volatile, so PostgreSQL runs it once, not once per row. Waiting
# workers also poll, so a hint lost with a connection costs latency, never a task.
_NOTIFY = """
    ), notified AS (
        SELECT CASE WHEN %(notify)s THEN pg_notify(%(channel)s, %(queue)s)::text END
        WHERE EXISTS (SELECT 1 FROM inserted)
    )
    SELECT inserted.id FROM inserted CROSS JOIN notified
"""

ENQUEUE = (
    """
    WITH inserted AS (
    INSERT INTO {schema}.tasks
        (queue, priority, payload, idempotency_key, max_attempts, lease_seconds, run_at)
    VALUES (%(queue)s, %(priority)s, %(payload)s::jsonb, %(idempotency_key)s,
            %(max_attempts)s, %(lease_seconds)s, """
    + _RUN_AT
    + """)
    ON CONFLICT (queue, idempotency_key)
        WHERE idempotency_key IS NOT NULL AND status IN ('enqueued', 'processing')
        DO NOTHING
    RETURNING id
"""
    + _NOTIFY
)

FIND_UNFINISHED_BY_KEY = """
    SELECT id FROM {schema}.tasks
    WHERE queue = %(queue)s AND idempotency_key = %(idempotency_key)s
      AND status IN ('enqueued', 'processing')
"""

# One statement for any number of tasks; identity values are drawn in ordinality order.
ENQUEUE_MANY = (
    """
    WITH inserted AS (
        INSERT INTO {schema}.tasks (queue, priority, payload, max_attempts)
        SELECT %(queue)s, %(priority)s, p.payload::jsonb, %(max_attempts)s
        FROM unnest(%(payloads)s::text[]) WITH ORDINALITY AS p(payload, ord)
        ORDER BY p.ord
        RETURNING id
"""
    + _NOTIFY
)

LISTEN = "LISTEN {channel}"

# -- claiming and the lease -------------------------------------------------------------

# The claim: the due rows of a queue, highest priority first, locked so that concurrent
# claimers skip each other, then leased under a new fencing token.
_CLAIM_PICK = """
        SELECT id FROM {schema}.tasks
        WHERE status = 'enqueued' AND queue = %(queue)s AND run_at <= clock_timestamp()
        ORDER BY priority DESC, run_at, id
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED
"""
_CLAIM_SET = """
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = nextval({lease_tokens}::regclass),
        lease_expires_at = clock_timestamp()
            + make_interval(
                secs => coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)),
        worker_id = %(worker_id)s,
        updated_at = clock_timestamp()
"""
# What a Lease needs, in the order queue.claim_many reads it.
_CLAIM_RETURNING = """
    RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
              t.lease_expires_at, t.idempotency_key,
              coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)
"""

# One task: the scalar subquery runs once, as an InitPlan, so it locks one row; the plan
# is cheaper than a join with a CTE.
CLAIM_ONE = (
    "UPDATE {schema}.tasks AS t"
    + _CLAIM_SET
    + "WHERE t.id = ("
    + _CLAIM_PICK
    + ")"
    + _CLAIM_RETURNING
)

# Many tasks: the rows are locked in a CTE with LIMIT, because "id IN (SELECT ... LIMIT n
# FOR UPDATE SKIP LOCKED)" may be re-evaluated by the planner and claim more than n rows.
# In both, the limit is written into the statement (see compose_claim), not passed as a
# parameter: with a parameter the planner cannot see it, so a prepared claim is planned
# again on every call, and the generic plan it would settle on scans the whole table.
# run_at comes last: only the order of many rows needs it (RETURNING keeps none).
CLAIM_MANY = (
    "WITH picked AS ("
    + _CLAIM_PICK
    + ") UPDATE {schema}.tasks AS t"
    + _CLAIM_SET
    + "FROM picked WHERE t.id = picked.id"
    + _CLAIM_RETURNING
    + ", t.run_at"
)

# Fencing: every lease operation matches the token of this claim and the status it left.
# ack and fail keep the token on the row (the sweeper and cancel clear it), so a holder
# whose statement changed nothing can tell its own earlier conclusion from a lost lease.
_FENCE = "id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'"

# No RETURNING: the row count tells whether the fence matched.
ACK = (
    """
    UPDATE {schema}.tasks
    SET status = 'done', result = %(result)s::jsonb, lease_expires_at = NULL,
        finished_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE """
    + _FENCE
)

FAIL = (
    """
    UPDATE {schema}.tasks
    SET status = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'enqueued' END,
        run_at = clock_timestamp() + make_interval(secs => %(retry_in)s),
        last_error = %(error)s, lease_expires_at = NULL,
        finished_at = CASE WHEN attempts >= max_attempts THEN clock_timestamp() END,
        updated_at = clock_timestamp()
    WHERE """
    + _FENCE
    + """
    RETURNING status, run_at
"""
)

# The holder gives the task back untouched (a worker stopping, or a task snoozed): due
# again after the delay, and this claim is not counted against max_attempts, so the next
# claim has the same attempt number.
RELEASE = (
    """
    UPDATE {schema}.tasks
    SET status = 'enqueued', attempts = attempts - 1,
        run_at = clock_timestamp() + make_interval(secs => %(delay)s),
        lease_expires_at = NULL, updated_at = clock_timestamp()
    WHERE """
    + _FENCE
)

RENEW = (
    """
    UPDATE {schema}.tasks
    SET lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_seconds)s)
    WHERE """
    + _FENCE
    + """
    RETURNING lease_expires_at
"""
)

# Many acks in one statement, each still fenced by its own token.
ACK_MANY = """
    UPDATE {schema}.tasks AS t
    SET status = 'done', result = a.result::jsonb, lease_expires_at = NULL,
        finished_at = clock_timestamp(), updated_at = clock_timestamp()
    FROM unnest(%(task_ids)s::bigint[], %(tokens)s::bigint[], %(results)s::text[])
        AS a(task_id, token, result)
    WHERE t.id = a.task_id AND t.lease_token = a.token AND t.status = 'processing'
    RETURNING t.id
"""

# Why a fenced statement changed nothing, for the LeaseLost message.
LEASE_STATE = "SELECT status, lease_token FROM {schema}.tasks WHERE id = %(task_id)s"

# -- the sweeper -------------------------------------------------------------------------


SWEEP_BATCH = """
    WITH expired AS (
        SELECT id, lease_expires_at FROM {schema}.tasks
        WHERE status = 'processing' AND lease_expires_at < clock_timestamp()
        ORDER BY lease_expires_at
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    ), recovered AS (
        UPDATE {schema}.tasks AS t
        SET status = CASE WHEN t.attempts >= t.max_attempts THEN 'dead' ELSE 'enqueued' END,
            run_at = clock_timestamp(),
            lease_token = NULL,
            lease_expires_at = NULL,
            last_error = 'lease expired at ' || expired.lease_expires_at
                || ' (held by ' || coalesce(t.worker_id, 'unknown worker') || ')',
            finished_at = CASE WHEN t.attempts >= t.max_attempts THEN clock_timestamp() END,
            updated_at = clock_timestamp()
        FROM expired
        WHERE t.id = expired.id
        RETURNING t.id, t.queue, t.attempts, t.worker_id, expired.lease_expires_at,
                  CASE WHEN t.status = 'dead' THEN 'dead' ELSE 'requeued' END AS action
    )
    INSERT INTO {schema}.recovery_events
        (task_id, queue, action, attempt, worker_id, lease_expires_at)
    SELECT id, queue, action, attempts, worker_id, lease_expires_at
    FROM recovered ORDER BY lease_expires_at, id
    RETURNING task_id, queue, attempt, worker_id, lease_expires_at, action, id, recovered_at
"""

RECOVERY_EVENTS_AFTER = """
    SELECT id, task_id, queue, action, attempt, worker_id, lease_expires_at, recovered_at
    FROM {schema}.recovery_events
    WHERE id > %(after_id)s
    ORDER BY id
    LIMIT %(limit)s
"""

# -- inspecting and steering -------------------------------------------------------------

# The database's clock, which every lease time is read against.
DATABASE_NOW = "SELECT clock_timestamp()"

_TASK_COLUMNS = """
    id, queue, status, priority, attempts, max_attempts, payload, result, last_error,
    idempotency_key, run_at, lease_expires_at, worker_id, created_at, updated_at, finished_at
"""

GET_TASK = "SELECT" + _TASK_COLUMNS + "FROM {schema}.tasks WHERE id = %(task_id)s"

LIST_TASKS = (
    "SELECT"
    + _TASK_COLUMNS
    + """FROM {schema}.tasks
    WHERE id > %(after_id)s
      AND (%(status)s::text IS NULL OR status = %(status)s)
      AND (%(queue)s::text IS NULL OR queue = %(queue)s)
    ORDER BY id
    LIMIT %(limit)s
"""
)

# A due task is enqueued and its run_at has come: the count of them, and how long the
# oldest has waited.
_DUE_AND_OLDEST = """
           count(*) FILTER (WHERE status = 'enqueued' AND run_at <= clock_timestamp()),
           extract(epoch FROM clock_timestamp()
                   - min(run_at) FILTER (WHERE status = 'enqueued'
                                           AND run_at <= clock_timestamp()))
"""

STATS = (
    "SELECT queue, status, count(*),"
    + _DUE_AND_OLDEST
    + """
    FROM {schema}.tasks
    WHERE %(queue)s::text IS NULL OR queue = %(queue)s
    GROUP BY queue, status
"""
)

# The same numbers for the statuses a partial index covers (enqueued, processing, dead):
# what sensors and checks read on every tick, at a cost that grows with the live tasks,
# not with the finished ones.
_LIVE_QUEUE_FILTER = "(%(queue)s::text IS NULL OR queue = %(queue)s)"


def _count_per_queue(status: str) -> str:
    return (
        f"SELECT queue, '{status}', count(*), 0, NULL FROM {{schema}}.tasks"
        f" WHERE status = '{status}' AND {_LIVE_QUEUE_FILTER} GROUP BY queue"
    )


LIVE_STATS = (
    "SELECT queue, 'enqueued', count(*),"
    + _DUE_AND_OLDEST
    + "FROM {schema}.tasks WHERE status = 'enqueued' AND "
    + _LIVE_QUEUE_FILTER
    + " GROUP BY queue UNION ALL "
    + _count_per_queue("processing")
    + " UNION ALL "
    + _count_per_queue("dead")
)

QUEUE_NAMES = "SELECT DISTINCT queue FROM {schema}.tasks ORDER BY queue"

# Finished tasks older than a cut-off, a batch at a time (ids, so the batch is bounded).
# The ids come from the statement's snapshot; a row that changed meanwhile (a dead task put
# back by retry_dead, then claimed) is read again after its lock is waited for, so the
# condition is checked again on the row as it is when deleted. It returns how many rows
# were picked and how many deleted: a batch that picked fewer than its limit was the last.
_PURGEABLE = """
        status = ANY(%(statuses)s::text[])
        AND finished_at < clock_timestamp() - make_interval(secs => %(older_than)s)
        AND (%(queue)s::text IS NULL OR queue = %(queue)s)
"""
PURGE_BATCH = (
    """
    WITH picked AS (
        SELECT id FROM {schema}.tasks WHERE"""
    + _PURGEABLE
    + """
        LIMIT %(limit)s
    ), deleted AS (
        DELETE FROM {schema}.tasks
        WHERE id = ANY(ARRAY(SELECT id FROM picked)) AND"""
    + _PURGEABLE
    + """
        RETURNING 1
    )
    SELECT (SELECT count(*) FROM picked), (SELECT count(*) FROM deleted)
"""
)

CANCEL = """
    UPDATE {schema}.tasks
    SET status = 'cancelled', lease_token = NULL, lease_expires_at = NULL,
        finished_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE id = %(task_id)s AND status IN ('enqueued', 'processing')
    RETURNING id
"""

TASK_EXISTS = "SELECT 1 FROM {schema}.tasks WHERE id = %(task_id)s"

# A dead task whose idempotency key an unfinished task has taken meanwhile stays dead (the
# key is unique among unfinished tasks); of several dead tasks sharing a key, the newest.
# A task without a key is a group of its own (its id in the third column, never mixed
# with a key that happens to read like an id).
_DEAD_IN_SCOPE = """
        d.status = 'dead'
          AND (%(task_ids)s::bigint[] IS NULL OR d.id = ANY(%(task_ids)s::bigint[]))
          AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
"""
_KEY_TAKEN = """EXISTS (
                SELECT 1 FROM {schema}.tasks AS u
                WHERE u.queue = d.queue AND u.idempotency_key = d.idempotency_key
                  AND u.status IN ('enqueued', 'processing'))"""
RETRY_DEAD = (
    """
    WITH candidates AS (
        SELECT DISTINCT ON (d.queue, d.idempotency_key,
                            CASE WHEN d.idempotency_key IS NULL THEN d.id END) d.id
        FROM {schema}.tasks AS d
        WHERE"""
    + _DEAD_IN_SCOPE
    + "AND (d.idempotency_key IS NULL OR NOT "
    + _KEY_TAKEN
    + """)
        ORDER BY d.queue, d.idempotency_key,
                 CASE WHEN d.idempotency_key IS NULL THEN d.id END, d.id DESC
    )
    UPDATE {schema}.tasks AS t
    SET status = 'enqueued', attempts = 0, run_at = clock_timestamp(), finished_at = NULL,
        updated_at = clock_timestamp()
    FROM candidates
    WHERE t.id = candidates.id AND t.status = 'dead'
    RETURNING t.id
"""
)

# The dead tasks in a retry's scope that stay dead because their key is taken.
DEAD_WITH_KEY_TAKEN = (
    "SELECT d.id, d.idempotency_key FROM {schema}.tasks AS d WHERE"
    + _DEAD_IN_SCOPE
    + "AND d.idempotency_key IS NOT NULL AND "
    + _KEY_TAKEN
    + " ORDER BY d.id"
)

# -- attempts (the idempotency table) ------------------------------------------------------

# Rows of the key still 'running' belong to an attempt that died, or to one still under
# way elsewhere (a zombie and its replacement, say): both are marked abandoned; one that is
# in fact alive sets its own outcome when it ends. Then the key's success, if any, and a
# new row recording this attempt.
#
# Its commit does not wait for the disk (synchronous_commit off, for this transaction
# only): a crash of the server may lose this start record and the abandoned marks, which
# only lose a record of attempts that are over, since the crash ended them too. Every
# commit that matters (the success, the ack) is synchronous and, being later in the WAL,
# makes this record durable with it.
BEGIN_ATTEMPT = """
    WITH abandoned AS (
        UPDATE {schema}.attempts SET outcome = 'abandoned', finished_at = clock_timestamp()
        WHERE identity = %(identity)s AND outcome = 'running'
        RETURNING id
    ), previous AS (
        SELECT count(*) AS n,
               bool_or(outcome = 'succeeded') AS succeeded,
               (array_agg(result) FILTER (WHERE outcome = 'succeeded'))[1] AS result
        FROM {schema}.attempts WHERE identity = %(identity)s
    )
    INSERT INTO {schema}.attempts
        (identity, queue, key, attempt, task_id, worker_id, outcome, finished_at)
    SELECT %(identity)s, %(queue)s, %(key)s, previous.n + 1, %(task_id)s, %(worker_id)s,
           CASE WHEN previous.succeeded THEN 'skipped' ELSE 'running' END,
           CASE WHEN previous.succeeded THEN clock_timestamp() END
    FROM previous
    RETURNING id, attempt, outcome = 'skipped',
              (SELECT result FROM previous), (SELECT count(*) FROM abandoned),
              set_config('synchronous_commit', 'off', true)
"""

# Sent with the BEGIN of an attempt's transaction (see QueueConnection): the session ends
# if left idle inside that transaction this long. SET LOCAL, so it ends with the
# transaction and never stays on a connection that PgBouncer hands to another client.
ATTEMPT_SETTINGS = "SET LOCAL idle_in_transaction_session_timeout = {milliseconds}"

# The longest idle timeout PostgreSQL accepts, in milliseconds (a 32-bit integer).
MAX_TIMEOUT_MILLISECONDS = 2**31 - 1

# Only an unfinished attempt (or one another attempt took for dead while it still ran)
# gets an outcome: a committed success is never overwritten.
FINISH_ATTEMPT = """
    UPDATE {schema}.attempts
    SET outcome = %(outcome)s, error = %(error)s, result = %(result)s::jsonb,
        finished_at = clock_timestamp()
    WHERE id = %(attempt_id)s AND outcome IN ('running', 'abandoned')
"""

SUCCESS_FOR_IDENTITY = """
    SELECT result FROM {schema}.attempts
    WHERE identity = %(identity)s AND outcome = 'succeeded'
"""

ATTEMPTS_FOR_IDENTITY = """
    SELECT id, key, attempt, task_id, worker_id, outcome, error, result, started_at,
           finished_at, queue
    FROM {schema}.attempts WHERE identity = %(identity)s ORDER BY id
"""

# The identity of a task's work: its queue and idempotency key, else the task itself.
TASK_ATTEMPT_KEY = "SELECT queue, idempotency_key FROM {schema}.tasks WHERE id = %(task_id)s"


# -- lent connections ---------------------------------------------------------------------

# What a borrower may have done to a lent connection is undone before it is used again:
# settings (a search path, a timeout), the role (which RESET ALL leaves alone), session
# advisory locks and LISTENs, cursors WITH HOLD, temporary tables, and the statements it
# PREPAREd. psycopg's own prepared statements (prepared by protocol, so not from_sql) are
# kept: DEALLOCATE ALL would drop them and make psycopg forget them all. DISCARD ALL is
# not used: it cannot run in a query of several statements, which is a transaction block.
# It all runs in the round trip that ends an attempt or a loan, inside or after its
# transaction, and leaves nothing in the session (behind PgBouncer included). No % nor
# braces: the text goes through the client's parameter binding and sql.SQL.
RESET_SESSION = (
    "RESET ALL; RESET ROLE; RESET SESSION AUTHORIZATION; UNLISTEN *;"
    " SELECT pg_advisory_unlock_all(); CLOSE ALL; DISCARD TEMP;"
    " DO $$DECLARE statement text; BEGIN"
    " FOR statement IN SELECT p.name FROM pg_catalog.pg_prepared_statements p WHERE p.from_sql"
    " LOOP EXECUTE 'DEALLOCATE ' || pg_catalog.quote_ident(statement); END LOOP; END$$"
)

# How an attempt ends when its work is done: the success mark (attempt_id; NULL for a
# duplicate), the lease's fenced ack (task_id and token; NULL without a lease), the commit
# and the session's reset, in one round trip (one simple query, its values bound by the
# client). When the fence fails the function raises LEASE_GONE, so the COMMIT never runs.
_CONCLUDE = "SELECT {schema}.conclude_attempt(%(attempt_id)s, %(task_id)s, %(token)s, %(result)s); "
CONCLUDE_ATTEMPT = _CONCLUDE + "COMMIT; " + RESET_SESSION
# When the work ran no statement there is no transaction to commit: the simple query is
# one implicit transaction, committed when it ends, and no BEGIN is needed before it.
CONCLUDE_EMPTY_ATTEMPT = _CONCLUDE + RESET_SESSION
LEASE_GONE = "LQ001"
# The unique index that allows one success per key.
SUCCESS_INDEX = "attempts_success_idx"

# A statement that does nothing: on a connection out of autocommit, psycopg sends the
# transaction's BEGIN before it.
NO_OP = "SELECT 1"


def listen_statement(schema: str) -> str:
    """LISTEN on the schema's notification channel."""
    return sql.SQL(LISTEN).format(channel=sql.Identifier(notify_channel(schema))).as_string(None)


def notify_channel(schema: str) -> str:
    """The channel enqueues notify on; PostgreSQL truncates channel names to 63 bytes."""
    return f"lq_{schema}"[:63]


@lru_cache(maxsize=256)
def compose_claim(schema: str, limit: int) -> str:
    """The claim statement for ``schema`` with ``limit`` written in as a literal."""
    return _render(CLAIM_ONE if limit == 1 else CLAIM_MANY, schema, limit=sql.Literal(limit))


def compose_grant(template: str, schema: str, role: str) -> str:
    """Render a grant template for ``schema`` and ``role``, both quoted as identifiers."""
    return (
        sql.SQL(template)
        .format(schema=sql.Identifier(schema), role=sql.Identifier(role))
        .as_string(None)
    )


@lru_cache(maxsize=1024)
def compose(template: str, schema: str) -> str:
    """Render a template for ``schema``, quoting the schema name as an identifier."""
    return _render(template, schema)


def _render(template: str, schema: str, **extra: sql.Composable) -> str:
    return (
        sql.SQL(template)
        .format(
            schema=sql.Identifier(schema),
            lease_tokens=sql.Literal(sql.Identifier(schema, "lease_tokens").as_string(None)),
            **extra,
        )
        .as_string(None)
    )
