"""fpdt: Fully Pipelined Distributed Transformer.

Layers (imports point down only)::

    train  ->  model  ->  attention  ->  offload, comm, layout

* ``fpdt.layout``    -- the FPDT token layout (shard / unshard / position ids)
* ``fpdt.comm``      -- Ulysses all-to-all and GQA head replication
* ``fpdt.offload``   -- pinned host buffer pool, copy streams, chunk stash
* ``fpdt.attention`` -- block kernels returning (out, lse), the online-softmax merge,
                        the chunked FPDT attention pipeline and the FPDTAttention module
* ``fpdt.model``     -- Llama-family causal LM built on FPDT layers
* ``fpdt.train``     -- the DeepSpeed trainer and CLI
"""

__version__ = "0.1.0"
