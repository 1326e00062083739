"""Many tasks written at once through COPY: ``enqueue_batch`` and large ``enqueue_many``.

COPY takes rows as text and answers with a count, not ids, so a caller that needs the ids
(``enqueue_many`` returns them) draws them from the table's identity sequence first and
writes them with the rows: COPY keeps the values it is given, even for an identity column.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from itertools import islice, repeat
from typing import Any

import psycopg

from . import sql
from .driver import QueueDriver

# Rows sent to COPY per write: memory stays flat however many rows stream through.
COPY_ROWS_PER_WRITE = 2000

# COPY's text format: a backslash starts an escape, and tab and newline end a field and a
# row. A payload's JSON never holds a raw tab, newline or carriage return (json.dumps
# escapes them in strings), only backslashes; a queue name may hold anything.
_COPY_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})


def copy_tasks(
    conn: psycopg.Connection[Any],
    driver: QueueDriver,
    encoded: Iterable[tuple[str, str | None]],
    columns: Mapping[str, Any],
    ids: Iterator[int] | None = None,
) -> int:
    """Stream tasks (each payload's JSON and concurrency key) through COPY; return how many.

    ``columns`` holds what every row shares: queue, priority, max_attempts and batch_id
    (None outside a batch). With ``ids``, each row takes the next one as its id.
    """
    # Every column but the id, the payload and the concurrency key is the same on every row.
    before = columns["queue"].translate(_COPY_ESCAPES) + "\t" + str(columns["priority"]) + "\t"
    batch = columns["batch_id"]
    middle = f"\t{columns['max_attempts']}\t{_copy_text(None if batch is None else str(batch))}\t"
    template = sql.COPY_TASKS_WITH_IDS if ids is not None else sql.COPY_TASKS
    rows = iter(encoded)
    # Each row's id and its tab, or nothing: zip below takes the chunk's row first, so it
    # stops on the chunk's end without drawing an id too many.
    prefixes = repeat("") if ids is None else (f"{task_id}\t" for task_id in ids)
    total = 0
    with conn.cursor().copy(driver.statement(template)) as copy:
        while chunk := list(islice(rows, COPY_ROWS_PER_WRITE)):
            lines = [
                f"{prefix}{before}{text.replace(chr(92), chr(92) * 2)}{middle}{_copy_text(key)}\n"
                for (text, key), prefix in zip(chunk, prefixes, strict=False)
            ]
            copy.write("".join(lines).encode())
            total += len(chunk)
    return total


def reserve_ids(conn: psycopg.Connection[Any], driver: QueueDriver, count: int) -> list[int]:
    """``count`` new task ids drawn from the tasks' identity sequence."""
    row = conn.execute(driver.statement(sql.RESERVE_TASK_IDS), {"count": count}).fetchone()
    assert row is not None
    first, scattered = row
    return list(range(first, first + count)) if scattered is None else list(scattered)


def _copy_text(value: str | None) -> str:
    """A text column in COPY's text format: escaped, or \\N for NULL."""
    return "\\N" if value is None else value.translate(_COPY_ESCAPES)
