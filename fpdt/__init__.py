"""fpdt: Fully Pipelined Distributed Transformer.

Layers (imports point down only; ``tests/test_layering.py`` checks them)::

    cli  ->  plan  ->  train  ->  model  ->  options  ->  attention  ->  offload, comm, layout, ops

with ``memory`` beside ``offload`` and ``hf`` beside ``train``.

* ``fpdt.layout``    -- sequence-parallel token layouts, the divisibility rule, the memory unit
* ``fpdt.ops``       -- numerical primitives shared by attention and model (LoRA, RMSNorm)
* ``fpdt.offload``   -- pinned host buffer pool, copy streams and runtimes, chunk stash
* ``fpdt.comm``      -- Ulysses all-to-all, ring P2P, the 2D hp x cp mesh
* ``fpdt.attention`` -- block kernels returning (out, lse), the online-softmax merge,
                        the chunked FPDT attention pipelines and the FPDTAttention module
* ``fpdt.options``   -- FPDTOptions: every entry point's options and their one validation
* ``fpdt.memory``    -- the device-memory accountant
* ``fpdt.model``     -- Llama-family causal LM built on FPDT layers
* ``fpdt.hf``        -- apply_fpdt / remove_fpdt on a Transformers causal LM
* ``fpdt.train``     -- the trainer's configuration, data, DeepSpeed set-up, loop, saving, export
* ``fpdt.plan``      -- ``fpdt-plan``: memory and time model, the settings search
* ``fpdt.cli``       -- ``fpdt-train``'s command line (``python -m fpdt.cli``)
"""

__version__ = "0.1.0"
