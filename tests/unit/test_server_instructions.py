"""The server-instruction counts' check that both drains ran the same plans."""

from __future__ import annotations

from benchmarks.server_instructions import LARGE, SMALL, plans_differ


def test_a_small_drain_planned_otherwise_is_told_apart() -> None:
    # Instructions per task of raw_one_lean's drains of 300 and 1,300 tasks.
    assert plans_differ(678_306 * SMALL, 324_647 * LARGE)
    # lq_chain's drains, both through the indexes.
    assert not plans_differ(535_675 * SMALL, 530_291 * LARGE)
    assert not plans_differ(479_410 * SMALL, 434_719 * LARGE)


def test_the_drains_are_past_the_sizes_whose_counts_differed() -> None:
    # Counted drains of raw_one_lean: 300 tasks ran 678,306 instructions per task, 700
    # tasks 327,202 and 1,300 tasks 324,647.
    assert SMALL >= 700
    assert LARGE >= 2 * SMALL
