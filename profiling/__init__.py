"""The measurement scripts: maximum sequence length per strategy, chunk sweeps, op latencies,
memory budgets and the Transformers comparison, with their shared helpers (``bench_common``,
``strategies``). A package of the repository, not of the installed ``fpdt`` (which never
imports it): run a script from the repository root as ``python -m profiling.<name>``, or all
of them with ``bash profiling/run_suite.sh``; results land in ``benchmarks/results/``.
"""
