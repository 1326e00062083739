"""Progress lines on stderr, and the failures a run met and went past."""

from __future__ import annotations

import sys
import time


class Progress:
    """Call it with a message to log it; :meth:`failed` logs and remembers a failure."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self.failures: list[str] = []

    def __call__(self, message: str) -> None:
        elapsed = time.monotonic() - self._started
        print(f"[{elapsed:6.1f} s] {message}", file=sys.stderr, flush=True)

    def failed(self, what: str, error: BaseException) -> None:
        text = f"{what}: {type(error).__name__}: {str(error).strip()}"
        self.failures.append(text)
        self(f"FAILED {text}")

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._started
