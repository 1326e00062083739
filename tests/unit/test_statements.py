"""The hot statements are written out whole in sql.py; these tests hold them together.

Where several statements share a condition (the fence) or a part (the claim's pick, set
and returned columns), each is checked to have it exactly, and the column order the hot
paths read by position is pinned.
"""

from __future__ import annotations

import re

from dagster_leasequeue import attempts, migrations, sql


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def _between(text: str, start: str, end: str) -> str:
    flat = _flat(text)
    begin = flat.index(start)
    return flat[begin : flat.index(end, begin) + len(end)]


def test_every_fenced_statement_has_the_fence_whole() -> None:
    for statement in (sql.ACK, sql.FAIL, sql.RELEASE, sql.RENEW):
        assert f"WHERE {sql.FENCE}" in _flat(statement)
    # The same condition on the task's row named t: in the start of an attempt on a lease,
    # per row of many leases, and in the attempt's conclusion.
    on_t = (
        sql.FENCE.replace("id =", "t.id =")
        .replace("lease_token =", "t.lease_token =")
        .replace("AND status", "AND t.status")
    )
    assert f"WHERE {on_t}" in _flat(sql.BEGIN_ATTEMPT_UNDER_LEASE)
    per_row = on_t.replace("%(task_id)s", "a.task_id").replace("%(token)s", "a.token")
    assert f"WHERE {per_row}" in _flat(sql.ACK_MANY)
    # The keyless ack and claim moves two rows: the claimed one, and the acked one under
    # the fence.
    keyless = "AND (t.id <> %(task_id)s OR (" + sql.FENCE + "))"
    assert keyless in _flat(sql.ACK_KEYLESS_AND_CLAIM)
    conclusion = sql.FENCE.replace("%(task_id)s", "p_task_id").replace("%(token)s", "p_token")
    (function,) = migrations.MIGRATIONS[3].statements
    assert f"WHERE {conclusion}" in _flat(function)


def test_the_function_that_undoes_a_zombies_claim_is_volatile() -> None:
    # Declared IMMUTABLE or STABLE, lease_gone() could be folded at planning, and every
    # keyless ack_and_claim would raise; or be made a one-time filter, run before the
    # statement's rows are known.
    (migration,) = [m for m in migrations.MIGRATIONS if "lease_gone" in m.statements[0]]
    assert "LANGUAGE plpgsql VOLATILE AS" in _flat(migration.statements[0])
    assert "ELSE {schema}.lease_gone(%(task_id)s, %(token)s) END" in _flat(
        sql.ACK_KEYLESS_AND_CLAIM
    )


def test_the_two_claims_pick_set_and_return_alike() -> None:
    one, many = sql.CLAIM_ONE, sql.CLAIM_MANY
    pick = ("SELECT id FROM", "FOR UPDATE SKIP LOCKED")
    assert _between(one, *pick) == _between(many, *pick)
    lease = ("SET status = 'processing'", "updated_at = clock_timestamp()")
    assert _between(one, *lease) == _between(many, *lease)
    assert _returned(_leased(one)) == _returned(_leased(many))


def test_the_claim_in_a_script_is_the_plain_claim_of_one_task() -> None:
    # claim_one() (migration 13) runs sql.CLAIM_ONE with its parameters named, up to the
    # key column a plain claim adds for the worker's ack (the function's columns are fixed
    # by its migration).
    (function,) = migrations.MIGRATIONS[12].statements
    body = _parenthesised(function)
    assert _in_a_function(_leased(sql.CLAIM_ONE)) in body
    assert "CLAIM_ONE" not in body and "%(" not in body


def test_the_claim_that_commits_with_an_attempt_is_the_plain_claim_of_one_task() -> None:
    # conclude_and_claim() (migrations 21 and 22) runs sql.CLAIM_ONE whole, its parameters
    # named.
    for migration in migrations.MIGRATIONS[20:22]:
        (function,) = migration.statements
        body = _parenthesised(function)
        assert _in_a_function(sql.CLAIM_ONE) + " INTO id," in body
        assert "CLAIM_ONE" not in body and "%(" not in body


def test_the_conclusion_that_begins_the_next_attempt_acks_and_claims_as_the_worker_loop() -> None:
    # conclude_claim_and_begin() (migration 27) runs sql.CLAIM_ONE whole, and from migration
    # 28 on, the keyless ack and claim of the worker loop (sql.ACK_KEYLESS_AND_CLAIM) up to
    # its final SELECT, its parameters named.
    (v27, *_) = migrations.MIGRATIONS[26].statements
    assert _in_a_function(sql.CLAIM_ONE) + " INTO id," in _parenthesised(v27)
    keyless = sql.ACK_KEYLESS_AND_CLAIM
    moved = _in_a_function(keyless[: keyless.index("SELECT id, CASE")])
    moved = (
        moved.replace("%(task_id)s::bigint", "p_task_id")
        .replace("%(task_id)s", "p_task_id")
        .replace("%(result)s::jsonb", "p_result")
        .replace("%(token)s", "p_token")
    )
    for migration in migrations.MIGRATIONS[27:29]:
        (function,) = migration.statements
        assert moved in _parenthesised(function)
        assert "%(" not in function


def _in_a_function(claim: str) -> str:
    """A claim as a function runs it: its parameters named, its limit 1."""
    return _parenthesised(
        _flat(claim)
        .replace("%(queue)s", "p_queue")
        .replace("%(worker_id)s", "p_worker")
        .replace("%(lease_seconds)s", "p_lease")
        .replace("%(default_lease)s", "p_default_lease")
        .replace("{limit}", "1")
    )


def _parenthesised(text: str) -> str:
    return _flat(text).replace("( ", "(").replace(" )", ")")


def _leased(claim: str) -> str:
    """The claim up to the end of its lease's RETURNING list (what follows counts keys, or
    is claim_flow's part for a controlled queue)."""
    flat = _flat(claim)
    return flat[: flat.index("AS next_token_in") + len("AS next_token_in")]


def _returned(statement: str) -> list[str]:
    """The RETURNING list, split at the commas outside parentheses."""
    text = _flat(statement)
    return _listed(text[text.rindex("RETURNING") + len("RETURNING") :])


def _table_columns(function: str) -> list[str]:
    """A function's RETURNS TABLE columns, each with its type."""
    text = _flat(function)
    start = text.index("RETURNS TABLE (") + len("RETURNS TABLE (")
    return _listed(text[start : text.index(")", text.index("abandoned_count", start))])


def _listed(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses."""
    items, depth, current = [], 0, ""
    for char in text:
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(current.strip())
            current = ""
        else:
            current += char
    return [*items, current.strip()]


def test_the_keyless_ack_and_claim_sets_the_claimed_row_as_a_claim_does() -> None:
    # Its one UPDATE gives each column the claim sets either the claim's value for both
    # rows, or a CASE whose value for the row that is not the acked one is the claim's.
    def assignments(statement: str, end: str) -> dict[str, str]:
        listed = _listed(_between(statement, "SET status", end)[len("SET ") : -len(end)])
        return dict(item.split(" = ", 1) for item in listed)

    claim = assignments(sql.CLAIM_MANY, " FROM picked")
    keyless = assignments(sql.ACK_KEYLESS_AND_CLAIM, " WHERE t.id")
    for column, value in claim.items():
        assert keyless[column] == value or re.fullmatch(
            r"CASE WHEN t\.id = %\(task_id\)s THEN .+ ELSE " + re.escape(value) + " END",
            keyless[column],
        ), column


def test_the_columns_the_hot_paths_read_by_position() -> None:
    # queue.claim_many builds each Lease from these positions.
    assert _returned(_leased(sql.CLAIM_MANY)) == [
        "t.id",
        "t.payload",
        "t.priority",
        "t.attempts",
        "t.max_attempts",
        "t.lease_token",
        "t.lease_expires_at",
        "t.idempotency_key",
        "coalesce(%(lease_seconds)s, t.lease_seconds, %(default_lease)s) AS lease_seconds",
        "t.run_at",
        "NULL::double precision AS next_token_in",  # a controlled queue's next token
    ]
    # leases_from_rows: a plain claim's rows end with the task's concurrency key, which
    # picks the statement of its lease's ack_and_claim.
    assert _returned(sql.CLAIM_ONE)[11] == "t.concurrency_key"
    for statement in (sql.CLAIM_MANY, sql.ACK_AND_CLAIM):
        assert _flat(statement).endswith("next_token_in, concurrency_key FROM claimed")
    # The keyless ack and claim moves both rows in one UPDATE, which returns what a claim
    # returns; the acked row comes back with a NULL payload, as the other statements'.
    keyless = sql.ACK_KEYLESS_AND_CLAIM
    moved = keyless[: keyless.index("SELECT id, CASE")]
    assert _returned(moved) == [*_returned(_leased(sql.CLAIM_MANY)), "t.concurrency_key )"]
    assert "SELECT id, CASE WHEN id <> %(task_id)s THEN payload END, priority," in _flat(keyless)
    assert "next_token_in, concurrency_key FROM moved WHERE" in _flat(keyless)
    assert _returned(sql.FAIL) == ["status", "run_at"]
    assert _returned(sql.RENEW) == ["lease_expires_at"]
    # run_attempt reads the start record's id, number, duplicate flag, earlier result and
    # how many attempts it found abandoned: begin_attempt()'s columns (migration 26), which
    # the claim made with an attempt's conclusion returns after the claim's own.
    begun = _table_columns(migrations._BEGIN_ATTEMPT_FUNCTION)
    assert [column.split()[0] for column in begun] == [
        "attempt_id",
        "attempt_number",
        "duplicate",
        "success_result",
        "abandoned_count",
    ]
    assert _flat(sql.BEGIN_ATTEMPT).startswith("SELECT b.*, set_config(")
    claimed_and_begun = _table_columns(migrations._CONCLUDE_CLAIM_AND_BEGIN)
    assert claimed_and_begun[attempts._BEGUN_COLUMN :] == begun
    assert _table_columns(migrations._CONCLUDE_CLAIM_AND_BEGIN_V27) == claimed_and_begun
    claimed = [column.split()[0] for column in claimed_and_begun[: attempts._BEGUN_COLUMN]]
    assert claimed == [item.split()[-1].split(".")[-1] for item in _returned(sql.CLAIM_ONE)]


def test_the_statements_sent_for_every_task_keep_their_conversion_in_psycopg() -> None:
    """psycopg converts a query's placeholders again on every call once it is longer than
    this (and keeps the conversion otherwise): the worker loop's statements stay within."""
    from psycopg._queries import MAX_CACHED_STATEMENT_LENGTH

    schema = "leasequeue"  # the default schema name
    hot = {
        "claim one": sql.compose_claim(schema, 1),
        "claim many": sql.compose_claim(schema, 100),
        "ack and claim": sql.compose_ack_and_claim(schema, 1, many=False),
        "ack keyless and claim": sql.compose_ack_and_claim(schema, 1, many=False, keyless=True),
        "ack many and claim": sql.compose_ack_and_claim(schema, 100, many=True),
        "ack": sql.compose(sql.ACK, schema),
        "ack many": sql.compose(sql.ACK_MANY, schema),
    }
    too_long = {name: len(text) for name, text in hot.items()}
    assert all(length <= MAX_CACHED_STATEMENT_LENGTH for length in too_long.values()), too_long


# Every UPDATE of tasks in the package, with its placeholders written as $name (their
# parentheses would end a clause early): its SET list, and its WHERE clause.
_TASK_UPDATE = re.compile(
    r"UPDATE \{schema\}\.tasks(?: (?:AS )?\w+)? SET (?P<set>.*?) (?:FROM .*? )?WHERE (?P<where>.*?)"
    r"(?: RETURNING|\)|;|$)"
)


def _named(text: str) -> str:
    """``text`` flattened, its placeholders written as $name."""
    return re.sub(r"%\((\w+)\)s", r"$\1", _flat(text))


def _task_updates() -> list[tuple[str, str]]:
    texts = [value for value in vars(sql).values() if isinstance(value, str)]
    texts += [text for migration in migrations.MIGRATIONS for text in migration.statements]
    updates = []
    for text in texts:
        flat = _named(text)
        found = list(_TASK_UPDATE.finditer(flat))
        assert len(found) == flat.count("UPDATE {schema}.tasks"), flat  # each one read
        updates += [(match["set"], match["where"]) for match in found]
    return updates


def test_every_statement_that_finishes_a_task_or_takes_one_back_sets_finished_at() -> None:
    # The batch trigger is on UPDATE OF finished_at (migration 18): a statement that moved
    # a task into done, dead or cancelled, or out of them, without setting finished_at
    # would go uncounted, and its batch would never finish. So every statement that sets
    # a status sets finished_at, but for a claim (to processing) and a release (back from
    # processing to enqueued), which change nothing a batch counts.
    release = _named(sql.RELEASE).split(" SET ")[1].split(" WHERE ")[0]
    statuses = [(set_list, where) for set_list, where in _task_updates() if "status =" in set_list]
    claims = [s for s, _ in statuses if s.startswith("status = 'processing',")]
    releases = [s for s, _ in statuses if s == release]
    others = [(s, w) for s, w in statuses if s not in claims and s not in releases]
    assert claims and releases and len(others) >= 6
    assert not any("finished_at" in set_list for set_list in claims + releases)
    for set_list, where in others:
        assert "finished_at =" in set_list, f"SET {set_list} WHERE {where}"
