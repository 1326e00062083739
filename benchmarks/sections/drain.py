"""Drain throughput by strategy and worker count, with and without a sweeper, and memory."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table
from benchmarks.harness.runner import DrainResult, Filler, Reader, fill_no_ops, run_drain
from benchmarks.harness.stats import ratio
from benchmarks.harness.strategies import DRAIN_ORDER, STRATEGIES


def drain(
    config: BenchConfig,
    log: Progress,
    strategy: str,
    workers: int,
    *,
    tasks: int | None = None,
    sweep_interval: float | None = None,
    fill: Filler = fill_no_ops,
    read: Reader | None = None,
    label: str = "",
) -> DrainResult:
    count = tasks or config.tasks
    sweeping = f", sweep every {sweep_interval:g} s" if sweep_interval else ""
    kind = f" {label}" if label else ""
    log(f"drain {strategy} x{workers} ({count}{kind} tasks{sweeping})")
    result = run_drain(
        config.dsn,
        strategy,
        workers=workers,
        tasks=count,
        batch=config.batch,
        sample_every=max(config.batch, count // 20),
        sweep_interval=sweep_interval,
        fill=fill,
        read=read,
    )
    log(f"  {result.throughput:,.0f} tasks/s in {result.seconds:.2f} s")
    return result


# -- the matrix: every strategy at every worker count ----------------------------------------


def run_matrix(config: BenchConfig, log: Progress) -> list[DrainResult]:
    """Every strategy at every worker count, ``rounds`` times, every other round reversed.

    The machine drifts over a run; in forward-then-reversed rounds every strategy has the
    same mean position, so a steady drift favours none. A drain that fails is reported and
    left out, so the others still count.
    """
    results: list[DrainResult] = []
    for round_number in range(config.rounds):
        order = DRAIN_ORDER if round_number % 2 == 0 else DRAIN_ORDER[::-1]
        for workers in config.workers:
            for name in order:
                try:
                    results.extend(repeat_drain(config, log, name, workers))
                except Exception as error:
                    log.failed(f"drain {name} x{workers}", error)
    return results


def repeat_drain(
    config: BenchConfig,
    log: Progress,
    name: str,
    workers: int,
    *,
    fill: Filler = fill_no_ops,
    read: Reader | None = None,
    label: str = "",
) -> list[DrainResult]:
    """Drain again until the runs add up to ``min_drain_seconds`` (short drains are noisy)."""

    def once() -> DrainResult:
        return drain(config, log, name, workers, fill=fill, read=read, label=label)

    runs = [once()]
    while (
        sum(run.seconds for run in runs) < config.min_drain_seconds
        and len(runs) < config.max_drain_repeats
    ):
        runs.append(once())
    return runs


def throughputs(results: Iterable[DrainResult]) -> dict[tuple[str, int], float]:
    """Median throughput per (strategy, workers) over the rounds."""
    grouped: dict[tuple[str, int], list[float]] = {}
    for result in results:
        grouped.setdefault((result.strategy, result.workers), []).append(result.throughput)
    return {key: statistics.median(values) for key, values in grouped.items()}


def render_matrix(results: list[DrainResult]) -> str:
    rates = throughputs(results)
    fewest = min((workers for _, workers in rates), default=1)
    rows = []
    for name, workers in sorted(rates, key=lambda key: (key[1], DRAIN_ORDER.index(key[0]))):
        strategy = STRATEGIES[name]
        runs = [r for r in results if (r.strategy, r.workers) == (name, workers)]
        rate = rates[(name, workers)]
        baseline = rates.get((strategy.baseline or "", workers))
        rows.append(
            (
                name,
                strategy.label,
                workers,
                len(runs),
                _spread(runs),
                rate,
                strategy.baseline or "",
                ratio(rate, baseline),
                ratio(rate, rates.get((name, fewest))),
                statistics.median(r.client_cpu_us for r in runs),
                _median_or_none([r.server_cpu_us for r in runs]),
                "yes" if all(r.verified for r in runs) else "NO",
            )
        )
    headers = (
        "strategy",
        "how",
        "workers",
        "runs",
        "spread %",
        "tasks/s",
        "baseline",
        "x baseline",
        f"x {fewest} worker",
        "client CPU us/task",
        "server CPU us/task",
        "all done",
    )
    return table("drain throughput (worker processes, spawn)", headers, rows)


def _spread(runs: list[DrainResult]) -> float | None:
    """(max - min) / median throughput over the runs, in percent; None for a single run."""
    if len(runs) < 2:
        return None
    rates = [run.throughput for run in runs]
    return (max(rates) - min(rates)) / statistics.median(rates) * 100


def _median_or_none(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and len(known) == len(values) else None


# -- the sweeper: the same drain with and without a sweep every second ------------------------


@dataclass
class SweeperResult:
    strategy: str
    workers: int
    interval: float
    runs: list[DrainResult]

    def mean_throughput(self, sweeper: bool) -> float | None:
        values = [r.throughput for r in self.runs if r.sweeper == sweeper]
        return statistics.fmean(values) if values else None

    @property
    def ratio(self) -> float | None:
        return ratio(self.mean_throughput(True), self.mean_throughput(False))


def run_sweeper(config: BenchConfig, log: Progress) -> SweeperResult:
    """Pairs of drains, off/on then on/off (ABBA), so a drift in load cancels out."""
    runs = []
    for pair in range(config.sweeper_pairs):
        for sweeper_on in (False, True) if pair % 2 == 0 else (True, False):
            interval = config.sweeper_interval if sweeper_on else None
            runs.append(
                drain(
                    config,
                    log,
                    config.sweeper_strategy,
                    config.sweeper_workers,
                    sweep_interval=interval,
                )
            )
    return SweeperResult(
        config.sweeper_strategy, config.sweeper_workers, config.sweeper_interval, runs
    )


def render_sweeper(result: SweeperResult) -> str:
    rows: list[tuple[object, ...]] = [
        (
            "on" if r.sweeper else "off",
            r.throughput,
            r.seconds,
            len(r.sweep_ms),
            statistics.median(r.sweep_ms) if r.sweep_ms else None,
            max(r.sweep_ms, default=None),
        )
        for r in result.runs
    ]
    rows.append(("on / off", result.ratio, None, None, None, None))
    headers = ("sweeper", "tasks/s", "seconds", "sweeps", "sweep p50 ms", "sweep max ms")
    title = (
        f"drain with a sweeper every {result.interval:g} s ({result.strategy} x{result.workers})"
    )
    return table(title, headers, rows)
