"""fpdt-train --pack-documents: documents from every source, windows of whole documents in order."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from fpdt.comm import SequenceMesh
from fpdt.layout import mesh_unshard, unshard
from fpdt.layout.documents import doc_ids_from_position_ids
from fpdt.train.data import DataError, PackedWindows, load_documents
from tests.train.helpers import fresh_env, logged_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENIZER = "examples/tiny-llama/tokenizer.json"
EOS = 0


def _stream(lengths, seed=0):
    """Documents of ``lengths`` tokens, each ending with EOS, ids in [1, 50)."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, 50, n - 1), EOS) for n in lengths]
    return np.concatenate(docs), np.asarray(lengths)


def test_token_streams_split_at_eos(tmp_path):
    tokens, lengths = _stream([4, 1, 9, 3])
    tail = np.array([7, 8])                              # a file's tail without EOS is a document too
    np.save(tmp_path / "a.npy", np.concatenate([tokens, tail]).astype(np.int32))
    tokens.astype(np.uint16).tofile(tmp_path / "b.bin")
    got, n = load_documents(str(tmp_path / "a.npy"), eos_id=EOS)
    assert n.tolist() == [4, 1, 9, 3, 2] and np.array_equal(got, np.concatenate([tokens, tail]))
    got, n = load_documents(str(tmp_path), eos_id=EOS)  # the directory: both files, a.npy first
    assert n.tolist() == [4, 1, 9, 3, 2, 4, 1, 9, 3] and n.sum() == len(got)
    with pytest.raises(DataError, match="eos_token_id, and the config names none"):
        load_documents(str(tmp_path / "b.bin"), eos_id=None)


def test_text_documents(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(TOKENIZER)
    (tmp_path / "a.txt").write_text("first document\n")
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": "second doc"}) + "\n" + json.dumps("third") + "\n")
    got, n = load_documents(str(tmp_path), tokenizer_path=TOKENIZER, eos_id=EOS)
    want = [tok.encode(d, add_special_tokens=False).ids + [EOS] for d in ("first document\n", "second doc", "third")]
    assert n.tolist() == [len(w) for w in want] and got.tolist() == sum(want, [])


def _pieces(windows: PackedWindows, w: int):
    """Window ``w``'s documents as lists of token ids, and its padding length."""
    win = windows.window(w)
    docs, pad = [], 0
    for d in np.unique(win["doc_ids"]):
        sel = win["doc_ids"] == d
        assert win["position_ids"][sel].tolist() == list(range(sel.sum()))          # restart at 0
        toks = win["input_ids"][sel]
        labels = win["labels"][sel]
        if d >= windows.first_piece[w + 1] - windows.first_piece[w]:               # the padding
            assert (labels == -100).all() and (toks == windows.pad_id).all()
            pad = int(sel.sum())
            continue
        assert labels[:-1].tolist() == toks[1:].tolist() and labels[-1] == -100     # last token predicts nothing
        docs.append(toks.tolist())
    return docs, pad


def test_windows_of_whole_documents_in_order():
    S = 16
    lengths = [5, 3, 8, 1, 40, 7, 16, 2, 9, 9]          # 40: split 16 + 16 + 8; 16 fills a window alone
    tokens, lengths = _stream(lengths)
    windows = PackedWindows(tokens, lengths, S, pad_id=3)
    seen, pads = [], 0
    for w in range(windows.num_windows):
        docs, pad = _pieces(windows, w)
        assert sum(map(len, docs)) + pad == S
        j = windows.first_piece[w + 1]                                             # next fit: the next piece
        assert pad == 0 or j == windows.piece_len.size or pad < windows.piece_len[j]   # did not fit
        seen += docs
        pads += pad
    starts = np.cumsum(lengths) - lengths
    want = []
    for s, n in zip(starts, lengths):
        doc = tokens[s:s + n].tolist()
        want += [doc[i:i + S] for i in range(0, n, S)]   # longer than a window: S-token pieces
    assert seen == want                                  # every token once, in order
    assert [len(p) for p in seen] == [5, 3, 8, 1, 16, 16, 8, 7, 16, 2, 9, 9]
    assert windows.num_documents == 10 and windows.mean_length == pytest.approx(10.0)
    assert "packed documents=10 mean_len=10.0 continuations=2" in windows.describe()


def _all_pieces(windows: PackedWindows) -> list[list[int]]:
    out = []
    for w in range(windows.num_windows):
        docs, pad = _pieces(windows, w)
        assert sum(map(len, docs)) + pad == windows.seq_len
        out += docs
    return out


def test_best_fit_keeps_whole_documents_and_fills_more():
    """best-fit: the same pieces as in-order (every document whole unless longer than S), each
    once, a window's pieces in stream order, no window over S; deterministic; on long-tailed
    lengths it leaves far less padding; each window opens with the earliest piece left."""
    from fpdt.bench.documents import document_stream
    import itertools

    S = 16
    tokens, lengths = _stream([5, 3, 8, 1, 40, 7, 16, 2, 9, 9, 12, 4, 4, 15, 1])
    plain = PackedWindows(tokens, lengths, S)
    best = PackedWindows(tokens, lengths, S, packing="best-fit", lookahead=4)
    got = _all_pieces(best)
    assert sorted(got) == sorted(_all_pieces(plain))
    for w in range(best.num_windows):
        members = best.order[best.first_piece[w]:best.first_piece[w + 1]]
        assert list(members) == sorted(members)
    assert best.num_windows < plain.num_windows
    again = PackedWindows(tokens, lengths, S, packing="best-fit", lookahead=4)
    assert np.array_equal(again.order, best.order) and np.array_equal(again.first_piece, best.first_piece)
    # with one piece of lookahead there is no choice: in-order next fit
    one = PackedWindows(tokens, lengths, S, packing="best-fit", lookahead=1)
    assert np.array_equal(one.first_piece, plain.first_piece)
    # log-normal lengths (median 2K, tail to 128K) in 256K windows
    L = np.array(list(itertools.islice(document_stream(0, 2048, 1.5, 131072), 3000)))
    toks = np.zeros(int(L.sum()), dtype=np.int64)
    fills = {p: PackedWindows(toks, L, 262144, packing=p) for p in ("in-order", "best-fit")}
    used = int(L.sum())
    assert used / (fills["in-order"].num_windows * 262144) < 0.95
    assert used / (fills["best-fit"].num_windows * 262144) > 0.99
    # each window opens with the earliest piece not yet placed: with `lookahead` pieces in the
    # buffer, none waits for more than `lookahead` windows
    for b in (best, fills["best-fit"]):
        placed = np.zeros(b.order.size, dtype=bool)
        for w in range(b.num_windows):
            members = b.order[b.first_piece[w]:b.first_piece[w + 1]]
            assert members[0] == np.flatnonzero(~placed)[0]
            placed[members] = True
        assert placed.all()


def test_split_fills_every_window():
    """split: every window full but the last, documents crossing a window's end continuing in the
    next from position 0, every token once in stream order."""
    S = 16
    tokens, lengths = _stream([5, 3, 9, 1, 40, 7])
    split = PackedWindows(tokens, lengths, S, packing="split")
    assert split.num_windows == -(-int(lengths.sum()) // S) == 5
    got = _all_pieces(split)
    assert sum(got, []) == tokens.tolist()
    assert [len(p) for p in got] == [5, 3, 8, 1, 1, 14, 16, 10, 6, 1]
    assert "continuations=4" in split.describe() and "packing=split" in split.describe()
    assert split.attended_length(0) == pytest.approx((25 + 9 + 64) / S)
    with pytest.raises(DataError, match="choose one of in-order, best-fit, split"):
        PackedWindows(tokens, lengths, S, packing="first-fit")


def test_ring_arrangement_evens_out_the_cp_ranks_work():
    """With a ring (cp > 1) a window's pieces are written in the order, of 32 candidates, whose
    busiest CP rank has the least attention work: the same pieces (a permutation, the padding
    last), never more work on the busiest rank than stream order, the same on every call; on
    log-normal documents (median 2K, tail to 128K) in 128K windows, cp 8, two chunks per rank, the
    mean max/mean over ranks drops from about 1.5 to under 1.25 (fpdt.bench.documents'
    count)."""
    from fpdt.bench.documents import document_stream
    import itertools

    S, cp, u = 1 << 17, 8, 2
    L = np.array(list(itertools.islice(document_stream(0, 2048, 1.5, 1 << 17), 600)))
    toks = np.arange(int(L.sum()), dtype=np.int64) % 50 + 1
    plain = PackedWindows(toks, L, S)
    ring = PackedWindows(toks, L, S, balance_cp=cp, balance_chunks=u)
    assert "balanced for cp=8" in ring.describe() and "balanced" not in plain.describe()
    owner = ring._cp_owner()
    assert np.bincount(owner).tolist() == [S // cp] * cp
    before, after = [], []
    for w in range(min(24, ring.num_windows)):
        stream, arranged = plain.arrangement(w), ring.arrangement(w)
        assert sorted(arranged.tolist()) == stream.tolist()
        assert np.array_equal(ring.arrangement(w), arranged)              # deterministic
        busy = [ring._busiest(x, owner) for x in (stream, arranged)]
        assert busy[1] <= busy[0]
        mean = sum(n * (n + 1) / 2 for n in ring.piece_len[stream].tolist() + [S - ring.piece_len[stream].sum()]) / cp
        before.append(busy[0] / mean)
        after.append(busy[1] / mean)
        docs, pad = _pieces(ring, w)
        assert sorted(docs) == sorted(_pieces(plain, w)[0]) and pad == _pieces(plain, w)[1]
    assert np.mean(before) > 1.4 and np.mean(after) < 1.25, (np.mean(before), np.mean(after))


def test_attended_length_is_the_masked_attention_work():
    """A window's attended length is sum n^2 / S over its documents, the padding one more: the
    attention term of the FLOPs formula then counts the query-key work the document mask leaves,
    i.e. what the doc_ids the model gets describe (S for a window holding one document)."""
    from fpdt.train.data import Windows
    from fpdt.train.loop import step_attended_length

    S = 16
    tokens, lengths = _stream([5, 3, 8, 1, 40, 7, 16, 2, 9, 9])
    windows = PackedWindows(tokens, lengths, S)
    for w in range(windows.num_windows):
        doc_ids = windows.window(w)["doc_ids"]
        want = sum(int(c) ** 2 for c in np.bincount(doc_ids)) / S
        assert windows.attended_length(w) == pytest.approx(want)
    assert windows.attended_length(3) == S                       # [16]: one document
    assert windows.attended_length(0) == pytest.approx((25 + 9 + 64) / S)
    assert windows.attended_length(windows.num_windows) == windows.attended_length(0)   # next epoch
    # a step's mean covers every DP group and micro step: step 1 of 2 x 2 x 2 reads sequences 8..15
    spec = type("Spec", (), {"grad_accum": 2, "micro_batch": 2, "parallel": type("P", (), {"dp": 2})})
    mean = step_attended_length(windows, spec, 1)
    assert mean == pytest.approx(sum(windows.attended_length(k) for k in range(8, 16)) / 8)
    assert step_attended_length(Windows(np.arange(100), 9), spec, 0) == 9
    from fpdt.plan.documents import effective_length      # the planner's count, for equal documents
    even = PackedWindows(*_stream([4] * 8), S)
    assert even.attended_length(0) == effective_length(S, 4) == 4


@pytest.mark.parametrize("sp, u, mesh", [(1, 1, None), (2, 2, None), (4, 1, (2, 2))])
def test_shard_and_doc_ids(sp, u, mesh):
    S = 32
    tokens, lengths = _stream([3, 11, 1, 20, 6, 2, 40, 5], seed=1)
    windows = PackedWindows(tokens, lengths, S, shuffle=True, seed=5)
    ks = [0, 3, 1]
    whole = [windows.window(windows.window_of_sequence(k)) for k in ks]
    for name in ("input_ids", "labels", "position_ids"):
        if mesh is None:
            parts = [windows.shard(ks, sp, u, r)[name] for r in range(sp)]
            got = unshard(parts, u)
        else:
            hp, cp = mesh
            parts = [windows.shard(ks, sp, u, None, mesh=_FakeMesh(hp, cp, c, h))[name]
                     for c in range(cp) for h in range(hp)]
            got = mesh_unshard(parts, hp, cp, u)
        assert torch.equal(got, torch.from_numpy(np.stack([w[name] for w in whole])))
    batch = windows.shard(ks, sp, u, 0, mesh=_FakeMesh(*mesh, 0, 0) if mesh else None)
    # doc_ids: the whole windows', the documents the positions mark (the padding a document of its own)
    assert torch.equal(batch["doc_ids"], doc_ids_from_position_ids(torch.from_numpy(
        np.stack([w["position_ids"] for w in whole]))))


class _FakeMesh(SequenceMesh):
    """The mesh layout of rank (c, h) without process groups."""

    def __init__(self, hp, cp, c, h):
        self.hp, self.cp, self.cp_rank, self.hp_rank = hp, cp, c, h


def test_order_is_a_function_of_the_run():
    tokens, lengths = _stream(list(range(1, 30)), seed=2)
    a = PackedWindows(tokens, lengths, 24, shuffle=True, seed=7)
    b = PackedWindows(tokens, lengths, 24, shuffle=True, seed=7)
    order = [a.window_of_sequence(k) for k in range(3 * a.num_windows)]
    assert order == [b.window_of_sequence(k) for k in range(3 * b.num_windows)]     # a resumed run reads the same
    assert sorted(order[:a.num_windows]) == list(range(a.num_windows))
    plain = PackedWindows(tokens, lengths, 24)
    assert [plain.window_of_sequence(k) for k in range(plain.num_windows + 2)] == \
        list(range(plain.num_windows)) + [0, 1]


def _jargon_paragraphs(path) -> int:
    """The main job's text (README) as JSONL documents, one per paragraph."""
    import re

    with open(os.path.join(ROOT, "examples", "data", "jargon-file-4.4.7.txt")) as f:
        paragraphs = [p for p in re.split(r"\n\s*\n", f.read()) if p.strip()]
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    return len(paragraphs)


def _train(tmp, *extra):
    argv = [sys.executable, "-m", "fpdt.cli", "--model-config", "examples/tiny-llama/config.json",
            "--data", os.path.join(tmp, "jargon.jsonl"), "--seq-len", "256", "--steps", "3",
            "--deepspeed", "examples/tiny-llama/ds_cpu.json", "--pack-documents", "--no-mem-accounting", *extra]
    env = fresh_env()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stderr


@pytest.mark.slow
def test_main_job_data_packed_and_resumed_in_order(tmp_path):
    """The README's main job on its text cut into paragraphs, packed: the start-up line counts the
    documents, the loss starts near ln(vocab) and falls, and a run resumed at step 2 takes step 3
    exactly as the uninterrupted run did (same windows, in the same order)."""
    tmp = str(tmp_path)
    docs = _jargon_paragraphs(os.path.join(tmp, "jargon.jsonl"))
    log = os.path.join(tmp, "run.jsonl")
    err = _train(tmp, "--log-json", log, "--save-dir", os.path.join(tmp, "ckpt"), "--save-every", "2")
    line = re.search(r"packed documents=(\d+) mean_len=([\d.]+) continuations=(\d+) fill=([\d.]+)%", err)
    assert line and int(line.group(1)) == docs and 30 < float(line.group(2)) < 200, err[-2000:]
    losses = logged_losses(log)
    assert len(losses) == 3 and losses[0] == pytest.approx(7.6, abs=0.3) and losses[-1] < losses[0]
    resumed_log = os.path.join(tmp, "resumed.jsonl")
    err = _train(tmp, "--log-json", resumed_log, "--resume", os.path.join(tmp, "ckpt", "step2"))
    assert "differs from the saved one" not in err
    assert logged_losses(resumed_log) == losses[2:]


def _train_sp2(rank, world, tmp, log):
    from fpdt.cli.train import main
    from tests.train.helpers import quiet

    quiet()
    os.chdir(ROOT)
    assert main(["--model-config", "examples/tiny-llama/config.json", "--data", os.path.join(tmp, "jargon.jsonl"),
                 "--seq-len", "256", "--steps", "3", "--sp", "2", "--deepspeed", "examples/tiny-llama/ds_cpu.json",
                 "--pack-documents", "--no-mem-accounting", "--log-json", log]) == 0


@pytest.mark.slow
def test_main_job_data_packed_on_two_ranks_matches_one(tmp_path):
    """sp=2 (documents across the ranks' chunks, the model given the windows' document ids) trains as
    one process does: each step's loss within 1e-4."""
    from tests.distributed import run_distributed

    tmp = str(tmp_path)
    _jargon_paragraphs(os.path.join(tmp, "jargon.jsonl"))
    one, two = os.path.join(tmp, "one.jsonl"), os.path.join(tmp, "two.jsonl")
    _train(tmp, "--log-json", one)
    run_distributed(_train_sp2, 2, args=(tmp, two), timeout=300)
    one, two = logged_losses(one), logged_losses(two)
    for a, b in zip(one, two, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (one, two)


@pytest.mark.long
@pytest.mark.slow
def test_main_job_best_fit_packing_fills_more_and_resume_names_a_change(tmp_path):
    """--pack-documents best-fit on the main job's paragraphs: the start-up line names the packing
    and a fill above in-order's; a run resumed with another packing is told its data differs."""
    tmp = str(tmp_path)
    _jargon_paragraphs(os.path.join(tmp, "jargon.jsonl"))
    fills = {}
    for packing in ("in-order", "best-fit"):
        err = _train(tmp, "--pack-documents", packing, "--steps", "2", "--save-dir", os.path.join(tmp, packing),
                     "--save-every", "2")
        line = re.search(r"fill=([\d.]+)% packing=(\S+)", err)
        assert line and line.group(2) == packing, err[-2000:]
        fills[packing] = float(line.group(1))
    assert fills["best-fit"] > fills["in-order"] + 10, fills
    err = _train(tmp, "--pack-documents", "split", "--resume", os.path.join(tmp, "best-fit", "step2"))
    assert "differs from the saved one" in err and "pack_documents" in err, err[-2000:]


def _train_cp2(rank, world, tmp, log):
    from fpdt.cli.train import main
    from tests.train.helpers import quiet

    quiet()
    os.chdir(ROOT)
    assert main(["--model-config", "examples/tiny-llama/config.json", "--data", os.path.join(tmp, "jargon.jsonl"),
                 "--seq-len", "256", "--steps", "3", "--cp", "2", "--deepspeed", "examples/tiny-llama/ds_cpu.json",
                 "--pack-documents", "--no-mem-accounting", "--shuffle", "--seed", "0", "--log-json", log]) == 0


@pytest.mark.long
@pytest.mark.slow
def test_main_job_packed_on_a_ring_trains_what_one_process_does(tmp_path):
    """cp=2 (the ring): each window's documents arranged for the CP ranks' work
    (PackedWindows.arrangement), which changes where they sit, not what is trained: each step's
    loss within 1e-4 of one process's, in stream order."""
    from tests.distributed import run_distributed

    tmp = str(tmp_path)
    path = os.path.join(tmp, "jargon.jsonl")
    _jargon_paragraphs(path)
    # the windows these 3 steps read (shuffled, seed 0), one of them rearranged (tiny-llama: 128-token chunks)
    tokens, lengths = load_documents(path, tokenizer_path=TOKENIZER, eos_id=EOS)
    ring_windows = PackedWindows(tokens, lengths, 256, shuffle=True, seed=0, balance_cp=2, balance_chunks=2)
    read = [ring_windows.window_of_sequence(k) for k in range(3)]
    assert any(not np.array_equal(ring_windows.arrangement(w),
                                  ring_windows.order[ring_windows.first_piece[w]:ring_windows.first_piece[w + 1]])
               for w in read)
    one, ring = os.path.join(tmp, "one.jsonl"), os.path.join(tmp, "ring.jsonl")
    _train(tmp, "--log-json", one, "--shuffle", "--seed", "0")
    run_distributed(_train_cp2, 2, args=(tmp, ring), timeout=300)
    one, ring = logged_losses(one), logged_losses(ring)
    for a, b in zip(one, ring, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (one, ring)


def test_the_shipped_paragraphs_are_the_text_split_at_blank_lines_and_pack():
    """examples/data/jargon-file-paragraphs.jsonl is what examples/data/README.md's one-liner makes
    from the shipped text, and it gives docs/train.md's fill figures: 1623 documents in 256-token
    windows, 78.3% in order, 99.9% best-fit (the whole text is one document, which packing cannot help)."""
    from fpdt.train.data import PackedWindows, load_documents

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    with open(os.path.join(here, "data", "jargon-file-4.4.7.txt")) as f:
        text = f.read()
    path = os.path.join(here, "data", "jargon-file-paragraphs.jsonl")
    with open(path) as f:
        shipped = f.read()
    assert shipped == "".join(json.dumps({"text": p.strip()}) + "\n" for p in text.split("\n\n") if p.strip())
    tokens, lengths = load_documents(path, tokenizer_path=os.path.join(here, "tiny-llama", "tokenizer.json"), eos_id=0)
    fills = {}
    for packing in ("in-order", "best-fit"):
        line = PackedWindows(tokens, lengths, 256, pad_id=0, packing=packing).describe()
        assert "packed documents=1623 " in line, line
        fills[packing] = line.split("fill=")[1].split("%")[0]
    assert fills == {"in-order": "78.3", "best-fit": "99.9"}
