"""A DSN's password never shows in errors, reprs, chained exceptions or logs."""

from __future__ import annotations

import logging
import time
import traceback

import pytest

from dagster_leasequeue import DatabaseUnavailable, LeaseQueue, LeaseQueueError, LeaseQueueSettings
from dagster_leasequeue.dsn import describe, redact

PASSWORD = "Tr0ub4dor-S3cret"

BAD_DSNS = [
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app",  # nothing listens on port 1
    f"host=127.0.0.1 port=1 user=alice password={PASSWORD} dbname=app",
    f"postgresql://alice:{PASSWORD}@no-such-host.invalid:5432/app",
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app?sslmode=bogus",
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app?nonsense_option=1",
]


def every_text_of(error: BaseException) -> str:
    texts = ["".join(traceback.format_exception(error))]
    seen: BaseException | None = error
    while seen is not None:
        texts += [str(seen), repr(seen), repr(seen.args)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


@pytest.mark.parametrize("dsn", BAD_DSNS)
def test_a_failing_dsn_never_shows_its_password(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    started = time.monotonic()
    with pytest.raises(LeaseQueueError) as raised:
        LeaseQueue(dsn, settings=LeaseQueueSettings(connect_timeout=2, _env_file=None))
    assert time.monotonic() - started < 10
    text = every_text_of(raised.value)
    assert PASSWORD not in text
    assert PASSWORD not in caplog.text
    if "nonsense" not in dsn and "bogus" not in dsn:
        assert isinstance(raised.value, DatabaseUnavailable)
        assert "alice" not in str(raised.value) or "***" in str(raised.value)
        host = "no-such-host.invalid" if "invalid" in dsn else "127.0.0.1:1"
        assert host in str(raised.value)


def test_settings_never_show_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEASEQUEUE_DSN", f"postgresql://alice:{PASSWORD}@db/app")
    settings = LeaseQueueSettings()
    assert PASSWORD not in repr(settings) and PASSWORD not in str(settings)
    assert PASSWORD not in settings.model_dump_json()
    monkeypatch.setenv("LEASEQUEUE_LEASE_SECONDS", "never")
    with pytest.raises(LeaseQueueError) as raised:
        LeaseQueueSettings()
    assert PASSWORD not in every_text_of(raised.value)


def test_queue_repr_has_no_password(dsn: str) -> None:
    # A working DSN with a password added: trust authentication ignores it.
    with_password = redact(dsn).replace("***", PASSWORD) if "***" in redact(dsn) else dsn
    with LeaseQueue(with_password) as queue:
        assert PASSWORD not in repr(queue) and PASSWORD not in queue.location


def test_redact_and_describe() -> None:
    assert redact(f"postgresql://a:{PASSWORD}@h/db") == "postgresql://a:***@h/db"
    assert redact(f"host=h password={PASSWORD} user=a") == "host=h password=*** user=a"
    assert redact(f"host=h password='{PASSWORD} x' user=a") == "host=h password=*** user=a"
    assert describe(f"postgresql://a:{PASSWORD}@db.example:6543/app") == "db.example:6543/app"
    assert describe("postgresql://postgres:@/postgres?host=/tmp/pg") == "socket /tmp/pg/postgres"


def test_an_unencoded_at_sign_in_a_url_password_is_refused() -> None:
    with pytest.raises(LeaseQueueError, match="percent-encode") as raised:
        LeaseQueue("postgresql://alice:Tr0ub@dor@127.0.0.1:1/app")
    assert "dor" not in str(raised.value) and "Tr0ub" not in str(raised.value)
