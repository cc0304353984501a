"""Measurement helpers that the measurement scripts (``profiling/``, a folder of the repository)
and the tests share: timing with the device idle (``timing``), least-squares slopes and their
extrapolation (``fit``), the longest length that fits (``search``), the device and software a
result ran on (``environment``), profiler traces (``trace``), the planner's prediction beside a
trial (``planner``), the results table (``report``), packed documents' per-rank work
(``documents``) and a streamed step's counted peak (``streamed_peak``). Nothing else in ``fpdt``
imports it.
"""
