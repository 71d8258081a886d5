"""`moetrain data prepare`: tokenize text into token shards (moetrain.data.shards), in parallel worker processes.

Inputs (any mix, each --input one of):
- `stdlib`: the embedded corpus (the running interpreter's standard library, as data.source = 'stdlib');
- a directory: its files matching --glob, one document per file (as data.source = 'dir'), or a
  Hugging Face dataset saved with `save_to_disk` (one document per row of --text-field);
- a `.jsonl` file: one document per line, the --text-field key (as data.source = 'jsonl');
- a `.parquet`, `.json` or `.arrow` file: one document per row, read with `datasets.load_dataset`
  on the local file (nothing is downloaded; the `hf` extra);
- `hf:NAME`: a dataset already in the local Hugging Face cache, one document per row of --hf-split
  (--hf-config), reloaded by `datasets` offline (HF_HUB_OFFLINE): nothing is downloaded, and a
  dataset that is not cached is one line naming it;
- any other file: one document.

With --format chat every record (a .jsonl line or a row) holds a conversation, an OpenAI-style
list of messages under --messages-field, rendered with the tokenizer directory's chat template
and masked to the assistant's tokens (moetrain.data.chat); each shard then carries a loss mask
beside its tokens, the conversation is framed only by its template (no BOS/EOS added), and the
manifest records the template's sha256. A conversation that cannot be used (no assistant turn,
an unknown role, a template that raises, no messages field) is refused in one line naming the
file and line (or row), or skipped and counted with --skip-bad-files. A refused prepare writes
no manifest, so nothing can train on it; the shards it finished are complete files, kept for
the rerun.

The modules, in the order a prepare uses them:
- command: the options, their checks and the flow of one prepare (`main` is the CLI entry point);
- output: which --out a prepare may write into, and a failed write as one line;
- inputs: each input's documents as references (DocRef), named and sorted;
- hf: `datasets` inputs (local files, saved datasets, the offline Hugging Face cache);
- streaming: --streaming, the records read a batch at a time as the shards are planned;
- plan: the train / held-out split, the shards and their plan keys, and which shards are still to write;
- workers: the worker processes that read, tokenize and write one shard each.
This package holds no code of its own: import each name from the module that owns it.
"""
