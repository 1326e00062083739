"""Worker memory: one long drain with RSS sampled along the way, and every drain's workers."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.runner import DrainResult
from benchmarks.harness.strategies import STRATEGIES
from benchmarks.sections.drain import drain

# A worker's memory is flat when it grew by less than this between its first and last sample.
FLAT_KIB = 2048
FLAT_FRACTION = 0.05


@dataclass
class MemoryResult:
    strategy: str
    tasks: int
    samples_kib: list[tuple[int, int]]
    growth_kib: int
    bytes_per_task: float
    flat: bool


def memory_growth(samples: list[tuple[int, int]]) -> int:
    """RSS growth in KiB from the first (warm) sample to the last."""
    return samples[-1][1] - samples[0][1] if samples else 0


def is_flat(samples: list[tuple[int, int]]) -> bool:
    return not samples or memory_growth(samples) <= max(FLAT_KIB, FLAT_FRACTION * samples[0][1])


def run_memory(config: BenchConfig, log: Progress) -> MemoryResult:
    result = drain(config, log, config.memory_strategy, 1, tasks=config.memory_tasks)
    samples = result.rss_kib[0]
    growth = memory_growth(samples)
    return MemoryResult(
        strategy=config.memory_strategy,
        tasks=result.tasks,
        samples_kib=samples,
        growth_kib=growth,
        bytes_per_task=growth * 1024 / max(1, samples[-1][0] - samples[0][0]),
        flat=is_flat(samples),
    )


def _row(
    label: str, workers: int, tasks: int, samples: list[tuple[int, int]]
) -> tuple[object, ...]:
    start, end = samples[0][1], samples[-1][1]
    flat = "yes" if is_flat(samples) else "NO"
    return (label, workers, tasks, start / 1024, end / 1024, memory_growth(samples) / 1024, flat)


def render_memory(result: MemoryResult, drains: list[DrainResult] | None) -> str:
    rows = [_row(f"{result.strategy} (long drain)", 1, result.tasks, result.samples_kib)]
    worst: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for run in drains or []:
        if STRATEGIES[run.strategy].is_package:
            key = (run.strategy, run.workers)
            worst[key] = max([*run.rss_kib, worst.get(key, [])], key=memory_growth)
    for (name, workers), samples in worst.items():
        rows.append(_row(name, workers, samples[-1][0], samples))
    headers = (
        "drain",
        "workers",
        "tasks (worker)",
        "RSS start MiB",
        "RSS end MiB",
        "growth MiB",
        "flat",
    )
    title = "worker memory while draining (worst worker of all runs; start = after one task)"
    return table(title, headers, rows)
