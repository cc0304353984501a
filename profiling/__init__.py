"""The measurement scripts: maximum sequence length per strategy, chunk sweeps, op latencies,
memory budgets and the Transformers comparison, with their own helpers (``bench_common``: where
results go; ``strategies``: the trainees compared). What they share with the tests is in
:mod:`fpdt.bench`. A package of the repository, not of the installed ``fpdt`` (which never
imports it), and no test imports it: run a script from the repository root as
``python -m profiling.<name>``, or all of them with ``bash profiling/run_suite.sh``; results land
in ``benchmarks/results/``.
"""
