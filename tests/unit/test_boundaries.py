"""Module boundaries: no module of the package reaches into another's private names.

A name with a leading underscore belongs to the module (and class) that defines it. Every
read of one on another object is listed in ALLOWED with its reason: the methods a Lease
offers the attempts it takes part in (its package-internal interface), and the internals
of psycopg and pgserver that the package builds on where they have no public way.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "dagster_leasequeue"

# Every read of a private name on anything but ``self``, ``cls`` or ``super()``, by module:
# each one is listed here with its reason, so a new one fails until it is looked at.
ALLOWED: dict[str, set[str]] = {
    # Lease's package-internal interface: an attempt acks, fails and reports a lost lease
    # inside its own transaction, and ack_many marks the leases it acked.
    # (and, when its ack met a conflict outside READ COMMITTED, whether the lease is lost)
    # An attempt also hands a lease the start record its claim made, and takes it.
    "attempts.py": {
        "_ack_on",
        "_fail_on",
        "_mark_acked",
        "_raise_if_lost_on",
        "_raise_lost_on",
        "_begin_attempt_with",
        "_take_begun_attempt",
        "_discard_attempt_record",
    },
    "queue.py": {"_mark_acked"},
    # The renewal thread is part of the Lease it renews (same module), and so is the
    # function that takes back the unused start records of many leases.
    "lease.py": {
        "_concluded_by_self",
        "_driver",
        "_local_deadline",
        "_lost",
        "_begun_attempt",
        "_discard_begun_attempt",
        "_lock",
    },
    # The hot path borrows a connection without a frame of its own (same module); psycopg
    # has no public way to name the connection's encoding for a raw error result.
    "connection.py": {"_acquire", "_encoding"},
    # pgserver: where its PostgreSQL binaries are (pg_ctl, to stop a server it started),
    # and the lock it takes to start one, which stopping must take too.
    "embedded.py": {"_commands", "_lock"},
    # psycopg names the expiry of its wait's timeout only by this class (3.3.6 and later).
    "bounded.py": {"_WaitTimeout"},
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own(value: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: a class touching its own (or its base's) state."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls")
    return (
        isinstance(value, ast.Call)
        and isinstance(value.func, ast.Name)
        and value.func.id == "super"
    )


def test_no_module_reaches_into_another_modules_private_names() -> None:
    trespasses = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(PACKAGE)
        allowed = ALLOWED.get(path.name, set()) if path.parent == PACKAGE else set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                trespasses += [
                    f"{where}:{node.lineno} imports {alias.name} from {node.module}"
                    for alias in node.names
                    if _private(alias.name)
                ]
            elif (
                isinstance(node, ast.Attribute)
                and _private(node.attr)
                and not _own(node.value)
                and node.attr not in allowed
            ):
                trespasses.append(f"{where}:{node.lineno} reads .{node.attr}")
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and _private(str(node.args[1].value))
            ):
                trespasses.append(f"{where}:{node.lineno} {node.func.id} {node.args[1].value}")
    assert trespasses == []


def test_importing_the_core_imports_no_dagster() -> None:
    code = (
        "import sys, dagster_leasequeue, dagster_leasequeue.cli, dagster_leasequeue.worker;"
        "print(sorted(m for m in sys.modules if m == 'dagster' or m.startswith('dagster.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
