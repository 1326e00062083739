"""Plain-text tables, number formatting and the JSON file."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dagster_leasequeue.dsn import redact


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A titled, aligned table; text columns left-aligned, numbers right-aligned."""
    cells = [[str(h) for h in headers], *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [all(_is_number(row[i]) for row in rows) for i in range(len(headers))]

    def line(row: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if right else cell.ljust(width)
            for cell, width, right in zip(row, widths, numeric, strict=True)
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    body = [line(cells[0]), rule, *(line(row) for row in cells[1:])]
    return "\n".join([f"== {title}", *body, ""])


def _is_number(value: object) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return fmt(value)
    return str(value)


def fmt(value: float | None, digits: int = 3) -> str:
    """A number with ``digits`` significant digits, thousands separated; '-' when missing."""
    if value is None or math.isnan(value):
        return "-"
    if value == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(value)))
    decimals = max(0, digits - 1 - magnitude)
    return f"{value:,.{decimals}f}"


def to_jsonable(value: Any) -> Any:
    """Dataclasses (fields and properties), tuples, paths and NaN as plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        names = [f.name for f in dataclasses.fields(value)]
        names += [n for n, a in vars(type(value)).items() if isinstance(a, property)]
        return {name: to_jsonable(getattr(value, name)) for name in names}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    return value


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The results hold the DSN; a password in it must not reach a file that gets committed.
    path.write_text(redact(json.dumps(to_jsonable(payload), indent=2)) + "\n")
