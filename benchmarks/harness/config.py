"""What a benchmark run measures, and how much of it: the defaults and the --quick ones."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

DEFAULT_DSN = "postgresql://postgres@127.0.0.1:5432/test"
RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"

SECTIONS = (
    "enqueue",
    "latency",
    "plans",
    "renew",
    "drain",
    "sweeper",
    "polling",
    "memory",
    "sweep",
    "batches",
    "flow",
)


@dataclass(frozen=True)
class BenchConfig:
    """One run's parameters; :func:`full` and :func:`quick` give the two presets."""

    dsn: str
    quick: bool
    tasks: int
    workers: tuple[int, ...] = (1, 4)
    rounds: int = 4
    min_drain_seconds: float = 2.0
    max_drain_repeats: int = 5
    batch: int = 100
    enqueue_chunk: int = 1000
    enqueue_single: int = 3000
    latency_tasks: int = 3000
    sweep_sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    sweep_expired: int = 1000
    sweep_idle_calls: int = 25
    counts_calls: int = 5
    sweep_expired_repeats: int = 5
    sweeper_strategy: str = "lq_one"
    sweeper_workers: int = 4
    sweeper_interval: float = 1.0
    sweeper_pairs: int = 2
    poll_intervals_ms: tuple[int, ...] = (10, 100)
    poll_samples: int = 30
    memory_strategy: str = "lq_batch"
    memory_tasks: int = 1_000_000
    batch_enqueue_tasks: int = 100_000
    batch_enqueue_pairs: int = 2
    # Four pairs of 20,000-task drains per cell, in ABBA order (a single pair moves by more
    # than the target's ten percent, and two by about as much as the target allows): the
    # section takes about 6 minutes on two cores.
    batch_drain_pairs: int = 4
    # Two passes over the flow cases, the second in reversed order: the limited and the
    # unlimited drains each run a second or two, and one pass moved the ratio from 0.67 to
    # 1.02 between runs of the same code.
    flow_drain_pairs: int = 2
    batch_info_tasks: int = 1_000_000
    batch_info_acked: int = 1000
    batch_info_processing: int = 5
    batch_info_calls: int = 2000
    sections: tuple[str, ...] = SECTIONS
    output: Path = RESULTS_DIR / "latest.json"
    plot: Path | None = RESULTS_DIR / "latest.png"


def full(dsn: str, tasks: int | None = None) -> BenchConfig:
    """The default run: about half an hour on two cores."""
    return BenchConfig(dsn=dsn, quick=False, tasks=tasks or 20_000)


def quick(dsn: str, tasks: int | None = None) -> BenchConfig:
    """A smoke run of a minute or so: smaller counts, no 1M-row sweep."""
    return BenchConfig(
        dsn=dsn,
        quick=True,
        tasks=tasks or 2000,
        enqueue_single=500,
        latency_tasks=500,
        rounds=1,
        min_drain_seconds=0.0,
        sweep_sizes=(10_000, 100_000),
        sweep_idle_calls=15,
        sweep_expired_repeats=3,
        sweeper_pairs=1,
        flow_drain_pairs=1,
        poll_samples=10,
        memory_tasks=10_000,
        batch_enqueue_tasks=10_000,
        batch_enqueue_pairs=1,
        batch_info_tasks=100_000,
        batch_info_acked=200,
        batch_info_calls=300,
    )
