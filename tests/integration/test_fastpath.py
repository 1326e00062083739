"""The worker loop's statements on the fast path: prepared once, kept right at every edge.

Claims, acks and ``ack_and_claim`` go to libpq without psycopg's cursor (fastpath.py).
These tests hold it to what the cursor gave: values of every size, a session that lost
its prepared statements, many statement shapes, and a pooler that keeps none.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dagster_leasequeue import LeaseQueue
from dagster_leasequeue.fastpath import PreparedNames


@pytest.fixture
def small(make_queue: Callable[..., LeaseQueue]) -> LeaseQueue:
    """A queue of one connection: the worker loop and every borrower share one session."""
    queue = make_queue(pool_size=1)
    queue.install()
    return queue


def fast_statements(queue: LeaseQueue) -> list[str]:
    """The statements the fast path has prepared in the queue's one session."""
    with queue.connection() as conn:
        rows = conn.execute(
            "SELECT name FROM pg_prepared_statements WHERE name LIKE '\\_leasequeue\\_%' "
            "ORDER BY name"
        ).fetchall()
    return [name for (name,) in rows]


def drain(queue: LeaseQueue) -> int:
    """Claims, ``ack_and_claim`` and a plain ack, as a worker runs them; tasks concluded."""
    done = 0
    lease = queue.claim()
    while lease is not None:
        done += 1
        if done % 2:
            lease = lease.ack_and_claim()
        else:
            lease.ack()
            lease = queue.claim()
    return done


def test_the_worker_loop_prepares_each_statement_once_in_its_session(small: LeaseQueue) -> None:
    small.enqueue_many([{"n": n} for n in range(40)])
    assert drain(small) == 40
    prepared = fast_statements(small)
    # The claim, the ack and ack_and_claim, once each (their values keep one type here).
    assert len(prepared) == 3
    small.enqueue_many([{"n": n} for n in range(40)])
    assert drain(small) == 40
    assert fast_statements(small) == prepared


@pytest.mark.parametrize("first_id", [32_760, 2_147_483_640], ids=["int2 to int4", "to int8"])
def test_ids_and_tokens_that_outgrow_their_type_are_claimed_and_acked(
    small: LeaseQueue, first_id: int
) -> None:
    # psycopg sends a small int as int2, a larger as int4 or int8: each size is its own
    # prepared statement, and a value must never go to a statement of a smaller type.
    small.enqueue_many([{"n": n} for n in range(5)])
    assert drain(small) == 5
    schema = f'"{small.schema}"'
    with small.connection() as conn:
        conn.execute(f"ALTER TABLE {schema}.tasks ALTER COLUMN id RESTART WITH {first_id}")
        conn.execute(f"SELECT setval('{small.schema}.lease_tokens', {first_id})")
    ids = small.enqueue_many([{"n": n} for n in range(20)])
    assert min(ids) == first_id and max(ids) > first_id + 8
    assert drain(small) == 20
    assert {small.get(task_id).status for task_id in ids} == {"done"}


def test_a_session_that_lost_its_prepared_statements_prepares_them_again(
    small: LeaseQueue,
) -> None:
    small.enqueue_many([{"n": n} for n in range(6)])
    lease = small.claim()
    assert lease is not None
    lease = lease.ack_and_claim()
    assert lease is not None and fast_statements(small)
    # A borrower drops every prepared statement of the session, the fast path's too.
    with small.connection() as conn:
        conn.execute("DEALLOCATE ALL")
    assert fast_statements(small) == []
    lease = lease.ack_and_claim()
    assert lease is not None
    lease.ack()
    assert drain(small) == 3
    assert len(fast_statements(small)) == 3


def test_claims_of_more_sizes_than_it_keeps_prepared_go_through_unnamed(
    small: LeaseQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each claim_many(n) is a statement of its own (its limit is written into it).
    monkeypatch.setattr(PreparedNames, "MAX_PREPARED", 4)
    small.enqueue_many([{"n": n} for n in range(60)])
    claimed = 0
    for size in range(1, 11):
        leases = small.claim_many(size)
        assert len(leases) == size
        small.ack_many(leases)
        claimed += size
    assert claimed == 55
    assert len(fast_statements(small)) == 4
    assert drain(small) == 5


def test_without_prepared_statements_nothing_is_prepared(
    make_queue: Callable[..., LeaseQueue],
) -> None:
    # As behind PgBouncer in transaction mode, where a session's statements are not kept.
    queue = make_queue(pool_size=1, prepared_statements=False)
    queue.install()
    queue.enqueue_many([{"n": n} for n in range(10)])
    assert drain(queue) == 10
    with queue.connection() as conn:
        count = conn.execute("SELECT count(*) FROM pg_prepared_statements").fetchone()
    assert count == (0,)
