"""The server-instruction counts' check that both drains ran the same plans."""

from __future__ import annotations

from benchmarks.server_instructions import plans_differ


def test_a_small_drain_planned_otherwise_is_told_apart() -> None:
    # Counts of lq_chain drains of 300 and 1,300 tasks: the first pair's 300-task drain
    # scanned the whole table in each statement; the second's used the primary key.
    assert plans_differ(337_310_806, 716_669_391)
    assert not plans_differ(180_273_311, 719_619_029)
    assert not plans_differ(214_151_665, 869_508_882)
