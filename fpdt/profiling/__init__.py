"""Deprecated name of :mod:`fpdt.memory` (the device-memory accountant); kept for one release."""

import warnings

from fpdt.memory import *  # noqa: F401,F403
from fpdt.memory import __all__  # noqa: F401

warnings.warn("fpdt.profiling is now fpdt.memory; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
