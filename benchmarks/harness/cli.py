"""The command line: parse options, run the chosen sections (:mod:`benchmarks.sections`), print
tables, write JSON."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import config as presets, plot, targets
from benchmarks.harness.config import SECTIONS, BenchConfig
from benchmarks.harness.db import environment, probe_round_trips
from benchmarks.harness.progress import Progress
from benchmarks.harness.report import table, write_json
from benchmarks.harness.results import Results
from benchmarks.sections import (
    batches,
    drain,
    enqueue,
    flow,
    latency,
    memory,
    plans,
    polling,
    renew,
    sweep,
)
from dagster_leasequeue.dsn import redact


@dataclass(frozen=True)
class Section:
    """How to run one section, and how to print what it measured."""

    run: Callable[[BenchConfig, Progress], Any]
    render: Callable[[Results], str]


RUNNERS: dict[str, Section] = {
    "enqueue": Section(enqueue.run, lambda r: enqueue.render(r.enqueue or [])),
    "latency": Section(latency.run, lambda r: latency.render(r.latency or [])),
    "plans": Section(plans.run, lambda r: plans.render(r.plans or [])),
    "renew": Section(renew.run, lambda r: renew.render(r.renew or [])),
    "drain": Section(drain.run_matrix, lambda r: drain.render_matrix(r.drain or [])),
    "sweeper": Section(
        drain.run_sweeper,
        lambda r: drain.render_sweeper(r.sweeper) if r.sweeper else "",
    ),
    "polling": Section(polling.run, lambda r: polling.render(r.polling or [])),
    "memory": Section(
        memory.run_memory,
        lambda r: memory.render_memory(r.memory, r.drain) if r.memory else "",
    ),
    "sweep": Section(sweep.run, lambda r: sweep.render(r.sweep or [])),
    "batches": Section(batches.run, lambda r: batches.render(r.batches) if r.batches else ""),
    "flow": Section(flow.run, lambda r: flow.render(r.flow) if r.flow else ""),
}


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part.replace("_", "")) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected numbers separated by commas: {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    value = _int_list(text)
    if len(value) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive number, got {text!r}")
    return value[0]


def _sections(values: Sequence[str] | None) -> tuple[str, ...]:
    chosen = {name.strip() for value in values or [] for name in value.split(",") if name.strip()}
    unknown = chosen - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    return tuple(name for name in SECTIONS if name in chosen) if chosen else SECTIONS


def parse(argv: Sequence[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark dagster-leasequeue against raw SQL baselines of the same run.",
    )
    default_dsn = os.environ.get("LEASEQUEUE_BENCH_DSN", presets.DEFAULT_DSN)
    parser.add_argument(
        "--dsn", default=default_dsn, help=f"PostgreSQL URL (default: {redact(default_dsn)})"
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small counts, no 1M-row sweep"
    )
    parser.add_argument(
        "--tasks", type=_positive_int, help="tasks per drain (default 20000; 2000 with --quick)"
    )
    parser.add_argument("--workers", type=_int_list, help="worker process counts (default 1,4)")
    parser.add_argument(
        "--rounds",
        type=_positive_int,
        help="rounds of the drain matrix, medians reported (default 4; 1 with --quick)",
    )
    parser.add_argument(
        "--sweep-sizes",
        type=_int_list,
        help="finished rows for the sweep (default 10000,100000,1000000)",
    )
    parser.add_argument(
        "--poll-ms", type=_int_list, help="polling intervals in ms (default 10,100)"
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help=f"run only these sections (repeatable or comma-separated): {', '.join(SECTIONS)}",
    )
    parser.add_argument(
        "--output", type=Path, help="JSON results file (default benchmarks/results/latest.json)"
    )
    parser.add_argument(
        "--plot", type=Path, help="figure file (default benchmarks/results/latest.png)"
    )
    parser.add_argument("--no-plot", action="store_true", help="do not draw the figure")
    parser.add_argument(
        "--source",
        metavar="REF",
        help="measure dagster_leasequeue as committed at REF (git archive), not the working tree",
    )
    args = parser.parse_args(argv)
    config = (presets.quick if args.quick else presets.full)(args.dsn, args.tasks)
    overrides: dict[str, Any] = {
        "workers": args.workers,
        "rounds": args.rounds,
        "sweep_sizes": args.sweep_sizes,
        "poll_intervals_ms": args.poll_ms,
        "output": args.output,
        "plot": args.plot,
    }
    config = dataclasses.replace(
        config,
        sections=_sections(args.only),
        **{k: v for k, v in overrides.items() if v is not None},
    )
    return dataclasses.replace(config, plot=None) if args.no_plot else config


def render_environment(results: Results) -> str:
    env = results.environment
    code = env["source"]
    rows: list[tuple[str, object]] = [
        ("PostgreSQL", env["postgresql"]),
        *((f"  {name}", value) for name, value in env["settings"].items()),
        ("Python", env["python"]),
        ("psycopg / psycopg-pool", f"{env['psycopg']} / {env['psycopg_pool']}"),
        ("dagster-leasequeue", env["dagster_leasequeue"]),
        ("  measured code", f"{code['path']} at {code['revision']}"),
        ("  uncommitted changes", code["working_tree_changes"]),
        ("machine", f"{env['platform']}, {env['cpus']} CPUs, load {env['load_average'][0]:.2f}"),
        ("round trip (SELECT 1) p50 ms", results.probe["round_trip"].p50_ms),
        ("durable commit (1-row UPDATE) p50 ms", results.probe["commit"].p50_ms),
        ("mode", "quick" if results.config.quick else "full"),
        ("tasks per drain", results.config.tasks),
    ]
    return table("environment", ("what", "value"), rows)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse(argv)
    progress = Progress()
    progress(f"sections: {', '.join(config.sections)}")
    results = Results(
        config=config, environment=environment(config.dsn), probe=probe_round_trips(config.dsn)
    )
    print(render_environment(results), flush=True)
    for name in config.sections:
        _run_section(name, results, progress)
    results.targets = targets.evaluate(results)
    results.failures = progress.failures
    results.seconds = progress.elapsed
    print(targets.render(results.targets))
    for failure in results.failures:
        print(f"FAILED {failure}")
    write_json(config.output, results)
    print(f"results: {config.output}")
    if config.plot is not None:
        drawn = plot.plot(results, config.plot)
        print(f"plot: {drawn}" if drawn else "plot: skipped (matplotlib is not installed)")
    print(f"total: {results.seconds:.0f} s")
    return 0


def _run_section(name: str, results: Results, progress: Progress) -> None:
    """Run one section and print its table; a section that fails is reported and skipped."""
    section = RUNNERS[name]
    try:
        setattr(results, name, section.run(results.config, progress))
    except Exception as error:  # one broken section must not cost the whole run
        progress.failed(f"section {name}", error)
        return
    print(section.render(results), flush=True)
