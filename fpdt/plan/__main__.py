"""``python -m fpdt.plan`` = ``fpdt-plan``."""

import sys

from fpdt.plan.cli import main

if __name__ == "__main__":
    sys.exit(main())
