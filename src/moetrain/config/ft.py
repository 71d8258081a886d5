"""The [ft] section: fault-tolerant HSDP with torchft (replica groups that leave and rejoin); its checks.

Each replica group is its own torchrun job (FSDP/EP inside it); the groups meet through a lighthouse
(`moetrain lighthouse`) and all-reduce gradients over torchft's managed process group. This module
only holds and checks the fields; the rules that read other sections are JobConfig's, the manager
itself is moetrain.parallel.fault_tolerance's. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.config.checks import check, check_positive


@dataclass
class FtConfig:
    enabled: bool = False
    """Run this job as one replica group of a fault-tolerant HSDP run (torchft); False = plain job."""
    lighthouse: str = ""
    """The lighthouse's address, as `moetrain lighthouse` prints it (http://HOST:PORT)."""
    replica_id: int = 0
    """This replica group's id, 0 .. ft.replica_groups - 1; unique among the live groups."""
    replica_groups: int = 2
    """How many replica groups the run is planned for: the step's global batch is split over
    replica_groups x (the group's data ranks); a missing group's share of a step is skipped."""
    min_replicas: int = 1
    """Replica groups a step needs; fewer and the live groups wait (up to ft.quorum_timeout_s)."""
    quorum_timeout_s: float = 60.0
    """How long a step waits for the lighthouse's quorum before the group stops with one line."""
    timeout_s: float = 60.0
    """How long a managed all-reduce, a commit vote or a recovery transfer from a peer may take."""
    connect_timeout_s: float = 10.0
    """How long connecting to the lighthouse (at start) may take before the group stops with one line."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [ft] field."""
        check_positive(self, "ft", ("replica_groups", "min_replicas"))
        check(0 <= self.replica_id < self.replica_groups, "ft.replica_id", self.replica_id,
              f"must be in [0, ft.replica_groups = {self.replica_groups})")
        check(self.min_replicas <= self.replica_groups, "ft.min_replicas", self.min_replicas,
              f"must be <= ft.replica_groups = {self.replica_groups}")
        for name in ("quorum_timeout_s", "timeout_s", "connect_timeout_s"):
            value = getattr(self, name)
            check(0 < value <= 86400, f"ft.{name}", value, "must be a number of seconds in (0, 86400]")
        if self.enabled:
            check(self.lighthouse.startswith(("http://", "https://")) and ":" in self.lighthouse[8:],
                  "ft.lighthouse", self.lighthouse,
                  "with ft.enabled = true: the address `moetrain lighthouse` printed, http://HOST:PORT")
