"""The [data] section: where documents come from, how they are tokenized, framed and batched; its checks.

A rule that also reads the model (data.seq_len and data.token_budget against model.max_seq_len, the
tokenizer a model directory carries) or train (compile with token budgets) is JobConfig's. No I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from moetrain.config.checks import check, check_positive
from moetrain.errors import ConfigError


@dataclass
class DataConfig:
    source: Literal["stdlib", "dir", "jsonl", "hf", "tokens"] = "stdlib"
    """stdlib: this interpreter's own standard-library .py sources (embedded, no download); dir: text
    files under data.path; jsonl: a JSON-lines file; hf: a `datasets` save_to_disk directory;
    tokens: a directory written by `moetrain data prepare` (memory-mapped token shards)."""
    path: str | None = None
    """The file or directory of data.source (dir, jsonl, hf, tokens)."""
    glob: str = "**/*"
    """Which files under data.path a 'dir' source reads."""
    text_field: str = "text"
    """The field holding a document's text in JSON-lines records and datasets rows."""
    tokenizer: str = "byte"
    """'byte' (256 bytes + 3 special tokens) or a directory holding a Hugging Face tokenizer.json."""
    seq_len: int = 512
    """Tokens per training sequence."""
    heldout_fraction: float = 0.05
    """Share of documents kept out of training for held-out loss and bits per byte."""
    skip_bad_files: bool = False
    """Skip unreadable or non-UTF-8 inputs with a warning instead of refusing them."""
    max_documents: int | None = None
    """Read at most this many documents; None = all."""
    batching: Literal["packed", "token_budget"] = "packed"
    """packed: microbatches of train.microbatch_size sequences of seq_len tokens. token_budget: each
    microbatch is one row of as many whole documents as fit data.token_budget tokens (longer
    documents cut into budget-size pieces), so lengths vary; train.microbatch_size then only sizes evaluation."""
    token_budget: int | None = None
    """Tokens per microbatch under batching = 'token_budget'; None = data.seq_len."""
    mixture: list[str] = field(default_factory=list)
    """data.source = 'tokens' over several prepared directories, each 'PATH=WEIGHT': every step draws
    units (sequences or token-budget bins) from them in these proportions, in an order that does
    not depend on the number of ranks (exact resume on any world size). Replaces data.path."""
    framing: Literal["bos_eos", "tokenizer"] = "bos_eos"
    """How a text document is framed: bos_eos = [BOS] text [EOS] always; tokenizer = BOS only where the
    tokenizer directory adds one (`add_bos_token` in tokenizer_config.json, else its post-processor),
    EOS always. Conversations are framed by their chat template alone."""
    chat_template: str | None = None
    """Conversations (shards prepared with --format chat): the Jinja chat template file they were
    prepared with when it is not the data.tokenizer directory's own (as `data prepare --chat-template`);
    checked against the manifest's template hash, and written by export-hf."""

    def validate(self) -> None:
        """Raise ConfigError (one line) at the first invalid [data] field."""
        check_positive(self, "data", ("seq_len",))
        check(self.chat_template is None or self.source == "tokens", "data.chat_template", self.chat_template,
              "only conversations prepared as token shards use it (data.source = 'tokens'); leave it unset")
        if self.token_budget is not None:
            check(self.batching == "token_budget", "data.token_budget", self.token_budget,
                  "is only used under data.batching = 'token_budget' (batching is 'packed'); set that, or leave "
                  "data.token_budget unset")
        check(0 <= self.heldout_fraction < 1, "data.heldout_fraction", self.heldout_fraction, "must be in [0, 1)")
        if self.max_documents is not None:
            check(self.max_documents >= 1, "data.max_documents", self.max_documents, "must be >= 1")
        if self.mixture:
            check(self.source == "tokens", "data.source", self.source,
                  "data.mixture draws from prepared directories: set data.source = 'tokens'")
            check(self.path is None, "data.path", self.path,
                  "data.mixture names the directories; leave data.path unset (or drop data.mixture)")
            self.mixture_weights()
            return
        check(self.source == "stdlib" or self.path is not None, "data.path", self.path,
              f"a path is required when data.source = {self.source!r}"
              + (" (or data.mixture = ['DIR=WEIGHT', ...])" if self.source == "tokens" else ""))

    def mixture_weights(self) -> list[tuple[str, float]]:
        """data.mixture entries 'PATH=WEIGHT' -> [(path, weight)] (ConfigError naming the entry when bad)."""
        parsed = []
        for entry in self.mixture:
            path, sep, weight = entry.rpartition("=")
            try:
                value = float(weight) if sep else math.nan
            except ValueError:
                value = math.nan
            if not path or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"data.mixture entry {entry!r} is invalid: write PATH=WEIGHT with a weight > 0")
            parsed.append((path, value))
        total = sum(value for _, value in parsed)
        if not math.isfinite(total):
            raise ConfigError(f"data.mixture weights {[w for _, w in parsed]} overflow their sum; only their "
                              "ratios matter: scale them down (e.g. 0.7 and 0.3)")
        return parsed
