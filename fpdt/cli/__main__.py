"""``python -m fpdt.cli`` (also under ``torchrun -m`` / ``deepspeed --module``) = ``fpdt-train``."""

import sys

from fpdt.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
