"""The process a run lives in: run directory and writer lock, signals, disk space, threads,
allocator settings, the pre-flight memory refusal, and the fault hooks tests use.

Nothing here trains a model or records metrics.
"""
