"""``fpdt-export``: a Hugging Face checkpoint from a training checkpoint.

    fpdt-export SAVE_DIR OUT_DIR [--tag step<N>] [--dtype bf16]

Merges the fp32 master weights of a ``fpdt-train --save-dir`` checkpoint on the host (any ZeRO
stage, no GPU or process group) into ``config.json`` + safetensors, plus the tokenizer files. A
LoRA checkpoint exports as a PEFT adapter directory (``base_model_name_or_path``: the run's
``--model``); LoRA or full, and the spec, are read from the checkpoint's own trainer file
(:func:`fpdt.train.lora.record`), not the save dir's ``adapter_config.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil
import sys
import zipfile

import torch

from fpdt.train.saving import TRAINER_FILE, model_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _read_tag(save_dir: str, tag: str | None) -> str:
    """The checkpoint to export: ``tag`` or the newest; errors name what exists."""
    from fpdt.train.saving import available_tags, read_latest

    if not os.path.exists(save_dir):
        raise FileNotFoundError(f"{save_dir}: no such directory; pass the --save-dir of an fpdt-train run")
    if not os.path.isdir(save_dir):
        raise FileNotFoundError(f"{save_dir} is a file; pass the --save-dir directory of an fpdt-train run")
    tags = available_tags(save_dir)
    if tag is None:
        tag = read_latest(save_dir)
        if tag is None:
            if not tags:
                raise FileNotFoundError(f"{save_dir} has no 'latest' file and no step<N> checkpoints; pass the "
                                        f"--save-dir of an fpdt-train run")
            raise FileNotFoundError(f"{save_dir} has no 'latest' file; pass --tag (one of {', '.join(tags)})")
    if not os.path.isdir(os.path.join(save_dir, tag)):
        raise FileNotFoundError(f"{os.path.join(save_dir, tag)}: no such checkpoint; pass --tag "
                                f"(one of {', '.join(tags) or 'none'})")
    return tag


def _tags(save_dir: str) -> list[str]:
    from fpdt.train.saving import available_tags

    return available_tags(save_dir)


def fp32_state_dict(save_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights of checkpoint ``tag``: merged ZeRO shards, or the plain module
    state of a ZeRO-0 run."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = os.path.join(save_dir, tag)
    for name in sorted(os.listdir(tag_dir)):
        if name.endswith(".pt") and not zipfile.is_zipfile(os.path.join(tag_dir, name)):
            raise ValueError(f"{os.path.join(tag_dir, name)} is truncated or corrupt; export another checkpoint "
                             f"with --tag (one of {', '.join(_tags(save_dir))})")
    if any(n.endswith("optim_states.pt") and "zero_pp_rank" in n for n in os.listdir(tag_dir)):
        with _quiet_deepspeed():
            return get_fp32_state_dict_from_zero_checkpoint(save_dir, tag=tag)
    state = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), map_location="cpu", weights_only=False)
    return {k: v.float() for k, v in state["module"].items()}


@contextlib.contextmanager
def _quiet_deepspeed():
    """Keep DeepSpeed's shard-merging chatter (its logger's INFO lines and prints) off the
    terminal: the export's own output is one line naming what it wrote."""
    from deepspeed.utils import logger

    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def saved_lora(save_dir: str, tag: str) -> dict | None:
    """The LoRA record (:func:`fpdt.train.lora.record`) that checkpoint ``tag``'s rank-0 trainer
    file holds; None for full training (and checkpoints written before LoRA existed)."""
    path = os.path.join(save_dir, tag, TRAINER_FILE.format(rank=0))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: it records whether the checkpoint trained LoRA adapters or "
                                f"every weight; export another checkpoint with --tag (one of "
                                f"{', '.join(_tags(save_dir))})")
    return torch.load(path, map_location="cpu", weights_only=False).get("lora")


def export_checkpoint(save_dir: str, out_dir: str, tag: str | None = None, dtype: str | None = None) -> str:
    """Write the HF checkpoint of ``save_dir``'s checkpoint ``tag`` (default: newest) to
    ``out_dir``, or the PEFT adapter directory when that checkpoint is of a LoRA run (its
    trainer file says so); returns ``out_dir``."""
    from fpdt.model import from_config, load_hf_state_dict, save_pretrained

    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"{out_dir} is a file, not a directory; pass a directory path for the export (it is "
                         f"created if missing)")
    tag = _read_tag(save_dir, tag)
    config = model_file(save_dir, tag, "config.json")
    if not os.path.isfile(config):
        raise FileNotFoundError(f"{config} is missing: export needs the config.json fpdt-train writes to --save-dir")
    state = fp32_state_dict(save_dir, tag)
    lora = saved_lora(save_dir, tag)
    if lora is not None:
        export_adapter(save_dir, tag, config, state, out_dir, lora, dtype)
    else:
        model = from_config(config, device="meta")
        load_hf_state_dict(model, {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")})
        model.reset_rope()
        save_pretrained(model, out_dir, dtype=dtype)
    for name in TOKENIZER_FILES:
        src = model_file(save_dir, tag, name)
        if os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
    return out_dir


def export_adapter(save_dir: str, tag: str, config: str, state: dict[str, torch.Tensor], out_dir: str,
                   lora: dict, dtype: torch.dtype | None = None) -> None:
    """Write the adapters of checkpoint ``tag``'s ``state`` as a PEFT adapter directory with
    the spec and base of its trainer file's record ``lora`` (:func:`fpdt.train.lora.record`),
    after checking that they are exactly the ones that spec puts on the model of ``config``."""
    from fpdt.model.lora import is_adapter, save_adapter
    from fpdt.train.lora import adapter_shapes, spec_from_record
    from fpdt.train.preflight import read_model_config

    spec = spec_from_record(lora)
    adapters = {k: v for k, v in state.items() if is_adapter(k)}
    want = adapter_shapes(read_model_config(config), spec)
    wrong = sorted(set(want) ^ set(adapters)) + [k for k in want if k in adapters and tuple(adapters[k].shape) != want[k]]
    if wrong:
        raise ValueError(f"{os.path.join(save_dir, tag)}: the checkpoint's adapters do not match the LoRA spec its "
                         f"trainer file records on the model of {config} (e.g. {wrong[0]}); export another checkpoint "
                         f"with --tag (one of {', '.join(_tags(save_dir))})")
    save_adapter(adapters, spec, out_dir, base_model_name_or_path=lora["base"]["model"], dtype=dtype)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fpdt-export", description="Hugging Face checkpoint from an fpdt-train checkpoint "
                                                                 "(a PEFT adapter directory for a LoRA run)")
    p.add_argument("save_dir", help="the --save-dir of an fpdt-train run")
    p.add_argument("out_dir", help="where to write config.json + safetensors (LoRA: adapter_config.json + "
                                   "adapter_model.safetensors)")
    p.add_argument("--tag", help="checkpoint to export, e.g. step100 (default: the newest)")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="dtype of the saved weights")
    args = p.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    try:
        out = export_checkpoint(args.save_dir, args.out_dir, args.tag, dtype)
    except Exception as e:  # noqa: BLE001 -- one line, as fpdt-train does (FPDT_DEBUG=1: traceback)
        if os.environ.get("FPDT_DEBUG", "") not in ("", "0"):
            raise
        known = isinstance(e, (FileNotFoundError, ValueError))
        text = " ".join(str(e).split())
        if not known:
            text = (f"{type(e).__name__}: {text[:500]} (is a checkpoint file truncated? export another --tag; "
                    f"FPDT_DEBUG=1 shows the traceback)")
        print(f"fpdt-export: error: {text}", file=sys.stderr)
        return 2 if known else 1
    print(f"wrote {out}")
    return 0
