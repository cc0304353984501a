"""Measurement helpers that the measurement scripts (``profiling/``, a folder of the repository)
and the tests share: timing with the device idle (:mod:`~fpdt.bench.timing`), least-squares
slopes against the length (:mod:`~fpdt.bench.fit`), the device and software a result ran on
(:mod:`~fpdt.bench.environment`), profiler traces (:mod:`~fpdt.bench.trace`), the planner's
cluster for predictions (:mod:`~fpdt.bench.planner`), packed documents' per-rank work
(:mod:`~fpdt.bench.documents`) and a streamed step's counted peak (:mod:`~fpdt.bench.streamed_peak`).
Nothing else in ``fpdt`` imports it.
"""
