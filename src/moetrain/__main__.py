"""`python -m moetrain` (used under torchrun) is the `moetrain` command."""

from moetrain.cli import entry

entry()
