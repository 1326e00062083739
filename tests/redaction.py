"""What the tests of DSN handling share: the passwords they plant and the texts they search."""

from __future__ import annotations

import re
import traceback

PASSWORD = "Tr0ub4dor-S3cret"


def every_text_of(error: BaseException) -> str:
    texts = ["".join(traceback.format_exception(error))]
    seen: BaseException | None = error
    while seen is not None:
        texts += [str(seen), repr(seen), repr(seen.args)]
        seen = seen.__cause__ or seen.__context__
    return "\n".join(texts)


def token(number: int) -> str:
    """A password no message could hold by chance."""
    return f"Zq{number:02d}s3cr3T"


def assert_hidden(text: str, dsn: str, fragments: list[str]) -> None:
    """No piece of the DSN but its host, port or database name is in ``text``."""
    password = re.search(r"Zq\d\ds3cr3T", dsn)
    assert password is not None
    for secret in [password.group(), "alice", *fragments]:
        assert secret not in text, f"{secret!r} shown in: {text}"
