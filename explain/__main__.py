"""python -m explain: the command line."""

import sys

from .cli import main

if __name__ == "__main__":  # documentation tools import this module: only running it runs the command
    sys.exit(main())
