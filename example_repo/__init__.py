"""An example Dagster project: summarising documents of very different sizes through a lease queue."""
