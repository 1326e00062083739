"""Payloads and results are encoded, and refused with what to fix, before anything is sent.

That a refused payload stores nothing, and how a stored one reads back, is in
tests/integration/test_inputs.py.
"""

from __future__ import annotations

import json
import math
from decimal import Decimal

import pytest
from hypothesis import given, strategies as st

from dagster_leasequeue import PayloadError
from dagster_leasequeue.payloads import encode_object

# Refused by encode_object, and so by every enqueue (tests/integration/test_inputs.py).
BAD_PAYLOADS = [
    ([1, 2], "must be a JSON object"),
    ("text", "must be a JSON object"),
    (None, "must be a JSON object"),
    ({"when": object()}, "not JSON-serialisable"),
    ({"amount": Decimal("1.5")}, "not JSON-serialisable"),
    ({"x": math.nan}, "not JSON-serialisable"),
    ({"x": math.inf}, "not JSON-serialisable"),
    ({"x": "a\x00b"}, "NUL"),
    ({"x": "a\\\x00b"}, "NUL"),
    ({"x": "a\ud800b"}, "lone surrogate"),
    ({1: "int key"}, "keys must be strings"),
    # JSON would make 1 the text "1" and keep one of the two values.
    ({"nested": {1: "one", "1": "also one"}}, "nested object with the key 1"),
    ({"rows": [{"id": 1}, {None: "x"}]}, "nested object with the key None"),
]


@pytest.mark.parametrize(("payload", "message"), BAD_PAYLOADS)
def test_a_bad_payload_is_refused_before_it_is_sent(payload: object, message: str) -> None:
    with pytest.raises(PayloadError, match=rf"^payload .*{message}"):
        encode_object(payload, what="payload", max_bytes=1000)


def test_the_limit_counts_encoded_bytes_and_names_its_setting() -> None:
    payload = {"s": "é" * 10}  # {"s":"…"}: 8 bytes, and 2 for each é
    assert json.loads(encode_object(payload, what="payload", max_bytes=28)) == payload
    with pytest.raises(PayloadError, match=r"28 bytes .* limit of 27 .*PAYLOAD_MAX_BYTES"):
        encode_object(payload, what="payload", max_bytes=27)


@pytest.mark.parametrize("text", ["C:\\u0000\\files", "\\\\u0000", "u0000"])
def test_an_escaped_backslash_before_u0000_is_not_a_nul(text: str) -> None:
    encoded = encode_object({"path": text}, what="payload", max_bytes=1000)
    assert json.loads(encoded) == {"path": text}


# What jsonb stores: no NUL character and no lone surrogate, in keys as in values.
_TEXT = st.text(st.characters(codec="utf-8", blacklist_characters="\x00"), max_size=8)
_JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(_TEXT, inner),
    max_leaves=12,
)


@given(payload=st.dictionaries(_TEXT, _JSON_VALUES, max_size=5))
def test_every_json_object_encodes_to_text_that_reads_back_the_same(
    payload: dict[str, object],
) -> None:
    assert json.loads(encode_object(payload, what="payload", max_bytes=10**6)) == payload


def test_a_payload_nested_past_the_encoders_depth_is_refused() -> None:
    payload: dict[str, object] = {}
    inner = payload
    for _ in range(100_000):
        inner["a"] = inner = {}
    with pytest.raises(PayloadError, match=r"^payload is nested too deeply"):
        encode_object(payload, what="payload", max_bytes=10**9)


def test_text_that_only_looks_like_a_nested_object_is_taken() -> None:
    assert encode_object({"a": "{1: 2}"}, what="payload", max_bytes=100) == '{"a":"{1: 2}"}'
