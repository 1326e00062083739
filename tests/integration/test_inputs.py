"""Bad input gets a clear error and stores nothing (settings: tests/unit/test_settings.py)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from dagster_leasequeue import (
    ConfigurationError,
    LeaseQueue,
    LeaseQueueSettings,
    PayloadError,
)
from dagster_leasequeue.errors import MAX_ERROR_LENGTH

from ..helpers import run_sql
from ..unit.test_payloads import BAD_PAYLOADS


@pytest.mark.parametrize(("payload", "message"), BAD_PAYLOADS)
def test_bad_payloads_are_refused_and_nothing_is_stored(
    queue: LeaseQueue, payload: object, message: str
) -> None:
    with pytest.raises(PayloadError, match=message):
        queue.enqueue(payload)  # type: ignore[arg-type]
    with pytest.raises(PayloadError, match=message):
        queue.enqueue_many([{"ok": 1}, payload])  # type: ignore[list-item]
    assert queue.stats().total == 0


def test_oversized_payload_is_refused(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(payload_max_bytes=1000)
    queue.install()
    with pytest.raises(PayloadError, match=r"over the limit of 1000 bytes.*PAYLOAD_MAX_BYTES"):
        queue.enqueue({"blob": "x" * 1000})
    queue.enqueue({"blob": "x" * 900})
    assert queue.stats().total == 1


def test_oversized_result_is_refused_and_the_lease_kept(make_queue) -> None:  # type: ignore[no-untyped-def]
    queue = make_queue(payload_max_bytes=100)
    queue.install()
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(PayloadError, match="result"):
        lease.ack({"big": "y" * 200})
    assert queue.get(task_id).status == "processing"
    lease.ack({"small": 1})
    assert queue.get(task_id).status == "done"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"queue": ""}, "queue must be"),
        ({"priority": 2**40}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"delay": -1}, "delay"),
        ({"max_attempts": 0}, "max_attempts"),
        ({"lease_seconds": 0}, "lease_seconds"),
        # An attempt's idle timeout is the lease in milliseconds: a 32-bit integer.
        ({"lease_seconds": 25 * 86400}, "at most 604800"),
        ({"lease_seconds": math.inf}, "lease_seconds"),
        ({"delay": math.nan}, "delay"),
        ({"delay": 1e300}, "at most 1e"),
        ({"idempotency_key": ""}, "idempotency_key"),
    ],
)
def test_bad_enqueue_arguments(queue: LeaseQueue, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        queue.enqueue({"n": 1}, **kwargs)  # type: ignore[arg-type]
    assert queue.stats().total == 0


def test_a_backslash_before_u0000_is_not_a_nul(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"path": "C:\\u0000\\files"})
    assert queue.get(task_id).payload == {"path": "C:\\u0000\\files"}


# jsonb refuses NUL characters and lone surrogates, in keys as in values.
_TEXT = st.text(st.characters(codec="utf-8", blacklist_characters="\x00"), max_size=8)
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner),
    max_leaves=12,
)


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(payloads=st.lists(st.dictionaries(_TEXT, _JSON_VALUES), min_size=1, max_size=5))
def test_claimed_payloads_read_as_json_loads_reads_the_stored_text(
    queue: LeaseQueue, payloads: list[dict[str, object]]
) -> None:
    ids = queue.enqueue_many(payloads)
    leases = queue.claim_many(len(ids))
    stored = dict(
        run_sql(
            queue,
            "SELECT id, payload::text FROM {schema}.tasks WHERE id = ANY(%(ids)s)",
            {"ids": ids},
        )
    )
    assert {lease.task_id: lease.payload for lease in leases} == {
        task_id: json.loads(text) for task_id, text in stored.items()
    }
    queue.ack_many(leases)


LONG_LEASE = 25 * 86400  # past the ~24.8 days an idle timeout can hold


def test_every_lease_length_is_bounded_where_it_is_given(queue: LeaseQueue) -> None:
    with pytest.raises(ConfigurationError, match="lease_seconds"):
        queue.claim(lease_seconds=LONG_LEASE)
    with pytest.raises(ConfigurationError, match="LEASEQUEUE_LEASE_SECONDS"):
        LeaseQueueSettings(lease_seconds=LONG_LEASE, _env_file=None)
    queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(ConfigurationError, match="lease_seconds"):
        lease.renew(LONG_LEASE)
    with pytest.raises(ConfigurationError, match="retry_in"):
        lease.fail("x", retry_in=math.inf)
    assert queue.get(lease.task_id).status == "processing"
    lease.ack()


def test_a_task_stored_with_a_longer_lease_still_runs_its_attempt(queue: LeaseQueue) -> None:
    # A lease longer than the idle timeout can hold, stored by an earlier release.
    task_id = queue.enqueue({"n": 1})
    run_sql(queue, "UPDATE {schema}.tasks SET lease_seconds = %(s)s", {"s": LONG_LEASE})
    lease = queue.claim()
    assert lease is not None and lease.lease_seconds == LONG_LEASE
    with queue.attempt(lease=lease) as attempt:
        attempt.connection.execute("SELECT 1")
    assert queue.get(task_id).status == "done"


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda q: q.claim_many(2**31), "limit"),
        (lambda q: q.claim(wait=math.inf), "wait"),
        (lambda q: q.sweep(limit=0), "limit"),
        (lambda q: q.purge(60, batch_size=0), "batch_size"),
        (lambda q: q.purge(math.inf), "older_than"),
        (lambda q: q.list_tasks(limit=2**40), "limit"),
        (lambda q: q.recovery_events(-1), "after_id"),
    ],
)
def test_numbers_sent_to_the_server_are_checked_first(
    queue: LeaseQueue, call: Any, message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        call(queue)


@pytest.mark.parametrize(
    ("raised", "stored"),
    [
        (ValueError("page 3 holds \x00"), "ValueError: page 3 holds \\x00"),
        (ValueError("name \udcff"), "ValueError: name \\udcff"),
    ],
)
def test_an_error_text_the_database_cannot_store_still_fails_the_task(
    queue: LeaseQueue, raised: ValueError, stored: str
) -> None:
    """A NUL or a lone surrogate in an exception's text (decoded bytes, say) is stored
    escaped: the task is given back with the error, by fail() and by each way of leaving
    a lease or an attempt on an exception, and the caller's exception is the one raised."""
    task_id = queue.enqueue({"n": 1}, max_attempts=10)

    lease = queue.claim()
    assert lease is not None
    assert lease.fail(raised, retry_in=0) == "enqueued"
    assert queue.get(task_id).last_error == stored

    lease = queue.claim()
    assert lease is not None
    with pytest.raises(ValueError) as caught, lease:
        raise raised
    assert caught.value is raised
    info = queue.get(task_id)
    assert (info.status, info.last_error) == ("enqueued", stored)

    run_sql(queue, "UPDATE {schema}.tasks SET run_at = now()")
    lease = queue.claim()
    assert lease is not None
    with pytest.raises(ValueError) as caught, queue.attempt(lease=lease):
        raise raised
    assert caught.value is raised
    info = queue.get(task_id)
    assert (info.status, info.last_error) == ("enqueued", stored)
    assert queue.attempts(task_id=task_id)[-1].error == stored


def test_a_long_error_text_is_stored_cut_with_how_much_was_left_out(queue: LeaseQueue) -> None:
    task_id = queue.enqueue({"n": 1})
    lease = queue.claim()
    assert lease is not None
    lease.fail("x" * (MAX_ERROR_LENGTH + 5), retry_in=0)
    assert queue.get(task_id).last_error == "x" * MAX_ERROR_LENGTH + "... (5 more characters)"


@pytest.mark.parametrize("text", ["a\x00b", "a\udcffb"])
def test_names_the_database_cannot_store_are_refused_before_anything_is_written(
    queue: LeaseQueue, text: str
) -> None:
    with pytest.raises(ConfigurationError, match=r"^queue must be"):
        queue.enqueue({"n": 1}, queue=text)
    with pytest.raises(ConfigurationError, match=r"^queue must be"):
        queue.enqueue_many([{"n": i} for i in range(1_001)], queue=text)  # the COPY path
    with pytest.raises(ConfigurationError, match=r"^idempotency_key must be"):
        queue.enqueue({"n": 1}, idempotency_key=text)
    with pytest.raises(ConfigurationError, match=r"^concurrency_key must be"):
        queue.enqueue({"n": 1}, concurrency_key=text)
    assert queue.stats().total == 0
    queue.enqueue({"n": 1})
    with pytest.raises(ConfigurationError, match=r"^worker_id must be"):
        queue.claim(worker_id=text)
    assert queue.stats().counts["enqueued"] == 1


@pytest.mark.parametrize(
    ("task_ids", "message"),
    [
        ("12", "task_ids must be an iterable of task ids"),
        (12, "task_ids must be an iterable of task ids"),
        ([3.9], "each of task_ids must be a whole number"),
        ([True], "each of task_ids must be a whole number"),
        ([0], "each of task_ids must be a whole number"),
    ],
)
def test_retry_dead_refuses_ids_that_are_not_ids(
    queue: LeaseQueue, task_ids: object, message: str
) -> None:
    """A string of digits was taken digit by digit, and retried other tasks."""
    dead = [queue.enqueue({"n": i}, max_attempts=1) for i in range(3)]
    for _ in dead:
        lease = queue.claim()
        assert lease is not None
        lease.fail("broken")
    with pytest.raises(ConfigurationError, match=message):
        queue.retry_dead(task_ids)  # type: ignore[arg-type]
    assert {queue.get(task_id).status for task_id in dead} == {"dead"}
    assert queue.retry_dead([dead[1]]) == 1
    assert [queue.get(task_id).status for task_id in dead] == ["dead", "enqueued", "dead"]
