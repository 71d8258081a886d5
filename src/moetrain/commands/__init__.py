"""The subcommands that do not train: sample, export-hf, eval, estimate, config --from-hf, init-report.

One module per command, each a `main(argv) -> int` that `moetrain.cli` dispatches to: it parses the
command's options, loads what the command needs through train/evaluate/interop and prints or writes
the result. The work itself (generation, scoring, the memory estimate, conversion) lives in the
layers below; training never imports from here.
"""
