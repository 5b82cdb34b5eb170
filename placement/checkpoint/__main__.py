"""``python -m placement.checkpoint``: see :mod:`placement.checkpoint.cli`."""

import sys

from placement.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
