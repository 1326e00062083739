"""The sections of ``python -m benchmarks``, one module each, named as ``--only`` names them
(``drain`` also runs the ``sweeper`` section). Each has a ``run`` that measures and a
``render`` that prints a table; the harness in :mod:`benchmarks.harness` runs them.
"""
