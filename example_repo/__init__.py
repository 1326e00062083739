"""An example Dagster project: summarising documents of very different sizes via a queue."""
