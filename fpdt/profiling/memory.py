"""Deprecated name of :mod:`fpdt.memory.accountant`; kept for one release."""

import warnings

from fpdt.memory.accountant import *  # noqa: F401,F403

warnings.warn("fpdt.profiling.memory is now fpdt.memory.accountant; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
