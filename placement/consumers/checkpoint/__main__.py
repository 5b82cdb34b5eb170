"""``python -m placement.consumers.checkpoint``: see :mod:`placement.consumers.checkpoint.cli`."""

import sys

from placement.consumers.checkpoint.cli import main

if __name__ == "__main__":
    sys.exit(main())
