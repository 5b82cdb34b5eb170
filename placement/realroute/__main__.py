"""``python -m placement.realroute OUTDIR``: train, record and write the ``real_*`` instances."""

from __future__ import annotations

import sys

from placement.realroute.cli import main

if __name__ == "__main__":
    sys.exit(main())
