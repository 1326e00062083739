"""The listener that wakes waiting claims, when its server cannot be reached."""

from __future__ import annotations

import time

from dagster_leasequeue.notify import Listener

UNREACHABLE = "postgresql://nobody@127.0.0.1:1/none"  # nothing listens on port 1


def test_a_wait_with_no_server_sleeps_out_its_time_instead_of_spinning() -> None:
    listener = Listener(UNREACHABLE, "lq", {"connect_timeout": 2})
    try:
        started = time.monotonic()
        mark = listener.wait(0.5, 0)
        assert 0.45 <= time.monotonic() - started < 3
        assert listener.wait(0.3, mark) == mark  # no notification came
    finally:
        listener.close()
