"""DSN handling with no server: parsing, redaction, and the messages of a malformed DSN.

What happens when a DSN that parses fails to connect is in tests/integration/test_secrets.py.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner
from dagster._utils.error import serializable_error_info_from_exc_info

from dagster_leasequeue import (
    ConfigurationError,
    LeaseQueue,
    LeaseQueueError,
    LeaseQueueResource,
    LeaseQueueSettings,
    build_sweeper_sensor,
)
from dagster_leasequeue.cli import main
from dagster_leasequeue.dsn import describe, redact

from ..redaction import PASSWORD, assert_hidden, every_text_of, token


def test_settings_never_show_the_dsn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEASEQUEUE_DSN", f"postgresql://alice:{PASSWORD}@db/app")
    settings = LeaseQueueSettings()
    assert PASSWORD not in repr(settings) and PASSWORD not in str(settings)
    assert PASSWORD not in settings.model_dump_json()
    monkeypatch.setenv("LEASEQUEUE_LEASE_SECONDS", "never")
    with pytest.raises(LeaseQueueError) as raised:
        LeaseQueueSettings()
    assert PASSWORD not in every_text_of(raised.value)


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


# -- malformed DSNs: the error says what is wrong, and quotes nothing but host/port/dbname ---


# (name, DSN, fragments besides the password and the user that must never be shown)
MALFORMED_DSNS = [
    # The cases: libpq quoted the whole password, or the words after it.
    (
        "url-space-in-password",
        f"postgresql://alice:{token(1)} mango@127.0.0.1:5432/app",
        ["mango"],
    ),
    (
        "kv-unquoted-space",
        f"host=127.0.0.1 dbname=app user=alice password={token(2)} kiwi7",
        ["kiwi7"],
    ),
    (
        "kv-unterminated-quote",
        f"host=127.0.0.1 dbname=app user=alice password='{token(3)} papaya",
        ["papaya"],
    ),
    ("kv-missing-equals", f"host=127.0.0.1 dbname=app user=alice password {token(4)}", []),
    (
        "kv-empty-keyword",
        f"host=127.0.0.1 dbname=app user=alice password={token(5)} =banana",
        ["banana"],
    ),
    (
        "kv-unknown-keyword",
        f"host=127.0.0.1 dbname=app user=alice password={token(6)} grape_opt=cherry",
        ["grape", "cherry"],
    ),
    (
        "kv-misspelt-keyword",
        f"host=127.0.0.1 dbname=app user=alice passwd={token(20)}",
        ["passwd"],
    ),
    ("kv-bad-port", f"host=127.0.0.1 port=5432x dbname=app user=alice password={token(7)}", []),
    ("kv-lone-surrogate", f"host=127.0.0.1 dbname=app user=alice password={token(8)}\udcff", []),
    ("kv-nul", f"host=127.0.0.1 dbname=app user=alice password={token(9)}\x00 olive", ["olive"]),
    ("url-bad-percent", f"postgresql://alice:{token(10)}%zz@127.0.0.1:5432/app", []),
    ("url-percent-nul", f"postgresql://alice:{token(11)}%00@127.0.0.1:5432/app", []),
    (
        "url-unknown-param",
        f"postgresql://alice:{token(12)}@127.0.0.1:5432/app?guava_opt=on",
        ["guava"],
    ),
    (
        "url-param-without-equals",
        f"postgresql://alice:{token(13)}@127.0.0.1:5432/app?sslmode=disable&melon",
        ["melon", "sslmode"],
    ),
    (
        "url-param-two-equals",
        f"postgresql://alice:{token(14)}@127.0.0.1:5432/app?application_name=a=lime",
        ["lime", "application_name"],
    ),
    (
        "url-space-in-param",
        f"postgresql://alice:{token(15)}@127.0.0.1:5432/app?application_name=nightly batch",
        ["nightly", "batch"],
    ),
    ("url-no-host-after-password", f"postgresql://alice:{token(16)}/app", []),
    ("url-port-out-of-range", f"postgresql://alice:{token(17)}@127.0.0.1:99999/app", []),
    ("url-ipv6-unterminated", f"postgresql://alice:{token(18)}@[::1/app", []),
    ("url-ipv6-trailing-text", f"postgresql://alice:{token(19)}@[::1]x/app", []),
]


MALFORMED_IDS = [name for name, _, _ in MALFORMED_DSNS]


# What the error says is wrong with each.
PROBLEMS = {
    "url-space-in-password": "holds a space: in a URL write a space as %20",
    "kv-unquoted-space": "a key=value pair has no '='",
    "kv-unterminated-quote": "a quoted value has no closing quote",
    "kv-missing-equals": "a key=value pair has no '='",
    "kv-empty-keyword": "a keyword is not a connection option",
    "kv-unknown-keyword": "a keyword is not a connection option;",
    "kv-misspelt-keyword": "a keyword is not a connection option (did you mean password?)",
    "kv-bad-port": "a port is not a number from 1 to 65535;",
    "kv-lone-surrogate": "not valid Unicode text",
    "kv-nul": "holds a NUL character",
    "url-bad-percent": "a '%' is not followed by two hexadecimal digits",
    "url-percent-nul": "holds %00",
    "url-unknown-param": "a URL query parameter is not a connection option",
    "url-param-without-equals": "a URL query parameter has no '='",
    "url-param-two-equals": "a URL query parameter has more than one '='",
    "url-space-in-param": "holds a space",
    "url-no-host-after-password": "user:password needs @host after it",
    "url-port-out-of-range": "a port is not a number from 1 to 65535;",
    "url-ipv6-unterminated": "an IPv6 host is malformed",
    "url-ipv6-trailing-text": "an unexpected character follows the host",
}


def assert_explained(message: str) -> None:
    assert "not a valid PostgreSQL connection string" in message
    assert "for example postgresql://" in message


@pytest.mark.parametrize(("name", "dsn", "fragments"), MALFORMED_DSNS, ids=MALFORMED_IDS)
def test_a_malformed_dsn_is_refused_without_quoting_it(
    name: str, dsn: str, fragments: list[str], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    caplog.set_level(logging.DEBUG)
    no_env = {"_env_file": None, "data_dir": tmp_path / "unused", "connect_timeout": 2}
    attempts: list[Callable[[], object]] = [
        lambda: describe(dsn),
        lambda: LeaseQueue(dsn, settings=LeaseQueueSettings(**no_env)),
        lambda: LeaseQueue(settings=LeaseQueueSettings(dsn=dsn, **no_env)),
        lambda: LeaseQueue.from_settings(LeaseQueueSettings(dsn=dsn, **no_env)),
    ]
    for attempt in attempts:
        with pytest.raises(ConfigurationError) as raised:
            attempt()
        assert_explained(str(raised.value))
        assert PROBLEMS[name] in str(raised.value)
        assert_hidden(every_text_of(raised.value), dsn, fragments)
    assert_hidden(caplog.text, dsn, fragments)


@pytest.mark.parametrize(("name", "dsn", "fragments"), MALFORMED_DSNS, ids=MALFORMED_IDS)
def test_the_cli_never_echoes_a_malformed_dsn(
    name: str, dsn: str, fragments: list[str], tmp_path: Path
) -> None:
    env = {"LEASEQUEUE_DSN": None, "LEASEQUEUE_DATA_DIR": str(tmp_path / "unused")}
    result = CliRunner().invoke(main, ["--dsn", dsn, "stats"], env=env)
    assert result.exit_code == 1, result.output
    assert_explained(result.stderr)
    assert_hidden(result.output, dsn, fragments)
    assert_hidden(result.stderr, dsn, fragments)


@pytest.mark.parametrize("name", ["url-space-in-password", "kv-unquoted-space"])
def test_the_leasequeue_command_never_echoes_a_malformed_dsn(name: str, tmp_path: Path) -> None:
    _, dsn, fragments = next(case for case in MALFORMED_DSNS if case[0] == name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LEASEQUEUE_")}
    command = Path(sys.executable).with_name("leasequeue")
    done = subprocess.run(
        [str(command), "--dsn", dsn, "stats"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert_explained(done.stderr)
    assert_hidden(done.stdout + done.stderr, dsn, fragments)


@pytest.mark.parametrize(
    ("name", "dsn", "fragments"),
    # Dagster stores a run's events as UTF-8 text: a lone surrogate never gets that far.
    [case for case in MALFORMED_DSNS if "surrogate" not in case[0]],
    ids=[name for name in MALFORMED_IDS if "surrogate" not in name],
)
def test_a_dagster_run_never_logs_a_malformed_dsn(
    name: str, dsn: str, fragments: list[str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    @dg.op
    def needs_queue(leasequeue: LeaseQueueResource) -> None:
        leasequeue.claim()

    @dg.job(resource_defs={"leasequeue": LeaseQueueResource(dsn=dsn)})
    def broken() -> None:
        needs_queue()

    with dg.instance_for_test(temp_dir=str(tmp_path)) as instance:
        result = broken.execute_in_process(instance=instance, raise_on_error=False)
        assert not result.success
        failure = next(e for e in result.all_events if e.is_failure)
        assert_explained(str(failure.event_specific_data))
        texts = [str(event) for event in result.all_events]
        texts += [str(entry) for entry in instance.all_logs(result.run_id)]
    assert_hidden("\n".join(texts), dsn, fragments)
    assert_hidden(caplog.text, dsn, fragments)


@pytest.mark.parametrize(
    "name", ["url-space-in-password", "kv-unquoted-space", "url-no-host-after-password"]
)
def test_a_sensor_tick_never_shows_a_malformed_dsn(name: str) -> None:
    _, dsn, fragments = next(case for case in MALFORMED_DSNS if case[0] == name)
    sensor = build_sweeper_sensor()
    with dg.build_sensor_context(resources={"leasequeue": LeaseQueueResource(dsn=dsn)}) as context:
        try:
            sensor.evaluate_tick(context)
        except Exception:
            # What the daemon stores with the failed tick.
            error = serializable_error_info_from_exc_info(sys.exc_info())
        else:
            pytest.fail("the tick should fail")
    assert_explained(error.to_string())
    assert_hidden(error.to_string(), dsn, fragments)


def test_redact_hides_the_whole_password_of_a_malformed_url() -> None:
    dsn = f"postgresql://alice:{token(1)} mango@127.0.0.1:5432/app"
    text = redact(f'unexpected spaces found in "{token(1)} mango"', dsn)
    assert token(1) not in text and "mango" not in text


@pytest.mark.parametrize(
    ("dsn", "where"),
    [
        ("host=h1,h2 port=5432,5433 dbname=db", "h1:5432,h2:5433/db"),
        ("postgresql://app@h1,h2/db", "h1:5432,h2:5432/db"),
        (
            "postgresql://app@h1:6432,h2:6433/db?target_session_attrs=read-write",
            "h1:6432,h2:6433/db",
        ),
        ("host=/tmp,h2 port=5432 dbname=x", "socket /tmp,h2:5432/x"),
        ("hostaddr=10.0.0.1 dbname=d", "10.0.0.1:5432/d"),
    ],
)
def test_a_dsn_with_several_hosts_names_each_with_its_port(dsn: str, where: str) -> None:
    assert describe(dsn) == where


def test_a_dsn_whose_ports_do_not_match_its_hosts_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="number of ports"):
        describe("host=h1,h2,h3 port=1,2 dbname=db")
