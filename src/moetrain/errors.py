"""The project's error types, in one place, at the bottom of the import graph.

`ConfigError` is every user-caused problem (a bad config field, a bad file, a bad
command-line option): its message is one line naming the field or file, the value
and what would be valid, and the CLI turns it into `moetrain: error: ...` with exit
status 2. `TrainingDiverged` ends a run whose loss or state became NaN/inf (exit 1),
`CollectiveFailed` one whose collective timed out or lost a peer (exit 3). `ModelError` is what
model and kernel code raise when asked for something they do not compute: a validated config
never gets there, so it means a caller (a benchmark's own options, library use) passed it
directly; the CLI reports it in one line like a ConfigError.
This module defines types only; it imports nothing from the project.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-caused configuration, data or command-line problem; the message is one line."""


class ModelError(ValueError):
    """Model or kernel code was asked for an option it does not compute; the message is one line."""


class TrainingDiverged(RuntimeError):
    """Loss or gradient norm became NaN/inf under train.nan_policy = 'stop' (one-line message)."""


class PoisonedStateError(RuntimeError):
    """The model or optimizer state to be saved holds NaN or inf; nothing was written."""


class CollectiveFailed(RuntimeError):
    """A collective timed out or lost a peer during a run; the message (one line) names the step."""
