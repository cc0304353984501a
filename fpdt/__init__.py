"""fpdt: Fully Pipelined Distributed Transformer (arXiv 2408.16978).

The packages and their layering (imports point down only): README.md, "Layout of the code", and
CONTRIBUTING.md, "The layering rule".
"""

__version__ = "0.1.0"
