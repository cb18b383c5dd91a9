"""``python -m ctxrl``: the ``ctxrl`` command (also what ``torchrun -m ctxrl train ...`` starts on every rank)."""

import sys

from ctxrl.cli import main

sys.exit(main())
