"""The machinery of ``python -m benchmarks``: options and presets (``cli``, ``config``), the
server and its environment (``db``, ``cpu``, ``rss``), the drain strategies and the process
runner that drains with them (``strategies``, ``runner``), statistics, tables, JSON, the
figure and the targets (``stats``, ``report``, ``results``, ``plot``, ``targets``), and which
package code is measured (``source``). What is measured is in :mod:`benchmarks.sections`.
"""
