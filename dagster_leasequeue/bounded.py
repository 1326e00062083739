"""Round trips of the worker loop's own statements, bounded in time.

The TCP settings of every connection (connection.connection_options) end a call whose
network path died, but not a call the server holds while its kernel still answers: a
statement waiting for a row lock another session holds (a ``SELECT ... FOR UPDATE`` left
open in psql), a commit waiting for a synchronous standby that is gone, a server that
stopped running. A bounded round trip that outlives its bound is cancelled, as psycopg
cancels one on Ctrl-C; a server that answers neither the statement nor the cancel within
the bound again has the connection closed under it. Either way the call returns or raises
within three times the bound (the wait, the cancel, the wait for the cancel's effect).

Bounded: what the worker loop sends through CachedConnection (claims, acks, fails,
releases, an attempt's start and conclusion) and renewals, statements that take
milliseconds when nothing holds them up. The caller's own statements on a lent connection
(``queue.connection()``, ``attempt.connection``) are not, nor are ``install()``, the
statistics and the other calls that may read or write many rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

import psycopg
from psycopg import errors as pg_errors
from psycopg.abc import PQGen

logger = logging.getLogger(__name__)

RV = TypeVar("RV")

# What psycopg's Connection.wait raises when its timeout expires (psycopg 3.3.6 and later).
_EXPIRED = pg_errors._WaitTimeout


class NoAnswer(psycopg.OperationalError):
    """The server answered neither a bounded round trip nor its cancel: the connection is
    closed, and whether the statement took effect is unknown."""


def wait_bounded(
    conn: psycopg.Connection[object],
    wait: Callable[[PQGen[RV], float, float | None], RV],
    gen: PQGen[RV],
    interval: float,
    bound: float,
) -> RV:
    """``wait(gen, interval, timeout)`` (psycopg's Connection.wait) with ``bound`` seconds
    for the round trip, then a cancel and ``bound`` seconds more for its answer.

    A cancelled statement comes back as the server's error (QueryCanceled), which its
    caller raises as any other; a statement that finished before the cancel took effect
    (a commit the cancel released from waiting for a standby, say) comes back as done.
    """
    try:
        return wait(gen, interval, bound)
    except _EXPIRED:
        pass
    logger.warning(
        "a statement of the queue had no answer within %g s (network_timeout): "
        "cancelling it (is a lock held by another session, or the server stalled?)",
        bound,
    )
    try:
        conn.cancel_safe(timeout=bound)
    except psycopg.Error:
        pass  # the cancel got no answer either (a timeout, a refused connection)
    else:
        try:
            # The statement's own outcome: the server's error (QueryCanceled) raised by
            # the generator of a cursor, or returned as a result by the package's own.
            return wait(gen, interval, bound)
        except _EXPIRED:
            pass
    conn.pgconn.finish()
    raise NoAnswer(
        f"no answer from the server within {bound:g} s (network_timeout), nor to the cancel "
        "that followed: the connection was closed, and whether the statement took effect "
        "is unknown"
    )
