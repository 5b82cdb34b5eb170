"""``python -m placement.sources.realroute OUTDIR``: train, record and write the ``real_*`` instances."""

from __future__ import annotations

import sys

from placement.sources.realroute.cli import main

if __name__ == "__main__":
    sys.exit(main())
