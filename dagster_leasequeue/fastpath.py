"""The worker loop's statements, sent through libpq with psycopg's adapters but not its cursor.

A worker sends one statement per task (``ack_and_claim``), or a claim and an ack. For each,
psycopg's cursor checks its state, consults its prepared-statement cache, splits the query
and dumps the parameters, and builds a result set with its column descriptions: on these
short statements, as much client CPU as libpq's own send and receive. Here a statement's
placeholders are read once, it is prepared once per connection (and per parameter types,
as psycopg does: an integer's type follows its size), and its rows are loaded straight
from the result by the same loaders a cursor would use.

Only the package's own statements take this path, each its own transaction on an idle
autocommit connection; the caller falls back to a cursor otherwise (see
:meth:`CachedConnection.rows`). Errors are psycopg's, raised as a cursor raises them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import psycopg
from psycopg import errors as pg_errors, generators, pq
from psycopg.abc import AdaptContext
from psycopg.adapt import PyFormat, Transformer

# A prepared statement the server no longer has (a borrower ran DISCARD ALL or DEALLOCATE).
_UNKNOWN_STATEMENT = "26000"

# A row as the package's statements return it: a tuple, in the statement's column order.
Row = tuple[Any, ...]

# Any other status (an error, a bad response) is raised, as a cursor raises it.
_SUCCEEDED = (pq.ExecStatus.TUPLES_OK, pq.ExecStatus.COMMAND_OK)

_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%")


class ParsedStatement(NamedTuple):
    """A statement's text with PostgreSQL's placeholders, and its parameters' names."""

    query: bytes
    names: tuple[str, ...]
    formats: tuple[PyFormat, ...]  # psycopg chooses each value's format


@lru_cache(maxsize=512)
def parse(text: str) -> ParsedStatement:
    """``text`` with each ``%(name)s`` made ``$n`` (a name used twice keeps its number).

    The package's statements use named placeholders only; any other ``%`` is refused
    rather than guessed at.
    """
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            raise ValueError(f"a statement on the fast path has a bare '%': {text[:80]!r}")
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    query = _PLACEHOLDER.sub(number, text).encode()
    return ParsedStatement(query, tuple(names), (PyFormat.AUTO,) * len(names))


def bigint_array(values: Sequence[int]) -> str:
    """``values`` in PostgreSQL's text form of an array (``{1,2,3}``), for a parameter the
    statement casts (``%(ids)s::bigint[]``).

    psycopg's list dumper looks in each element's text for characters to quote, which no
    integer has: for the ids and tokens of 100 leases acked with the next claim
    (``ack_many_and_claim``), a sixth of the client's instructions per task.
    """
    return "{" + ",".join(map(str, values)) + "}"


class PreparedNames:
    """The statements this path prepared in one server session, by text and parameter types.

    It belongs to the connection, whose session holds them. Past MAX_PREPARED (a caller
    claiming batches of many sizes makes a statement per size) new ones run unnamed.
    """

    MAX_PREPARED = 64

    __slots__ = ("_made", "_names")

    def __init__(self) -> None:
        self._names: dict[tuple[bytes, tuple[int, ...]], bytes] = {}
        self._made = 0

    def get(self, key: tuple[bytes, tuple[int, ...]]) -> bytes | None:
        return self._names.get(key)

    def add(self, key: tuple[bytes, tuple[int, ...]]) -> bytes | None:
        """A new name for ``key``, or None past the limit."""
        if len(self._names) >= self.MAX_PREPARED:
            return None
        self._made += 1
        name = self._names[key] = f"_leasequeue_{self._made}".encode()
        return name

    def forget(self, key: tuple[bytes, tuple[int, ...]] | None = None) -> None:
        """Forget ``key``'s statement (its PREPARE failed), or all (the session lost them)."""
        if key is None:
            self._names.clear()
        else:
            self._names.pop(key, None)


class FastStatements:
    """Runs statements on one connection (see the module's docstring).

    ``context`` gives the adapters (the cursor's, with the package's jsonb loader).
    ``prepare`` is False behind a pooler that cannot keep prepared statements: then every
    statement is sent unnamed, parsed and planned each time, as psycopg would send it.
    """

    __slots__ = ("_conn", "_names", "_prepare", "_tx")

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        names: PreparedNames,
        context: AdaptContext,
        *,
        prepare: bool,
    ) -> None:
        self._conn = conn
        self._names = names
        self._prepare = prepare
        self._tx = Transformer(context)

    def rows(self, text: str, params: Mapping[str, Any]) -> list[Row]:
        """The rows ``text`` returns with ``params``."""
        result = self.run(text, params)
        tx = self._tx
        tx.set_pgresult(result)
        return tx.load_rows(0, result.ntuples, tuple)

    def run(self, text: str, params: Mapping[str, Any]) -> pq.abc.PGresult:
        """Send ``text`` with ``params`` and wait for its one result."""
        if self._conn.pgconn.status != pq.ConnStatus.OK:
            raise psycopg.OperationalError("the connection is closed")
        with self._conn.lock:
            return self._run(parse(text), params)

    def _run(self, statement: ParsedStatement, params: Mapping[str, Any]) -> pq.abc.PGresult:
        tx = self._tx
        values = tx.dump_sequence([params[name] for name in statement.names], statement.formats)
        # Set by every dump, to one entry per value.
        types, formats = tx.types or (), tx.formats or ()
        if not self._prepare:
            return self._send_unnamed(statement.query, values, types, formats)
        key = (statement.query, types)
        try:
            return self._send_prepared(key, statement.query, values, types, formats)
        except pg_errors.Error as exc:
            if exc.sqlstate != _UNKNOWN_STATEMENT:
                raise
        # The session dropped what was prepared: prepare again, once.
        self._names.forget()
        return self._send_prepared(key, statement.query, values, types, formats)

    def _send_prepared(
        self,
        key: tuple[bytes, tuple[int, ...]],
        query: bytes,
        values: Sequence[Any],
        types: Sequence[int],
        formats: Sequence[pq.Format],
    ) -> pq.abc.PGresult:
        """Send under the name ``key`` was prepared with, preparing it first if need be;
        unnamed past the limit of names."""
        name = self._names.get(key) or self._prepared(key, query, types)
        if name is None:
            return self._send_unnamed(query, values, types, formats)
        self._conn.pgconn.send_query_prepared(name, values, param_formats=formats)
        return self._result()

    def _prepared(
        self, key: tuple[bytes, tuple[int, ...]], query: bytes, types: Sequence[int]
    ) -> bytes | None:
        name = self._names.add(key)
        if name is None:
            return None
        try:
            self._conn.pgconn.send_prepare(name, query, param_types=types)
            self._result()
        except BaseException:
            self._names.forget(key)
            raise
        return name

    def _send_unnamed(
        self,
        query: bytes,
        values: Sequence[Any],
        types: Sequence[int],
        formats: Sequence[pq.Format],
    ) -> pq.abc.PGresult:
        self._conn.pgconn.send_query_params(query, values, param_types=types, param_formats=formats)
        return self._result()

    def _result(self) -> pq.abc.PGresult:
        conn = self._conn
        results: list[pq.abc.PGresult] = conn.wait(generators.execute(conn.pgconn))
        (result,) = results
        if result.status not in _SUCCEEDED:
            raise pg_errors.error_from_result(result, encoding=conn.info.encoding)
        return result
