"""Every Python snippet in the README runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import dagster as dg
import pytest

from dagster_leasequeue import LeaseQueue
from dagster_leasequeue.embedded import server_status

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def with_search_path(dsn: str, schema: str) -> str:
    """The DSN with the schema first on the search path, so unqualified tables land there."""
    return (
        f"{dsn} options='-csearch_path={schema}'"
        if "://" not in dsn
        else (f"{dsn}{'&' if '?' in dsn else '?'}options=-csearch_path%3D{schema}")
    )


@pytest.fixture
def readme_env(dsn: str, schema_name: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("LEASEQUEUE_DSN", with_search_path(dsn, schema_name))
    monkeypatch.setenv("LEASEQUEUE_SCHEMA_NAME", schema_name)
    return schema_name


def test_the_readme_has_its_snippets() -> None:
    assert len(SNIPPETS) == 2


def test_the_dagster_snippet(readme_env: str, tmp_path: Path) -> None:
    namespace: dict[str, object] = {}
    exec(compile(SNIPPETS[0], "README.md (Dagster)", "exec"), namespace)
    with LeaseQueue() as queue:
        queue.install()
        with queue.connection() as conn:
            conn.execute("CREATE TABLE summaries (document text, words int)")
        queue.enqueue({"document": "a.pdf", "text": "three short words"}, queue="documents")
        defs = namespace["defs"]
        assert isinstance(defs, dg.Definitions)
        with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
            assert (
                defs.get_job_def("process_documents").execute_in_process(instance=instance).success
            )
        with queue.connection() as conn:
            assert conn.execute("SELECT document, words FROM summaries").fetchall() == [
                ("a.pdf", 3)
            ]
        assert queue.stats("documents").counts["done"] == 1


def test_the_core_snippet(readme_env: str, capsys: pytest.CaptureFixture[str]) -> None:
    exec(compile(SNIPPETS[1], "README.md (core)", "exec"), {})
    printed = capsys.readouterr().out
    assert "'enqueued': 0, 'processing': 0, 'done': 11" in printed


def test_the_command_line_examples(readme_env: str, tmp_path: Path) -> None:
    """Every `leasequeue` line of the README's command-line section runs, but the worker
    (which runs until stopped) and the embedded server (tested in test_cli.py)."""
    section = README.read_text().split("## The command line", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    assert block is not None
    lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines()]
    runnable = [
        line
        for line in lines
        if line and not line.startswith(("leasequeue worker", "leasequeue embedded"))
    ]
    assert len(runnable) >= 9
    (tmp_path / "documents.jsonl").write_text(
        "".join(json.dumps({"document": f"scan-{n}.pdf"}) + "\n" for n in range(50))
    )
    for line in runnable:
        arguments = shlex.split(line)[1:]
        completed = subprocess.run(
            [sys.executable, "-m", "dagster_leasequeue.cli", *arguments],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert completed.returncode == 0, f"{line}: {completed.stderr}"


@pytest.mark.slow
def test_the_demo_command_tells_the_whole_story(tmp_path: Path) -> None:
    """The README's main command (after its install step), on the embedded server."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("LEASEQUEUE_")}
    env["LEASEQUEUE_DATA_DIR"] = str(tmp_path / "pgdata")
    completed = subprocess.run(
        [sys.executable, "-m", "example_repo.demo"],
        cwd=README.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # The demo's killed worker never said goodbye; its last clean user still stopped the
    # server. The stop may still be under way when the demo has exited (seen as "stopping"):
    # it is given the time a fast shutdown takes on a loaded machine.
    deadline = time.monotonic() + 60
    while server_status(tmp_path / "pgdata").running and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not server_status(tmp_path / "pgdata").running
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "killed worker pid" in completed.stdout
    assert "requeued, attempt 1" in completed.stdout
    assert "every document summarised exactly once" in completed.stdout
    assert "tick skipped: 0 batch(es) finished, 1 still running" in completed.stdout
    assert "and the report materialized once, after the batch's last task" in completed.stdout
