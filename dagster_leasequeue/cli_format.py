"""What the command line prints and reads: durations, JSON and plain text tables."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from .errors import ConfigurationError

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"(?:\d+(?:\.\d+)?[smhd])+|\d+(?:\.\d+)?")
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> float:
    """Seconds in a duration such as ``30s``, ``15m``, ``12h``, ``7d`` or ``1h30m``.

    A bare number counts seconds.
    """
    compact = text.strip().lower().replace(" ", "")
    if not _DURATION.fullmatch(compact):
        raise ConfigurationError(
            f"{text!r} is not a duration: use a number and a unit (s, m, h or d), "
            "for example 30s, 15m, 12h, 7d or 1h30m"
        )
    if compact[-1].isdigit():
        return float(compact)
    return sum(float(number) * _UNITS[unit] for number, unit in _DURATION_PART.findall(compact))


if TYPE_CHECKING:
    _DurationBase = click.ParamType[float]
else:  # click before 8.2 has no generic ParamType
    _DurationBase = click.ParamType


class _Duration(_DurationBase):
    """A click parameter type for :func:`parse_duration`."""

    name = "duration"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        if isinstance(value, (int, float)):
            return float(value)
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()


def json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot encode {type(value).__name__} as JSON")


def echo_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, default=json_default, ensure_ascii=False))


def parse_object(text: str, what: str) -> dict[str, Any]:
    """Parse a JSON object, or stop with a one-line error before anything is written."""

    def refuse_constant(name: str) -> Any:
        # json accepts NaN and Infinity, which are not JSON and which jsonb refuses.
        raise ValueError(f"{name} is not a JSON value")

    try:
        value = json.loads(text, parse_constant=refuse_constant)
    except ValueError as exc:
        raise click.ClickException(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise click.ClickException(
            f"{what} must be a JSON object, got {type(value).__name__}: "
            'wrap it, for example {"value": ...}'
        )
    return value


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], numeric: set[int]) -> str:
    """A plain text table; the columns in ``numeric`` are right-aligned."""
    body = [list(row) for row in rows]
    widths = [
        max([len(header), *(len(row[i]) for row in body)]) for i, header in enumerate(headers)
    ]

    def line(cells: Sequence[str]) -> str:
        padded = (
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        )
        return "  ".join(padded).rstrip()

    return "\n".join([line(headers), *(line(row) for row in body)])


def age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"


def when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(sep=" ", timespec="seconds")


def elapsed(seconds: float | None) -> str:
    """A duration to read: ``0.42s`` under a minute, else as :func:`age` (``3m12s``)."""
    if seconds is None:
        return "-"
    return f"{seconds:.2f}s" if seconds < 60 else age(seconds)


def flat(text: str) -> str:
    """One line for a table cell: runs of whitespace (newlines, tabs) become one space."""
    return " ".join(text.split())


def shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
