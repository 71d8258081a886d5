"""Checkpoints: written whole or not at all, verified before anything reads them, never unpickled.

A checkpoint is a directory `RUN_DIR/checkpoints/step_00000100/` holding

- `tensors/*.safetensors`: the model and optimizer tensors, written through torch.distributed.checkpoint
  (DCP) with its safetensors storage, each rank its own shards (`storage`);
- `trainer.json` (+ `trainer_tensors.safetensors`): the step, counters and every rank's
  `per_rank_state()` (loader position, RNG states), gathered so one copy serves all ranks (`state`);
- `config.json`: the job's config at the save, compared with a resuming job's before anything loads (`state`);
- `meta.json`: step, world size, time, intra-op thread count (`storage`);
- `manifest.json`: the sha256 and size of every other file, written last (`manifest`).

What loading trusts: nothing is unpickled. Files are parsed only as JSON and safetensors (whose
header is JSON and whose payload is raw tensor bytes), and only after every file in the directory
has matched its sha256 in the manifest and no file outside the manifest is present.

One module per job: `layout` (directory names, complete checkpoints, pruning), `manifest`
(integrity), `state` (the small state and the stored config), `storage` (writing and reading a
whole checkpoint, in the foreground or a background thread) and `checkpointer` (when a run saves
and where it resumes). Import each name from the module that owns it; this package re-exports
nothing. No module here writes outside the checkpoint directory.
"""
