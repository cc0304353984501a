"""``python -m fpdt.train`` (also under ``torchrun -m`` / ``deepspeed --module``) = ``fpdt-train``.

An entry script, run and never imported: it may call the command line above this package.
"""

import sys

from fpdt.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
