"""Everything one run measured, section by section (None: the section did not run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from benchmarks.harness.config import BenchConfig
from benchmarks.harness.runner import DrainResult
from benchmarks.harness.stats import Summary
from benchmarks.sections.batches import BatchesResult
from benchmarks.sections.drain import SweeperResult, throughputs
from benchmarks.sections.enqueue import EnqueueResult
from benchmarks.sections.flow import FlowResult
from benchmarks.sections.latency import LatencyResult
from benchmarks.sections.memory import MemoryResult
from benchmarks.sections.plans import PlanCheck
from benchmarks.sections.polling import PollingResult
from benchmarks.sections.renew import RenewResult
from benchmarks.sections.sweep import SweepResult


@dataclass(frozen=True)
class Target:
    """A goal from the issue, checked against this run's own baselines (never timed alone)."""

    name: str
    measured: str
    value: float | None
    goal: str
    passed: bool | None  # None: not measured in this run

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.passed]


@dataclass
class Results:
    config: BenchConfig
    environment: dict[str, Any]
    probe: dict[str, Summary]
    seconds: float = 0.0
    enqueue: list[EnqueueResult] | None = None
    latency: list[LatencyResult] | None = None
    plans: list[PlanCheck] | None = None
    renew: list[RenewResult] | None = None
    drain: list[DrainResult] | None = None
    sweeper: SweeperResult | None = None
    polling: list[PollingResult] | None = None
    memory: MemoryResult | None = None
    sweep: list[SweepResult] | None = None
    batches: BatchesResult | None = None
    flow: FlowResult | None = None
    targets: list[Target] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def drain_medians(self) -> dict[str, float]:
        """Median drain throughput (tasks/s) by ``strategy x workers``."""
        rates = throughputs(self.drain or [])
        return {f"{name} x{workers}": rate for (name, workers), rate in rates.items()}
