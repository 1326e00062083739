"""The names the Dagster layer shares: queue asset keys and the tags of the runs it launches."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import dagster as dg

from ..errors import ConfigurationError

# Set on runs that should work one queue: the worker launcher sensor sets it, and the
# resource in such a run claims from that queue.
QUEUE_TAG = "leasequeue/queue"
# Set by the worker launcher sensor on its runs: the sensor's name (its runs count against
# its limit), and the run's number among those it launched.
LAUNCHER_TAG = "leasequeue/launcher"
LAUNCH_TAG = "leasequeue/launch"
# Set by the sweeper sensor on the runs of its job: the last recovery event reported.
RECOVERED_THROUGH_EVENT_TAG = "leasequeue/recovered_through_event"
# Set by the batch sensor on the run it requests for a finished batch: the batch's id.
BATCH_TAG = "leasequeue/batch"

_ASSET_KEY_PART = re.compile(r"[A-Za-z0-9_]+")
_REPLACED = re.compile(r"[^A-Za-z0-9_]")


def key_prefix(asset_key_prefix: str | Sequence[str]) -> tuple[str, ...]:
    """An asset key prefix as its parts: one name, or a sequence of names.

    A single string is one part (``"leasequeue"``, not its letters); anything but strings
    raises ConfigurationError.
    """
    parts = (asset_key_prefix,) if isinstance(asset_key_prefix, str) else asset_key_prefix
    if not isinstance(parts, Sequence) or not all(isinstance(part, str) and part for part in parts):
        raise ConfigurationError(
            "asset_key_prefix must be a name or a sequence of names, such as "
            f"'leasequeue' or ['data', 'queues']; got {asset_key_prefix!r}"
        )
    return tuple(parts)


def queue_asset_key(
    queue: str, asset_key_prefix: str | Sequence[str] = ("leasequeue",)
) -> dg.AssetKey:
    """The asset key under which a queue's observations are reported.

    The key is the prefix followed by the queue's name, when the name is made of letters,
    digits and underscores only (``documents`` → ``leasequeue/documents``). Any other name
    has each other character replaced by ``_`` and the first 8 hex digits of the SHA-1 of
    the name (UTF-8) appended, so that queues such as ``a-b`` and ``a_b`` keep distinct
    keys: ``a-b`` → ``leasequeue/a_b_34fafddd``. The key is the same in every process.
    """
    return dg.AssetKey([*key_prefix(asset_key_prefix), _asset_key_part(queue)])


def _asset_key_part(queue: str) -> str:
    if _ASSET_KEY_PART.fullmatch(queue):
        return queue
    digest = hashlib.sha1(queue.encode("utf-8", "surrogatepass"), usedforsecurity=False)
    return f"{_REPLACED.sub('_', queue)}_{digest.hexdigest()[:8]}"


def refuse_shared_keys(queues: Sequence[str], prefix: Sequence[str]) -> list[str]:
    """The queues, each once, in order; ConfigurationError (a ValueError) if two of them
    have one asset key."""
    named: dict[dg.AssetKey, str] = {}
    for queue in dict.fromkeys(queues):
        key = queue_asset_key(queue, prefix)
        if key in named:
            raise ConfigurationError(
                f"queues {named[key]!r} and {queue!r} have the same asset key "
                f"{key.to_user_string()!r}; rename one of them"
            )
        named[key] = queue
    return list(named.values())
