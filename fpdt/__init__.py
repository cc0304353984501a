"""fpdt: Fully Pipelined Distributed Transformer.

Layers (imports point down only; ``tests/test_layering.py`` checks them)::

    cli  ->  plan  ->  train  ->  model  ->  options  ->  attention  ->  offload, comm, layout, ops

with ``memory`` (the device-memory accountant) beside ``offload`` and ``hf`` (``apply_fpdt`` on a
Transformers model) beside ``train``. Bottom up: token layouts (``layout``), numerical primitives
(``ops``), host buffers, copy streams and the chunk stash (``offload``), all-to-all, ring and the
hp x cp mesh (``comm``), kernels, merge and the chunked pipelines (``attention``), the one
options class (``options``), the Llama-family model (``model``), the trainer (``train``), the
planner (``plan``) and ``fpdt-train``'s command line (``cli``).
"""

__version__ = "0.1.0"
