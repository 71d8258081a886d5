"""`python -m moetrain` (used under torchrun) is the `moetrain` command."""

import sys

from moetrain.cli import main

sys.exit(main())
