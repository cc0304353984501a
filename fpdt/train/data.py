"""Training data: a token stream, cut into windows, sharded into the FPDT layout.

``--data``: ``.npy`` / ``.bin`` ids (an implausible ``.bin`` is refused) or ``.txt`` / ``.jsonl``
text tokenized with ``tokenizer.json`` (each document followed by ``eos_token_id``), or a
directory of them in sorted order. Consecutive windows of ``seq_len + 1`` tokens (optionally
shuffled per pass from ``(seed, epoch)``) give inputs ``window[:-1]`` and labels ``window[1:]``,
shifted on the global sequence and then sharded. Step ``t``, micro step ``m``, DP group ``d``,
sample ``b`` read sequence ``((t * gas + m) * dp + d) * B + b``. :class:`PackedWindows` packs whole
documents. The contract in full: ``docs/train.md`` (Data contract, Packed documents).
"""

from __future__ import annotations

import bisect
import json
import os
from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from fpdt.comm import SequenceMesh
from fpdt.model.inputs import prepare_inputs
from fpdt.model.loss import IGNORE_INDEX

TEXT_SUFFIXES = (".txt", ".jsonl")
TOKEN_SUFFIXES = (".npy", ".bin")
BIN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


class DataError(ValueError):
    """Unusable training data; the message says what to change."""


# ----------------------------------------------------------------------------- token sources

def list_data_files(path: str) -> list[str]:
    """The files ``--data`` names: the file itself, or the usable files under a directory."""
    if os.path.isfile(path):
        if not path.endswith(TEXT_SUFFIXES + TOKEN_SUFFIXES):
            raise DataError(f"--data {path}: unknown file type; use .npy, .bin, .txt or .jsonl")
        return [path]
    if not os.path.isdir(path):
        raise DataError(f"--data {path}: no such file or directory")
    found = []
    for root, dirs, files in os.walk(path):
        dirs.sort()
        found.extend(os.path.join(root, f) for f in sorted(files) if f.endswith(TEXT_SUFFIXES + TOKEN_SUFFIXES))
    if not found:
        raise DataError(f"--data {path}: the directory holds no .npy, .bin, .txt or .jsonl files")
    return sorted(found)


def read_documents(path: str) -> list[str]:
    """The documents of one text file: the whole ``.txt``, or each line of a ``.jsonl``. Raises
    :class:`DataError` naming the file (and line) for non-UTF-8 text and malformed ``.jsonl`` lines.
    """
    with open(path, "rb") as f:
        if path.endswith(".txt"):
            return [_decode(f.read(), path)]
        docs = []
        for n, raw in enumerate(f, 1):
            line = _decode(raw, f"{path}:{n}")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg}, column {e.colno}); each line of a .jsonl "
                                f"must be one JSON object with a \"text\" field (or a JSON string)") from None
            if isinstance(obj, dict):
                if "text" not in obj:
                    raise DataError(f"{path}:{n}: JSON object has no \"text\" field; "
                                    f"each line must be {{\"text\": \"...\"}} (or a JSON string)")
                obj = obj["text"]
            if not isinstance(obj, str):
                raise DataError(f"{path}:{n}: expected a string or an object with a \"text\" string, "
                                f"found {type(obj).__name__}")
            docs.append(obj)
        return docs


def _decode(raw: bytes, where: str) -> str:
    """UTF-8 text of ``raw``; ``where`` (``file`` or ``file:line``) names it in the error."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); convert the "
                        f"file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or pre-tokenize it to .npy/.bin") from None


def tokenize_documents(docs: list[str], tokenizer_path: str, eos_id: int | None) -> np.ndarray:
    """Token ids of ``docs`` (each followed by ``eos_id`` when given), as one int64 array."""
    return tokenize_with_lengths(docs, tokenizer_path, eos_id)[0]


def tokenize_with_lengths(docs: list[str], tokenizer_path: str, eos_id: int | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`tokenize_documents`, and each document's token count (int64, end-of-text id included)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    ids: list[int] = []
    lengths: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        if eos_id is not None:
            ids.append(eos_id)
        lengths.append(len(enc.ids) + (eos_id is not None))
    return np.asarray(ids, dtype=np.int64), np.asarray(lengths, dtype=np.int64)


def bin_dtype_for_vocab(vocab_size: int) -> str:
    """Default ``--data-dtype``: ``uint16`` when every id of the vocabulary fits, else ``uint32``."""
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


def read_token_file(path: str, bin_dtype: str) -> np.ndarray:
    """Ids of one ``.npy`` (memory-mapped, flattened) or ``.bin`` (raw ``bin_dtype``) file."""
    if path.endswith(".npy"):
        try:
            arr = np.load(path, mmap_mode="r")
        except (ValueError, OSError, EOFError) as e:
            raise DataError(f"{path}: not a readable .npy file ({e}); write it with numpy.save") from None
        if not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: token ids must be integers, found dtype {arr.dtype}")
        return arr.reshape(-1)
    if bin_dtype not in BIN_DTYPES:
        raise DataError(f"--data-dtype {bin_dtype!r}: use one of {sorted(BIN_DTYPES)}")
    itemsize = np.dtype(BIN_DTYPES[bin_dtype]).itemsize
    size = os.path.getsize(path)
    if size % itemsize:
        fits = [d for d in BIN_DTYPES if size % np.dtype(BIN_DTYPES[d]).itemsize == 0]
        hint = f"pass --data-dtype {fits[0]}" if fits else "the file is truncated: re-write it"
        raise DataError(f"{path}: {size} bytes is not a multiple of {itemsize} ({bin_dtype} ids); the file is "
                        f"truncated or holds another type: {hint}")
    if size == 0:
        return np.zeros(0, dtype=BIN_DTYPES[bin_dtype])
    return np.memmap(path, dtype=BIN_DTYPES[bin_dtype], mode="r")


def load_tokens(path: str, *, bin_dtype: str = "uint16", tokenizer_path: str | None = None,
                eos_id: int | None = None) -> np.ndarray:
    """The whole token stream named by ``--data`` as one 1-D integer array."""
    parts: list[np.ndarray] = []
    for f in list_data_files(path):
        if f.endswith(TOKEN_SUFFIXES):
            part = read_token_file(f, bin_dtype)
            if f.endswith(".bin"):
                check_plausible_bin(part, bin_dtype, f)
            parts.append(part)
            continue
        parts.append(tokenize_documents(read_documents(f), _tokenizer(f, tokenizer_path), eos_id))
    return parts[0] if len(parts) == 1 else np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])


def load_documents(path: str, *, bin_dtype: str = "uint16", tokenizer_path: str | None = None,
                   eos_id: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The stream of :func:`load_tokens` and its documents' lengths (``[documents]`` int64, summing to
    the stream's length; no empty ones): each text document (with its ``eos_id``), and the pieces of
    ``.npy``/``.bin`` streams that end with ``eos_id`` (which they need)."""
    parts: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    for f in list_data_files(path):
        if f.endswith(TOKEN_SUFFIXES):
            if eos_id is None:
                raise DataError(f"--pack-documents splits the token stream {f} into documents at the model config's "
                                f"eos_token_id, and the config names none: set eos_token_id in config.json, or "
                                f"train on .jsonl/.txt documents")
            part = load_tokens(f, bin_dtype=bin_dtype)
            ends = np.flatnonzero(np.asarray(part) == eos_id) + 1
            cuts = np.concatenate([[0], ends, [len(part)]])
            lengths.append(np.diff(cuts))
        else:
            part, n = tokenize_with_lengths(read_documents(f), _tokenizer(f, tokenizer_path), eos_id)
            lengths.append(n)
        parts.append(np.asarray(part))
    tokens = parts[0] if len(parts) == 1 else np.concatenate([p.astype(np.int64) for p in parts])
    lengths = np.concatenate(lengths).astype(np.int64)
    return tokens, lengths[lengths > 0]


def _tokenizer(f: str, tokenizer_path: str | None) -> str:
    if tokenizer_path is None or not os.path.isfile(tokenizer_path):
        raise DataError(f"--data {f} is text but no tokenizer.json was found "
                        f"(looked for {tokenizer_path}); put tokenizer.json in the model directory "
                        f"or pass --tokenizer PATH, or pre-tokenize to .npy/.bin")
    return tokenizer_path


def check_vocab(tokens: np.ndarray, vocab_size: int, source: str) -> None:
    """Refuse ids outside ``[0, vocab_size)`` (they would index past the embedding)."""
    if tokens.size == 0:
        raise DataError(f"--data {source} holds no tokens")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= vocab_size:
        raise DataError(f"--data {source} has token ids in [{lo}, {hi}] but the model's vocab_size is "
                        f"{vocab_size}; tokenize with the model's tokenizer (or check --data-dtype)")


PLAUSIBILITY_SAMPLE = 1 << 20
"""Ids inspected by :func:`check_plausible_bin` (a prefix of the file)."""


def check_plausible_bin(tokens: np.ndarray, bin_dtype: str, source: str) -> None:
    """Refuse a ``.bin`` stream that is almost surely read with the wrong element type: every
    odd-position id of the first :data:`PLAUSIBILITY_SAMPLE` 0 (and not every even one) is uint32
    read as uint16 (the other mix-up gives ids >= 65536, which :func:`check_vocab` refuses).
    """
    if bin_dtype != "uint16" or tokens.size < 16:
        return
    head = np.asarray(tokens[:PLAUSIBILITY_SAMPLE])
    head = head[:head.size - head.size % 2]
    if not head[1::2].any() and head[0::2].any():
        raise DataError(f"--data {source}: read as uint16, every other id is 0, which is how uint32 ids look "
                        f"when read as uint16; pass --data-dtype uint32 (or re-write the file as uint16)")


# ----------------------------------------------------------------------------- windows

@dataclass
class Windows:
    """Consecutive windows of ``seq_len + 1`` tokens over a token stream."""

    tokens: np.ndarray
    """1-D token ids (may be a memory map)."""
    seq_len: int
    """S: tokens per training sequence (a window holds S + 1)."""
    shuffle: bool = False
    """Visit each pass's windows in a seeded random order instead of file order."""
    seed: int = 0
    """Seed of the shuffle order (together with the epoch)."""

    def __post_init__(self) -> None:
        if self.num_windows < 1:
            raise DataError(f"the data has {len(self.tokens)} tokens, fewer than one window of "
                            f"seq_len + 1 = {self.seq_len + 1}; use more data or a shorter --seq-len")

    @property
    def num_windows(self) -> int:
        return len(self.tokens) // (self.seq_len + 1)

    def window_of_sequence(self, k: int) -> int:
        """Which window the ``k``-th sequence of the run reads."""
        epoch, pos = divmod(k, self.num_windows)
        if not self.shuffle:
            return pos
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
        return int(order[pos])

    def attended_length(self, k: int) -> float:
        """The length the FLOPs formula's attention term takes for sequence ``k``
        (:func:`fpdt.train.metrics.step_rates`): ``S``, one causal sequence."""
        return float(self.seq_len)

    def window(self, w: int) -> np.ndarray:
        """Window ``w``: ``S + 1`` int64 ids."""
        start = w * (self.seq_len + 1)
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def sequences(self, ks: Iterable[int]) -> torch.Tensor:
        """``[B, S + 1]`` int64: the windows of sequences ``ks``."""
        return torch.from_numpy(np.stack([self.window(self.window_of_sequence(k)) for k in ks]))

    def shard(self, ks: Iterable[int], sp: int, num_chunks: int, sp_rank: int,
              mesh: SequenceMesh | None = None) -> dict[str, torch.Tensor]:
        """This rank's inputs for sequences ``ks``: :func:`shard_windows` of their windows."""
        return shard_windows(self.sequences(ks), sp, num_chunks, sp_rank, mesh=mesh)

    def describe(self) -> str:
        """What the start-up line says about the data."""
        return f"windows={self.num_windows}"


PACKINGS = ("in-order", "best-fit", "split")
"""How :class:`PackedWindows` fills its windows (``fpdt-train --pack-documents PACKING``)."""


@dataclass
class PackedWindows:
    """Windows of ``seq_len`` tokens of whole documents (``--pack-documents``), ``packing`` one of
    :data:`PACKINGS`: ``"in-order"`` (next fit; the rest of a window is padding, targets ``-100``),
    ``"best-fit"`` (each window filled greedily, largest first, from a buffer of the next
    ``lookahead`` pieces) or ``"split"`` (full windows, a crossing document continuing at position 0).
    Documents longer than ``seq_len`` are cut into pieces, each a document of its own; window ``w``
    holds pieces ``order[first_piece[w]:first_piece[w + 1]]``.
    """

    tokens: np.ndarray
    """1-D token ids (may be a memory map)."""
    doc_lengths: np.ndarray
    """``[documents]`` int64 token counts, in stream order, summing to ``len(tokens)``."""
    seq_len: int
    """S: tokens per training sequence (a window holds exactly S, padding included)."""
    pad_id: int = 0
    """Token id of the padding after a window's last whole document (its targets are -100)."""
    shuffle: bool = False
    seed: int = 0
    packing: str = "in-order"
    lookahead: int = 1024
    """``"best-fit"``: how many pieces the buffer holds."""
    balance_cp: int = 1
    """With a ring (``cp > 1``, the 2D mesh's zigzag layout over ``balance_chunks`` chunks per
    rank): each window's pieces are put in the order, of ``arrangements`` candidates, that gives
    the busiest CP rank the least attention work (:meth:`arrangement`). 1: stream order."""
    balance_chunks: int = 1
    arrangements: int = 32

    def __post_init__(self) -> None:
        S, lengths = self.seq_len, np.asarray(self.doc_lengths, dtype=np.int64)
        if lengths.size == 0 or int(lengths.sum()) != len(self.tokens) or (lengths <= 0).any():
            raise DataError(f"--data holds {len(self.tokens)} tokens in {lengths.size} documents whose lengths "
                            f"do not add up to them (or a document is empty)")
        if self.packing not in PACKINGS:
            raise DataError(f"--pack-documents {self.packing!r}: choose one of {', '.join(PACKINGS)}")
        if self.lookahead < 1:
            raise DataError(f"the best-fit lookahead must be at least 1 piece, got {self.lookahead}")
        starts = np.cumsum(lengths) - lengths
        if self.packing == "split":   # cut at every document start and every multiple of S
            total = int(lengths.sum())
            self.piece_start = np.union1d(starts, np.arange(0, total, S))
            self.piece_len = np.diff(np.append(self.piece_start, total))
            self.order = np.arange(self.piece_start.size)
            self.first_piece = np.append(np.searchsorted(self.piece_start, np.arange(0, total, S)),
                                         self.piece_start.size)
        else:   # every document cut into S-token pieces (a document of at most S tokens is one piece)
            count = -(-lengths // S)
            doc = np.repeat(np.arange(lengths.size), count)
            k = np.arange(doc.size) - np.repeat(np.cumsum(count) - count, count)
            self.piece_start = starts[doc] + k * S
            self.piece_len = np.minimum(S, lengths[doc] - k * S)
            # in order is best fit with a buffer of one piece: next fit
            buffer = 1 if self.packing == "in-order" else self.lookahead
            self.order, self.first_piece = _best_fit(self.piece_len.tolist(), S, buffer)
        self.num_documents = int(lengths.size)
        self.mean_length = float(lengths.mean())
        self._owner: np.ndarray | None = None

    @property
    def num_windows(self) -> int:
        return len(self.first_piece) - 1

    window_of_sequence = Windows.window_of_sequence

    def arrangement(self, w: int) -> np.ndarray:
        """Window ``w``'s pieces in the order they are written (padding after them).

        Without a ring (``balance_cp == 1``): stream order. With one: of stream order and
        ``arrangements - 1`` permutations drawn from ``(seed, w)``, the one whose busiest CP rank (zigzag
        pieces over ``balance_chunks`` spans) has the least attention work under the document mask (the
        first of equals). It changes which rank computes what, not what is trained; deterministic.
        """
        pieces = self.order[self.first_piece[w]:self.first_piece[w + 1]]
        if self.balance_cp == 1 or pieces.size < 2:
            return pieces
        owner = self._cp_owner()
        rng = np.random.default_rng([self.seed, w])
        best, best_load = pieces, self._busiest(pieces, owner)
        for _ in range(self.arrangements - 1):
            cand = rng.permutation(pieces)
            load = self._busiest(cand, owner)
            if load < best_load:
                best, best_load = cand, load
        return best

    def _cp_owner(self) -> np.ndarray:
        """``[S]``: the CP rank holding each global token of a window."""
        if self._owner is None:
            from fpdt.layout import mesh_token_index
            cp, S = self.balance_cp, self.seq_len
            owner = np.empty(S, dtype=np.int64)
            for c in range(cp):
                owner[mesh_token_index(S, 1, cp, self.balance_chunks, c, 0).numpy()] = c
            self._owner = owner
        return self._owner

    def _segments(self, pieces: np.ndarray) -> np.ndarray:
        """The lengths of the documents a window of ``pieces`` (in this order) holds, as the
        model attends them: each piece, then the padding after them, if any, as one more."""
        n = self.piece_len[pieces]
        pad = self.seq_len - int(n.sum())
        return np.append(n, pad) if pad else n

    def _busiest(self, pieces: np.ndarray, owner: np.ndarray) -> float:
        """The most attention work (query-key pairs) any CP rank runs for this order of ``pieces``."""
        n = self._segments(pieces)
        keys = np.arange(self.seq_len) - np.repeat(np.cumsum(n) - n, n) + 1
        return float(np.bincount(owner, weights=keys, minlength=self.balance_cp).max())

    def attended_length(self, k: int) -> float:
        """The length the FLOPs formula's attention term takes for sequence ``k``: ``sum n_d^2 / S`` over
        the window's documents, the padding after the last counted as one more (as ``fpdt-plan
        --doc-len`` counts it); ``S`` for one document.
        """
        w = self.window_of_sequence(k)
        n = self._segments(self.order[self.first_piece[w]:self.first_piece[w + 1]]).astype(np.float64)
        return float((n * n).sum()) / self.seq_len

    def window(self, w: int) -> dict[str, np.ndarray]:
        """Window ``w``: ``input_ids``, ``labels`` (next-token targets, -100 at each document's last
        token and at the padding), ``position_ids`` (restarting per document) and ``doc_ids``
        (0, 1, ... per piece; the padding one more), each ``[S]`` int64."""
        S = self.seq_len
        ids = np.full(S, self.pad_id, dtype=np.int64)
        labels = np.full(S, IGNORE_INDEX, dtype=np.int64)
        pos = np.zeros(S, dtype=np.int64)
        docs = np.zeros(S, dtype=np.int64)
        at = 0
        for d, j in enumerate(self.arrangement(w).tolist()):
            start, n = int(self.piece_start[j]), int(self.piece_len[j])
            piece = np.asarray(self.tokens[start:start + n], dtype=np.int64)
            ids[at:at + n] = piece
            labels[at:at + n - 1] = piece[1:]
            pos[at:at + n] = np.arange(n)
            docs[at:at + n] = d
            at += n
        if at < S:                                 # padding: a document of its own that predicts nothing
            pos[at:] = np.arange(S - at)
            docs[at:] = docs[at - 1] + 1
        return {"input_ids": ids, "labels": labels, "position_ids": pos, "doc_ids": docs}

    def shard(self, ks: Iterable[int], sp: int, num_chunks: int, sp_rank: int,
              mesh: SequenceMesh | None = None) -> dict[str, torch.Tensor]:
        """:func:`fpdt.model.prepare_inputs` of sequences ``ks`` (targets shifted already): this rank's
        ``input_ids``, ``labels``, ``position_ids`` ``[B, S / P]`` (FPDT layout, or ``mesh``'s), and
        ``doc_ids`` ``[B, S]`` of the whole windows (what the model's attention takes)."""
        rows = [self.window(self.window_of_sequence(k)) for k in ks]
        batch = {name: torch.from_numpy(np.stack([r[name] for r in rows])) for name in rows[0]}
        return prepare_inputs(batch["input_ids"], labels=batch["labels"], position_ids=batch["position_ids"],
                              doc_ids=batch["doc_ids"], shift=False, sp_size=sp, rank=sp_rank, num_chunks=num_chunks,
                              mesh=mesh)

    def describe(self) -> str:
        """What the start-up line says about the data."""
        used = int(self.piece_len.sum())
        split = int((self.piece_len.size - self.num_documents))
        balance = f" balanced for cp={self.balance_cp}" if self.balance_cp > 1 else ""
        return (f"windows={self.num_windows} packed documents={self.num_documents} "
                f"mean_len={self.mean_length:.1f} continuations={split} "
                f"fill={100 * used / (self.num_windows * self.seq_len):.1f}% packing={self.packing}{balance}")


def _best_fit(piece_len: list[int], seq_len: int, lookahead: int) -> tuple[np.ndarray, np.ndarray]:
    """``(order, first)`` of windows filled from a buffer of the next ``lookahead`` pieces: the
    earliest piece opens the window, then the largest that fits (earliest of equals) until none
    does; each window's pieces in stream order. A function of the lengths alone; ``lookahead=1``
    is in-order next fit.
    """
    buffer: list[tuple[int, int]] = []       # (length, -index), sorted
    nxt, order, first = 0, [], [0]
    while nxt < len(piece_len) or buffer:
        while len(buffer) < lookahead and nxt < len(piece_len):
            bisect.insort(buffer, (piece_len[nxt], -nxt))
            nxt += 1
        oldest = max(range(len(buffer)), key=lambda i: buffer[i][1])   # the earliest piece opens the window
        n, neg = buffer.pop(oldest)
        room, members = seq_len - n, [-neg]
        if nxt < len(piece_len):
            bisect.insort(buffer, (piece_len[nxt], -nxt))
            nxt += 1
        while buffer:
            at = bisect.bisect_right(buffer, (room, 1)) - 1       # the largest length <= room
            if at < 0:
                break
            n, neg = buffer.pop(at)
            members.append(-neg)
            room -= n
            if nxt < len(piece_len):                              # keep the buffer full
                bisect.insort(buffer, (piece_len[nxt], -nxt))
                nxt += 1
        order += sorted(members)
        first.append(len(order))
    return np.asarray(order, dtype=np.int64), np.asarray(first, dtype=np.int64)


def sequence_ids(step: int, micro: int, grad_accum: int, dp_rank: int, dp: int, micro_batch: int) -> list[int]:
    """Sequence numbers read by DP group ``dp_rank`` at optimizer step ``step``, micro step ``micro``."""
    first = ((step * grad_accum + micro) * dp + dp_rank) * micro_batch
    return list(range(first, first + micro_batch))


# ----------------------------------------------------------------------------- sharding

def shard_windows(windows: torch.Tensor, sp: int, num_chunks: int, sp_rank: int,
                  mesh: SequenceMesh | None = None) -> dict[str, torch.Tensor]:
    """:func:`fpdt.model.prepare_inputs` of ``windows`` ``[B, S + 1]`` (``S`` inputs, their ``S`` targets):
    rank ``sp_rank``'s ``input_ids``, ``labels``, ``position_ids`` ``[B, S / P]`` in the FPDT layout
    (or this rank's in ``mesh``'s; ``sp``/``sp_rank`` then unused)."""
    return prepare_inputs(windows[:, :-1], labels=windows[:, 1:], shift=False, sp_size=sp, rank=sp_rank,
                          num_chunks=num_chunks, mesh=mesh)
