"""``python -m placement.cli ARGS``: the same as the ``placement`` console script."""

from placement.cli.run import entry

if __name__ == "__main__":
    entry()
