"""The optional figure: drain throughput against workers, sweep time against table size.

matplotlib is optional: without it the plot is skipped and everything else still runs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.harness.results import Results
from benchmarks.harness.strategies import STRATEGIES
from benchmarks.sections.drain import throughputs

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def plot(results: Results, path: Path) -> Path | None:
    """Write the figure to ``path``; None when matplotlib is missing or nothing was measured."""
    if not available() or not (results.drain or results.sweep):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    _throughput_panel(left, results)
    _sweep_panel(right, results)
    figure.suptitle(_subtitle(results), fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _throughput_panel(axes: Axes, results: Results) -> None:
    rates = throughputs(results.drain or [])
    for name, strategy in STRATEGIES.items():
        points = sorted((workers, rate) for (key, workers), rate in rates.items() if key == name)
        if points:
            xs, ys = zip(*points, strict=True)
            style = "-" if strategy.is_package else "--"
            axes.plot(xs, ys, style, marker="o", label=f"{name}: {strategy.label}")
    axes.set_xticks(sorted({workers for _, workers in rates}))
    _finish(axes, "drain throughput", "worker processes", "tasks / s", log_x=False)


def _sweep_panel(axes: Axes, results: Results) -> None:
    sweeps = sorted(results.sweep or [], key=lambda r: r.size)
    sizes = [r.size for r in sweeps]
    axes.plot(sizes, [r.idle.p50_ms for r in sweeps], marker="o", label="nothing expired, p50")
    axes.plot(sizes, [r.recovering.p50_ms for r in sweeps], marker="s", label="1,000 expired, p50")
    axes.axhline(1.0, linestyle=":", color="grey", label="1 ms (idle target)")
    _finish(axes, "queue.sweep() time", "finished rows in the table", "ms", log_x=True)


def _finish(axes: Axes, title: str, xlabel: str, ylabel: str, *, log_x: bool) -> None:
    axes.set_title(title)
    axes.set_xlabel(xlabel + (" (log)" if log_x else ""))
    axes.set_ylabel(ylabel + " (log)")
    if log_x:
        axes.set_xscale("log")
    axes.set_yscale("log")
    axes.grid(True, which="both", alpha=0.3)
    if axes.get_legend_handles_labels()[0]:
        axes.legend(fontsize=7)


def _subtitle(results: Results) -> str:
    env = results.environment
    settings = env["settings"]
    return (
        f"PostgreSQL {env['postgresql']} (fsync={settings.get('fsync')}, "
        f"synchronous_commit={settings.get('synchronous_commit')}), {env['cpus']} CPUs, "
        f"{results.config.tasks:,} tasks per drain"
    )
