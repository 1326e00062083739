"""The schema's migrations, in order: each database is brought to the latest one.

Migrations are numbered; :mod:`dagster_leasequeue.schema` applies the ones a database
lacks, in one transaction under an advisory lock. Never edit a released migration: append
a new one. Statements are templates over ``{schema}``, like those of :mod:`.sql`.

Upgrades must not stop a running queue. From migration 5 on, a migration that builds an
index on ``tasks`` does it with ``CREATE INDEX CONCURRENTLY``, outside the migration's
transaction (it cannot run inside one): a plain ``CREATE INDEX`` takes a lock that blocks
every claim, ack and enqueue until the whole table is read. Such a statement must also be
safe to run again (``IF NOT EXISTS``, and a check for an invalid index left by an
interrupted build), since its effect is not rolled back with the version record.
"""

from __future__ import annotations

from textwrap import indent
from typing import NamedTuple


class Migration(NamedTuple):
    version: int
    description: str
    statements: tuple[str, ...]
    # Run one by one outside a transaction (CREATE INDEX CONCURRENTLY), each safe to run
    # again; the version is recorded once all of them went through.
    concurrently: bool = False


# What an attempt is an attempt at, as one text: a task without idempotency key is its own
# work ("task:" + id); a key the caller chose is its own space ("key:" + key); else the
# task's queue and idempotency key ("queue:" + the queue's length + ":" + queue + ":" +
# key). The prefixes and the length make it injective: no key a caller chooses reaches
# another's space. AttemptTarget.identity (attempts.py) computes the same text in Python.
#
# A record of an earlier release that cannot be given a task (a key the caller chose, or a
# task since purged) keeps the meaning it had: its key named the same work in every queue.
# Its identity is "legacy:" + key, which every attempt with that key also looks at
# (AttemptTarget.legacy_identity).
_ATTEMPT_IDENTITY = """
    CASE WHEN key IS NULL THEN 'task:' || task_id
         WHEN queue IS NULL THEN 'legacy:' || key
         ELSE 'queue:' || length(queue) || ':' || queue || ':' || key END
"""


# A batch's finished tasks are counted in stripes, BATCH_STRIPES rows per batch: each
# finish adds one to a stripe no other open transaction holds, so workers acking tasks of
# one batch do not wait on each other's row lock, as they would on one counter (a
# transaction-scoped advisory lock marks the stripe taken until commit, when the row lock
# goes too). The trigger keeps the counts whatever path finishes or un-finishes a task
# (ack, fail, sweep, cancel, retry_dead, an attempt's conclusion); since migration 18, each
# such path sets finished_at, the column the trigger waits for.
#
# It also wakes wait_batch, with a NOTIFY on the schema's channel (sql.notify_channel:
# 'lq_' + schema), on the last tasks of a batch. "The last": a transaction cannot see the
# increments of others not yet committed, so the one that finishes a batch may not know
# it; every finish that finds no task of the batch enqueued and at most BATCH_NOTIFY_TAIL
# left notifies, and wait_batch also polls. The enqueued probe reads the batch's index
# from its newest end, where a live entry stays until the very last claims: while it
# finds one, the stripes are not summed at all. (From migration 23, the batch's last task,
# read by primary key, spares that probe until the batch's last claims.)
#
# A statement that changes many tasks of a batch at once (ack_many, cancel_batch,
# retry_dead) counts them itself, once per batch, and says so with BULK_MARKER in its
# text, which the trigger's condition reads with current_query() (in its WHEN clause;
# from migration 15, in batch_change_counted(); from migration 20, first thing in the
# trigger's function): row by row, its
# updates of one stripe row would pile up versions of that row that the transaction
# cannot prune, each update slower than the last. The marker holds for that statement
# alone, whatever transaction it runs in. (Code from before migration 8 set the
# leasequeue.counted_in_bulk setting for its transaction instead; the trigger still
# honours it, for a deploy that runs both.)
BATCH_STRIPES = 16
BATCH_NOTIFY_TAIL = 64
BULK_MARKER = "/* leasequeue: counted in bulk */"
# The same for the running tasks of concurrency keys (see migration 9).
KEYS_MARKER = "/* leasequeue: keys counted in bulk */"
# The class of the advisory locks on stripes (the two-key form: class, stripe).
BATCH_STRIPE_LOCK_CLASS = 0x6C71_6273  # "lqbs"

# The trigger function's parts that every version of it shares (text of the released
# migration 6 unchanged): its stripe's update, without the WHERE clause, and the NOTIFY
# when at most BATCH_NOTIFY_TAIL tasks are left.
_STRIPE_UPDATE = """        UPDATE {schema}.batch_counts
        SET done = done + (NEW.status = 'done')::int - (OLD.status = 'done')::int,
            dead = dead + (NEW.status = 'dead')::int - (OLD.status = 'dead')::int,
            cancelled = cancelled + (NEW.status = 'cancelled')::int
                        - (OLD.status = 'cancelled')::int,
            changed_at = clock_timestamp()
"""
_NOTIFY_NEAR_THE_END = f"""        SELECT b.total - c.finished INTO v_left
        FROM {{schema}}.batches AS b,
             LATERAL (SELECT sum(done + dead + cancelled) AS finished
                      FROM {{schema}}.batch_counts WHERE batch_id = b.id) AS c
        WHERE b.id = NEW.batch_id;
        IF v_left <= {BATCH_NOTIFY_TAIL} THEN
            PERFORM pg_notify(left('lq_' || TG_TABLE_SCHEMA, 63), 'batch:' || NEW.batch_id);
        END IF;
        RETURN NULL;
    END
    $$
"""

_PROCESS_STRIPE = f"mod(pg_backend_pid(), {BATCH_STRIPES})"  # migration 6's choice
_COUNT_BATCH_TASK = f"""
    CREATE FUNCTION {{schema}}.count_batch_task() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        v_left bigint;
    BEGIN
{_STRIPE_UPDATE}        WHERE batch_id = NEW.batch_id AND stripe = {_PROCESS_STRIPE};
{_NOTIFY_NEAR_THE_END}"""


# The stripe this transaction counts in: the first free one from the process's own, else
# (every stripe taken) the process's own, waiting on its row lock.
_BATCH_STRIPE = f"""
    CREATE FUNCTION {{schema}}.batch_stripe() RETURNS smallint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_own int := mod(pg_backend_pid(), {BATCH_STRIPES});
    BEGIN
        FOR i IN 0..{BATCH_STRIPES - 1} LOOP
            IF pg_try_advisory_xact_lock({BATCH_STRIPE_LOCK_CLASS},
                                         mod(v_own + i, {BATCH_STRIPES})) THEN
                RETURN mod(v_own + i, {BATCH_STRIPES});
            END IF;
        END LOOP;
        RETURN v_own;
    END
    $$
"""

# After the count, for a task that finished: nothing more while a task of its batch is
# still enqueued, then the NOTIFY when at most BATCH_NOTIFY_TAIL tasks are left.
_ENQUEUED_PROBE = f"""\
        -- In the batch index's order, which no other index gives: a plan over the
        -- primary key would walk the tasks enqueued after the batch.
        PERFORM 1 FROM {{schema}}.tasks
        WHERE batch_id = NEW.batch_id AND status = 'enqueued'
        ORDER BY batch_id DESC, status DESC, id DESC LIMIT 1;
        IF FOUND THEN
            RETURN NULL;
        END IF;
{_NOTIFY_NEAR_THE_END}"""
_END_OF_BATCH_CHECK = f"""        IF NEW.status NOT IN ('done', 'dead', 'cancelled') THEN
            RETURN NULL;
        END IF;
{_ENQUEUED_PROBE}"""

_COUNT_BATCH_TASK_V8 = f"""
    CREATE OR REPLACE FUNCTION {{schema}}.count_batch_task() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        v_stripe smallint := {{schema}}.batch_stripe();
        v_left bigint;
    BEGIN
{_STRIPE_UPDATE}        WHERE batch_id = NEW.batch_id AND stripe = v_stripe;
{_END_OF_BATCH_CHECK}"""

# Migration 14: a stripe held for the session. Searching for a free stripe on every finish
# took an advisory lock per transaction, and the lock manager's traffic slowed the workers'
# acks; a session now takes a stripe once, with a session-level advisory lock, and names it
# in the session setting BATCH_STRIPE_SETTING, so a finish reads a setting. Session stripes
# are numbered apart from the BATCH_STRIPES made with each batch (which the statements that
# count in bulk, and every transaction once all session stripes are held, still search
# among), and a session's stripe row is made by its first finish in the batch. A session
# that resets its settings and locks together (RESET ALL and pg_advisory_unlock_all(), as a
# pooled session's reset does) takes a stripe again on its next finish. A stripe only
# spreads the row locks: two sessions counting in one are still counted right.
BATCH_STRIPE_SETTING = "leasequeue.batch_stripe"
BATCH_SESSION_STRIPES = 64
_BATCH_SESSION_STRIPE = f"""
    CREATE FUNCTION {{schema}}.batch_session_stripe() RETURNS smallint
    LANGUAGE plpgsql AS $$
    DECLARE
        v_own int := mod(pg_backend_pid(), {BATCH_SESSION_STRIPES});
        v_stripe int;
    BEGIN
        FOR i IN 0..{BATCH_SESSION_STRIPES - 1} LOOP
            v_stripe := {BATCH_STRIPES} + mod(v_own + i, {BATCH_SESSION_STRIPES});
            IF pg_try_advisory_lock({BATCH_STRIPE_LOCK_CLASS}, v_stripe) THEN
                PERFORM set_config('{BATCH_STRIPE_SETTING}', v_stripe::text, false);
                RETURN v_stripe;
            END IF;
        END LOOP;
        RETURN NULL;
    END
    $$
"""

# An ack (to done, from a status not counted) adds one, with nothing to compute. Any other
# change, and a session's first count in the batch, make the stripe's row if it is missing
# and go through the general update.
_STRIPE_NAMED_BY_THE_SESSION = (
    f"nullif(current_setting('{BATCH_STRIPE_SETTING}', true), '')::smallint"
)
_SESSION_STRIPE = f"""coalesce(
            {_STRIPE_NAMED_BY_THE_SESSION},
            {{schema}}.batch_session_stripe(), {{schema}}.batch_stripe())"""
_COUNT_INTO_STRIPE = f"""\
        IF NEW.status = 'done' AND OLD.status NOT IN ('done', 'dead', 'cancelled') THEN
            UPDATE {{schema}}.batch_counts SET done = done + 1, changed_at = clock_timestamp()
            WHERE batch_id = NEW.batch_id AND stripe = v_stripe;
        END IF;
        IF NOT FOUND THEN
            INSERT INTO {{schema}}.batch_counts (batch_id, stripe)
            VALUES (NEW.batch_id, v_stripe) ON CONFLICT DO NOTHING;
{indent(_STRIPE_UPDATE, "    ")}            WHERE batch_id = NEW.batch_id AND stripe = v_stripe;
        END IF;
{_END_OF_BATCH_CHECK}"""
_COUNT_BATCH_TASK_V14 = f"""
    CREATE OR REPLACE FUNCTION {{schema}}.count_batch_task() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        v_stripe smallint := {_SESSION_STRIPE};
        v_left bigint;
    BEGIN
{_COUNT_INTO_STRIPE}"""

# A batch's running tasks, for batch(). A plain index scan marks the entries of tasks
# finished since the last vacuum as dead while it passes them, so the next call skips
# them; a bitmap scan, which the planner picks on a table not yet analyzed, cannot, and
# every call would visit the heap for each task the batch has finished since.
_BATCH_PROCESSING = """
    CREATE FUNCTION {schema}.batch_processing(p_batch_id bigint) RETURNS bigint
    LANGUAGE sql STABLE
    SET enable_bitmapscan = off
    AS $$
        SELECT count(*) FROM {schema}.tasks
        WHERE batch_id = p_batch_id AND status = 'processing'
    $$
"""

# The WHEN clause is evaluated without calling the function: tasks outside a batch,
# changes between enqueued and processing, and statements that count in bulk cost
# nothing here. (Its preparation, in every statement that sets a status, did cost: see
# migration 15.)
_BATCH_COUNTS_TRIGGER_V8 = f"""
    CREATE TRIGGER tasks_batch_counts
        AFTER UPDATE OF status ON {{schema}}.tasks
        FOR EACH ROW
        WHEN (NEW.batch_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
              AND (OLD.status IN ('done', 'dead', 'cancelled')
                   OR NEW.status IN ('done', 'dead', 'cancelled'))
              AND strpos(current_query(), '{BULK_MARKER}') = 0
              AND current_setting('leasequeue.counted_in_bulk', true) IS DISTINCT FROM 'on')
        EXECUTE FUNCTION {{schema}}.count_batch_task()
"""


# -- flow control (migrations 9 and 10) -----------------------------------------------------
#
# A queue's flow controls live in queue_flow (pause, the default concurrency limit per
# key, a token bucket) and flow_keys (per key: the tasks running, a limit and a bucket of
# its own). The plain claim reads queue_flow once, by primary key: a queue without a row
# there that controls anything is claimed as before. A controlled queue is claimed by
# claim_flow(), which:
#
# - returns nothing while the queue is paused;
# - takes tokens from the queue's bucket, whose row lock makes its claimers take turns;
# - counts a key's running tasks from flow_keys.running, kept by a trigger on every path
#   into and out of 'processing' (claim, ack, fail, release, sweep, cancel), under the
#   key row's lock: a claimer locks the row (skipping it when another claimer holds it),
#   reads the latest count, and its claims raise the count before it commits, so no two
#   claimers both see room for the same slot. An expired lease still counts until the
#   sweeper recovers its task;
# - takes the first due tasks in claim order whose keys have room in one statement, as the
#   plain claim does (migration 16); then, for the tasks still wanted, looks at the
#   queue's due tasks in claim order, passing over those of keys without room; after
#   FLOW_SCAN + 4 per task asked for, it looks up each waiting key's own first tasks
#   through tasks_key_claim_idx instead, so a key with a long backlog held at its limit
#   does not hide the tasks of other keys behind it.
FLOW_SCAN = 64

# A token bucket's level now: refilled at its rate since it was last read, up to its burst.
_REFILLED = """least(f.burst, coalesce(f.tokens, f.burst) + f.per_second
                 * extract(epoch FROM clock_timestamp() - coalesce(f.refilled_at,
                                                                   clock_timestamp()))::float8)"""

_FLOW_TABLES = (
    """
    CREATE TABLE {schema}.queue_flow (
        queue text PRIMARY KEY,
        paused boolean NOT NULL DEFAULT false,
        max_running integer CHECK (max_running >= 0),
        per_second double precision CHECK (per_second > 0),
        burst double precision CHECK (burst >= 1),
        tokens double precision,
        refilled_at timestamptz,
        key_limits boolean NOT NULL DEFAULT false,
        changed_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
    """,
    # Updated by every claim and finish of a keyed task: room on the page keeps them HOT.
    """
    CREATE TABLE {schema}.flow_keys (
        queue text NOT NULL,
        key text NOT NULL,
        running integer NOT NULL DEFAULT 0,
        max_running integer CHECK (max_running >= 0),
        per_second double precision CHECK (per_second > 0),
        burst double precision CHECK (burst >= 1),
        tokens double precision,
        refilled_at timestamptz,
        PRIMARY KEY (queue, key)
    ) WITH (fillfactor = 50)
    """,
    "ALTER TABLE {schema}.tasks ADD COLUMN concurrency_key text",
)

# The room a key has for this claim: none while another claimer holds its row, else its
# limit (its own, or the queue's default) less its running tasks, and no more than its
# bucket's whole tokens. The row stays locked until the claim commits.
_FLOW_KEY_ROOM = f"""
    CREATE FUNCTION {{schema}}.flow_key_room(p_queue text, p_key text, p_default integer)
    RETURNS integer
    LANGUAGE plpgsql AS $$
    DECLARE
        v_key {{schema}}.flow_keys;
        v_limit integer;
        v_room integer := 2147483647;
    BEGIN
        SELECT * INTO v_key FROM {{schema}}.flow_keys AS k
        WHERE k.queue = p_queue AND k.key = p_key FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            INSERT INTO {{schema}}.flow_keys (queue, key) VALUES (p_queue, p_key)
            ON CONFLICT DO NOTHING;
            SELECT * INTO v_key FROM {{schema}}.flow_keys AS k
            WHERE k.queue = p_queue AND k.key = p_key FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                RETURN 0;
            END IF;
        END IF;
        v_limit := coalesce(v_key.max_running, p_default);
        IF v_limit IS NOT NULL THEN
            v_room := greatest(0, v_limit - v_key.running);
        END IF;
        IF v_key.per_second IS NOT NULL AND v_room > 0 THEN
            UPDATE {{schema}}.flow_keys AS f
            SET tokens = {_REFILLED}, refilled_at = clock_timestamp()
            WHERE f.queue = p_queue AND f.key = p_key
            RETURNING f.* INTO v_key;
            v_room := least(v_room, floor(v_key.tokens)::integer);
        END IF;
        RETURN v_room;
    END
    $$
"""

# Picks the task ``v_task`` if its key has room left among this claim's picks.
_PICK_IF_ROOM = """
                IF v_task.concurrency_key IS NOT NULL THEN
                    v_at := array_position(v_keys, v_task.concurrency_key);
                    IF v_at IS NULL THEN
                        v_keys := v_keys || v_task.concurrency_key;
                        v_room := v_room || {schema}.flow_key_room(
                            p_queue, v_task.concurrency_key, v_flow.max_running);
                        v_picked := v_picked || 0;
                        v_at := cardinality(v_keys);
                    END IF;
                    CONTINUE WHEN v_picked[v_at] >= v_room[v_at];
                    v_picked[v_at] := v_picked[v_at] + 1;
                END IF;
                v_candidates := v_candidates || v_task.id;"""

# claim_flow() in parts: migration 9's version; migration 11's, which differs only in
# how many keys it locks (_KEYS_ROOM_V9, _KEYS_ROOM).
# What a claim function returns: the columns of a claim's rows (see sql.CLAIM_ONE), in
# the order a Lease is built from.
_CLAIMED_ROWS = """\
    ) RETURNS TABLE (
        id bigint, payload jsonb, priority integer, attempts integer, max_attempts integer,
        lease_token bigint, lease_expires_at timestamptz, idempotency_key text,
        lease_seconds double precision, run_at timestamptz, next_token_in double precision
    )
    LANGUAGE plpgsql AS $$
    #variable_conflict use_column
"""

_CLAIM_FLOW_HEAD = (
    """
    CREATE FUNCTION {schema}.claim_flow(
        p_queue text, p_limit integer, p_worker text, p_lease double precision,
        p_default_lease double precision
"""
    + _CLAIMED_ROWS
    + """    DECLARE
        v_flow {schema}.queue_flow;
        v_want integer := p_limit;
        v_scan integer := """
    + str(FLOW_SCAN)
    + """ + 4 * p_limit;
        v_ids bigint[];
        v_scan_keys text[];
        v_new text[];
        v_keys text[] := ARRAY[]::text[];
        v_room integer[] := ARRAY[]::integer[];
        v_picked integer[];
        v_candidates bigint[] := ARRAY[]::bigint[];
        v_at integer;
        v_key text;
        v_tokens double precision;
        v_task record;
"""
)

_CLAIM_FLOW_BUDGET = (
    """    BEGIN
        SELECT * INTO v_flow FROM {schema}.queue_flow AS f WHERE f.queue = p_queue;
        IF v_flow.per_second IS NOT NULL THEN
            UPDATE {schema}.queue_flow AS f
            SET tokens = """
    + _REFILLED
    + """, refilled_at = clock_timestamp()
            WHERE f.queue = p_queue
            RETURNING f.* INTO v_flow;
        END IF;
        IF v_flow.paused THEN
            RETURN;
        END IF;
        IF v_flow.per_second IS NOT NULL THEN
            v_want := least(v_want, floor(v_flow.tokens)::integer);
            IF v_want < 1 THEN
                next_token_in := (1 - v_flow.tokens) / v_flow.per_second;
                RETURN NEXT;
                RETURN;
            END IF;
        END IF;

"""
)

_CLAIM_FLOW_SCAN = """\
        -- The first due tasks in claim order, one past the scan's length.
        SELECT coalesce(array_agg(d.id ORDER BY d.priority DESC, d.run_at, d.id),
                        ARRAY[]::bigint[]),
               coalesce(array_agg(d.concurrency_key ORDER BY d.priority DESC, d.run_at, d.id),
                        ARRAY[]::text[])
        INTO v_ids, v_scan_keys
        FROM (SELECT t.id, t.concurrency_key, t.priority, t.run_at FROM {schema}.tasks AS t
              WHERE t.status = 'enqueued' AND t.queue = p_queue
                AND t.run_at <= clock_timestamp()
              ORDER BY t.priority DESC, t.run_at, t.id
              LIMIT v_scan + 1) AS d;
"""

# Locks the rows of the keys ``v_new`` that no other claimer holds, reads their room into
# ``{into}`` (keys, then rooms), and takes their buckets' whole tokens off that room.
_LOCK_KEYS = """            SELECT coalesce(array_agg(l.key), ARRAY[]::text[]),
                   coalesce(array_agg(l.room), ARRAY[]::integer[])
            INTO {into}
            FROM (SELECT k.key,
                         CASE WHEN coalesce(k.max_running, v_flow.max_running) IS NULL
                              THEN 2147483647
                              ELSE greatest(0, coalesce(k.max_running, v_flow.max_running)
                                               - k.running) END AS room
                  FROM {schema}.flow_keys AS k
                  WHERE k.queue = p_queue AND k.key = ANY (v_new)
                  FOR UPDATE SKIP LOCKED) AS l;
"""
_TAKE_KEY_TOKENS = (
    """            FOR v_key, v_tokens IN
                UPDATE {schema}.flow_keys AS f
                SET tokens = """
    + _REFILLED
    + """, refilled_at = clock_timestamp()
                WHERE f.queue = p_queue AND f.key = ANY ({locked}) AND f.per_second IS NOT NULL
                RETURNING f.key, f.tokens
            LOOP
                v_at := array_position(v_keys, v_key);
                v_room[v_at] := least(v_room[v_at], floor(v_tokens)::integer);
            END LOOP;
"""
)
_MAKE_KEY_ROWS = """\
            -- A key's row is made by its first claim (a probe first: a conflict costs more).
            -- In key order, as every statement that writes many keys' rows: two that
            -- share keys then never hold one each while waiting for the other's.
            INSERT INTO {schema}.flow_keys (queue, key)
            SELECT p_queue, k FROM unnest(v_new) AS k
            WHERE NOT EXISTS (SELECT 1 FROM {schema}.flow_keys AS e
                              WHERE e.queue = p_queue AND e.key = k)
            ORDER BY k
            ON CONFLICT DO NOTHING;
"""
_SCANNED_KEYS = (
    "v_new := ARRAY(SELECT DISTINCT k FROM unnest(v_scan_keys) AS k WHERE k IS NOT NULL);"
)

# The first ``v_want`` scanned tasks among the first ``{bound}``, in claim order, those of
# keys without room passed over.
_CANDIDATES = """SELECT coalesce(array_agg(p.id ORDER BY p.n), ARRAY[]::bigint[])
        INTO v_candidates
        FROM (SELECT r.id, r.n
              FROM (SELECT u.id, u.n, u.concurrency_key,
                           row_number() OVER (PARTITION BY u.concurrency_key ORDER BY u.n)
                               AS nth
                    FROM unnest(v_ids, v_scan_keys) WITH ORDINALITY
                        AS u(id, concurrency_key, n)
                    WHERE u.n <= {bound}) AS r
              LEFT JOIN unnest(v_keys, v_room) AS k(key, room) ON k.key = r.concurrency_key
              WHERE r.concurrency_key IS NULL OR r.nth <= k.room
              ORDER BY r.n
              LIMIT v_want) AS p;"""

# Migration 9: every scanned task's key locked at once.
_KEYS_ROOM_V9 = (
    """
        -- Their keys' room, each key's row locked until commit, all at once; a key
        -- another claimer holds has none.
        """
    + _SCANNED_KEYS
    + """
        IF cardinality(v_new) > 0 THEN
"""
    + _MAKE_KEY_ROWS
    + _LOCK_KEYS.replace("{into}", "v_keys, v_room")
    + _TAKE_KEY_TOKENS.replace("{locked}", "v_keys")
    + """            v_new := ARRAY(SELECT unnest(v_new) EXCEPT SELECT unnest(v_keys));
            v_keys := v_keys || v_new;
            v_room := v_room || array_fill(0, ARRAY[cardinality(v_new)]);
        END IF;
        -- The scanned tasks in claim order, those of keys without room passed over.
        """
    + _CANDIDATES.replace("{bound}", "v_scan")
    + "\n"
)

_PICKED_AND_LOOK_UP = (
    """        -- How many each key has picked, for the look-up below.
        v_picked := ARRAY(
            SELECT count(u.id)::integer
            FROM unnest(v_keys) WITH ORDINALITY AS k(key, n)
            LEFT JOIN unnest(v_ids, v_scan_keys) AS u(id, concurrency_key)
                ON u.concurrency_key = k.key AND u.id = ANY (v_candidates)
            GROUP BY k.n ORDER BY k.n);

        -- Many tasks passed over: each waiting key's own first tasks, through the key
        -- index (its keys one probe each), and the first tasks without a key.
        IF cardinality(v_ids) > v_scan AND cardinality(v_candidates) < v_want THEN
            FOR v_task IN
                SELECT t.id, t.concurrency_key FROM {schema}.tasks AS t
                WHERE t.status = 'enqueued' AND t.queue = p_queue
                  AND t.concurrency_key IS NULL AND t.run_at <= clock_timestamp()
                  AND t.id <> ALL (v_candidates)
                ORDER BY t.priority DESC, t.run_at, t.id
                LIMIT v_want
            LOOP"""
    + _PICK_IF_ROOM
    + """
            END LOOP;
            FOR v_key IN{waiting_keys}            LOOP
{enough}                v_at := array_position(v_keys, v_key);
                CONTINUE WHEN v_at IS NOT NULL AND v_picked[v_at] >= v_room[v_at];
                FOR v_task IN
                    SELECT t.id, t.concurrency_key FROM {schema}.tasks AS t
                    WHERE t.queue = p_queue AND t.concurrency_key = v_key
                      AND t.status = 'enqueued' AND t.run_at <= clock_timestamp()
                      AND t.id <> ALL (v_candidates)
                    ORDER BY t.priority DESC, t.run_at, t.id
                    LIMIT v_want
                LOOP"""
    + _PICK_IF_ROOM.replace("CONTINUE WHEN", "EXIT WHEN")
    + """
                END LOOP;
            END LOOP;
        END IF;

"""
)

# The update that leases claim_flow's picks (in its CTE ``leased``).
_LEASE_TASKS = """\
            UPDATE {schema}.tasks AS t
            SET status = 'processing',
                attempts = t.attempts + 1,
                lease_token = nextval({lease_tokens}::regclass),
                lease_expires_at = clock_timestamp()
                    + make_interval(secs => coalesce(p_lease, t.lease_seconds,
                                                     p_default_lease)),
                worker_id = p_worker,
                updated_at = clock_timestamp()
"""
_LEASE_PICKS = (
    """\
        -- Lease the picks in claim order, up to the tasks asked for, in one statement that
        -- also counts them against their keys (whose rows this claim holds) and takes
        -- their tokens; the key trigger, told so, leaves them be.
        PERFORM set_config('leasequeue.keys_counted', 'on', true);
        RETURN QUERY
        WITH locked AS (
            SELECT x.id FROM {schema}.tasks AS x
            WHERE x.id = ANY (v_candidates) AND x.status = 'enqueued'
            ORDER BY x.priority DESC, x.run_at, x.id
            LIMIT v_want
            FOR UPDATE SKIP LOCKED
        ), leased AS (
"""
    + _LEASE_TASKS
    + """            FROM locked WHERE t.id = locked.id
            RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts,
                      t.lease_token, t.lease_expires_at, t.idempotency_key,
                      coalesce(p_lease, t.lease_seconds, p_default_lease) AS lease_seconds,
                      t.run_at, t.concurrency_key
        ), counted AS (
            UPDATE {schema}.flow_keys AS k
            SET running = k.running + n.tasks,
                tokens = CASE WHEN k.per_second IS NULL THEN k.tokens
                              ELSE k.tokens - n.tasks END
            FROM (SELECT l.concurrency_key, count(*) AS tasks FROM leased AS l
                  WHERE l.concurrency_key IS NOT NULL GROUP BY l.concurrency_key) AS n
            WHERE k.queue = p_queue AND k.key = n.concurrency_key
        ), charged AS (
            UPDATE {schema}.queue_flow AS f SET tokens = f.tokens - (SELECT count(*) FROM leased)
            WHERE f.queue = p_queue AND f.per_second IS NOT NULL
        )
        SELECT l.id, l.payload, l.priority, l.attempts, l.max_attempts, l.lease_token,
               l.lease_expires_at, l.idempotency_key, l.lease_seconds, l.run_at,
               NULL::double precision
        FROM leased AS l;
"""
)
_CLAIM_FLOW_END = """\
        PERFORM set_config('leasequeue.keys_counted', 'off', true);
    END
    $$
"""

# The keys with tasks enqueued, in key order, one index probe each.
_WAITING_KEYS_V9 = """
                WITH RECURSIVE waiting(key) AS (
                    SELECT min(t.concurrency_key) FROM {schema}.tasks AS t
                    WHERE t.queue = p_queue AND t.status = 'enqueued'
                      AND t.concurrency_key IS NOT NULL
                    UNION ALL
                    SELECT (SELECT min(t.concurrency_key) FROM {schema}.tasks AS t
                            WHERE t.queue = p_queue AND t.status = 'enqueued'
                              AND t.concurrency_key > w.key)
                    FROM waiting AS w WHERE w.key IS NOT NULL
                )
                SELECT w.key FROM waiting AS w WHERE w.key IS NOT NULL
"""

_CLAIM_FLOW = (
    _CLAIM_FLOW_HEAD
    + _CLAIM_FLOW_BUDGET
    + _CLAIM_FLOW_SCAN
    + _KEYS_ROOM_V9
    + _PICKED_AND_LOOK_UP.replace("{waiting_keys}", _WAITING_KEYS_V9).replace("{enough}", "")
    + _LEASE_PICKS
    + _CLAIM_FLOW_END
)

# Migration 11: keys locked as the claim needs them. Locking every scanned task's key
# (migration 9) held hundreds of key rows for a claim of 100 tasks, and claimers running
# side by side found the keys of the queue's first tasks all held, passed over most of
# their scan, and fell through to the key-by-key look-up. Now a claim locks the keys of
# its first v_want scanned tasks; while it has fewer picks than it wants, it locks those
# of as many more tasks again as it still lacks, twice over. The picks stay the first in
# claim order among the tasks looked at, as before.
_KEYS_ROOM = (
    """
        -- Every scanned task's key has a row, made here at once.
        """
    + _SCANNED_KEYS
    + """
        IF cardinality(v_new) > 0 THEN
"""
    + _MAKE_KEY_ROWS
    + """        END IF;
        -- The keys of the first tasks, each key's row locked until commit; a key another
        -- claimer holds has no room.
        v_prefix := least(v_want, v_scan);
        LOOP
            v_new := ARRAY(SELECT DISTINCT k FROM unnest(v_scan_keys[1:v_prefix]) AS k
                           WHERE k IS NOT NULL AND k <> ALL (v_keys));
            IF cardinality(v_new) > 0 THEN
"""
    + indent(_LOCK_KEYS.replace("{into}", "v_locked, v_locked_room"), "    ")
    + """                v_keys := v_keys || v_locked;
                v_room := v_room || v_locked_room;
"""
    + indent(_TAKE_KEY_TOKENS.replace("{locked}", "v_locked"), "    ")
    + """                v_new := ARRAY(SELECT unnest(v_new) EXCEPT SELECT unnest(v_locked));
                v_keys := v_keys || v_new;
                v_room := v_room || array_fill(0, ARRAY[cardinality(v_new)]);
            END IF;
"""
    + indent("        " + _CANDIDATES.replace("{bound}", "v_prefix"), "    ")
    + """
            EXIT WHEN cardinality(v_candidates) >= v_want
                OR v_prefix >= least(v_scan, cardinality(v_ids));
            v_prefix := least(v_scan, v_prefix + v_want - cardinality(v_candidates));
        END LOOP;

"""
)

# The same walk, written in the key index's own order so that it is the plan even before
# the table's statistics are gathered (with none, min() was planned over the claim index:
# a read of every enqueued task per key).
_WAITING_KEYS = """
                WITH RECURSIVE waiting(key) AS (
                    (SELECT t.concurrency_key FROM {schema}.tasks AS t
                     WHERE t.queue = p_queue AND t.status = 'enqueued'
                       AND t.concurrency_key IS NOT NULL
                     ORDER BY t.queue, t.concurrency_key LIMIT 1)
                    UNION ALL
                    SELECT (SELECT t.concurrency_key FROM {schema}.tasks AS t
                            WHERE t.queue = p_queue AND t.status = 'enqueued'
                              AND t.concurrency_key > w.key
                            ORDER BY t.queue, t.concurrency_key LIMIT 1)
                    FROM waiting AS w WHERE w.key IS NOT NULL
                )
                SELECT w.key FROM waiting AS w WHERE w.key IS NOT NULL
"""

_CLAIM_FLOW_V11_HEAD = _CLAIM_FLOW_HEAD.replace(
    "CREATE FUNCTION", "CREATE OR REPLACE FUNCTION"
).replace(
    "        v_task record;\n",
    "        v_task record;\n"
    "        v_prefix integer;\n"
    "        v_locked text[];\n"
    "        v_locked_room integer[];\n",
)
_LOOK_UP_V11 = _PICKED_AND_LOOK_UP.replace("{waiting_keys}", _WAITING_KEYS).replace(
    "{enough}", "                EXIT WHEN cardinality(v_candidates) >= v_want;\n"
)

_CLAIM_FLOW_V11 = (
    _CLAIM_FLOW_V11_HEAD
    + _CLAIM_FLOW_BUDGET
    + _CLAIM_FLOW_SCAN
    + _KEYS_ROOM
    + _LOOK_UP_V11
    + _LEASE_PICKS
    + _CLAIM_FLOW_END
)

# Migration 12: a claim in rounds. Its scan and its lease are two statements: a task another
# claimer leases between them (as when this claim waited for that claimer's new key rows,
# and then locked keys free by now) is no pick at all, and a claim of nothing but such
# tasks returned nothing while the queue had work due. A claim that leased fewer of its
# picks than it made scans again for what it still lacks; the keys it holds stay held.
CLAIM_FLOW_ROUNDS = 3
_CLAIM_FLOW_V12_HEAD = _CLAIM_FLOW_V11_HEAD.replace(
    "        v_task record;\n",
    "        v_task record;\n        v_leased integer;\n        v_round integer := 0;\n",
)
# The rounds, and the function's end.
_CLAIM_FLOW_ROUNDS = (
    """
        LOOP
            v_round := v_round + 1;
            v_keys := ARRAY[]::text[];
            v_room := ARRAY[]::integer[];
"""
    + indent(
        _CLAIM_FLOW_SCAN
        # Key rows are made in the first round only: a claim that made some and waits, in
        # a later round, on another's new rows could hold one that the other waits for.
        + _KEYS_ROOM.replace(
            "IF cardinality(v_new) > 0 THEN\n            -- A key's row",
            "IF v_round = 1 AND cardinality(v_new) > 0 THEN\n            -- A key's row",
        )
        + _LOOK_UP_V11
        + _LEASE_PICKS,
        "    ",
    )
    + """            GET DIAGNOSTICS v_leased = ROW_COUNT;
            v_want := v_want - v_leased;
            EXIT WHEN v_want < 1 OR v_leased >= cardinality(v_candidates)
                OR v_round >= """
    + str(CLAIM_FLOW_ROUNDS)
    + """;
        END LOOP;
"""
    + _CLAIM_FLOW_END
)
_CLAIM_FLOW_V12 = _CLAIM_FLOW_V12_HEAD + _CLAIM_FLOW_BUDGET + _CLAIM_FLOW_ROUNDS


# Migration 16: the first picks in one statement. A claim of 100 tasks over many keys with
# room ran a dozen statements in claim_flow's rounds: 55 µs of server time per task
# against 16 for the plain claim, most of it in locking the keys' rows (found by comparing
# every row of flow_keys with the array of keys wanted) and in probing for rows to make.
# Now claim_flow first takes the queue's first due tasks as the plain claim does, locks
# the rows of their keys that no other claimer holds, and leases as many of each key's
# tasks as it has room for, raising the counts in the same statement. What that leaves
# (tasks of keys without a row yet, with a bucket of their own, held by another claimer or
# out of room) goes through the rounds as before, for the tasks still wanted.
#
# The statement waits for no lock (its tasks and key rows are taken SKIP LOCKED), and the
# rounds after it wait only for a claimer inserting the same new key's row, which itself
# never waits for a row held as these are: it adds no lock order to keep. The tasks it
# locked and could not lease stay locked until the claim commits, so a claimer beside it
# may lease a key's later tasks before those (as claimers taking turns always could); a
# queue whose first tasks are held back pays for their locks on top of the rounds (a
# claim of 100 behind a backlog of one key at its limit: 10.8 ms either way). Each key's
# row is looked up on its own, by primary key, whatever the statistics of flow_keys.
# Queues with a bucket of their own take the rounds alone, which charge it.
_FIRST_PICKS = (
    """        IF v_flow.per_second IS NULL THEN
            PERFORM set_config('leasequeue.keys_counted', 'on', true);
            RETURN QUERY
            WITH picked AS MATERIALIZED (
                SELECT t.id, t.concurrency_key, t.priority, t.run_at FROM {schema}.tasks AS t
                WHERE t.status = 'enqueued' AND t.queue = p_queue
                  AND t.run_at <= clock_timestamp()
                ORDER BY t.priority DESC, t.run_at, t.id
                LIMIT v_want
                FOR UPDATE SKIP LOCKED
            ), wanted AS (
                SELECT p.concurrency_key AS key, count(*)::integer AS tasks FROM picked AS p
                WHERE p.concurrency_key IS NOT NULL GROUP BY p.concurrency_key
            ), held AS (
                SELECT k.key, k.running, coalesce(k.max_running, v_flow.max_running) AS lim
                FROM wanted AS w
                CROSS JOIN LATERAL (
                    SELECT f.key, f.running, f.max_running FROM {schema}.flow_keys AS f
                    WHERE f.queue = p_queue AND f.key = w.key AND f.per_second IS NULL
                    FOR UPDATE SKIP LOCKED) AS k
            ), granted AS (
                SELECT h.key, CASE WHEN h.lim IS NULL THEN w.tasks
                                   ELSE least(w.tasks, greatest(0, h.lim - h.running))
                              END AS tasks
                FROM held AS h JOIN wanted AS w ON w.key = h.key
            ), counted AS (
                UPDATE {schema}.flow_keys AS k SET running = k.running + g.tasks
                FROM granted AS g
                WHERE k.queue = p_queue AND k.key = g.key AND g.tasks > 0
            ), ranked AS (
                SELECT p.id, p.concurrency_key,
                       row_number() OVER (PARTITION BY p.concurrency_key
                                          ORDER BY p.priority DESC, p.run_at, p.id) AS nth
                FROM picked AS p
            ), leased AS (
"""
    + indent(_LEASE_TASKS, "    ")
    + """                FROM ranked AS r LEFT JOIN granted AS g ON g.key = r.concurrency_key
                WHERE t.id = r.id AND (r.concurrency_key IS NULL OR r.nth <= g.tasks)
                RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts,
                          t.lease_token, t.lease_expires_at, t.idempotency_key,
                          coalesce(p_lease, t.lease_seconds, p_default_lease) AS lease_seconds,
                          t.run_at
            )
            SELECT l.id, l.payload, l.priority, l.attempts, l.max_attempts, l.lease_token,
                   l.lease_expires_at, l.idempotency_key, l.lease_seconds, l.run_at,
                   NULL::double precision
            FROM leased AS l;
            GET DIAGNOSTICS v_leased = ROW_COUNT;
            v_want := v_want - v_leased;
            IF v_want < 1 THEN
                PERFORM set_config('leasequeue.keys_counted', 'off', true);
                RETURN;
            END IF;
        END IF;
"""
)
_CLAIM_FLOW_V16 = _CLAIM_FLOW_V12_HEAD + _CLAIM_FLOW_BUDGET + _FIRST_PICKS + _CLAIM_FLOW_ROUNDS


# A keyed task's running count, on every path into and out of 'processing'. A finish that
# frees a slot of a key at its limit wakes the queue's waiting claimers, as an enqueue does.
_KEY_RUNNING_FUNCTION = """{schema}.count_key_running() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        v_was_full boolean;
    BEGIN
"""
_COUNT_KEY_CHANGE = """        IF NEW.status = 'processing' THEN
            INSERT INTO {schema}.flow_keys AS k (queue, key, running)
            VALUES (NEW.queue, NEW.concurrency_key, 1)
            ON CONFLICT (queue, key) DO UPDATE SET running = k.running + 1;
        ELSE
            UPDATE {schema}.flow_keys AS k SET running = k.running - 1
            WHERE k.queue = NEW.queue AND k.key = NEW.concurrency_key
            RETURNING k.running + 1 >= coalesce(
                k.max_running,
                (SELECT f.max_running FROM {schema}.queue_flow AS f WHERE f.queue = k.queue))
            INTO v_was_full;
            IF v_was_full THEN
                PERFORM pg_notify(left('lq_' || TG_TABLE_SCHEMA, 63), NEW.queue);
            END IF;
        END IF;
        RETURN NULL;
    END
    $$
"""
_COUNT_KEY_RUNNING = "\n    CREATE FUNCTION " + _KEY_RUNNING_FUNCTION + _COUNT_KEY_CHANGE

_KEY_RUNNING_TRIGGER = (
    """
    CREATE TRIGGER tasks_key_running
        AFTER UPDATE OF status ON {schema}.tasks
        FOR EACH ROW
        WHEN (NEW.concurrency_key IS NOT NULL
              AND (OLD.status = 'processing') IS DISTINCT FROM (NEW.status = 'processing')
              AND current_setting('leasequeue.keys_counted', true) IS DISTINCT FROM 'on'
              AND strpos(current_query(), '"""
    + KEYS_MARKER
    + """') = 0)
        EXECUTE FUNCTION {schema}.count_key_running()
"""
)


# The pick of the plain claim of one task (sql.CLAIM_ONE's, its parameters named): the
# claim below, and the keyless ack and claim of an attempt's conclusion (migration 28).
_PICK_ONE = """\
                SELECT id FROM {schema}.tasks
                WHERE status = 'enqueued' AND queue = p_queue AND run_at <= clock_timestamp()
                  AND NOT EXISTS (
                    SELECT 1 FROM {schema}.queue_flow AS f
                    WHERE f.queue = p_queue
                      AND (f.paused OR f.max_running IS NOT NULL OR f.per_second IS NOT NULL
                           OR f.key_limits))
                ORDER BY priority DESC, run_at, id
                LIMIT 1
                FOR UPDATE SKIP LOCKED
"""
# The plain claim of one task (sql.CLAIM_ONE, its parameters named), as claim_one() and
# conclude_and_claim() run it, up to the concurrency key that only the second returns.
_CLAIM_ONE_UPDATE = (
    """\
            UPDATE {schema}.tasks AS t
            SET status = 'processing',
                attempts = t.attempts + 1,
                lease_token = nextval({lease_tokens}::regclass),
                lease_expires_at = clock_timestamp()
                    + make_interval(
                        secs => coalesce(p_lease, t.lease_seconds, p_default_lease)),
                worker_id = p_worker,
                updated_at = clock_timestamp()
            WHERE t.id = (
"""
    + _PICK_ONE
    + """            )
            RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
                      t.lease_expires_at, t.idempotency_key,
                      coalesce(p_lease, t.lease_seconds, p_default_lease) AS lease_seconds,
                      t.run_at, NULL::double precision AS next_token_in"""
)

# The plain claim of one task (sql.CLAIM_ONE, its parameters named), for a claim sent in a
# simple query of several statements: an attempt's conclusion that claims the next task.
# There nothing is prepared, and planning sql.CLAIM_ONE anew took more server time than
# running it; a function's statements keep their plans for the session, as a prepared
# statement does. tests/unit/test_statements.py holds it to sql.CLAIM_ONE.
_CLAIM_ONE = (
    """
    CREATE FUNCTION {schema}.claim_one(
        p_queue text, p_worker text, p_lease double precision, p_default_lease double precision
"""
    + _CLAIMED_ROWS
    + """    BEGIN
        RETURN QUERY
        WITH claimed AS (
"""
    + _CLAIM_ONE_UPDATE
    + """
        )
        SELECT * FROM claimed;
    END
    $$
"""
)

# Migration 15: the triggers' conditions, prepared for every statement that updates tasks.
# PostgreSQL reads a trigger's WHEN clause from its stored text and prepares it again in
# every statement that sets a status, whatever rows it touches: the two conditions above
# (strings of 4,000 and 2,900 characters, with their constants and functions) took 15 to
# 25 µs of each claim and ack, in queues without batches or keys too. Now each condition
# is a NULL test, which decides for tasks outside batches and without keys, and a call of
# a small function with the rest, unchanged, made for the others' rows alone.
_BATCH_CHANGE_COUNTED = f"""
    CREATE FUNCTION {{schema}}.batch_change_counted(p_old text, p_new text) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
    BEGIN
        RETURN p_old IS DISTINCT FROM p_new
            AND (p_old IN ('done', 'dead', 'cancelled') OR p_new IN ('done', 'dead', 'cancelled'))
            AND strpos(current_query(), '{BULK_MARKER}') = 0
            AND current_setting('leasequeue.counted_in_bulk', true) IS DISTINCT FROM 'on';
    END
    $$
"""
_KEY_CHANGE_COUNTED = f"""
    CREATE FUNCTION {{schema}}.key_change_counted(p_old text, p_new text) RETURNS boolean
    LANGUAGE plpgsql STABLE AS $$
    BEGIN
        RETURN (p_old = 'processing') IS DISTINCT FROM (p_new = 'processing')
            AND current_setting('leasequeue.keys_counted', true) IS DISTINCT FROM 'on'
            AND strpos(current_query(), '{KEYS_MARKER}') = 0;
    END
    $$
"""


# Migration 17: the checks on tasks and attempts, made cheap to prepare.
# PostgreSQL prepares every CHECK constraint of a table again, from its stored text, in
# every statement that writes a row of it, whatever the statement sets. The claim and the
# ack each paid for the four checks on tasks, most of all for the one on status: its list
# of five names is a constant array, which the server reads back byte by byte. Counted by
# callgrind in the server, one task of the worker loop (ack_and_claim) took 853,000
# instructions with the checks as they were, 732,000 with these, and 685,000 with none.
#
# Each table now has one check, a call of a function that holds the conditions: the call
# is all a statement prepares. Each row written pays the call (about 6% more server work
# for an enqueued row, as counted the same way). Domains for the columns would be as cheap
# in the loop, but status is in the partial indexes' predicates, whose rebuild a new type
# forces under an exclusive lock on tasks; and a column of a new type no longer matches
# the integer and text columns that the claim functions declare they return.
#
# The new checks are added NOT VALID, which skips the scan of the rows in place: they were
# held to the same conditions by the constraints these replace, dropped in the same
# statement. So a later version of either function may only widen what it accepts: rows
# already stored are never checked again. A bad value fails as it did, with
# check_violation. The functions are executable by every role (they only read their
# arguments): a role that writes tasks calls them, and where PUBLIC's default right to
# execute is revoked, writes would otherwise fail until grant_worker ran again.
#
# Both tables are locked first, attempts then tasks, the order in which an attempt's
# conclusion writes them: taken the other way, the migration and a conclusion could each
# hold the lock the other waits for.
_TASK_VALUES_VALID = """
    CREATE FUNCTION {schema}.task_values_valid(
        p_status text, p_attempts integer, p_max_attempts integer, p_lease_seconds float8
    ) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
    BEGIN
        RETURN p_status IN ('enqueued', 'processing', 'done', 'dead', 'cancelled')
            AND p_attempts >= 0
            AND p_max_attempts >= 1
            AND (p_lease_seconds IS NULL OR p_lease_seconds > 0);
    END
    $$
"""
_ATTEMPT_OUTCOME_VALID = """
    CREATE FUNCTION {schema}.attempt_outcome_valid(p_outcome text) RETURNS boolean
    LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
    BEGIN
        RETURN p_outcome IN ('running', 'succeeded', 'failed', 'skipped', 'abandoned');
    END
    $$
"""
_CHEAP_CHECKS = (
    "LOCK TABLE {schema}.attempts, {schema}.tasks IN ACCESS EXCLUSIVE MODE",
    _TASK_VALUES_VALID,
    _ATTEMPT_OUTCOME_VALID,
    "GRANT EXECUTE ON FUNCTION {schema}.task_values_valid(text, integer, integer, float8),"
    " {schema}.attempt_outcome_valid(text) TO PUBLIC",
    """
    ALTER TABLE {schema}.tasks
        DROP CONSTRAINT tasks_status_check,
        DROP CONSTRAINT tasks_attempts_check,
        DROP CONSTRAINT tasks_max_attempts_check,
        DROP CONSTRAINT tasks_lease_seconds_check,
        ADD CONSTRAINT tasks_values_check
            CHECK ({schema}.task_values_valid(status, attempts, max_attempts, lease_seconds))
            NOT VALID
    """,
    """
    ALTER TABLE {schema}.attempts
        DROP CONSTRAINT attempts_outcome_check,
        ADD CONSTRAINT attempts_outcome_check
            CHECK ({schema}.attempt_outcome_valid(outcome)) NOT VALID
    """,
)


def _counting_trigger(
    name: str, column: str, condition: str | None, function: str, *, updated: str = "status"
) -> str:
    """A counting trigger on tasks: for statements that set ``updated``, its rows with
    ``column`` set (and, until migration 20, ``condition`` holding)."""
    called = (
        ""
        if condition is None
        else f"\n              AND {{schema}}.{condition}(OLD.status, NEW.status)"
    )
    return f"""
    CREATE TRIGGER {name}
        AFTER UPDATE OF {updated} ON {{schema}}.tasks
        FOR EACH ROW
        WHEN (NEW.{column} IS NOT NULL{called})
        EXECUTE FUNCTION {{schema}}.{function}()
"""


# Migration 18: the batch trigger considered only by statements that finish a task or take
# one back. PostgreSQL prepares a trigger's WHEN clause, at the first row, in every
# statement whose SET list names a column of the trigger's UPDATE OF list, and skips the
# trigger in any other; on UPDATE OF status that was every claim too, though a claim never
# changes what a batch counts. Every statement that moves a task into done, dead or
# cancelled, or out of them (retry_dead), sets finished_at, and no claim does: on UPDATE OF
# finished_at the claim skips the trigger altogether. Counted by callgrind in the server,
# per task of claim() and ack(): 686,500 -> 664,600 instructions for plain tasks, 907,900
# -> 869,400 for a batch's. So a statement that moves a task into a finished status or out
# of one must set finished_at (tests/unit/test_statements.py checks every one the package
# has).
_BATCH_TRIGGER_ON_FINISHES = (
    "DROP TRIGGER tasks_batch_counts ON {schema}.tasks",
    _counting_trigger(
        "tasks_batch_counts",
        "batch_id",
        "batch_change_counted",
        "count_batch_task",
        updated="finished_at",
    ),
)


# Migration 19: what a borrower may have left in a lent connection's session, undone by one
# function. The reset ran as seven statements of a simple query, each parsed, analysed and
# planned again at every attempt's conclusion and every loan's end; counted by callgrind in
# the server, the attempts' worker loop took 1,458,000 instructions per task with them and
# 1,380,000 with this. What it undoes is listed at sql.RESET_SESSION. No SET clause: one
# would undo RESET ALL when the function returns. The functions and views it names are
# schema-qualified, so no search_path a borrower set can stand in for them. It only touches
# the calling session, so every role may run it.
_RESET_SESSION_FUNCTION = """
    CREATE FUNCTION {schema}.reset_session() RETURNS text[]
    LANGUAGE plpgsql AS $$
    BEGIN
        RESET ALL;
        UNLISTEN *;
        -- PL/pgSQL's own CLOSE closes one of its cursors: this closes the session's.
        EXECUTE 'CLOSE ALL';
        DISCARD TEMP;
        PERFORM pg_catalog.pg_advisory_unlock_all();
        RETURN ARRAY(SELECT name FROM pg_catalog.pg_prepared_statements WHERE from_sql);
    END
    $$
"""
_SESSION_RESET_BY_FUNCTION = (
    _RESET_SESSION_FUNCTION,
    "GRANT EXECUTE ON FUNCTION {schema}.reset_session() TO PUBLIC",
)

# Migration 20: each counting trigger's condition is its column's NULL test alone; the rest
# of it is tested first thing in the trigger's function. PostgreSQL prepares a trigger's
# WHEN clause in every statement that sets a column of its UPDATE OF list, for the first row
# whatever the rows are: the call of batch_change_counted() or key_change_counted() in it
# (looked up, its right to be called checked) cost every ack and claim, of tasks outside
# batches and without keys too. Counted by callgrind in the server, per task: lq_chain
# 707,977 -> 655,345 instructions, lq_one 660,481 -> 606,342. A task of a batch
# or with a key now fires its trigger on each change its statement makes (the function then
# returns at once when there is nothing to count), where the condition's call was made per
# row before: the same single call for a lease's ack or claim, one more step for each row of
# a statement that counts in bulk, which the server keeps queued until the statement ends
# (about 16 bytes a row and trigger: 16 MB for a cancel_batch of a million tasks). The
# conditions are unchanged, so workers of the earlier release count right beside this one;
# only a session without a query text (current_query() NULL: a background worker), whose
# rows the WHEN clause left uncounted, now has them counted.
_REPLACE_COUNT_BATCH_TASK = """
    CREATE OR REPLACE FUNCTION {schema}.count_batch_task() RETURNS trigger
    LANGUAGE plpgsql AS $$
    DECLARE
        v_stripe smallint;
        v_left bigint;
"""
# A statement that counts the batch's tasks itself (see BULK_MARKER), as an OR-chain's link.
_COUNTED_IN_BULK = f"""strpos(current_query(), '{BULK_MARKER}') > 0
           OR current_setting('leasequeue.counted_in_bulk', true) IS NOT DISTINCT FROM 'on'"""
# Nothing to count: the status did not change, or not into or out of a finished one, or the
# statement counts in bulk.
_RETURN_IF_NOTHING_TO_COUNT = f"""\
        IF OLD.status IS NOT DISTINCT FROM NEW.status
           OR NOT (OLD.status IN ('done', 'dead', 'cancelled')
                   OR NEW.status IN ('done', 'dead', 'cancelled'))
           OR {_COUNTED_IN_BULK}
        THEN
            RETURN NULL;
        END IF;
"""
_COUNT_BATCH_TASK_V20 = f"""{_REPLACE_COUNT_BATCH_TASK}    BEGIN
{_RETURN_IF_NOTHING_TO_COUNT}        v_stripe := {_SESSION_STRIPE};
{_COUNT_INTO_STRIPE}"""
_COUNT_KEY_RUNNING_V20 = (
    "\n    CREATE OR REPLACE FUNCTION "
    + _KEY_RUNNING_FUNCTION
    + f"""        IF (OLD.status = 'processing') IS NOT DISTINCT FROM (NEW.status = 'processing')
           OR current_setting('leasequeue.keys_counted', true) IS NOT DISTINCT FROM 'on'
           OR strpos(current_query(), '{KEYS_MARKER}') > 0
        THEN
            RETURN NULL;
        END IF;
"""
    + _COUNT_KEY_CHANGE
)
_CONDITIONS_IN_THE_FUNCTIONS = (
    _COUNT_BATCH_TASK_V20,
    _COUNT_KEY_RUNNING_V20,
    "DROP TRIGGER tasks_batch_counts ON {schema}.tasks",
    _counting_trigger(
        "tasks_batch_counts", "batch_id", None, "count_batch_task", updated="finished_at"
    ),
    "DROP TRIGGER tasks_key_running ON {schema}.tasks",
    _counting_trigger("tasks_key_running", "concurrency_key", None, "count_key_running"),
    "DROP FUNCTION {schema}.batch_change_counted(text, text)",
    "DROP FUNCTION {schema}.key_change_counted(text, text)",
)

# Migration 21: an attempt's conclusion and the claim of the next task in one commit. With
# claim_next, the round trip that ended an attempt committed the success mark and the ack,
# then the claim in a transaction of its own: two commits to wait for, one for the
# claim alone. This function concludes the attempt (conclude_attempt(), which raises when
# the fence fails, so nothing is claimed) and then claims the next task of the queue, as
# sql.CLAIM_ONE does, in the caller's transaction: one commit for both. The claim runs in
# a block of its own: when it fails (a trigger of the caller's refuses the task, say), its
# changes are undone alone, the error goes to the server's log as a warning, and the
# conclusion still commits, with no next task. Its rows end with the task's concurrency
# key, as a plain claim's do, so the next lease knows whether it is keyless: a lease whose
# task has a key concludes apart from the next claim (see sql.CONCLUDE_ATTEMPT_AND_CLAIM).
# tests/unit/test_statements.py holds the claim to sql.CLAIM_ONE.
# Its arguments, and the columns of a claim it returns (conclude_claim_and_begin() too).
_CONCLUDE_AND_CLAIM_SIGNATURE = """(
        p_attempt_id bigint, p_task_id bigint, p_token bigint, p_result jsonb,
        p_queue text, p_worker text, p_lease double precision, p_default_lease double precision
    ) RETURNS TABLE (
        id bigint, payload jsonb, priority integer, attempts integer, max_attempts integer,
        lease_token bigint, lease_expires_at timestamptz, idempotency_key text,
        lease_seconds double precision, run_at timestamptz, next_token_in double precision,
        concurrency_key text"""
_CONCLUDE_AND_CLAIM_HEAD = (
    """
    CREATE {replace}FUNCTION {{schema}}.conclude_and_claim"""
    + _CONCLUDE_AND_CLAIM_SIGNATURE
    + """
    )
    LANGUAGE plpgsql AS $$
    #variable_conflict use_column
    DECLARE
        v_claimed boolean;{declare}
    BEGIN
        PERFORM {{schema}}.conclude_attempt(p_attempt_id, p_task_id, p_token, p_result);
{before}        BEGIN
"""
)
_CONCLUDE_AND_CLAIM_TAIL = """, t.concurrency_key
            INTO id, payload, priority, attempts, max_attempts, lease_token, lease_expires_at,
                 idempotency_key, lease_seconds, run_at, next_token_in, concurrency_key;
            v_claimed := FOUND;
        EXCEPTION WHEN {handled} THEN
{after_handler}            RAISE WARNING {warning},
                p_task_id, SQLERRM;
{give_up}        END;
{after}        IF v_claimed THEN
            RETURN NEXT;
        END IF;
    END
    $$
"""


def _conclude_and_claim(
    *,
    replace: bool,
    declare: str,
    before: str,
    after: str,
    warning: str,
    handled: str,
    give_up: str,
) -> str:
    """conclude_and_claim() as a migration creates it (see migrations 21 and 22)."""
    head = _CONCLUDE_AND_CLAIM_HEAD.format(
        replace="OR REPLACE " if replace else "", declare=declare, before=before
    )
    tail = _CONCLUDE_AND_CLAIM_TAIL.format(
        after=after,
        after_handler=indent(after, "    "),
        warning=warning,
        handled=handled,
        give_up=indent(give_up, " " * 12),
    )
    return head + _CLAIM_ONE_UPDATE + tail


_CONCLUDE_AND_CLAIM = _conclude_and_claim(
    replace=False,
    declare="",
    before="",
    after="",
    warning="'task % concluded, but the claim of the next task after it failed: %'",
    handled="OTHERS",
    give_up="RETURN;\n",
)

# Migration 22: conclude_and_claim() claims only in a READ COMMITTED transaction, and
# waits at most CLAIM_LOCK_TIMEOUT for a lock. A work that ran under REPEATABLE READ or
# SERIALIZABLE would have the claim read with its snapshot, and under SERIALIZABLE the
# claim's reads could fail the commit and take the work's effects with them. A claim that
# waited (for a key's row, the only lock it can wait for) would hold the attempt's locks
# meanwhile. A claim cut by a statement timeout (the work's, which still applies) is undone
# alone too, as a failing one is. When the claim is not made, or undone, the function
# returns one row of NULLs and the client claims the next task apart, after the commit
# (attempts._NextClaim); no row means that no task was due.
CLAIM_LOCK_TIMEOUT = "100ms"
_NO_CLAIM_MADE = """\
RETURN NEXT;  -- a row of NULLs: the claim was not made
RETURN;
"""
_CONCLUDE_AND_CLAIM_V22 = _conclude_and_claim(
    replace=True,
    declare="\n        v_lock_timeout text;",
    before="""\
        IF current_setting('transaction_isolation') <> 'read committed' THEN
"""
    + indent(_NO_CLAIM_MADE, "            ")
    + """\
        END IF;
        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', '"""
    + CLAIM_LOCK_TIMEOUT
    + """', true);
""",
    after="""\
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
""",
    warning="'the claim of the next task after task % failed (it is claimed apart): %'",
    handled="OTHERS OR query_canceled",
    give_up="id := NULL;\n" + _NO_CLAIM_MADE,
)

# Migration 23: a batch's finish with less to do, counted by callgrind in the server per
# task of a batch drained with claim() and lease.ack(): 841,566 -> 758,296 instructions
# (a plain task: 606,714).
# - The end-of-batch probe read the batch index's last leaf page, every entry on it
#   (PostgreSQL 15 and 16 read a page whole before returning its first entry). While any
#   task of the batch is enqueued, the batch is not finished, and one task decides it
#   nearly always: the batch's last (last_task_id, set by enqueue_batch), since a batch's
#   tasks are claimed in the order they were enqueued. A primary-key look-up reads its
#   status, with the id its stripe's update returns (each stripe keeps it too). The probe
#   runs once that task has left 'enqueued': from the batch's last claims on, when a retried
#   or flow-controlled task is claimed after it, and for a batch or a stripe the earlier
#   release made (no last_task_id).
# - An ack (processing to done), nearly every finish, is told apart by two comparisons and
#   adds one to its stripe (an insert makes the session's stripe row when it is missing:
#   an upsert every time would lock the row first, one more WAL record a finish); any
#   other change has its conditions tested and is counted as before, its stripe's row made
#   only when the update finds none.
# Workers of the earlier release count right beside it: the stripes and their meaning are
# unchanged.
_RETURN_IF_COUNTED_IN_BULK = f"""\
        IF {_COUNTED_IN_BULK}
        THEN
            RETURN NULL;
        END IF;
"""
_LAST_TASK_OF_BATCH = "(SELECT last_task_id FROM {schema}.batches WHERE id = NEW.batch_id)"
_GENERAL_STRIPE_UPDATE = (
    indent(_STRIPE_UPDATE, "    ")
    + """            WHERE batch_id = NEW.batch_id AND stripe = v_stripe
            RETURNING last_task_id INTO v_last;
"""
)
# The parts of migration 23's function that migration 24's shares: an ack's upsert into
# the stripe when the update found no row, the count of any other change, and the end
# check that reads the batch's last task before probing the batch index.
_UPSERT_ACK_INTO_STRIPE = f"""\
                INSERT INTO {{schema}}.batch_counts AS c
                    (batch_id, stripe, done, changed_at, last_task_id)
                VALUES (NEW.batch_id, v_stripe, 1, clock_timestamp(), {_LAST_TASK_OF_BATCH})
                ON CONFLICT (batch_id, stripe)
                DO UPDATE SET done = c.done + 1, changed_at = clock_timestamp()
                RETURNING c.last_task_id INTO v_last;
"""
_COUNT_ANY_OTHER_CHANGE = f"""\
        ELSE
{indent(_RETURN_IF_NOTHING_TO_COUNT, "    ")}            v_stripe := {_SESSION_STRIPE};
{_GENERAL_STRIPE_UPDATE}            IF NOT FOUND THEN
                INSERT INTO {{schema}}.batch_counts (batch_id, stripe, last_task_id)
                VALUES (NEW.batch_id, v_stripe, {_LAST_TASK_OF_BATCH})
                ON CONFLICT DO NOTHING;
{indent(_GENERAL_STRIPE_UPDATE, "    ")}            END IF;
            IF NEW.status NOT IN ('done', 'dead', 'cancelled') THEN
                RETURN NULL;
            END IF;
        END IF;
"""
_LAST_TASK_THEN_PROBE = f"""\
        PERFORM 1 FROM {{schema}}.tasks WHERE id = v_last AND status = 'enqueued';
        IF FOUND THEN
            RETURN NULL;
        END IF;
{_ENQUEUED_PROBE}"""
_COUNT_BATCH_TASK_V23 = f"""{_REPLACE_COUNT_BATCH_TASK}        v_last bigint;
    BEGIN
        IF NEW.status = 'done' AND OLD.status = 'processing' THEN
{indent(_RETURN_IF_COUNTED_IN_BULK, "    ")}            v_stripe := {_SESSION_STRIPE};
            UPDATE {{schema}}.batch_counts SET done = done + 1, changed_at = clock_timestamp()
            WHERE batch_id = NEW.batch_id AND stripe = v_stripe
            RETURNING last_task_id INTO v_last;
            IF NOT FOUND THEN
{_UPSERT_ACK_INTO_STRIPE}            END IF;
{_COUNT_ANY_OTHER_CHANGE}{_LAST_TASK_THEN_PROBE}"""
_BATCH_LAST_TASK = (
    # No default: adding the columns rewrites nothing.
    "ALTER TABLE {schema}.batches ADD COLUMN last_task_id bigint",
    "ALTER TABLE {schema}.batch_counts ADD COLUMN last_task_id bigint",
    _COUNT_BATCH_TASK_V23,
)

# Migration 24: no reads for a batch's end under SERIALIZABLE. The end-of-batch check reads
# the batch's last task, its index and its stripes, which other finishes write: two
# overlapping SERIALIZABLE transactions finishing tasks of one batch (attempts whose work
# runs SERIALIZABLE) each read what the other wrote, and the second commit failed, its
# attempt with it, for the package's own bookkeeping. Under SERIALIZABLE a finish now only
# counts: the batch's end is found by wait_batch's poll, not by a NOTIFY. (Under
# REPEATABLE READ the reads cannot fail a commit; a check on an old snapshot may miss the
# end, which the poll finds too.)
# The check costs a finish about 5,000 server instructions, which the ack's path gives
# back: one condition for an ack, and its update names the session's stripe from the
# setting, the stripe's function called only when the update finds no row (757,578 ->
# 756,853 instructions per batch task of a claim() and lease.ack() drain).
_COUNT_BATCH_TASK_V24 = f"""{_REPLACE_COUNT_BATCH_TASK}        v_last bigint;
    BEGIN
        IF NEW.status = 'done' AND OLD.status = 'processing'
           AND NOT ({_COUNTED_IN_BULK})
        THEN
            UPDATE {{schema}}.batch_counts SET done = done + 1, changed_at = clock_timestamp()
            WHERE batch_id = NEW.batch_id AND stripe = {_STRIPE_NAMED_BY_THE_SESSION}
            RETURNING last_task_id INTO v_last;
            IF NOT FOUND THEN
                v_stripe := {_SESSION_STRIPE};
{_UPSERT_ACK_INTO_STRIPE}            END IF;
{_COUNT_ANY_OTHER_CHANGE}        IF current_setting('transaction_isolation') = 'serializable' THEN
            RETURN NULL;
        END IF;
{_LAST_TASK_THEN_PROBE}"""

# Migration 25: the keyless ack and claim as one UPDATE (sql.ACK_KEYLESS_AND_CLAIM), whose
# fence is checked row by row beside the claim: when the acked row is not among those the
# statement moved, this raises, and the claim is undone with the statement. A function,
# because plain SQL has no RAISE; it touches nothing, so every role may call it. VOLATILE,
# so the planner neither folds the call at planning (every statement would raise) nor
# makes it a one-time filter evaluated before the rows are known.
_LEASE_GONE = (
    """
    CREATE FUNCTION {schema}.lease_gone(p_task_id bigint, p_token bigint) RETURNS boolean
    LANGUAGE plpgsql VOLATILE AS $$
    BEGIN
        RAISE EXCEPTION 'the lease on task % under token % is gone', p_task_id, p_token
            USING ERRCODE = 'LQ001';
    END
    $$
    """,
    "GRANT EXECUTE ON FUNCTION {schema}.lease_gone(bigint, bigint) TO PUBLIC",
)

# Migration 26: the next task's attempt begun in the commit that claims it. In the worker
# loop through attempts (attempt(claim_next=True)) each task took two round trips and two
# commits: the attempt's start record, then its conclusion with the next claim. The start
# record of the claimed task now commits with that claim: conclude_claim_and_begin() is
# conclude_and_claim() followed by begin_attempt() for the claimed task, and an attempt on
# that lease takes the record it began (attempts.run_attempt) instead of making one. The
# begin runs in a block of its own: when it fails, it is undone alone and the attempt is
# begun apart, as before. begin_attempt() is sql.BEGIN_ATTEMPT's statement, which now calls
# it: one text for both. The claimed task's identity is AttemptTarget.identity's for a
# task's own work (migration 5's text for it; tests/integration/test_attempts.py holds the
# two alike). A start record the lease did not use (concluded without an attempt, or by an
# attempt with a key of the caller's) is taken back by discard_begun_attempt(): workers have
# no DELETE on attempts, so it runs as the schema's owner, and deletes a record only while
# it is unused (running or skipped, and of its task).
# The start of an attempt: the running records of its work marked abandoned, the work's
# earlier records read, and its own record made.
_BEGIN_ATTEMPT_QUERY = """\
        WITH abandoned AS (
            UPDATE {schema}.attempts AS a
            SET outcome = 'abandoned', finished_at = clock_timestamp()
            WHERE a.identity = p_identity AND a.outcome = 'running'
            RETURNING a.id
        ), previous AS (
            -- One equality per identity, not IN (...): the generic plan, made while the
            -- table is nearly empty, then reads the index, not every record.
            SELECT count(*) AS n,
                   bool_or(r.outcome = 'succeeded') AS succeeded,
                   (array_agg(r.result) FILTER (WHERE r.outcome = 'succeeded'))[1] AS result
            FROM (SELECT a.outcome, a.result FROM {schema}.attempts AS a
                  WHERE a.identity = p_identity
                  UNION ALL
                  SELECT a.outcome, a.result FROM {schema}.attempts AS a
                  WHERE a.identity = p_legacy_identity) AS r
        ), began AS (
            INSERT INTO {schema}.attempts
                (identity, queue, key, attempt, task_id, worker_id, outcome, finished_at)
            SELECT p_identity, p_queue, p_key, previous.n + 1, p_task_id, p_worker,
                   CASE WHEN previous.succeeded THEN 'skipped' ELSE 'running' END,
                   CASE WHEN previous.succeeded THEN clock_timestamp() END
            FROM previous
            RETURNING id, attempt, outcome = 'skipped' AS skipped
        )
        SELECT began.id, began.attempt, began.skipped, (SELECT result FROM previous),
               (SELECT count(*) FROM abandoned)
        FROM began"""
# begin_attempt()'s parameters, result and language, after its name.
_BEGIN_ATTEMPT_SIGNATURE = """(
        p_identity text, p_legacy_identity text, p_queue text, p_key text, p_task_id bigint,
        p_worker text
    ) RETURNS TABLE (
        attempt_id bigint, attempt_number integer, duplicate boolean, success_result jsonb,
        abandoned_count bigint
    )
    LANGUAGE plpgsql AS $$
"""
_BEGIN_ATTEMPT_FUNCTION = (
    """
    CREATE FUNCTION {schema}.begin_attempt"""
    + _BEGIN_ATTEMPT_SIGNATURE
    + """    BEGIN
        RETURN QUERY
"""
    + _BEGIN_ATTEMPT_QUERY
    + """;
    END
    $$
"""
)
_CONCLUDE_CLAIM_AND_BEGIN = (
    """
    CREATE FUNCTION {schema}.conclude_claim_and_begin"""
    + _CONCLUDE_AND_CLAIM_SIGNATURE
    + """, attempt_id bigint, attempt_number integer,
        duplicate boolean, success_result jsonb, abandoned_count bigint
    )
    LANGUAGE plpgsql AS $$
    BEGIN
        SELECT c.id, c.payload, c.priority, c.attempts, c.max_attempts, c.lease_token,
               c.lease_expires_at, c.idempotency_key, c.lease_seconds, c.run_at,
               c.next_token_in, c.concurrency_key
        INTO id, payload, priority, attempts, max_attempts, lease_token, lease_expires_at,
             idempotency_key, lease_seconds, run_at, next_token_in, concurrency_key
        FROM {schema}.conclude_and_claim(
            p_attempt_id, p_task_id, p_token, p_result, p_queue, p_worker, p_lease,
            p_default_lease) AS c;
        IF NOT FOUND THEN
            RETURN;  -- no task was due
        END IF;
        IF id IS NOT NULL THEN
            BEGIN
                SELECT b.attempt_id, b.attempt_number, b.duplicate, b.success_result,
                       b.abandoned_count
                INTO attempt_id, attempt_number, duplicate, success_result, abandoned_count
                FROM {schema}.begin_attempt(
                    CASE WHEN idempotency_key IS NULL THEN 'task:' || id
                         ELSE 'queue:' || length(p_queue) || ':' || p_queue || ':'
                              || idempotency_key END,
                    'legacy:' || idempotency_key, p_queue, idempotency_key, id, p_worker) AS b;
            EXCEPTION WHEN OTHERS OR query_canceled THEN
                RAISE WARNING 'the attempt of task % was not begun with its claim (it is '
                    'begun apart): %', id, SQLERRM;
            END;
        END IF;
        RETURN NEXT;
    END
    $$
"""
)
_DISCARD_BEGUN_ATTEMPT = """
    CREATE FUNCTION {schema}.discard_begun_attempt(p_attempt_id bigint, p_task_id bigint)
    RETURNS void
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
        DELETE FROM {schema}.attempts
        WHERE id = p_attempt_id AND task_id = p_task_id AND outcome IN ('running', 'skipped')
    $$
"""
_BEGUN_ATTEMPTS = (
    _BEGIN_ATTEMPT_FUNCTION,
    _CONCLUDE_CLAIM_AND_BEGIN,
    _DISCARD_BEGUN_ATTEMPT,
    "GRANT EXECUTE ON FUNCTION {schema}.discard_begun_attempt(bigint, bigint) TO PUBLIC",
)

# Migration 27: the conclusion that begins the next attempt as one function, and the
# take-back fenced.
# - conclude_claim_and_begin() ran conclude_and_claim() and begin_attempt() as functions of
#   their own, each read back through a SELECT ... INTO from its rows, with a block each.
#   Their statements now run in it directly: conclude_attempt(), then the claim
#   (_CLAIM_ONE_UPDATE) and the start (_BEGIN_ATTEMPT_QUERY) in one block. A start that
#   fails undoes the claim with it, and both are made apart (a row of NULLs, as for any
#   claim not made); the start waits at most CLAIM_LOCK_TIMEOUT for a lock, as the claim
#   does, while the attempt's locks are held.
# - discard_begun_attempt() deleted a start record of any task whose id it was given, as the
#   schema's owner, for every role. It now takes the lease's token too and deletes only
#   while that lease holds the task (each caller takes a record back before concluding its
#   lease), and only the roles grant_worker names may call it.


def _for_the_claimed_task(start: str) -> str:
    """An attempt's start written for begin_attempt()'s parameters, with the names that
    conclude_claim_and_begin() gives the task it claimed."""
    return (
        start.replace("p_legacy_identity", "v_legacy_identity")
        .replace("p_identity", "v_identity")
        .replace("p_key", "idempotency_key")
        .replace("p_task_id", "v_task_id")
    )


_BEGIN_CLAIMED_ATTEMPT = (
    _for_the_claimed_task(_BEGIN_ATTEMPT_QUERY)
    + """
        INTO attempt_id, attempt_number, duplicate, success_result, abandoned_count"""
)
# conclude_claim_and_begin() from migration 27 on: its head, with ``{declare}`` for more
# variables; its lock timeout for the claim; the start of the claimed task's attempt, once
# ``id`` holds it, with the block's handler; and its end.
_CONCLUDE_CLAIM_AND_BEGIN_HEAD = (
    """
    CREATE OR REPLACE FUNCTION {{schema}}.conclude_claim_and_begin"""
    + _CONCLUDE_AND_CLAIM_SIGNATURE
    + """, attempt_id bigint, attempt_number integer,
        duplicate boolean, success_result jsonb, abandoned_count bigint
    )
    LANGUAGE plpgsql AS $$
    #variable_conflict use_column
    DECLARE
        v_lock_timeout text;
        v_identity text;
        v_legacy_identity text;
        v_task_id bigint;{declare}
    BEGIN
"""
)
_CLAIM_LOCK_TIMEOUT_SET = (
    """        v_lock_timeout := current_setting('lock_timeout');
        PERFORM set_config('lock_timeout', '"""
    + CLAIM_LOCK_TIMEOUT
    + """', true);
        BEGIN
"""
)
# The identity of a task's own work (AttemptTarget.identity): the task itself without an
# idempotency key, else its queue and key; laid out as conclude_claim_and_begin() has it.
TASK_WORK_IDENTITY = (
    "CASE WHEN {key} IS NULL THEN 'task:' || {id}\n"
    "                                   ELSE 'queue:' || length({queue}) || ':' || {queue} || ':'\n"
    "                                        || {key} END"
)
# The claimed task's identities, once ``id`` holds it.
_CLAIMED_IDENTITIES = (
    """\
                v_task_id := id;
                v_identity := """
    + TASK_WORK_IDENTITY.format(id="id", queue="p_queue", key="idempotency_key")
    + """;
                v_legacy_identity := 'legacy:' || idempotency_key;
"""
)
_BEGIN_CLAIMED_ATTEMPT_IF_CLAIMED = (
    _CLAIMED_IDENTITIES
    + _BEGIN_CLAIMED_ATTEMPT
    + """;
            END IF;
"""
)
_HANDLED = """\
        EXCEPTION WHEN OTHERS OR query_canceled THEN
"""
_LOCK_TIMEOUT_RESTORED = """\
            PERFORM set_config('lock_timeout', v_lock_timeout, true);
"""
_BEGIN_CLAIMED_ATTEMPT_THEN_HANDLE = (
    _BEGIN_CLAIMED_ATTEMPT_IF_CLAIMED + _HANDLED + _LOCK_TIMEOUT_RESTORED
)
_CLAIM_NOT_MADE_WARNING = """\
            RAISE WARNING 'the claim of the next task after task % failed (it is claimed '
                'apart): %', p_task_id, SQLERRM;
"""
_CONCLUDE_CLAIM_AND_BEGIN_END = """\
            id := NULL;
            RETURN NEXT;  -- a row of NULLs: the claim was not made
            RETURN;
        END;
        PERFORM set_config('lock_timeout', v_lock_timeout, true);
        IF id IS NOT NULL THEN
            RETURN NEXT;
        END IF;
    END
    $$
"""
_CONCLUDE_CLAIM_AND_BEGIN_V27 = (
    _CONCLUDE_CLAIM_AND_BEGIN_HEAD.format(declare="")
    + """        PERFORM {schema}.conclude_attempt(p_attempt_id, p_task_id, p_token, p_result);
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            RETURN NEXT;  -- a row of NULLs: the claim was not made
            RETURN;
        END IF;
"""
    + _CLAIM_LOCK_TIMEOUT_SET
    + _CLAIM_ONE_UPDATE
    + """, t.concurrency_key
            INTO id, payload, priority, attempts, max_attempts, lease_token, lease_expires_at,
                 idempotency_key, lease_seconds, run_at, next_token_in, concurrency_key;
            IF FOUND THEN
"""
    + _BEGIN_CLAIMED_ATTEMPT_THEN_HANDLE
    + _CLAIM_NOT_MADE_WARNING
    + _CONCLUDE_CLAIM_AND_BEGIN_END
)
_DISCARD_BEGUN_ATTEMPT_V27 = """
    CREATE FUNCTION {schema}.discard_begun_attempt(
        p_attempt_id bigint, p_task_id bigint, p_token bigint
    ) RETURNS void
    LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
        DELETE FROM {schema}.attempts AS a
        WHERE a.id = p_attempt_id AND a.task_id = p_task_id
          AND a.outcome IN ('running', 'skipped')
          AND EXISTS (SELECT FROM {schema}.tasks AS t
                      WHERE t.id = p_task_id AND t.lease_token = p_token
                        AND t.status = 'processing')
    $$
"""
_ONE_FUNCTION_AND_A_FENCED_TAKE_BACK = (
    _CONCLUDE_CLAIM_AND_BEGIN_V27,
    "DROP FUNCTION {schema}.discard_begun_attempt(bigint, bigint)",
    _DISCARD_BEGUN_ATTEMPT_V27,
    "REVOKE ALL ON FUNCTION {schema}.discard_begun_attempt(bigint, bigint, bigint) FROM PUBLIC",
)

# Migration 28: the ack and the claim in conclude_claim_and_begin() as one UPDATE. The
# attempt's conclusion ran the fenced ack (conclude_attempt()) and then the claim, two
# UPDATEs of tasks, each set up on its own; the worker loop's keyless ack and claim is one
# UPDATE of both rows (sql.ACK_KEYLESS_AND_CLAIM, migration 25), and so is this one, its
# parameters named (tests/unit/test_statements.py holds the two alike). The success mark
# comes first, on its own. When the acked row is not among those moved, the fence failed:
# LQ001 is raised, the claim is undone with the block and the conclusion fails, as before.
# When the claim fails (a trigger of the caller's, a lock wait past CLAIM_LOCK_TIMEOUT), the
# ack goes with it, and is made again alone (conclude_attempt()) before the row of NULLs
# that has the next task claimed apart: a claim that fails still costs the conclusion
# nothing.
_ACK_KEYLESS_AND_CLAIM_IN_A_FUNCTION = (
    """\
        WITH picked AS (
"""
    + _PICK_ONE
    + """\
        ), moved AS (
        UPDATE {schema}.tasks AS t
        SET status = CASE WHEN t.id = p_task_id THEN 'done' ELSE 'processing' END,
            result = CASE WHEN t.id = p_task_id THEN p_result ELSE t.result END,
            attempts = CASE WHEN t.id = p_task_id THEN t.attempts ELSE t.attempts + 1 END,
            lease_token = CASE WHEN t.id = p_task_id THEN t.lease_token
                               ELSE nextval({lease_tokens}::regclass) END,
            lease_expires_at = CASE WHEN t.id = p_task_id THEN NULL ELSE clock_timestamp()
                + make_interval(
                    secs => coalesce(p_lease, t.lease_seconds, p_default_lease)) END,
            worker_id = CASE WHEN t.id = p_task_id THEN t.worker_id ELSE p_worker END,
            finished_at = CASE WHEN t.id = p_task_id THEN clock_timestamp()
                               ELSE t.finished_at END,
            updated_at = clock_timestamp()
        WHERE t.id = ANY (ARRAY[p_task_id, (SELECT id FROM picked)])
          AND (t.id <> p_task_id
               OR (id = p_task_id AND lease_token = p_token AND status = 'processing'))
        RETURNING t.id, t.payload, t.priority, t.attempts, t.max_attempts, t.lease_token,
                  t.lease_expires_at, t.idempotency_key,
                  coalesce(p_lease, t.lease_seconds, p_default_lease) AS lease_seconds,
                  t.run_at, NULL::double precision AS next_token_in, t.concurrency_key
        )"""
)
# Above READ COMMITTED the attempt concludes alone, and a row of NULLs says so.
_CONCLUDED_ALONE_ABOVE_READ_COMMITTED = """\
        IF current_setting('transaction_isolation') <> 'read committed' THEN
            PERFORM {schema}.conclude_attempt(p_attempt_id, p_task_id, p_token, p_result);
            RETURN NEXT;  -- a row of NULLs: the claim was not made
            RETURN;
        END IF;
"""
# The success mark before the ack and claim, as migrations 28 and 29 make it.
_SUCCESS_MARKED_BY_CONCLUDE_ATTEMPT = """\
        PERFORM {schema}.conclude_attempt(p_attempt_id, NULL, NULL, p_result);
"""
# The ack and claim, the fence checked, and ``IF id IS NOT NULL THEN`` opened for the start.
_ACK_AND_CLAIM_FENCED = (
    _CLAIM_LOCK_TIMEOUT_SET
    + _ACK_KEYLESS_AND_CLAIM_IN_A_FUNCTION
    + """
        SELECT EXISTS (SELECT FROM moved AS a WHERE a.id = p_task_id), c.id, c.payload,
               c.priority, c.attempts, c.max_attempts, c.lease_token, c.lease_expires_at,
               c.idempotency_key, c.lease_seconds, c.run_at, c.next_token_in,
               c.concurrency_key
        INTO v_acked, id, payload, priority, attempts, max_attempts, lease_token,
             lease_expires_at, idempotency_key, lease_seconds, run_at, next_token_in,
             concurrency_key
        FROM (SELECT) AS one LEFT JOIN moved AS c ON c.id <> p_task_id;
            IF NOT v_acked THEN
                RAISE EXCEPTION 'the lease on task % under token % is gone', p_task_id, p_token
                    USING ERRCODE = 'LQ001';
            END IF;
            IF id IS NOT NULL THEN
"""
)
_ACK_AND_CLAIM_THEN_FENCE = (
    _CONCLUDED_ALONE_ABOVE_READ_COMMITTED
    + _SUCCESS_MARKED_BY_CONCLUDE_ATTEMPT
    + _ACK_AND_CLAIM_FENCED
)
_CONCLUDE_CLAIM_AND_BEGIN_V28 = (
    _CONCLUDE_CLAIM_AND_BEGIN_HEAD.format(declare="\n        v_acked boolean;")
    + _ACK_AND_CLAIM_THEN_FENCE
    + _BEGIN_CLAIMED_ATTEMPT_THEN_HANDLE
    + """            IF SQLSTATE = 'LQ001' THEN
                RAISE;
            END IF;
"""
    + _CLAIM_NOT_MADE_WARNING
    + """            PERFORM {schema}.conclude_attempt(NULL, p_task_id, p_token, p_result);
"""
    + _CONCLUDE_CLAIM_AND_BEGIN_END
)

# Migration 29: a cancel that cuts conclude_claim_and_begin()'s ack and claim is not
# waited out. Since migration 28 the ack runs in the block whose handler makes it again
# alone when the claim fails. A cancel (the work's statement timeout, or the client's
# bound on its wait: bounded.py) fires once; when it cut an ack that waited for a row
# another session holds, the ack made again after it would wait for that row without
# bound. After a cancel, the ack made alone keeps the claim's lock timeout, and fails the
# conclusion when it would wait longer.
# The handler from migration 29 on, with the function's end.
_ACK_MADE_ALONE_WHEN_THE_CLAIM_FAILS = (
    _HANDLED
    + """            IF SQLSTATE = 'LQ001' THEN
                RAISE;
            END IF;
            IF SQLSTATE <> '57014' THEN  -- query_canceled: keep the claim's lock timeout
"""
    + "    "
    + _LOCK_TIMEOUT_RESTORED
    + """            END IF;
            RAISE WARNING 'the ack and claim after task % failed (the ack is made alone, '
                'the next task claimed apart): %', p_task_id, SQLERRM;
            PERFORM {schema}.conclude_attempt(NULL, p_task_id, p_token, p_result);
"""
    + _LOCK_TIMEOUT_RESTORED
    + _CONCLUDE_CLAIM_AND_BEGIN_END
)
_CONCLUDE_CLAIM_AND_BEGIN_V29 = (
    _CONCLUDE_CLAIM_AND_BEGIN_HEAD.format(declare="\n        v_acked boolean;")
    + _ACK_AND_CLAIM_THEN_FENCE
    + _BEGIN_CLAIMED_ATTEMPT_IF_CLAIMED
    + _ACK_MADE_ALONE_WHEN_THE_CLAIM_FAILS
)

# Migration 30: an attempt's start as statements of their own, and its success mark in the
# conclusion itself. The start was one statement of four parts (the work's running records
# marked abandoned, its earlier records read, its own record made), and PostgreSQL sets up
# every part of a statement each time it runs it, the UPDATE that finds nothing to mark
# included: a result relation, its indexes and its checks. The earlier records are now
# read first, with the ids of the running ones; only when there are any are those of the
# work's identity marked abandoned (the ones still running: the records the one
# statement's snapshot saw, as before); and the record is made by an INSERT of one row. A
# task without an idempotency key has no records of an earlier release (migration 5): its
# read is of one identity, not two, and a probe of the index comes first, since its first
# attempt (most of them) finds none. conclude_claim_and_begin() marks the concluded
# attempt's success with its own UPDATE, instead of through a call of conclude_attempt(),
# a function of its own. Counted by callgrind in the server, the loop through attempts
# (lq_chain_attempt) took 867,790 instructions per task before, 760,072 after; an attempt
# begun apart (lq_attempt) 1,067,948 and 970,681.
_BEGIN_ATTEMPT_STATEMENTS = """\
        IF p_legacy_identity IS NULL THEN
            -- A task's first attempt finds no records: one probe of the index, and none of
            -- the aggregates below set up.
            PERFORM FROM {schema}.attempts AS a WHERE a.identity = p_identity LIMIT 1;
            IF FOUND THEN
                SELECT count(*), coalesce(bool_or(a.outcome = 'succeeded'), false),
                       (array_agg(a.result) FILTER (WHERE a.outcome = 'succeeded'))[1],
                       array_agg(a.id) FILTER (WHERE a.outcome = 'running')
                INTO v_count, duplicate, success_result, v_running
                FROM {schema}.attempts AS a
                WHERE a.identity = p_identity;
            ELSE
                v_count := 0;
                duplicate := false;
            END IF;
        ELSE
            -- One equality per identity, not IN (...): the generic plan, made while the
            -- table is nearly empty, then reads the index, not every record.
            SELECT count(*), coalesce(bool_or(r.outcome = 'succeeded'), false),
                   (array_agg(r.result) FILTER (WHERE r.outcome = 'succeeded'))[1],
                   array_agg(r.id) FILTER (WHERE r.outcome = 'running')
            INTO v_count, duplicate, success_result, v_running
            FROM (SELECT a.id, a.outcome, a.result FROM {schema}.attempts AS a
                  WHERE a.identity = p_identity
                  UNION ALL
                  SELECT a.id, a.outcome, a.result FROM {schema}.attempts AS a
                  WHERE a.identity = p_legacy_identity) AS r;
        END IF;
        abandoned_count := 0;
        IF v_running IS NOT NULL THEN
            -- By identity, which the generic plan reads by index, as the look-up.
            UPDATE {schema}.attempts AS a
            SET outcome = 'abandoned', finished_at = clock_timestamp()
            WHERE a.identity = p_identity AND a.outcome = 'running' AND a.id = ANY (v_running);
            GET DIAGNOSTICS abandoned_count = ROW_COUNT;
        END IF;
        INSERT INTO {schema}.attempts AS a
            (identity, queue, key, attempt, task_id, worker_id, outcome, finished_at)
        VALUES (p_identity, p_queue, p_key, v_count + 1, p_task_id, p_worker,
                CASE WHEN duplicate THEN 'skipped' ELSE 'running' END,
                CASE WHEN duplicate THEN clock_timestamp() END)
        RETURNING a.id, a.attempt INTO attempt_id, attempt_number;
"""
_BEGIN_ATTEMPT_VARIABLES = """
        v_count bigint;
        v_running bigint[];"""
_BEGIN_ATTEMPT_FUNCTION_V30 = (
    """
    CREATE OR REPLACE FUNCTION {schema}.begin_attempt"""
    + _BEGIN_ATTEMPT_SIGNATURE
    + """    DECLARE"""
    + _BEGIN_ATTEMPT_VARIABLES
    + """
    BEGIN
"""
    + _BEGIN_ATTEMPT_STATEMENTS
    + """        RETURN NEXT;
    END
    $$
"""
)
_CONCLUDE_CLAIM_AND_BEGIN_V30 = (
    _CONCLUDE_CLAIM_AND_BEGIN_HEAD.format(
        declare="\n        v_acked boolean;" + _BEGIN_ATTEMPT_VARIABLES
    )
    + _CONCLUDED_ALONE_ABOVE_READ_COMMITTED
    + """\
        IF p_attempt_id IS NOT NULL THEN
            UPDATE {schema}.attempts AS a
            SET outcome = 'succeeded', result = p_result, finished_at = clock_timestamp()
            WHERE a.id = p_attempt_id;
        END IF;
"""
    + _ACK_AND_CLAIM_FENCED
    + _CLAIMED_IDENTITIES
    + indent(_for_the_claimed_task(_BEGIN_ATTEMPT_STATEMENTS), " " * 8)
    + """            END IF;
"""
    + _ACK_MADE_ALONE_WHEN_THE_CLAIM_FAILS
)

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
            # rest (a key chosen by the caller, or a task since purged) stay in that one
            # space ("legacy:").
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
            # A worker of the earlier release, still running during a rolling upgrade,
            # records attempts without an identity: they keep their old meaning.
            """
            CREATE FUNCTION {schema}.attempt_of_an_earlier_release() RETURNS trigger
            LANGUAGE plpgsql AS $$
            BEGIN
                NEW.identity := 'legacy:' || NEW.key;
                RETURN NEW;
            END
            $$
            """,
            """
            CREATE TRIGGER attempts_of_an_earlier_release
                BEFORE INSERT ON {schema}.attempts
                FOR EACH ROW WHEN (NEW.identity IS NULL)
                EXECUTE FUNCTION {schema}.attempt_of_an_earlier_release()
            """,
            "DROP INDEX {schema}.attempts_success_idx",
            "DROP INDEX {schema}.attempts_key_idx",
            "CREATE INDEX attempts_identity_idx ON {schema}.attempts (identity)",
            """
            CREATE UNIQUE INDEX attempts_success_idx ON {schema}.attempts (identity)
                WHERE outcome = 'succeeded'
            """,
        ),
    ),
    Migration(
        6,
        "task batches, with their finished tasks counted in stripes",
        (
            """
            CREATE TABLE {schema}.batches (
                id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
                name text,
                queue text NOT NULL,
                total bigint NOT NULL DEFAULT 0,
                created_at timestamptz NOT NULL DEFAULT clock_timestamp()
            )
            """,
            """
            CREATE UNIQUE INDEX batches_name_idx ON {schema}.batches (name)
                WHERE name IS NOT NULL
            """,
            # Updated in place by every finish: room on the page keeps the updates HOT.
            """
            CREATE TABLE {schema}.batch_counts (
                batch_id bigint NOT NULL,
                stripe smallint NOT NULL,
                done bigint NOT NULL DEFAULT 0,
                dead bigint NOT NULL DEFAULT 0,
                cancelled bigint NOT NULL DEFAULT 0,
                changed_at timestamptz,
                PRIMARY KEY (batch_id, stripe)
            ) WITH (fillfactor = 50)
            """,
            # No default: adding the column rewrites nothing. No foreign key: a check per
            # row would slow every enqueue of a batch, and only enqueue_batch sets it.
            "ALTER TABLE {schema}.tasks ADD COLUMN batch_id bigint",
            _COUNT_BATCH_TASK,
            # The WHEN clause is evaluated without calling the function: tasks outside a
            # batch, and changes between enqueued and processing, cost nothing here.
            """
            CREATE TRIGGER tasks_batch_counts
                AFTER UPDATE OF status ON {schema}.tasks
                FOR EACH ROW
                WHEN (NEW.batch_id IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
                      AND (OLD.status IN ('done', 'dead', 'cancelled')
                           OR NEW.status IN ('done', 'dead', 'cancelled'))
                      AND current_setting('leasequeue.counted_in_bulk', true)
                          IS DISTINCT FROM 'on')
                EXECUTE FUNCTION {schema}.count_batch_task()
            """,
        ),
    ),
    Migration(
        7,
        "a batch's tasks indexed by status",
        (
            # A batch's results, its running tasks, and cancel_batch read its tasks by
            # status; in id order, so results come in the order they were enqueued.
            """
            CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_batch_idx
                ON {schema}.tasks (batch_id, status, id) WHERE batch_id IS NOT NULL
            """,
        ),
        concurrently=True,
    ),
    Migration(
        8,
        "batch counts: a free stripe per transaction, a cheaper end-of-batch check, bulk"
        " statements marked in their text, running tasks counted by a plain index scan",
        (
            _BATCH_STRIPE,
            _BATCH_PROCESSING,
            _COUNT_BATCH_TASK_V8,
            "DROP TRIGGER tasks_batch_counts ON {schema}.tasks",
            _BATCH_COUNTS_TRIGGER_V8,
        ),
    ),
    Migration(
        9,
        "flow control: pausing, concurrency limits per key, token buckets",
        (*_FLOW_TABLES, _FLOW_KEY_ROOM, _CLAIM_FLOW, _COUNT_KEY_RUNNING, _KEY_RUNNING_TRIGGER),
    ),
    Migration(
        10,
        "a queue's waiting tasks by concurrency key",
        (
            # claim_flow's look-up of each key's first tasks, and of the keys waiting.
            """
            CREATE INDEX CONCURRENTLY IF NOT EXISTS tasks_key_claim_idx
                ON {schema}.tasks (queue, concurrency_key, priority DESC, run_at, id)
                WHERE status = 'enqueued' AND concurrency_key IS NOT NULL
            """,
        ),
        concurrently=True,
    ),
    Migration(
        11, "claim_flow locks the keys it needs, not every key it looks at", (_CLAIM_FLOW_V11,)
    ),
    Migration(
        12,
        "claim_flow scans again when tasks it picked were leased by another claimer",
        (_CLAIM_FLOW_V12,),
    ),
    Migration(
        13, "claim_one(): the plain claim of one task, planned once per session", (_CLAIM_ONE,)
    ),
    Migration(
        14,
        "batch counts: a stripe held for the session, and an ack's count with nothing to compute",
        (_BATCH_SESSION_STRIPE, _COUNT_BATCH_TASK_V14),
    ),
    Migration(
        15,
        "trigger conditions that statements outside batches and keys prepare cheaply",
        (
            _BATCH_CHANGE_COUNTED,
            _KEY_CHANGE_COUNTED,
            "DROP TRIGGER tasks_batch_counts ON {schema}.tasks",
            _counting_trigger(
                "tasks_batch_counts", "batch_id", "batch_change_counted", "count_batch_task"
            ),
            "DROP TRIGGER tasks_key_running ON {schema}.tasks",
            _counting_trigger(
                "tasks_key_running", "concurrency_key", "key_change_counted", "count_key_running"
            ),
        ),
    ),
    Migration(16, "claim_flow takes its first picks in one statement", (_CLAIM_FLOW_V16,)),
    Migration(
        17,
        "checks on tasks and attempts that statements prepare cheaply",
        _CHEAP_CHECKS,
    ),
    Migration(
        18,
        "the batch trigger considered only by statements that finish a task or take one back",
        _BATCH_TRIGGER_ON_FINISHES,
    ),
    Migration(19, "a lent connection's session reset by one function", _SESSION_RESET_BY_FUNCTION),
    Migration(
        20,
        "counting triggers whose conditions are their column's NULL test alone",
        _CONDITIONS_IN_THE_FUNCTIONS,
    ),
    Migration(
        21,
        "an attempt's conclusion and the claim of the next task in one commit",
        (_CONCLUDE_AND_CLAIM,),
    ),
    Migration(
        22,
        "the claim that commits with an attempt: READ COMMITTED only, its lock waits bounded",
        (_CONCLUDE_AND_CLAIM_V22,),
    ),
    Migration(
        23,
        "a batch's finish reads its last task before probing the batch index for its end",
        _BATCH_LAST_TASK,
    ),
    Migration(
        24,
        "a batch's finish under SERIALIZABLE counts and reads nothing for the batch's end",
        (_COUNT_BATCH_TASK_V24,),
    ),
    Migration(
        25,
        "the keyless ack and claim in one update, a failed fence raised by lease_gone()",
        _LEASE_GONE,
    ),
    Migration(
        26,
        "the next task's attempt begun in the commit that claims it",
        _BEGUN_ATTEMPTS,
    ),
    Migration(
        27,
        "the conclusion that begins the next attempt as one function, its take-back fenced",
        _ONE_FUNCTION_AND_A_FENCED_TAKE_BACK,
    ),
    Migration(
        28,
        "the ack and the claim of an attempt's conclusion as one update",
        (_CONCLUDE_CLAIM_AND_BEGIN_V28,),
    ),
    Migration(
        29,
        "a cancel that cuts the ack and claim of an attempt's conclusion is not waited out",
        (_CONCLUDE_CLAIM_AND_BEGIN_V29,),
    ),
    Migration(
        30,
        "an attempt's start as statements of their own, its success mark in the conclusion",
        (_BEGIN_ATTEMPT_FUNCTION_V30, _CONCLUDE_CLAIM_AND_BEGIN_V30),
    ),
)

LATEST_VERSION = MIGRATIONS[-1].version
