"""Deprecated name of :mod:`fpdt.train.saving` (saving and resuming training checkpoints);
kept for one release."""

import warnings

from fpdt.train.saving import *  # noqa: F401,F403
from fpdt.train.saving import TRAINER_FILE, available_tags, model_file, read_latest  # noqa: F401

warnings.warn("fpdt.train.checkpoint is now fpdt.train.saving; the old name goes in the next release",
              DeprecationWarning, stacklevel=2)
