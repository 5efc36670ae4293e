"""``python -m dynamo_prep.cli``: the ``dynamo-prep`` command."""

from __future__ import annotations

import sys

from dynamo_prep.cli import main

# Guarded: a real engine's processes are spawned, and spawning imports the main module again.
if __name__ == "__main__":
    sys.exit(main())
