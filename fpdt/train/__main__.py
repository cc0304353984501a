"""``python -m fpdt.train`` = ``fpdt-train``."""

import sys

from fpdt.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
