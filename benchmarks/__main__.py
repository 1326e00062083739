"""``python -m benchmarks``: run the benchmark harness."""

from benchmarks.harness.source import main

# Worker processes are spawned: they re-import this module, which must not run anything.
if __name__ == "__main__":
    raise SystemExit(main())
