"""The one-process step shape the CPU performance work measures: qwen3_moe_debug at vocabulary 2048, 2 x 512 tokens.

Job arguments only (no imports of moetrain or torch): the A/B drivers pass them to processes of
other trees and other virtualenvs, and the profiling scripts build their Trainer from them
(`benchmarks.profile.bf16_step_profile.issue_shape_trainer`).
"""

VOCAB, BATCH, SEQ = 2048, 2, 512

ARGS = ["--config", "configs/qwen3_moe_debug.toml", "--model.vocab_size", str(VOCAB), "--data.seq_len", str(SEQ),
        "--train.microbatch_size", str(BATCH), "--train.grad_accum", "1", "--data.max_documents", "300"]
