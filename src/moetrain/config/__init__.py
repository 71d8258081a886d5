"""Typed job configuration: one dataclass per TOML section, each checking its own fields.

Every knob of a job lives in one dataclass tree (`job.JobConfig`). A job is described by a TOML file
under `configs/`; any field can be overridden on the command line as `--section.field value` (parsed by
tyro). A section's module holds its fields and its `validate()`: model (with moe for [model.moe]),
parallel (and `check_world_size`, run once the world size is known), data, train, checkpoint, logging,
profile. `job` holds JobConfig, the rules that read two sections, and the TOML and command-line forms;
`checks` the one-line `ConfigError` helpers. A check names the field, the bad value and what would be
valid.

This package exports nothing itself: importers name the submodule that owns what they use
(`from moetrain.config.job import JobConfig`), so a name has one home. Nothing here imports torch or
the model.
"""
