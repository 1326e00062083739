"""Queue asset keys: one key per queue, so observations and checks of two queues never mix.

How the checks and the sweeper use these keys on a real queue is in
tests/integration/test_asset_keys.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import dagster as dg
import pytest

from dagster_leasequeue import (
    ConfigurationError,
    build_queue_asset_checks,
    queue_asset_key,
    queue_asset_specs,
)
from dagster_leasequeue.dagster.keys import key_prefix

# sha1("a-b") begins 34fafddd: the suffix that keeps "a-b" apart from "a_b".
A_DASH_B = dg.AssetKey(["leasequeue", "a_b_34fafddd"])
A_UNDERSCORE_B = dg.AssetKey(["leasequeue", "a_b"])


def test_a_name_that_is_a_valid_key_part_keeps_its_key() -> None:
    for name in ["documents", "a_b", "Reports_2", "_", "0"]:
        assert queue_asset_key(name) == dg.AssetKey(["leasequeue", name])
    assert queue_asset_key("a_b", ("ops", "queues")) == dg.AssetKey(["ops", "queues", "a_b"])


def test_queues_whose_names_differ_only_in_replaced_characters_get_distinct_keys() -> None:
    assert queue_asset_key("a-b") == A_DASH_B
    assert queue_asset_key("a_b") == A_UNDERSCORE_B
    names = ["a-b", "a_b", "a.b", "a b", "a/b", "ü", "ö", "_", "-", "--"]
    keys = [queue_asset_key(name) for name in names]
    assert len(set(keys)) == len(names)
    # Still clean key parts: letters, digits and underscores, as Dagster names are.
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", key.path[-1]) for key in keys)


def test_the_keys_are_the_same_in_every_process() -> None:
    code = (
        "from dagster_leasequeue import queue_asset_key;"
        "print(queue_asset_key('a-b').path[-1], queue_asset_key('ü').path[-1])"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {"a_b_34fafddd __94a759fd"}


def test_asset_specs_of_such_queues_have_distinct_keys() -> None:
    specs = queue_asset_specs(["a-b", "a_b"])
    assert [spec.key for spec in specs] == [A_DASH_B, A_UNDERSCORE_B]
    assert [spec.metadata["queue"] for spec in specs] == ["a-b", "a_b"]
    dg.Definitions(assets=specs).get_repository_def()
    # A queue named twice is declared once.
    assert [spec.key for spec in queue_asset_specs(["a-b", "a-b"])] == [A_DASH_B]


def test_two_queues_with_one_key_are_refused_naming_both() -> None:
    # A name chosen to be another queue's replaced key: the one collision left possible.
    clash = ["a-b", "a_b_34fafddd"]
    with pytest.raises(ValueError, match=r"'a-b'.*'a_b_34fafddd'"):
        queue_asset_specs(clash)
    with pytest.raises(ValueError, match=r"'a-b'.*'a_b_34fafddd'"):
        build_queue_asset_checks(clash)


def test_a_prefix_given_as_one_name_is_one_part() -> None:
    assert queue_asset_key("docs", "data") == dg.AssetKey(["data", "docs"])
    assert queue_asset_key("docs", ["data", "queues"]) == dg.AssetKey(["data", "queues", "docs"])
    assert key_prefix("leasequeue") == ("leasequeue",)


@pytest.mark.parametrize("prefix", [5, ["data", ""], ["data", 5], None])
def test_a_prefix_of_anything_but_names_says_what_to_give(prefix: object) -> None:
    with pytest.raises(ConfigurationError, match="asset_key_prefix must be a name"):
        key_prefix(prefix)  # type: ignore[arg-type]
