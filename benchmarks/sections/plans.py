"""How PostgreSQL plans the claim statements when psycopg prepares them.

psycopg prepares a statement on its fifth execution. PostgreSQL then either re-plans it at
every execution with the parameters' values (a custom plan) or settles on one generic plan.
A LIMIT given as a parameter leaves the generic plan guessing how many rows come back, which
can make it far costlier than the custom one, so that every execution is planned again.
Each statement is prepared by name (``PREPARE``), executed ten times in the server's default
mode, then explained with a forced custom and a forced generic plan, all rolled back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.db import LEASE_SECONDS, bench_schema, connect, fill_tasks, vacuum
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.strategies import seed_claim
from dagster_leasequeue import sql as lq_sql

_PLACEHOLDER = re.compile(r"%\((\w+)\)s")
_NAME = "bench_plan"
_EXECUTIONS = 10


@dataclass
class PlanCheck:
    statement: str
    custom_plans: int
    generic_plans: int
    custom_planning_ms: float
    custom_execution_ms: float
    custom_cost: float
    generic_execution_ms: float
    generic_cost: float
    generic_scans_table: bool


@dataclass(frozen=True)
class _Explained:
    planning_ms: float
    execution_ms: float
    cost: float
    scans_table: bool


def to_positional(statement: str) -> tuple[str, list[str]]:
    """``%(name)s`` placeholders turned into ``$1``, ``$2``...; the names in that order."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    return _PLACEHOLDER.sub(number, statement), names


def _statements(config: BenchConfig, schema: str) -> dict[str, tuple[str, Mapping[str, Any]]]:
    claim = {
        "queue": "default",
        "worker_id": "bench-plan",
        "lease_seconds": None,
        "default_lease": LEASE_SECONDS,
    }
    return {
        "seed claim, LIMIT 1": (seed_claim(1), {}),
        f"seed claim, LIMIT {config.batch}": (seed_claim(config.batch), {}),
        "package CLAIM, LIMIT 1": (lq_sql.compose_claim(schema, 1), claim),
        f"package CLAIM, LIMIT {config.batch}": (
            lq_sql.compose_claim(schema, config.batch),
            claim,
        ),
        "package SWEEP_BATCH, limit=500": (
            lq_sql.compose(lq_sql.SWEEP_BATCH, schema),
            {"limit": 500, "channel": lq_sql.notify_channel(schema)},
        ),
    }


def run(config: BenchConfig, log: Progress) -> list[PlanCheck]:
    log(f"plans of the claim statements ({config.tasks} waiting tasks)")
    # psycopg must not prepare (nor, on rollback, deallocate) anything itself here.
    with (
        bench_schema(config.dsn, "plans") as schema,
        connect(config.dsn, schema, prepared=False) as conn,
    ):
        fill_tasks(conn, config.tasks)
        vacuum(conn)
        return [
            _check(conn, label, statement, params)
            for label, (statement, params) in _statements(config, schema).items()
        ]


def _check(
    conn: psycopg.Connection[Any], label: str, statement: str, params: Mapping[str, Any]
) -> PlanCheck:
    text, names = to_positional(statement)
    arguments = sql.SQL(", ").join(sql.Literal(params[name]) for name in names)
    execute = sql.SQL("EXECUTE {}").format(sql.Identifier(_NAME)).as_string(None)
    if names:
        execute += f"({arguments.as_string(conn)})"
    conn.execute(f"PREPARE {_NAME} AS {text}")
    try:
        with conn.transaction(force_rollback=True):
            for _ in range(_EXECUTIONS):
                conn.execute(execute)
            row = conn.execute(
                "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = %s",
                (_NAME,),
            ).fetchone()
            custom = _explain(conn, execute, "force_custom_plan")
            generic = _explain(conn, execute, "force_generic_plan")
    finally:
        conn.execute(f"DEALLOCATE {_NAME}")
    generic_plans, custom_plans = row if row else (0, 0)
    return PlanCheck(
        statement=label,
        custom_plans=int(custom_plans),
        generic_plans=int(generic_plans),
        custom_planning_ms=custom.planning_ms,
        custom_execution_ms=custom.execution_ms,
        custom_cost=custom.cost,
        generic_execution_ms=generic.execution_ms,
        generic_cost=generic.cost,
        generic_scans_table=generic.scans_table,
    )


def _explain(conn: psycopg.Connection[Any], execute: str, mode: str) -> _Explained:
    conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
    row = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {execute}").fetchone()
    if row is None:
        raise RuntimeError(f"EXPLAIN returned nothing for {execute}")
    root = (json.loads(row[0]) if isinstance(row[0], str) else row[0])[0]
    return _Explained(
        planning_ms=float(root.get("Planning Time", 0.0)),
        execution_ms=float(root.get("Execution Time", 0.0)),
        cost=float(root["Plan"]["Total Cost"]),
        scans_table=any(
            node.get("Node Type") == "Seq Scan" and node.get("Relation Name") == "tasks"
            for node in _nodes(root["Plan"])
        ),
    )


def _nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", []):
        yield from _nodes(child)


def render(results: list[PlanCheck]) -> str:
    rows = [
        (
            r.statement,
            f"{r.custom_plans}/{r.custom_plans + r.generic_plans}",
            r.custom_planning_ms,
            r.custom_execution_ms,
            r.custom_cost,
            r.generic_cost,
            r.generic_execution_ms,
            "yes" if r.generic_scans_table else "no",
        )
        for r in results
    ]
    headers = (
        "statement (prepared)",
        "re-planned",
        "plan ms",
        "custom exec ms",
        "custom cost",
        "generic cost",
        "generic exec ms",
        "generic seq-scans tasks",
    )
    return table("plans: custom (re-planned each time) against generic", headers, rows)
