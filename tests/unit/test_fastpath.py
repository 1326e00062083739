"""The fast path's reading of a statement's placeholders (fastpath.parse)."""

from __future__ import annotations

import pytest

from dagster_leasequeue import sql
from dagster_leasequeue.fastpath import bigint_array, parse


def test_each_name_gets_one_number_in_order_of_first_use() -> None:
    parsed = parse("SELECT %(b)s, %(a)s WHERE x = %(b)s")
    assert parsed.query == b"SELECT $1, $2 WHERE x = $1"
    assert parsed.names == ("b", "a")
    assert len(parsed.formats) == 2


def test_a_bare_percent_is_refused_rather_than_guessed_at() -> None:
    with pytest.raises(ValueError, match="bare '%'"):
        parse("SELECT %(a)s WHERE name LIKE 'x%'")


def test_every_statement_the_worker_loop_sends_is_read_whole() -> None:
    schema = "leasequeue"
    statements = [
        sql.compose_claim(schema, 1),
        sql.compose_claim(schema, 100),
        sql.compose_ack_and_claim(schema, 1, many=False),
        sql.compose_ack_and_claim(schema, 1, many=False, keyless=True),
        sql.compose_ack_and_claim(schema, 100, many=True),
        sql.compose(sql.ACK, schema),
    ]
    for text in statements:
        parsed = parse(text)
        assert b"%(" not in parsed.query
        assert parsed.query.count(b"$") >= len(parsed.names) > 0


def test_a_list_of_ids_is_sent_as_an_array_literal() -> None:
    # The statements cast the text (%(task_ids)s::bigint[]): no element needs quoting.
    assert bigint_array([1, 22, 9_223_372_036_854_775_807]) == "{1,22,9223372036854775807}"
    assert bigint_array([]) == "{}"
