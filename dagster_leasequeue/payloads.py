"""Payloads and results: JSON text the database will accept, and jsonb read back."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from psycopg.abc import Buffer
from psycopg.adapt import Loader

from .errors import PayloadError

# A NUL character as json.dumps writes it: \u0000 after an even number of backslashes
# (an odd number means the backslash itself was escaped: the text "\\u0000" is fine).
_ENCODED_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")

# One encoder for every call: json.dumps with options builds a new one each time, which on
# small payloads costs as much as the encoding itself.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"), ensure_ascii=False)


def encode_object(value: Any, *, what: str, max_bytes: int) -> str:
    """Encode a JSON object, or raise PayloadError saying what to fix.

    Checked here, before anything is written: the value must be a mapping with string keys,
    every value must be JSON (no NaN or infinity, which jsonb refuses), no string may hold
    a NUL character (jsonb refuses it too), and the encoded size must stay within the limit.
    """
    if not isinstance(value, Mapping):
        raise PayloadError(
            f"{what} must be a JSON object (a dict), got {type(value).__name__}: "
            f"wrap it, for example {{'value': ...}}"
        )
    try:
        text = _ENCODER.encode(value)
    except (TypeError, ValueError) as exc:
        raise PayloadError(f"{what} is not JSON-serialisable: {exc}") from None
    except RecursionError:
        raise PayloadError(
            f"{what} is nested too deeply to encode: flatten it, or store it elsewhere and "
            "enqueue a reference"
        ) from None
    if not all(isinstance(key, str) for key in value):
        raise PayloadError(f"{what} keys must be strings (JSON object keys)")
    # Only an object inside the payload can hide a key: its text has a "{" after the first.
    if "{" in text[1:] and (key := _nested_key_not_a_string(value)) is not _NO_KEY:
        raise PayloadError(
            f"{what} has a nested object with the key {key!r}, which is not a string: JSON "
            "would turn it into text silently (and 1 and '1' into one key), so make it a "
            "string"
        )
    if "\\u0000" in text and _ENCODED_NUL.search(text):
        raise PayloadError(f"{what} holds a NUL character (\\u0000), which PostgreSQL refuses")
    try:
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{what} holds a lone surrogate ({text[exc.start : exc.end]!a}), which is not "
            "Unicode text: decode the data it came from with errors='replace', or send bytes "
            "as base64"
        ) from None
    if size > max_bytes:
        raise PayloadError(
            f"{what} is {size} bytes encoded, over the limit of {max_bytes} bytes "
            "(LEASEQUEUE_PAYLOAD_MAX_BYTES): store large data elsewhere and enqueue a reference"
        )
    return text


_NO_KEY = object()


def _nested_key_not_a_string(value: Mapping[Any, Any]) -> object:
    """The first key of an object nested in ``value`` that is not a string, else _NO_KEY.
    A loop, not a recursion: the encoder has already accepted the nesting's depth."""
    pending: list[Any] = list(value.values())
    while pending:
        item = pending.pop()
        if isinstance(item, Mapping):
            for key in item:
                if not isinstance(key, str):
                    return key
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return _NO_KEY


_DECODER = json.JSONDecoder()


class JsonbLoader(Loader):
    """Reads jsonb in text form straight into Python, as ``json.loads`` would.

    The server writes jsonb in one canonical form: valid JSON, no whitespace around it. So
    the decoder can read it at once, skipping the encoding detection and the whitespace
    checks of ``json.loads``: about 5% of a claim and ack's client instructions.
    """

    def load(self, data: Buffer) -> Any:
        return _DECODER.raw_decode(str(data, "utf-8"))[0]
