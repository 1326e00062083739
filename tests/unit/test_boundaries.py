"""Module boundaries: no module of the package reaches into another's private names.

A name with a leading underscore belongs to the module that defines it. The exceptions are
listed below, each for a reason: the methods a Lease offers the attempts it takes part in
(its package-internal interface), and the internals of psycopg and pgserver that the
package builds on where they have no public way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dagster_leasequeue"

# Lease's package-internal interface: an attempt acks, fails and reports a lost lease
# inside its own transaction, and ack_many marks the leases it acked.
LEASE_INTERNALS = {"_ack_on", "_fail_on", "_mark_acked", "_raise_lost_on"}
# What QueueConnection needs of psycopg to send an attempt's settings with its BEGIN, and
# where pgserver keeps its PostgreSQL binaries (pg_ctl, to stop a server it started).
THIRD_PARTY_INTERNALS = {
    "_check_connection_ok",
    "_encoding",
    "_exec_command",
    "_get_tx_start_command",
    "_pipeline",
    "_commands",
}


def _defined_names(tree: ast.AST) -> set[str]:
    """Underscore names a module defines: functions, classes, attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {name for name in names if name.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def test_no_module_reaches_into_another_modules_private_names() -> None:
    trespasses = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        own = _defined_names(tree)
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                trespasses += [
                    f"{where}:{node.lineno} imports {alias.name} from {node.module}"
                    for alias in node.names
                    if _private(alias.name)
                ]
            elif isinstance(node, ast.Attribute) and _private(node.attr):
                allowed = own | LEASE_INTERNALS | THIRD_PARTY_INTERNALS
                if node.attr not in allowed:
                    trespasses.append(f"{where}:{node.lineno} reads .{node.attr}")
    assert trespasses == []


def test_importing_the_core_imports_no_dagster() -> None:
    code = (
        "import sys, dagster_leasequeue, dagster_leasequeue.cli, dagster_leasequeue.worker;"
        "print(sorted(m for m in sys.modules if m == 'dagster' or m.startswith('dagster.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
