"""Observation of a run: metrics records, tracking back-ends, the profiler window, step phases,
peak memory, peak FLOP/s and the training plots.

Nothing here changes what a run computes.
"""
