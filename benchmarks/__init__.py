"""Benchmarks for dagster-leasequeue: run ``python -m benchmarks`` (``--help`` for options).

Every number is a ratio against a baseline measured in the same run on the same table shape
(the package's own schema, created with ``LeaseQueue.install()``), because the machine is
noisy: nothing here asserts a time. The results are printed as tables and written as JSON
to ``benchmarks/results/latest.json``; see ``docs/BENCHMARKS.md``.

``harness/`` holds the machinery (options, database, worker processes, statistics, report),
``sections/`` what each section measures, and ``instructions.py`` is its own command,
``python -m benchmarks.instructions``.
"""
