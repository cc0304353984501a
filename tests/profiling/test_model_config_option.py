"""profiling/bytes_per_token.py on another model family (``--model-config``): Transformers' own
Qwen3.5 hybrid and Qwen3-MoE run as the baseline, the per-token figures and the plot come out."""

import json

import pytest

from tests.profiling.helpers import ROOT, read_json, run_script


def _tiny(path: str) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    return cfg | {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "head_dim": 16} | \
        ({"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
          "linear_value_head_dim": 16} if "layer_types" in cfg else {"moe_intermediate_size": 32})


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3_5_small", "qwen3_moe_small"])
def test_transformers_baseline_of_another_family(tmp_path, name):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(_tiny(f"{ROOT}/benchmarks/models/{name}.json")))
    png = tmp_path / "plot.png"
    run_script("bytes_per_token", "--model-config", path, "--strategies", "hf", "--lengths", "128", "256", "384",
               "--chunk-size", "64", "--in-process", "--plot", png, "--json", tmp_path / "r.json")
    result = read_json(tmp_path / "r.json")
    assert result["model"]["model_type"] == json.loads(path.read_text())["model_type"]
    assert {t["seq_len"] for t in result["trials"] if t["status"] == "ok"} == {128, 256, 384}
    assert result["per_token"]["hf"]["device"] > 0
    assert png.stat().st_size > 0
