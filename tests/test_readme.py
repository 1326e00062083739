"""Every Python snippet in the README runs."""

from __future__ import annotations

import re
from pathlib import Path

import dagster as dg
import pytest

from dagster_leasequeue import LeaseQueue

README = Path(__file__).resolve().parent.parent / "README.md"
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
    assert "'done': 1" in printed and "'enqueued': 1000" in printed
