"""fpdt-train on a 2D mesh (4 gloo processes, ZeRO-3, fp32) against single-process training.

``--hp 2 --cp 2`` and ``--cp 4 --inner-ring 2`` (a double ring), each for 3 SGD steps
(no clipping, so a wrong gradient scale shows at once): every step's loss must match the
unsharded single-process reference within 1e-5 relative. The second layout takes its
mesh from the ``"fpdt"`` JSON section instead of flags.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.distributed import run_distributed
from tests.train.helpers import SGD, SGD_CLIP, ds_config, quiet, reference_losses, write_fixture, write_json

SEQ_LEN = 64
STEPS = 3
RTOL = 1e-5
LAYOUTS = {  # name -> (flags, "fpdt" JSON section)
    "hp2_cp2": (["--hp", "2", "--cp", "2", "--chunk-size", "32"], {}),
    "cp4_w2": ([], {"cp": 4, "inner_ring": 2, "placement": "context_first", "chunk_size": 32}),
}


def _body(rank: int, world_size: int, tmp: str) -> None:
    from fpdt.cli.train import main

    quiet()
    for name, (flags, _) in LAYOUTS.items():
        argv = ["--model-config", os.path.join(tmp, "config.json"), "--data", os.path.join(tmp, "tokens.npy"),
                "--seq-len", str(SEQ_LEN), "--steps", str(STEPS), "--deepspeed", os.path.join(tmp, f"{name}.json"),
                "--log-json", os.path.join(tmp, f"{name}.jsonl"), "--seed", "0", *flags]
        assert main(argv) == 0


@pytest.mark.slow
def test_mesh_training_matches_single_process(tmp_path):
    tmp = str(tmp_path)
    cfg_path, data_path = write_fixture(tmp)
    for name, (_, section) in LAYOUTS.items():
        cfg = ds_config(SGD, SGD_CLIP)
        if section:
            cfg["fpdt"] = section
        write_json(os.path.join(tmp, f"{name}.json"), cfg)
    run_distributed(_body, world_size=4, args=(tmp,), timeout=300)
    ref = reference_losses(cfg_path, data_path, SEQ_LEN, STEPS, 1, SGD, SGD_CLIP)
    for name in LAYOUTS:
        with open(os.path.join(tmp, f"{name}.jsonl")) as f:
            got = [json.loads(line)["loss"] for line in f if line.strip()]
        rel = [abs(g - r) / abs(r) for g, r in zip(got, ref)]
        print(f"{name}: fpdt-train {got} reference {ref} rel.err {rel}")
        assert len(got) == STEPS and max(rel) < RTOL, f"{name}: losses {got} vs reference {ref} (rel. err {rel})"
