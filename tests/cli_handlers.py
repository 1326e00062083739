"""Task handlers run by `leasequeue worker` in the CLI tests (importable by module path)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from dagster_leasequeue import Lease


def double(payload: dict[str, Any], lease: Lease) -> dict[str, Any]:
    """Takes the lease too; fails on request, so the tests see both outcomes."""
    if payload.get("fail"):
        raise ValueError(f"asked to fail: {payload['n']}")
    return {"doubled": payload["n"] * 2, "attempt": lease.attempt}


def count_only(payload: dict[str, Any]) -> None:
    """Takes the payload only and returns nothing: the task is done with no result."""
    assert "n" in payload


def slow(payload: dict[str, Any]) -> dict[str, Any]:
    """Writes a marker file when it starts (so a test knows it runs), then sleeps."""
    Path(payload["marker"]).write_text("started")
    time.sleep(payload["seconds"])
    return {"slept": payload["seconds"]}


def nap(payload: dict[str, Any]) -> dict[str, Any]:
    """Sleeps for a moment, as a short task does."""
    time.sleep(payload["seconds"])
    return {"slept": payload["seconds"]}


def not_a_dict(payload: dict[str, Any]) -> list[int]:
    """Returns a list, which the worker refuses as a result."""
    return [1, 2]
