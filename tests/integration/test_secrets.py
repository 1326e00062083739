"""A DSN's password never shows in errors, reprs, chained exceptions or logs, when connecting.

The DSN tests that need no server (parsing, redaction, settings) are in tests/unit/test_dsn.py.
"""

from __future__ import annotations

import logging
import time
import traceback
from pathlib import Path

import pytest

from dagster_leasequeue import DatabaseUnavailable, LeaseQueue, LeaseQueueError, LeaseQueueSettings
from dagster_leasequeue.dsn import redact

from ..redaction import PASSWORD, assert_hidden, every_text_of, token

BAD_DSNS = [
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app",  # nothing listens on port 1
    f"host=127.0.0.1 port=1 user=alice password={PASSWORD} dbname=app",
    f"postgresql://alice:{PASSWORD}@no-such-host.invalid:5432/app",
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app?sslmode=bogus",
    f"postgresql://alice:{PASSWORD}@127.0.0.1:1/app?nonsense_option=1",
]


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


def test_queue_repr_has_no_password(dsn: str) -> None:
    # A working DSN with a password added: trust authentication ignores it.
    with_password = redact(dsn).replace("***", PASSWORD) if "***" in redact(dsn) else dsn
    with LeaseQueue(with_password) as queue:
        assert PASSWORD not in repr(queue) and PASSWORD not in queue.location


# A DSN that parses, with the password also (by mistake) in an option whose invalid value
# libpq quotes when connecting: the connection error still never shows it.
PARSABLE_BUT_WRONG = [
    f"host=127.0.0.1 port=1 dbname=app user=alice password={token(30)} sslmode={token(30)}",
    f"host=127.0.0.1 port=1 dbname=app user=alice password={token(31)} hostaddr={token(31)}",
    f"host=127.0.0.1 port=1 dbname=app user=alice password={token(32)} keepalives={token(32)}",
    f"postgresql://alice:{token(33)}@127.0.0.1:1/app?target_session_attrs={token(33)}",
    f"postgresql://alice:{token(34)}@127.0.0.1:1/app?channel_binding={token(34)}",
]


def shown_text_of(error: BaseException) -> str:
    """What a traceback, a log record or Dagster's stored error shows of ``error``: its chain,
    except a context suppressed by ``raise ... from None``."""
    texts = ["".join(traceback.format_exception(error))]
    seen: BaseException | None = error
    while seen is not None:
        texts += [str(seen), repr(seen), repr(seen.args)]
        seen = seen.__cause__ or (None if seen.__suppress_context__ else seen.__context__)
    return "\n".join(texts)


@pytest.mark.parametrize("dsn", PARSABLE_BUT_WRONG)
def test_a_connection_error_never_shows_the_password(
    dsn: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    settings = LeaseQueueSettings(connect_timeout=2, data_dir=tmp_path / "unused", _env_file=None)
    with pytest.raises(DatabaseUnavailable) as raised:
        LeaseQueue(dsn, settings=settings)
    assert "127.0.0.1:1" in str(raised.value)
    assert_hidden(shown_text_of(raised.value) + caplog.text, dsn, [])


def test_a_connection_error_does_not_hold_the_unredacted_driver_error(tmp_path: Path) -> None:
    dsn = PARSABLE_BUT_WRONG[0]
    settings = LeaseQueueSettings(connect_timeout=2, data_dir=tmp_path / "unused", _env_file=None)
    with pytest.raises(DatabaseUnavailable) as raised:
        LeaseQueue(dsn, settings=settings)
    assert_hidden(every_text_of(raised.value), dsn, [])
