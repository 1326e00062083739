"""The example's domain: documents to summarise, from a 2-page invoice to a 200-page contract."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql

DOCUMENTS: list[dict[str, Any]] = [
    {"document": "invoice-2026-0042.pdf", "kind": "invoice", "pages": 2},
    {"document": "master-services-agreement.pdf", "kind": "contract", "pages": 200},
    {"document": "delivery-note-881.pdf", "kind": "delivery note", "pages": 1},
    {"document": "invoice-2026-0043.pdf", "kind": "invoice", "pages": 3},
    {"document": "board-minutes-q3.pdf", "kind": "minutes", "pages": 24},
    {"document": "purchase-order-7731.pdf", "kind": "purchase order", "pages": 4},
]

RESULTS_TABLE = "document_summaries"

# No unique constraint on the document on purpose: a duplicate write would show up as a
# second row, which is exactly what the attempts table must prevent.
CREATE_RESULTS = """
    CREATE TABLE IF NOT EXISTS {table} (
        id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        document text NOT NULL,
        pages integer NOT NULL,
        words integer NOT NULL,
        task_id bigint NOT NULL,
        worker_id text,
        written_at timestamptz NOT NULL DEFAULT clock_timestamp()
    )
"""


def results_table(schema: str) -> sql.Composed:
    return sql.Identifier(schema, RESULTS_TABLE)


def create_results_table(conn: psycopg.Connection[Any], schema: str) -> None:
    conn.execute(sql.SQL(CREATE_RESULTS).format(table=results_table(schema)))


def summarise(
    document: dict[str, Any], page_seconds: float, between_pages: Callable[[], None]
) -> int:
    """Read every page (here: wait ``page_seconds`` each) and return a word count."""
    words = 0
    for page in range(int(document["pages"])):
        time.sleep(page_seconds)
        digest = hashlib.sha256(f"{document['document']}:{page}".encode()).digest()
        words += 250 + digest[0]
        between_pages()
    return words


def write_summary(
    conn: psycopg.Connection[Any],
    schema: str,
    document: dict[str, Any],
    words: int,
    task_id: int,
    worker_id: str | None,
) -> None:
    conn.execute(
        sql.SQL(
            "INSERT INTO {table} (document, pages, words, task_id, worker_id) "
            "VALUES (%s, %s, %s, %s, %s)"
        ).format(table=results_table(schema)),
        (document["document"], document["pages"], words, task_id, worker_id),
    )
