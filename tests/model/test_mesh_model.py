"""The model on a 2D mesh (``mesh=``) against Transformers: loss and every gradient.

4 gloo ranks; inputs from ``model.prepare_inputs`` (the mesh layout), gradients summed
over the SP ranks (the documented convention), fp32 within 1e-5 relative.
"""

import pytest

import torch.distributed as dist

import fpdt.model as fm
from fpdt.comm import SequenceMesh
from tests.distributed import run_distributed
from tests.model.helpers import compare, fpdt_from_hf, hf_loss_and_grads, hf_model, tokens


def _body(rank, world):
    cases = [  # (mesh kwargs, model, num_chunks, offload, checkpointing)
        (dict(hp=2, cp=2, placement="context_first"), "llama_gqa", 3, True, "off"),
        (dict(hp=1, cp=4, inner_ring=2), "llama_sp4", 1, False, "on"),
    ]
    for kw, name, u, offload, ckpt in cases:
        mesh = SequenceMesh(**kw)
        ref = hf_model(name)
        ids, labels = tokens(ref.config.vocab_size, 2, 2 * mesh.sp * u * 2)
        ref_loss, ref_grads = hf_loss_and_grads(ref, ids, labels)
        model = fpdt_from_hf(ref, num_chunks=u, offload=offload, checkpointing=ckpt, mesh=mesh)
        inputs = model.prepare_inputs(ids, labels=labels)
        assn = mesh.global_token_index(ids.shape[1], u)
        assert (inputs["position_ids"][0] == assn).all()
        loss = model(**inputs)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        for g in grads.values():
            dist.all_reduce(g, group=mesh.sp_group)
        compare(loss, grads, ref_loss, ref_grads, f"rank {rank} {mesh} {name} u={u} offload={offload} ckpt={ckpt}")


@pytest.mark.slow
def test_model_on_a_mesh_matches_transformers():
    run_distributed(_body, 4, timeout=240)


def test_group_and_mesh_together_are_refused():
    import pytest
    with pytest.raises(ValueError, match="either group= .* or mesh="):
        fm.FPDTOptions(mesh=SequenceMesh(), group=object()).validate()
