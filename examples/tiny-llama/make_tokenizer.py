"""Rebuild ``tokenizer.json`` for the tiny example model from the shipped corpus.

A byte-level BPE with 2048 entries, trained with ``tokenizers`` on
``examples/data/jargon-file-4.4.7.txt``. Run from the repository root::

    python3 examples/tiny-llama/make_tokenizer.py

The committed ``tokenizer.json`` came from this script; rerunning it gives the same file.
"""

from __future__ import annotations

import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "..", "data", "jargon-file-4.4.7.txt")
VOCAB_SIZE = 2048
SPECIAL = ["<|endoftext|>"]  # id 0: end of document; config.json uses it as bos/eos


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([CORPUS], trainer)
    return tok


if __name__ == "__main__":
    out = os.path.join(HERE, "tokenizer.json")
    build().save(out)
    print(f"wrote {out}")
