"""The [profile] section: which steps torch.profiler traces, and the parsing of that step range.

Only the field and its "A-B" syntax; the profiler itself is moetrain.observe's.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.checks import check


@dataclass
class ProfileConfig:
    steps: str = ""
    """Trace steps A to B (inclusive, the step numbers of the log) with torch.profiler, "A-B" or "A";
    each rank writes a Chrome trace into RUN_DIR/profile/. "" = off."""

    def validate(self) -> None:
        """Raise ConfigError (one line) when profile.steps is malformed."""
        parse_step_range(self.steps)


def parse_step_range(text: str) -> tuple[int, int] | None:
    """profile.steps "A-B" (or "A") -> (A, B); "" -> None; ConfigError when malformed."""
    if not text:
        return None
    first, dash, last = text.partition("-")
    valid = "must be 'A-B' (first and last step to trace, 1 <= A <= B) or '' (off)"
    check(first.strip().isdigit() and (not dash or last.strip().isdigit()), "profile.steps", text, valid)
    bounds = int(first), int(last if dash else first)
    check(1 <= bounds[0] <= bounds[1], "profile.steps", text, valid)
    return bounds
