"""The exceptions raised by dagster-leasequeue.

Every error the package raises on purpose is a :class:`LeaseQueueError`, so callers can
catch one class. Errors caused by a caller's input also derive from :class:`ValueError`.
"""

from __future__ import annotations


class LeaseQueueError(Exception):
    """Base class of every error raised by dagster-leasequeue."""


class LeaseLost(LeaseQueueError):
    """The lease is no longer held: the task was swept, re-claimed, cancelled or finished.

    Nothing was changed. The worker must stop working on the task; whoever holds it now
    (or the sweeper) decides what happens to it.
    """


class ConfigurationError(LeaseQueueError, ValueError):
    """A setting, schema name or argument has a value that cannot be used."""


class PayloadError(LeaseQueueError, ValueError):
    """A payload or result is not a JSON object, cannot be encoded, or is too large."""


class SchemaNotInstalled(LeaseQueueError):
    """The queue's tables do not exist (yet) in the database."""


class DatabaseUnavailable(LeaseQueueError):
    """The database could not be reached or refused the connection."""


class TransactionAbandoned(LeaseQueueError):
    """The server ended a transaction that sat idle too long; nothing in it was written."""


class TaskNotFound(LeaseQueueError, LookupError):
    """No task has the given id."""


class BatchNotFound(LeaseQueueError, LookupError):
    """No batch has the given id."""


# The longest error text stored: a task's last_error and an attempt's error are read on
# every look at the task, and an exception's text can be a whole response body.
MAX_ERROR_LENGTH = 10_000


def describe_error(error: str | BaseException) -> str:
    """How an error is stored in a task's ``last_error`` or an attempt's ``error``.

    Whatever the text holds, it can be stored: a NUL (which PostgreSQL's text cannot hold)
    and a lone surrogate (which has no UTF-8 form) are written as backslash escapes, so a
    task whose exception's text carries either still fails, and is retried, as any other.
    Text past MAX_ERROR_LENGTH characters is cut, with how much was left out.
    """
    if isinstance(error, BaseException):
        text = str(error)
        text = f"{type(error).__name__}: {text}" if text else type(error).__name__
    else:
        text = str(error)
    if len(text) > MAX_ERROR_LENGTH:
        text = f"{text[:MAX_ERROR_LENGTH]}... ({len(text) - MAX_ERROR_LENGTH} more characters)"
    text = text.replace("\x00", "\\x00")
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
