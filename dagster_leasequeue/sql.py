"""Every SQL statement dagster-leasequeue runs, in one reviewable place.

Statements are templates over ``{schema}``, composed with :class:`psycopg.sql.Identifier`
so a schema name is always quoted. Times always come from ``clock_timestamp()``: the
database's clock at the moment of the statement, never the client's and never the start
of a transaction (``now()``), so a claim made late in a long transaction still gets its
full lease.

The schema's migrations live apart, in :mod:`dagster_leasequeue.migrations`.
"""

from __future__ import annotations

import re
from functools import lru_cache

from psycopg import sql

from .migrations import (
    BATCH_NOTIFY_TAIL,
    BATCH_STRIPES,
    BULK_MARKER,
    KEYS_MARKER,
    TASK_WORK_IDENTITY,
)

# First keys of the two-key advisory locks this package takes, one per purpose, so that no
# name a user picks can make two purposes collide.
INSTALL_LOCK = 0x6C7101
SWEEP_LOCK = 0x6C7102


# -- schema management -------------------------------------------------------------------

VERSION_TABLE_EXISTS = "SELECT to_regclass(%(qualified)s) IS NOT NULL"
CURRENT_VERSION = "SELECT coalesce(max(version), 0) FROM {schema}.schema_version"
# Taken inside a transaction, released at its end; the namespace says what it guards.
ADVISORY_XACT_LOCK = "SELECT pg_advisory_xact_lock(%(namespace)s, hashtext(%(schema)s))"
# The same, held by the session: around statements that cannot run in a transaction.
ADVISORY_LOCK = "SELECT pg_advisory_lock(%(namespace)s, hashtext(%(schema)s))"
ADVISORY_UNLOCK = "SELECT pg_advisory_unlock(%(namespace)s, hashtext(%(schema)s))"
# An index left invalid by a CREATE INDEX CONCURRENTLY that was interrupted.
INVALID_INDEX = """
    SELECT 1 FROM pg_index AS i
    JOIN pg_class AS c ON c.oid = i.indexrelid
    JOIN pg_namespace AS n ON n.oid = c.relnamespace
    WHERE n.nspname = %(schema)s AND c.relname = %(index)s AND NOT i.indisvalid
"""
DROP_INDEX_CONCURRENTLY = "DROP INDEX CONCURRENTLY IF EXISTS {schema}.{index}"

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
    " {schema}.recovery_events, {schema}.batches, {schema}.batch_counts,"
    " {schema}.queue_flow, {schema}.flow_keys TO {role}",
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
        (queue, priority, payload, idempotency_key, max_attempts, lease_seconds,
         concurrency_key, run_at)
    VALUES (%(queue)s, %(priority)s, %(payload)s::jsonb, %(idempotency_key)s,
            %(max_attempts)s, %(lease_seconds)s, %(concurrency_key)s, """
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
        INSERT INTO {schema}.tasks (queue, priority, payload, max_attempts, concurrency_key)
        SELECT %(queue)s, %(priority)s, p.payload::jsonb, %(max_attempts)s, p.key
        FROM unnest(%(payloads)s::text[], %(keys)s::text[]) WITH ORDINALITY AS p(payload, key, ord)
        ORDER BY p.ord
        RETURNING id
"""
    + _NOTIFY
)

LISTEN = "LISTEN {channel}"

# -- flow control --------------------------------------------------------------------------

# See migrations.py (migration 9). A queue is controlled while its queue_flow row controls
# anything; the plain claims read this once, by primary key, and claim only when it is not.
_CONTROLLED = """EXISTS (
            SELECT 1 FROM {schema}.queue_flow AS f
            WHERE f.queue = %(queue)s
              AND (f.paused OR f.max_running IS NOT NULL OR f.per_second IS NOT NULL
                   OR f.key_limits))"""

# The running tasks of concurrency keys changed by a statement over many tasks (its CTE
# ``{changed}`` returns their queue and concurrency_key), counted once per key, with the
# marker that keeps the trigger from counting them again. The keys' rows are written in
# key order, as claim_flow writes them: two statements sharing keys, each holding one row
# while waiting for the other's, would deadlock. ``{tasks}`` is what each key's count
# changes by, an aggregate over the key's changed tasks (the insert, for a key not seen
# before, only on a claim).
_COUNT_KEYS_IN_BULK = (
    """
    , keys_touched AS ( """
    + KEYS_MARKER
    + """
        SELECT c.queue, c.concurrency_key AS key, {tasks}::integer AS tasks
        FROM {changed} AS c WHERE c.concurrency_key IS NOT NULL
        GROUP BY c.queue, c.concurrency_key
    ), keys_counted AS (
        INSERT INTO {{schema}}.flow_keys AS k (queue, key, running)
        SELECT n.queue, n.key, n.tasks FROM keys_touched AS n ORDER BY n.queue, n.key
        ON CONFLICT (queue, key) DO UPDATE SET running = k.running + EXCLUDED.running
        RETURNING k.queue, k.key, k.running, k.max_running
    )"""
)

# With _COUNT_KEYS_IN_BULK on finishes: the hint that wakes a queue's waiting claimers,
# for each key that was at its limit. One row, always, for the final SELECT to join.
_NOTIFY_KEYS_FREED = """
    , keys_freed AS (
        SELECT count(pg_notify(%(channel)s, c.queue)) AS notified
        FROM keys_counted AS c JOIN keys_touched AS n ON n.queue = c.queue AND n.key = c.key
        WHERE n.tasks < 0 AND c.running - n.tasks >= coalesce(
            c.max_running,
            (SELECT f.max_running FROM {schema}.queue_flow AS f WHERE f.queue = c.queue))
    )"""

# A controlled queue's claim. The plain claims refuse a controlled queue (they pick nothing
# from it); a claimer that finds nothing asks QUEUE_CONTROLLED, and claims a controlled
# queue through this for a while (queue.py, _CONTROLLED_RECHECK_SECONDS).
CLAIM_FLOW = """
    SELECT * FROM {schema}.claim_flow(
        %(queue)s, {limit}, %(worker_id)s, %(lease_seconds)s, %(default_lease)s)
"""
QUEUE_CONTROLLED = "SELECT " + _CONTROLLED
# CLAIM_ONE as a function (migration 13), for a claim that rides in a script, with the
# claimed task's concurrency key last, as CLAIM_ONE's rows have it (the function's columns
# were fixed before keys), so that its lease knows whether it is keyless. The key is read
# by a subquery on the primary key, which never drops the claimed row: the function claims
# with a snapshot of its own, newer than the statement's, and a task enqueued in between is
# claimed but not seen by the statement. Its key then reads NULL and its lease is taken
# for keyless, which costs at most a claim that waits migrations.CLAIM_LOCK_TIMEOUT for a
# key's row before it is made apart.
CLAIM_ONE_CALL = """
    SELECT c.*, (SELECT t.concurrency_key FROM {schema}.tasks AS t WHERE t.id = c.id)
    FROM {schema}.claim_one(%(queue)s, %(worker_id)s, %(lease_seconds)s, %(default_lease)s) AS c
"""

ENSURE_QUEUE_FLOW = """
    INSERT INTO {schema}.queue_flow (queue) VALUES (%(queue)s) ON CONFLICT (queue) DO NOTHING
"""
SET_PAUSED = """
    UPDATE {schema}.queue_flow SET paused = %(paused)s, changed_at = clock_timestamp()
    WHERE queue = %(queue)s
"""
SET_QUEUE_CONCURRENCY = """
    UPDATE {schema}.queue_flow SET max_running = %(max_running)s, changed_at = clock_timestamp()
    WHERE queue = %(queue)s
"""
# A new or changed bucket starts full.
SET_QUEUE_RATE = """
    UPDATE {schema}.queue_flow
    SET per_second = %(per_second)s, burst = %(burst)s, tokens = %(burst)s,
        refilled_at = clock_timestamp(), changed_at = clock_timestamp()
    WHERE queue = %(queue)s
"""
SET_KEY_CONCURRENCY = """
    INSERT INTO {schema}.flow_keys (queue, key, max_running)
    VALUES (%(queue)s, %(key)s, %(max_running)s)
    ON CONFLICT (queue, key) DO UPDATE SET max_running = EXCLUDED.max_running
"""
SET_KEY_RATE = """
    INSERT INTO {schema}.flow_keys (queue, key, per_second, burst, tokens, refilled_at)
    VALUES (%(queue)s, %(key)s, %(per_second)s, %(burst)s, %(burst)s, clock_timestamp())
    ON CONFLICT (queue, key) DO UPDATE
    SET per_second = EXCLUDED.per_second, burst = EXCLUDED.burst, tokens = EXCLUDED.tokens,
        refilled_at = EXCLUDED.refilled_at
"""
# Whether any key of the queue has a limit of its own: what makes claims of a queue with
# no queue-wide control go through claim_flow.
MARK_KEY_LIMITS = """
    UPDATE {schema}.queue_flow AS f
    SET key_limits = EXISTS (
            SELECT 1 FROM {schema}.flow_keys AS k
            WHERE k.queue = f.queue AND (k.max_running IS NOT NULL OR k.per_second IS NOT NULL)),
        changed_at = clock_timestamp()
    WHERE f.queue = %(queue)s
"""
QUEUE_FLOW = """
    SELECT paused, max_running, per_second, burst FROM {schema}.queue_flow
    WHERE queue = %(queue)s
"""
FLOW_KEYS = """
    SELECT key, running, max_running, per_second, burst FROM {schema}.flow_keys
    WHERE queue = %(queue)s AND (max_running IS NOT NULL OR per_second IS NOT NULL)
    ORDER BY key
"""
# Every queue with a control in force, and the keys with limits of their own.
CONTROLLED_QUEUES = """
    SELECT f.queue, f.paused, f.max_running, f.per_second, f.burst FROM {schema}.queue_flow AS f
    WHERE f.paused OR f.max_running IS NOT NULL OR f.per_second IS NOT NULL OR f.key_limits
    ORDER BY f.queue
"""
ALL_FLOW_KEYS = """
    SELECT queue, key, running, max_running, per_second, burst FROM {schema}.flow_keys
    WHERE max_running IS NOT NULL OR per_second IS NOT NULL
    ORDER BY queue, key
"""

# Keys at their concurrency limit whose oldest due task has waited longer than the bound.
KEYS_AT_LIMIT = """
    SELECT k.key, k.running, coalesce(k.max_running, f.max_running),
           extract(epoch FROM clock_timestamp() - w.oldest)::float8 AS waited
    FROM {schema}.flow_keys AS k
    JOIN {schema}.queue_flow AS f ON f.queue = k.queue
    CROSS JOIN LATERAL (
        SELECT min(t.run_at) AS oldest FROM {schema}.tasks AS t
        WHERE t.queue = k.queue AND t.concurrency_key = k.key AND t.status = 'enqueued'
          AND t.run_at <= clock_timestamp()
    ) AS w
    WHERE k.queue = %(queue)s AND k.running >= coalesce(k.max_running, f.max_running)
      AND w.oldest < clock_timestamp() - make_interval(secs => %(seconds)s)
    ORDER BY waited DESC
    LIMIT %(limit)s
"""


# -- claiming and the lease -------------------------------------------------------------

# The claim: the due rows of a queue, highest priority first, locked so that concurrent
# claimers skip each other, then leased under a new fencing token. The two claims pick,
# set and return the same (tests/unit/test_statements.py holds them to it).
#
# The limit is written into the statement (see compose_claim), not passed as a parameter:
# with a parameter the planner cannot see it, so a prepared claim is planned again on every
# call, and the generic plan it would settle on scans the whole table.
#
# One task: the scalar subquery runs once, as an InitPlan, so it locks one row; the plan
# is cheaper than a join with a CTE. RETURNING gives what a Lease needs, in the order
# queue.claim_many reads it.
CLAIM_ONE = (
    """
    UPDATE {schema}.tasks AS t
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = nextval({lease_tokens}::regclass),
        lease_expires_at = clock_timestamp()
            + make_interval(
                secs => coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)),
        worker_id = %(worker_id)s,
        updated_at = clock_timestamp()
    WHERE t.id = (
        SELECT id FROM {schema}.tasks
        WHERE status = 'enqueued' AND queue = %(queue)s AND run_at <= clock_timestamp()
          AND NOT """
    + _CONTROLLED
    + """
        ORDER BY priority DESC, run_at, id
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED
    )
    RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
              t.lease_expires_at, t.idempotency_key,
              coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s) AS lease_seconds,
              t.run_at, NULL::double precision AS next_token_in, t.concurrency_key
"""
)

# Many tasks: the rows are locked in a CTE with LIMIT, because "id IN (SELECT ... LIMIT n
# FOR UPDATE SKIP LOCKED)" may be re-evaluated by the planner and claim more than n rows.
# run_at comes last: only the order of many rows needs it (UPDATE ... RETURNING has none).
_PICKED = (
    """picked AS (
        SELECT id FROM {schema}.tasks
        WHERE status = 'enqueued' AND queue = %(queue)s AND run_at <= clock_timestamp()
          AND NOT """
    + _CONTROLLED
    + """
        ORDER BY priority DESC, run_at, id
        LIMIT {limit}
        FOR UPDATE SKIP LOCKED
    )"""
)
# ``{ready}`` is a further condition on leasing the picks (the combined statements below
# lease them only once their acks went through).
_LEASED = """, claimed AS (
    UPDATE {schema}.tasks AS t
    SET status = 'processing',
        attempts = t.attempts + 1,
        lease_token = nextval({lease_tokens}::regclass),
        lease_expires_at = clock_timestamp()
            + make_interval(
                secs => coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)),
        worker_id = %(worker_id)s,
        updated_at = clock_timestamp()
    FROM picked WHERE t.id = picked.id{ready}
    RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
              t.lease_expires_at, t.idempotency_key,
              coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s) AS lease_seconds,
              t.run_at, NULL::double precision AS next_token_in, t.queue, t.concurrency_key
    )"""
_CLAIMED_COLUMNS = """id, payload, priority, attempts, max_attempts, lease_token,
           lease_expires_at, idempotency_key, lease_seconds, run_at, next_token_in,
           concurrency_key"""

CLAIM_MANY = (
    """
    WITH """
    + _PICKED
    + _LEASED.replace("{ready}", "")
    + _COUNT_KEYS_IN_BULK.format(changed="claimed", tasks="count(*)")
    + """
    SELECT """
    + _CLAIMED_COLUMNS
    + """
    FROM claimed
"""
)

# Fencing: every lease operation matches the token of this claim and the status it left,
# with the same condition (FENCE; tests/unit/test_statements.py checks each has it whole).
# ack, fail and release keep the token on the row (the sweeper and cancel clear it), so a
# holder whose statement changed nothing can tell its own earlier conclusion from a lost
# lease.
FENCE = "id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'"

# A statement that moves a task into done, dead or cancelled, or out of them, sets
# finished_at: the batch counts' trigger is considered only by statements that do
# (migration 18).
#
# No RETURNING: the row count tells whether the fence matched.
ACK = """
    UPDATE {schema}.tasks
    SET status = 'done', result = %(result)s::jsonb, lease_expires_at = NULL,
        finished_at = clock_timestamp(), updated_at = clock_timestamp()
    WHERE id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'
"""

FAIL = """
    UPDATE {schema}.tasks
    SET status = CASE WHEN attempts >= max_attempts THEN 'dead' ELSE 'enqueued' END,
        run_at = clock_timestamp() + make_interval(secs => %(retry_in)s),
        last_error = %(error)s, lease_expires_at = NULL,
        finished_at = CASE WHEN attempts >= max_attempts THEN clock_timestamp() END,
        updated_at = clock_timestamp()
    WHERE id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'
    RETURNING status, run_at
"""

# The holder gives the task back untouched (a worker stopping, or a task snoozed): due
# again after the delay, and this claim is not counted against max_attempts, so the next
# claim has the same attempt number.
RELEASE = """
    UPDATE {schema}.tasks
    SET status = 'enqueued', attempts = attempts - 1,
        run_at = clock_timestamp() + make_interval(secs => %(delay)s),
        lease_expires_at = NULL, updated_at = clock_timestamp()
    WHERE id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'
"""

RENEW = """
    UPDATE {schema}.tasks
    SET lease_expires_at = clock_timestamp() + make_interval(secs => %(lease_seconds)s)
    WHERE id = %(task_id)s AND lease_token = %(token)s AND status = 'processing'
    RETURNING lease_expires_at
"""

# Many acks in one statement, each still fenced by its own token.
# Batch counting shared by statements that finish many tasks: see migrations.py
# (migrations 6 and 8) for how a batch's finished tasks are counted.

# The counts of a statement that changed many batch tasks (its CTE ``{changed}`` returns
# their batch_id), added to a free stripe once per batch. The marker in its text keeps the
# trigger from counting them again, row by row.
_COUNT_IN_BULK = (
    """
    ), counted AS ( """
    + BULK_MARKER
    + """
        UPDATE {{schema}}.batch_counts AS c
        SET {column} = c.{column} {sign} n.tasks, changed_at = clock_timestamp()
        FROM (SELECT batch_id, count(*) AS tasks FROM {changed}
              WHERE batch_id IS NOT NULL GROUP BY batch_id) AS n
        WHERE c.batch_id = n.batch_id AND c.stripe = (SELECT {{schema}}.batch_stripe())
    )"""
)

# With _COUNT_IN_BULK: a NOTIFY for each batch this statement left with at most
# BATCH_NOTIFY_TAIL tasks to go, as the trigger sends for a single finish. The statement
# does not see its own counted CTE, so its tasks are taken off apart. One row, always, for
# the final SELECT to join (a CTE no one reads is not run).
_NOTIFY_BATCH_ENDS = (
    """
    , batch_ends AS (
        SELECT count(pg_notify(%(channel)s, 'batch:' || b.id)) AS notified
        FROM (SELECT batch_id, count(*) AS tasks FROM {changed}
              WHERE batch_id IS NOT NULL GROUP BY batch_id) AS n
        JOIN {{schema}}.batches AS b ON b.id = n.batch_id
        WHERE b.total - n.tasks - (SELECT sum(done + dead + cancelled)
                                   FROM {{schema}}.batch_counts WHERE batch_id = b.id) <= """
    + str(BATCH_NOTIFY_TAIL)
    + """
    )"""
)

# Batch tasks among them are counted once per batch (see _COUNT_IN_BULK).
_ACKED_MANY = (
    """acked AS (
        UPDATE {schema}.tasks AS t
        SET status = 'done', result = a.result::jsonb, lease_expires_at = NULL,
            finished_at = clock_timestamp(), updated_at = clock_timestamp()
        FROM unnest(%(task_ids)s::bigint[], %(tokens)s::bigint[], %(results)s::text[])
            AS a(task_id, token, result)
        WHERE t.id = a.task_id AND t.lease_token = a.token AND t.status = 'processing'
        RETURNING t.id, t.batch_id, t.queue, t.concurrency_key
"""
    + _COUNT_IN_BULK.format(column="done", sign="+", changed="acked")
    + _NOTIFY_BATCH_ENDS.format(changed="acked")
)

ACK_MANY = (
    """
    WITH """
    + _ACKED_MANY
    + _COUNT_KEYS_IN_BULK.format(changed="acked", tasks="-count(*)")
    + _NOTIFY_KEYS_FREED
    + """
    SELECT acked.id FROM acked CROSS JOIN batch_ends CROSS JOIN keys_freed
"""
)

# -- concluding and claiming in one statement ------------------------------------------------

# A worker that finished a task nearly always wants the next: these ack and claim in one
# statement, one round trip and one commit. The picks are leased only once every ack's
# fence held: a holder that lost a lease is a zombie, and must not take more work (it
# leaves the picks locked until its statement ends, and unchanged). The keys of both (a
# freed slot, a taken one) are counted in one pass, in key order, as the bulk statements
# count them (two of these sharing keys cannot deadlock).
#
# The picks come first (_AFTER_PICKING makes the acks wait for them), on the statement's
# fresh snapshot. Picked after the acks, they would be locked with a snapshot as old as
# the acks took, and every task another claimer leased meanwhile would be passed over
# only after a recheck of its newer row: under four workers, a fifth of the throughput.
#
# Each answers with the acked tasks' ids (the other columns NULL: a claimed task's payload
# never is) and then the claimed tasks, as CLAIM_MANY returns them.
_AFTER_PICKING = "\n          AND (SELECT count(*) FROM picked) >= 0"
_MOVED_KEYS = """
    , moved AS (
        SELECT queue, concurrency_key, -1 AS delta FROM acked
        UNION ALL
        SELECT queue, concurrency_key, 1 FROM claimed
    )"""
# The acked tasks' ids, a NULL in each other column, then the claimed rows.
_ACKED_IDS_THEN_CLAIMED = (
    """
    SELECT acked.id"""
    + ", NULL" * _CLAIMED_COLUMNS.count(",")
    + """
    FROM acked CROSS JOIN {finished}keys_freed
    UNION ALL
    SELECT """
    + _CLAIMED_COLUMNS
    + """
    FROM claimed
"""
)
_ACKED_THEN_CLAIMED = (
    _MOVED_KEYS
    + _COUNT_KEYS_IN_BULK.format(changed="moved", tasks="sum(c.delta)")
    + _NOTIFY_KEYS_FREED
    + _ACKED_IDS_THEN_CLAIMED
)

# One lease: its task's batch is counted by the trigger, as a plain ack's is.
_ACK_THEN_LEASE = (
    """
    WITH """
    + _PICKED
    + """, acked AS ("""
    + ACK.rstrip()
    + _AFTER_PICKING
    + """
        RETURNING id, queue, concurrency_key
    )"""
    + _LEASED.replace("{ready}", "\n        AND EXISTS (SELECT 1 FROM acked)")
)
ACK_AND_CLAIM = _ACK_THEN_LEASE + _ACKED_THEN_CLAIMED.replace("{finished}", "")
# One lease whose task has no concurrency key, claiming one task (the worker loop's own
# statement): the ack frees no key's slot and the claim takes at most one key's, counted
# by its trigger as CLAIM_ONE's is, so there are no keys to order. The ack and the claim
# are then one UPDATE of both rows, each row's new values chosen by whether it is the
# acked one. PostgreSQL sets up each UPDATE of a statement on its own (the table's check,
# its seven indexes and their predicates, the triggers' conditions, read again from their
# stored text): one UPDATE instead of two, and no UNION of their rows, takes 17% off the
# server's instructions per task (callgrind, a drain of 1,300 tasks: 869.5 M to 719.6 M).
#
# The fence cannot hold the claim back here: the acked row's fence is checked as its row
# is reached, beside the claim's. A zombie's statement would claim; so when the acked
# row is not among those moved, lease_gone() (migration 25) raises LEASE_GONE, and the
# claim is undone with the statement. Called only then: a CASE runs no branch it does
# not take. The picked row is never acked: it was enqueued in the statement's snapshot,
# and the fence needs the row processing under the holder's token, which a re-enqueued
# row no longer carries (when a recovery committed before the statement began, the
# picked row may be the holder's own task: nothing is moved, and LeaseLost follows as
# for any fence that failed). finished_at is set on the claimed row to the
# value it has, so the batch trigger (UPDATE OF finished_at) looks at a claimed batch task
# and, finding no finish, counts nothing.
ACK_KEYLESS_AND_CLAIM = (
    """
    WITH """
    + _PICKED
    + """, moved AS (
    UPDATE {schema}.tasks AS t
    SET status = CASE WHEN t.id = %(task_id)s THEN 'done' ELSE 'processing' END,
        result = CASE WHEN t.id = %(task_id)s THEN %(result)s::jsonb ELSE t.result END,
        attempts = CASE WHEN t.id = %(task_id)s THEN t.attempts ELSE t.attempts + 1 END,
        lease_token = CASE WHEN t.id = %(task_id)s THEN t.lease_token
                           ELSE nextval({lease_tokens}::regclass) END,
        lease_expires_at = CASE WHEN t.id = %(task_id)s THEN NULL ELSE clock_timestamp()
            + make_interval(
                secs => coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s)) END,
        worker_id = CASE WHEN t.id = %(task_id)s THEN t.worker_id ELSE %(worker_id)s END,
        finished_at = CASE WHEN t.id = %(task_id)s THEN clock_timestamp()
                           ELSE t.finished_at END,
        updated_at = clock_timestamp()
    WHERE t.id = ANY (ARRAY[%(task_id)s::bigint, (SELECT id FROM picked)])
      AND (t.id <> %(task_id)s OR ("""
    + FENCE
    + """))
    RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
              t.lease_expires_at, t.idempotency_key,
              coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s) AS lease_seconds,
              t.run_at, NULL::double precision AS next_token_in, t.concurrency_key
    )
    SELECT id, CASE WHEN id <> %(task_id)s THEN payload END, """
    + _CLAIMED_COLUMNS.split(", ", 2)[2]
    + """
    FROM moved
    WHERE CASE WHEN EXISTS (SELECT FROM moved WHERE id = %(task_id)s) THEN true
               ELSE {schema}.lease_gone(%(task_id)s, %(token)s) END
"""
)

ACK_MANY_AND_CLAIM = (
    """
    WITH """
    + _PICKED
    + ", "
    + _ACKED_MANY.replace(
        "AND t.status = 'processing'\n", "AND t.status = 'processing'" + _AFTER_PICKING + "\n", 1
    )
    + _LEASED.replace(
        "{ready}",
        "\n        AND (SELECT count(*) FROM acked) = cardinality(%(task_ids)s::bigint[])",
    )
    + _ACKED_THEN_CLAIMED.replace("{finished}", "batch_ends CROSS JOIN ")
)

# Why a fenced statement changed nothing, for the LeaseLost message.
LEASE_STATE = "SELECT status, lease_token FROM {schema}.tasks WHERE id = %(task_id)s"

# The running records of the own work of tasks that will never run again (made dead, or
# cancelled): no next attempt will come to mark them abandoned, so whatever ends the tasks
# does (``{tasks}``: the ended tasks, with their id, queue and idempotency key; ``{which}``:
# a condition on them, with AND). A record another session holds is skipped: a conclusion
# locks its record before its task's row (which the caller holds), so waiting for it could
# deadlock; that conclusion then fails the fence and records its own outcome over the mark.
_MARK_RUNNING_RECORDS_ABANDONED = (
    """
        UPDATE {{schema}}.attempts AS a
        SET outcome = 'abandoned', finished_at = clock_timestamp()
        FROM (SELECT s.id FROM {{schema}}.attempts AS s JOIN {tasks} AS r
                ON s.identity = """
    + TASK_WORK_IDENTITY.format(id="r.id", queue="r.queue", key="r.idempotency_key")
    + """
              WHERE {which}s.outcome = 'running'
              FOR UPDATE OF s SKIP LOCKED) AS running
        WHERE a.id = running.id"""
)

# -- the sweeper -------------------------------------------------------------------------

SWEEP_BATCH = (
    """
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
                  CASE WHEN t.status = 'dead' THEN 'dead' ELSE 'requeued' END AS action,
                  t.concurrency_key, t.idempotency_key
    ), abandoned AS ("""
    # The dead tasks' workers' leases expired: no next attempt comes to a dead task.
    + _MARK_RUNNING_RECORDS_ABANDONED.format(tasks="recovered", which="r.action = 'dead' AND ")
    + """
    )"""
    # Its keys' running tasks counted once per key, in key order, as ack_many counts them:
    # row by row, in expiry order, a sweep holding one key's row and waiting for another's
    # could deadlock with a statement that holds the second and waits for the first.
    + _COUNT_KEYS_IN_BULK.format(changed="recovered", tasks="-count(*)")
    + _NOTIFY_KEYS_FREED
    + """
    INSERT INTO {schema}.recovery_events
        (task_id, queue, action, attempt, worker_id, lease_expires_at)
    SELECT r.id, r.queue, r.action, r.attempts, r.worker_id, r.lease_expires_at
    FROM recovered AS r CROSS JOIN keys_freed
    ORDER BY r.lease_expires_at, r.id
    RETURNING task_id, queue, attempt, worker_id, lease_expires_at, action
"""
)

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
    id AS task_id, queue, status, priority, attempts, max_attempts, payload, result, last_error,
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
# A cancelled task never runs again: the running records of its work are marked abandoned
# (_MARK_RUNNING_RECORDS_ABANDONED), whether its lease was held or it waited, enqueued,
# after one expired; those of the tasks this cancel ended, named by id: a key whose task was
# cancelled before may belong to a live task by now. In a statement after the cancel's, in
# its transaction: a cancel that waited for a task's row while a claim held it
# (conclude_claim_and_begin(), which begins the claimed task's attempt) would not see, in
# its own snapshot, the start record committed with that claim. (In READ COMMITTED; at a
# higher level the cancel that meets the claim fails with a serialization error instead,
# nothing written, and can be made again.)
ABANDON_RECORDS_OF_CANCELLED_TASKS = _MARK_RUNNING_RECORDS_ABANDONED.format(
    tasks="{schema}.tasks",
    which="r.id = ANY (%(task_ids)s::bigint[]) AND r.status = 'cancelled' AND ",
)

TASK_EXISTS = "SELECT 1 FROM {schema}.tasks WHERE id = %(task_id)s"

# -- batches ----------------------------------------------------------------------------

CREATE_BATCH = """
    INSERT INTO {schema}.batches (name, queue) VALUES (%(name)s, %(queue)s)
    ON CONFLICT (name) WHERE name IS NOT NULL DO NOTHING
    RETURNING id, created_at
"""
BATCH_BY_NAME = "SELECT id, queue, total, created_at FROM {schema}.batches WHERE name = %(name)s"
# See bulk.py: tasks written through COPY, with ids drawn beforehand when the caller
# returns them (an identity column takes the values COPY is given).
_COPIED_COLUMNS = "queue, priority, payload, max_attempts, batch_id, concurrency_key) FROM STDIN"
COPY_TASKS = "COPY {schema}.tasks (" + _COPIED_COLUMNS
COPY_TASKS_WITH_IDS = "COPY {schema}.tasks (id, " + _COPIED_COLUMNS
# The ids, drawn in one statement, are one run of numbers unless another session drew some
# meanwhile: then (only then) the list comes back whole.
RESERVE_TASK_IDS = """
    WITH drawn AS (
        -- The sequence looked up once (a scalar subquery, an InitPlan), not for every id:
        -- that took most of the time of a large enqueue_many.
        SELECT nextval((SELECT pg_get_serial_sequence({tasks_table}, 'id')::regclass)) AS id
        FROM generate_series(1, %(count)s)
    )
    SELECT min(id),
           CASE WHEN max(id) - min(id) + 1 <> count(*) THEN (SELECT array_agg(id) FROM drawn) END
    FROM drawn
"""
# With idempotency keys: a key an unfinished task of the queue holds is skipped, as
# enqueue skips it; the batch counts only the tasks it added.
ENQUEUE_BATCH_KEYED = """
    INSERT INTO {schema}.tasks
        (queue, priority, payload, idempotency_key, max_attempts, batch_id, concurrency_key)
    SELECT %(queue)s, %(priority)s, p.payload::jsonb, p.key, %(max_attempts)s, %(batch_id)s,
           p.concurrency_key
    FROM unnest(%(payloads)s::text[], %(keys)s::text[], %(concurrency_keys)s::text[])
        WITH ORDINALITY AS p(payload, key, concurrency_key, ord)
    ORDER BY p.ord
    ON CONFLICT (queue, idempotency_key)
        WHERE idempotency_key IS NOT NULL AND status IN ('enqueued', 'processing')
        DO NOTHING
"""
# The batch's size, its last task, and its BATCH_STRIPES stripes, which keep the last task
# too: the count trigger reads that task's status first (from migration 23), since a
# batch's tasks are claimed in the order they were enqueued and while it is enqueued the
# batch is not finished. Every task of the batch is enqueued in this transaction, so the
# batch index's range of enqueued tasks ends with it.
SEAL_BATCH = (
    """
    WITH last AS (
        SELECT id FROM {schema}.tasks WHERE batch_id = %(batch_id)s AND status = 'enqueued'
        ORDER BY batch_id DESC, status DESC, id DESC LIMIT 1
    ), sealed AS (
        UPDATE {schema}.batches SET total = %(total)s, last_task_id = (SELECT id FROM last)
        WHERE id = %(batch_id)s
    )
    INSERT INTO {schema}.batch_counts (batch_id, stripe, last_task_id)
    SELECT %(batch_id)s, generate_series(0, """
    + str(BATCH_STRIPES - 1)
    + """), (SELECT id FROM last)
"""
)
NOTIFY = "SELECT pg_notify(%(channel)s, %(payload)s)"

# A batch's state from its counters (a row per stripe) and its running tasks (an index range, as
# long as the workers are many): the same cost at 10 tasks or a million.
_BATCH_INFO = """
    SELECT b.id, b.name, b.queue, b.total, b.created_at,
           c.done, c.dead, c.cancelled, c.changed_at,
           {schema}.batch_processing(b.id) AS processing
    FROM {schema}.batches AS b
    CROSS JOIN LATERAL (
        SELECT coalesce(sum(done), 0)::bigint AS done, coalesce(sum(dead), 0)::bigint AS dead,
               coalesce(sum(cancelled), 0)::bigint AS cancelled, max(changed_at) AS changed_at
        FROM {schema}.batch_counts WHERE batch_id = b.id
    ) AS c
"""
BATCH_INFO = _BATCH_INFO + "WHERE b.id = %(batch_id)s"
BATCH_EXISTS = "SELECT 1 FROM {schema}.batches WHERE id = %(batch_id)s"
LIST_BATCHES = (
    _BATCH_INFO
    + "WHERE (%(queue)s::text IS NULL OR b.queue = %(queue)s) ORDER BY b.id DESC LIMIT %(limit)s"
)

# One status at a time, in id order (the index's order): no sort of a million rows.
BATCH_RESULTS = """
    SELECT id, payload, status, result, last_error FROM {schema}.tasks
    WHERE batch_id = %(batch_id)s AND status = %(status)s
    ORDER BY id
"""

# The keys of the tasks it took out of processing are counted once per key, in key order,
# as ack_many counts them: row by row, a cancel could deadlock with an ack of the same keys.
# Each row's status before the cancel comes from the rows it locks first (RETURNING gives
# only the new one).
CANCEL_BATCH = (
    """
    WITH unfinished AS (
        SELECT id, status FROM {schema}.tasks
        WHERE batch_id = %(batch_id)s AND status IN ('enqueued', 'processing')
        FOR UPDATE
    ), cancelled AS (
        UPDATE {schema}.tasks AS t
        SET status = 'cancelled', lease_token = NULL, lease_expires_at = NULL,
            finished_at = clock_timestamp(), updated_at = clock_timestamp()
        FROM unfinished AS u
        WHERE t.id = u.id
        RETURNING t.id, t.batch_id, t.queue, t.concurrency_key, u.status AS was
"""
    + _COUNT_IN_BULK.format(column="cancelled", sign="+", changed="cancelled")
    + """, was_running AS (SELECT * FROM cancelled WHERE was = 'processing')"""
    + _COUNT_KEYS_IN_BULK.format(changed="was_running", tasks="-count(*)")
    + _NOTIFY_KEYS_FREED
    + """
    SELECT coalesce(array_agg(cancelled.id), '{{}}') FROM cancelled CROSS JOIN keys_freed
"""
)

# A dead task whose idempotency key an unfinished task has taken meanwhile stays dead (the
# key is unique among unfinished tasks); of several dead tasks sharing a key, the newest.
# A task without a key is a group of its own (its id in the third column, never mixed
# with a key that happens to read like an id).
_DEAD_IN_SCOPE = """
        d.status = 'dead'
          AND (%(task_ids)s::bigint[] IS NULL OR d.id = ANY(%(task_ids)s::bigint[]))
          AND (%(queue)s::text IS NULL OR d.queue = %(queue)s)
          AND (%(batch_id)s::bigint IS NULL OR d.batch_id = %(batch_id)s)
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
    ), retried AS (
    UPDATE {schema}.tasks AS t
    SET status = 'enqueued', attempts = 0, run_at = clock_timestamp(), finished_at = NULL,
        updated_at = clock_timestamp()
    FROM candidates
    WHERE t.id = candidates.id AND t.status = 'dead'
    RETURNING t.id, t.batch_id
"""
    + _COUNT_IN_BULK.format(column="dead", sign="-", changed="retried")
    + """
    SELECT id FROM retried
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
# new row recording this attempt: begin_attempt() (migrations 26 and 30), which the commit
# that claims a task also runs for it when an attempt's conclusion claims the next task.
#
# Its commit does not wait for the disk (synchronous_commit off, for this transaction
# only): a crash of the server may lose this start record and the abandoned marks, which
# only lose a record of attempts that are over, since the crash ended them too. Every
# commit that matters (the success, the ack) is synchronous and, being later in the WAL,
# makes this record durable with it.
# begin_attempt()'s call, ``{task_id}`` where its task's id comes from.
_BEGIN_ATTEMPT_CALL = """{{schema}}.begin_attempt(%(identity)s, %(legacy_identity)s, %(queue)s,
                                %(key)s, {task_id}, %(worker_id)s) AS b"""
BEGIN_ATTEMPT = (
    """
    SELECT b.*, set_config('synchronous_commit', 'off', true)
    FROM """
    + _BEGIN_ATTEMPT_CALL.format(task_id="%(task_id)s")
    + "\n"
)
# An attempt on a lease, begun apart: only while the lease holds its task (as of the
# statement's start). A worker whose task was cancelled or recovered since its last
# renewal gets no row back (LeaseLost, nothing written) instead of starting its work on a
# task it no longer holds. begin_attempt() takes the task's id from the row read (t.id, not
# the parameter): that reference is what makes the task's row come first, and the
# function run only for it. The row is read, not locked: the start may wait to mark a
# record another session holds (a paused zombie's, in its aborted conclusion, until the
# server ends that session), and its worker's renewals would wait behind a lock held
# meanwhile on their task's row.
BEGIN_ATTEMPT_UNDER_LEASE = (
    """
    SELECT b.*, set_config('synchronous_commit', 'off', true)
    FROM {schema}.tasks AS t
    CROSS JOIN LATERAL """
    + _BEGIN_ATTEMPT_CALL.format(task_id="t.id")
    + """
    WHERE t.id = %(task_id)s AND t.lease_token = %(token)s AND t.status = 'processing'
"""
)

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

ATTEMPT_OUTCOME = "SELECT outcome FROM {schema}.attempts WHERE id = %(attempt_id)s"

SUCCESS_FOR_IDENTITY = """
    SELECT result FROM {schema}.attempts
    WHERE identity IN (%(identity)s, %(legacy_identity)s) AND outcome = 'succeeded'
"""

ATTEMPTS_FOR_IDENTITY = """
    SELECT id, key, attempt, task_id, worker_id, outcome, error, result, started_at,
           finished_at, queue
    FROM {schema}.attempts WHERE identity IN (%(identity)s, %(legacy_identity)s) ORDER BY id
"""

# The identity of a task's work: its queue and idempotency key, else the task itself.
TASK_ATTEMPT_KEY = "SELECT queue, idempotency_key FROM {schema}.tasks WHERE id = %(task_id)s"


# -- lent connections ---------------------------------------------------------------------

# What a borrower may have done to a lent connection is undone before it is used again:
# settings (a search path, a timeout), the role (which RESET ALL leaves alone), session
# advisory locks and LISTENs, cursors WITH HOLD, temporary tables, and the statements it
# PREPAREd. The settings and the role go first, as statements of their own: a timeout the
# borrower set would apply to the next statement, and the borrower's role may have no right
# to the queue's schema, where reset_session() (migration 19) lives. The function undoes
# the rest and names the statements a borrower PREPAREd (from_sql; psycopg prepares its own
# by protocol), which connection.deallocate_leftovers drops in a second round trip, only
# when there are any: DEALLOCATE ALL would drop psycopg's own statements too and make it
# forget them all. DISCARD ALL is not used: it cannot run in a query of several
# statements, which is a transaction block.
# It all runs in the round trip that ends an attempt or a loan, inside or after its
# transaction, and leaves nothing in the session (behind PgBouncer included). No %: the
# text goes through the client's parameter binding.
RESET_SESSION = (
    "RESET ALL; RESET ROLE; RESET SESSION AUTHORIZATION; SELECT {schema}.reset_session()"
)

# How an attempt ends when its work is done: the success mark (attempt_id; NULL for a
# duplicate), the lease's fenced ack (task_id and token; NULL without a lease), the commit
# and the session's reset, in one round trip (one simple query, its values bound by the
# client). When the fence fails the function raises LEASE_GONE, so the COMMIT never runs.
# Work run REPEATABLE READ or SERIALIZABLE cannot update a row changed after its snapshot:
# when its task's row changed (a renewal, a sweep, a cancel) or, for a task with a
# concurrency key, its key's row, the ack fails with a serialization failure and the
# COMMIT never runs either. The snapshot still shows the lease, so only that conflict tells
# a lease taken after it from one merely renewed: the conclusion fails either way, and the
# task is retried (attempts._conclude raises LeaseLost when the lease is in fact gone).
CONCLUDE_UNTOUCHED_ATTEMPT = (
    "SELECT {schema}.conclude_attempt(%(attempt_id)s, %(task_id)s, %(token)s, %(result)s::jsonb)"
)
_CONCLUDE = CONCLUDE_UNTOUCHED_ATTEMPT + "; "
CONCLUDE_ATTEMPT = _CONCLUDE + "COMMIT; " + RESET_SESSION
# When the work ran no statement there is no transaction to commit: the simple query is
# one implicit transaction, committed when it ends, and no BEGIN is needed before it.
CONCLUDE_EMPTY_ATTEMPT = _CONCLUDE + RESET_SESSION
# When the work made no round trip on the attempt's connection at all, it left nothing in
# the session to reset either: the conclusion is one statement, its own transaction, sent
# prepared as the worker loop's statements are (CONCLUDE_UNTOUCHED_ATTEMPT above, and its
# form that claims, CONCLUDE_UNTOUCHED_ATTEMPT_AND_CLAIM below).
# With the next claim after it, even an attempt that ran no statement commits on its own:
# in one transaction with the claim, its key's row would stay locked while the claim waits
# for its own key's, and two workers crossing keys would deadlock.
CONCLUDE_EMPTY_ATTEMPT_APART = "BEGIN; " + CONCLUDE_ATTEMPT
# With claim_next, the next claim rides in the same script, last: after the session's
# settings and role are reset, so that it runs as the package's own statements do.
#
# For a lease whose task has no concurrency key, on a queue the plain claim takes, the
# claim commits with the attempt instead, one commit to wait for and not two: the
# conclusion and the claim are one function, conclude_claim_and_begin() (migrations 26 to
# 30), which also begins the claimed task's attempt (an attempt on its lease then takes
# that start record, and makes no round trip of its own to begin), before the COMMIT, and
# the session's reset follows it, as it follows any conclusion (so a deferred trigger of
# the borrower's still runs with its settings and role, and its advisory locks hold until
# the commit). The claim is made in READ COMMITTED only, waits for no lock longer than
# migrations.CLAIM_LOCK_TIMEOUT, and a claim that fails costs the conclusion nothing (the
# ack, undone with it, is made again alone): with a row of NULLs back, the client claims
# the next task apart (attempts._NextClaim). The claim's rows
# come back before the reset's: a reset that fails after the commit leaves them read
# (CachedConnection.run_script), so a committed claim is never dropped. A task with a key
# concludes apart, as above: the ack holds its key's row until the commit, and a claim
# waiting meanwhile for another key's row could deadlock with a worker crossing keys.
CONCLUDE_UNTOUCHED_ATTEMPT_AND_CLAIM = (
    "SELECT * FROM {schema}.conclude_claim_and_begin(%(attempt_id)s, %(task_id)s, %(token)s, "
    "%(result)s::jsonb, %(queue)s, %(worker_id)s, %(lease_seconds)s, %(default_lease)s)"
)
CONCLUDE_ATTEMPT_AND_CLAIM = CONCLUDE_UNTOUCHED_ATTEMPT_AND_CLAIM + "; COMMIT; " + RESET_SESSION
CONCLUDE_EMPTY_ATTEMPT_AND_CLAIM = "BEGIN; " + CONCLUDE_ATTEMPT_AND_CLAIM
LEASE_GONE = "LQ001"
# A start record begun with a claim (see above) that its lease did not use: taken back,
# while the lease (its task and token) still holds the task.
DISCARD_BEGUN_ATTEMPT = (
    "SELECT {schema}.discard_begun_attempt(%(attempt_id)s, %(task_id)s, %(token)s)"
)
# The unique index that allows one success per key.
SUCCESS_INDEX = "attempts_success_idx"

# A statement that does nothing: on a connection out of autocommit, psycopg sends the
# transaction's BEGIN before it.
NO_OP = "SELECT 1"


def with_next_claim(script: str, claim: str) -> str:
    """A rendered CONCLUDE_ATTEMPT or CONCLUDE_EMPTY_ATTEMPT that also runs ``claim``."""
    return f"{script}; {claim.strip()}"


def listen_statement(schema: str) -> str:
    """LISTEN on the schema's notification channel."""
    return sql.SQL(LISTEN).format(channel=sql.Identifier(notify_channel(schema))).as_string(None)


def notify_channel(schema: str) -> str:
    """The channel enqueues notify on; PostgreSQL truncates channel names to 63 bytes."""
    return f"lq_{schema}"[:63]


@lru_cache(maxsize=256)
def compose_claim(schema: str, limit: int) -> str:
    """The claim statement for ``schema`` with ``limit`` written in as a literal."""
    return _unindented(
        _render(CLAIM_ONE if limit == 1 else CLAIM_MANY, schema, limit=sql.Literal(limit))
    )


@lru_cache(maxsize=256)
def compose_ack_and_claim(schema: str, limit: int, *, many: bool, keyless: bool = False) -> str:
    """Ack one lease (ACK_AND_CLAIM; ACK_KEYLESS_AND_CLAIM when its task has no concurrency
    key and one task is claimed) or ``many`` (ACK_MANY_AND_CLAIM), then claim ``limit``."""
    if many:
        template = ACK_MANY_AND_CLAIM
    elif keyless and limit == 1:
        template = ACK_KEYLESS_AND_CLAIM
    else:
        template = ACK_AND_CLAIM
    return _unindented(_render(template, schema, limit=sql.Literal(limit)))


def _unindented(statement: str) -> str:
    """``statement`` without its lines' indentation, for a statement sent on every task.

    psycopg keeps the conversion of a query to PostgreSQL's placeholders only for queries of
    up to 4,096 characters (psycopg._queries.MAX_CACHED_STATEMENT_LENGTH); a longer one is
    converted again on every call. ACK_MANY_AND_CLAIM is longer as written, shorter without
    its indentation. The statements have no string literal that spans lines.
    """
    return _INDENTATION.sub("\n", statement)


_INDENTATION = re.compile(r"\n[ \t]+")


def compose_claim_flow(schema: str, limit: int) -> str:
    """A controlled queue's claim for ``schema``, ``limit`` written in as in compose_claim."""
    return _render(CLAIM_FLOW, schema, limit=sql.Literal(limit))


def compose_index(template: str, schema: str, index: str) -> str:
    """Render a template over ``{schema}`` and ``{index}``, both quoted as identifiers."""
    return _render(template, schema, index=sql.Identifier(index))


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
            tasks_table=sql.Literal(sql.Identifier(schema, "tasks").as_string(None)),
            **extra,
        )
        .as_string(None)
    )
