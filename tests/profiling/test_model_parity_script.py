"""profiling/model_parity.py at CPU sizes: fpdt's bf16 step within twice plain Transformers bf16's
error against float64 (the script's criterion), on the small Qwen3.5 hybrid and Qwen3-MoE configs
shrunk by ``--tiny``, in one process; and (long tier, two more processes) the criterion failing,
exit 1 with the quantity named, when fpdt's copy of one weight is perturbed by 5% of its RMS."""

import os
import subprocess
import sys

import pytest

from tests.profiling.helpers import ROOT, read_json, run_script

pytestmark = pytest.mark.slow
HYBRID, MOE = (os.path.join(ROOT, "benchmarks", "models", f"{n}.json") for n in ("qwen3_5_small", "qwen3_moe_small"))


def test_both_models_pass(tmp_path):
    """--tiny: 128 tokens in 4 fpdt chunks."""
    run_script("model_parity", "--tiny", "--model-config", HYBRID, MOE, "--out-dir", tmp_path)
    r = read_json(tmp_path / "model_parity-qwen3_5_small.json")
    assert r["pass"] and r["seq_len"] == 128 and r["num_chunks"] == 4
    q = r["quantities"]
    gdn = [n for n in q if ".linear_attn." in n]
    assert {"loss", "lm_head.weight"} <= set(q) and any(n.endswith("A_log") for n in gdn)
    for row in q.values():          # bf16 is bf16: plain Transformers is off the reference, fp32 far less so
        assert row["pass"] and row["transformers_bf16"] > 0
        assert row["fpdt"] <= max(row["allowed_ratio"] * row["transformers_bf16"], 2 ** -7)
        assert row["allowed_ratio"] == 2 if row["elements"] >= 64 or row["elements"] == 1 else row["allowed_ratio"] > 2
    assert q["loss"]["elements"] == 1 and q["loss"]["allowed_ratio"] == 2
    assert max(q[n]["transformers_bf16"] for n in gdn) > 1e-3
    assert sorted(row["transformers_fp32"] for row in q.values())[len(q) // 2] < 1e-5
    # on the CPU both run the PyTorch delta rule, counted
    assert r["kernels"]["fpdt"]["delta_rule:torch"] > 0 and "delta_rule:fla" not in r["kernels"]["fpdt"]
    assert r["kernels"]["transformers_bf16"]["delta_rule"] == "torch"
    assert "| model.layers.0.linear_attn.A_log |" in (tmp_path / "model_parity-qwen3_5_small.md").read_text()
    m = read_json(tmp_path / "model_parity-qwen3_moe_small.json")
    assert m["pass"] and {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"} <= set(
        m["quantities"])
    moves = m["moved_routes"]      # fp32 routes as float64 does; a bf16 run may move a near-tie
    assert set(moves) == {"transformers_fp32", "transformers_bf16", "fpdt"} and not any(moves["transformers_fp32"].values())
    for name, row in m["quantities"].items():
        assert ("moved_routes" in row) == (".mlp." in name or "post_attention_layernorm" in name), name


def _failing(out_dir, config: str, param: str) -> tuple[dict, str]:
    """The script with fpdt's ``param`` perturbed: it must exit 1; its JSON and stderr."""
    proc = subprocess.run([sys.executable, "-m", "profiling.model_parity", "--tiny", "--model-config", config,
                           "--out-dir", str(out_dir), "--perturb", param], capture_output=True, text=True, cwd=ROOT,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    name = os.path.splitext(os.path.basename(config))[0]
    result = read_json(out_dir / f"model_parity-{name}.json")
    assert not result["pass"]
    return result, proc.stderr


@pytest.mark.long
def test_a_perturbed_weight_fails(tmp_path):
    bad, err = _failing(tmp_path / "hybrid", HYBRID, "model.layers.0.linear_attn.A_log")
    assert not bad["quantities"]["model.layers.0.linear_attn.A_log"]["pass"]
    assert "qwen3_5_small:model.layers.0.linear_attn.A_log" in err
    bad, err = _failing(tmp_path / "moe", MOE, "model.layers.1.self_attn.o_proj.weight")
    # v_proj's gradient passes through o_proj (dL/dv = o_proj^T dL/dout, per head)
    assert not bad["quantities"]["model.layers.1.self_attn.v_proj.weight"]["pass"]
    assert "qwen3_moe_small:model.layers.1.self_attn.v_proj.weight" in err
