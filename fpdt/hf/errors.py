"""The error ``fpdt.hf`` raises for what it cannot run as asked."""


class FPDTHFError(ValueError):
    """A Transformers model, input or setting that ``fpdt.hf`` cannot honour; the message names the fix."""
