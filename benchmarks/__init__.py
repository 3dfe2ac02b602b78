"""Benchmarks of lightning-skrull, run from the repository root as modules.

Each script runs as ``python -m benchmarks.<name>`` (e.g. ``python -m benchmarks.simulate_paper``)
and imports the others as ``benchmarks.<name>``; :mod:`benchmarks.lengths` draws the paper's
length distributions for all of them.
"""
