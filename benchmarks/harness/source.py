"""Which package code is measured: the working tree, or a committed revision (``--source``).

The repository may be edited while a run goes on (worker processes are spawned and import
the package afresh), so ``--source REF`` exports ``dagster_leasequeue/`` at REF with
``git archive`` into a temporary folder and re-runs the harness from there: that copy is
found before the working tree, by the parent and by every spawned worker.
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]
PINNED_ENV = "LEASEQUEUE_BENCH_SOURCE"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPOSITORY), *args], capture_output=True, text=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def describe() -> dict[str, str]:
    """Where the imported package comes from and which revision it is."""
    import dagster_leasequeue

    path = str(Path(dagster_leasequeue.__file__).resolve().parent)
    pinned = os.environ.get(PINNED_ENV)
    if pinned:
        return {"path": path, "revision": pinned, "working_tree_changes": "none (git archive)"}
    changed = _git("status", "--porcelain", "--", "dagster_leasequeue")
    return {
        "path": path,
        "revision": _git("rev-parse", "--short", "HEAD") or "unknown",
        "working_tree_changes": "yes" if changed else "none" if changed == "" else "unknown",
    }


def run_at_revision(ref: str, argv: Sequence[str]) -> int:
    """Run ``python -m benchmarks argv`` against ``dagster_leasequeue`` as committed at ``ref``."""
    commit = _git("rev-parse", "--short", "--verify", f"{ref}^{{commit}}")
    if not commit:
        raise SystemExit(f"--source: {ref!r} is not a commit of {REPOSITORY}")
    archive = subprocess.run(
        ["git", "-C", str(REPOSITORY), "archive", commit, "dagster_leasequeue"],
        capture_output=True,
        check=True,
    ).stdout
    with tempfile.TemporaryDirectory(prefix="bench_source_") as folder:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        paths = [str(REPOSITORY), os.environ.get("PYTHONPATH", "")]
        env = os.environ | {
            PINNED_ENV: f"{ref} = {commit}",
            "PYTHONPATH": os.pathsep.join(p for p in paths if p),
        }
        command = [sys.executable, "-m", "benchmarks", *argv]
        return subprocess.run(command, cwd=folder, env=env, check=False).returncode


def main(argv: Sequence[str] | None = None) -> int:
    """The entry point: re-run at ``--source REF`` if asked, else run here.

    Nothing here imports the package, so a working tree caught mid-edit cannot stop a
    ``--source`` run.
    """
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--source")
    early.add_argument("--output", type=Path)
    early.add_argument("--plot", type=Path)
    known, rest = early.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.source is None:
        from benchmarks.harness.cli import main as run_here

        return run_here(argv)
    # The run happens in another folder: make the chosen paths absolute first.
    for option in ("output", "plot"):
        value = getattr(known, option)
        if value is not None:
            rest += [f"--{option}", str(value.resolve())]
    return run_at_revision(known.source, rest)
