"""Training text for ``zeroinf train``: a corpus, a tokenizer, and deterministic batches.

The default corpus is the Python standard library found on this machine (its ``.py`` sources and
its ``.txt``/``.rst`` documentation files under ``sysconfig.get_paths()["stdlib"]``, without
``site-packages``), so the main job needs no download. ``--data PATH`` takes a ``.txt`` file, a
folder of text files, or a ``.jsonl`` file whose lines are objects with a ``"text"`` field.

Tokens are bytes (vocabulary 256) unless a local tokenizer folder is given.

Batches are a pure function of ``(seed, step, micro_step)``: the *global* batch of a micro-step
(``micro_batch * world_size`` rows) is drawn from its own generator, and rank ``r`` takes rows
``r * micro_batch .. (r + 1) * micro_batch``. So a resumed run sees the same batches as an
uninterrupted one, and N ranks with micro-batch b see the rows one rank sees with micro-batch N*b.
"""
from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np
import torch

__all__ = ["DataError", "ByteTokenizer", "corpus_files", "load_tokens", "Batches"]

#: file suffixes read from a folder given with --data, and from the standard library
TEXT_SUFFIXES = (".txt", ".py", ".rst", ".md")
_STDLIB_SUFFIXES = (".py", ".txt", ".rst")


class DataError(ValueError):
    """The training text cannot be used; the message starts with the offending path."""


class ByteTokenizer:
    """UTF-8 bytes as tokens: ``vocab_size`` 256, token id = byte value, no special tokens."""

    vocab_size = 256
    name = "bytes"

    def encode(self, text: str) -> np.ndarray:
        """Text -> uint8 array of its UTF-8 bytes (one token per byte)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids -> text; invalid UTF-8 sequences become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A tokenizer from a local Hugging Face folder (``tokenizer.json`` etc.); never downloads."""

    def __init__(self, folder: str):
        from transformers import AutoTokenizer
        if not os.path.isdir(folder):
            raise DataError(f"{folder}: --tokenizer must be a local tokenizer folder")
        try:
            self._tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise DataError(f"{folder}: cannot load a tokenizer from this folder ({exc})") from exc
        self.vocab_size = len(self._tok)
        self.name = folder

    def encode(self, text: str) -> np.ndarray:
        ids = self._tok(text, add_special_tokens=False)["input_ids"]
        dtype = np.uint16 if self.vocab_size <= 65536 else np.int32
        return np.asarray(ids, dtype=dtype)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def corpus_files(data: Optional[str] = None) -> List[Path]:
    """The files of the corpus, sorted, so every process and every run reads the same bytes.

    Args:
        data: ``None`` for the standard library corpus; else a ``.txt``/``.jsonl`` file or a folder
            (searched recursively for ``.txt``, ``.py``, ``.rst`` and ``.md`` files).

    Raises:
        DataError: the path does not exist, or holds no usable file.
    """
    if data is None:
        root = Path(sysconfig.get_paths()["stdlib"])
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__")]
            files += [Path(dirpath, f) for f in filenames if f.endswith(_STDLIB_SUFFIXES)]
        if not files:
            raise DataError(f"{root}: no standard library .py files found; pass --data PATH")
        return sorted(files)
    path = Path(data)
    if not path.exists():
        raise DataError(f"{data}: --data path does not exist")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
        if not files:
            raise DataError(f"{data}: folder holds no {'/'.join(TEXT_SUFFIXES)} files")
        return files
    return [path]


def _read_text(path: Path) -> str:
    if path.suffix == ".jsonl":
        parts = []
        # undecodable bytes become U+FFFD, as in .txt files (never a UnicodeDecodeError)
        with open(path, encoding="utf-8", errors="replace") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from exc
                if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                    raise DataError(f'{path}:{lineno}: each line needs a string field "text"')
                parts.append(rec["text"])
        return "\n".join(parts)
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror})") from exc


def load_tokens(data: Optional[str], tokenizer, min_tokens: int) -> torch.Tensor:
    """Read and tokenize the whole corpus into one flat int64 tensor.

    Args:
        data: see :func:`corpus_files`.
        tokenizer: :class:`ByteTokenizer` or :class:`HFTokenizer`.
        min_tokens: the fewest tokens a batch row needs (``seq_len + 1``).

    Returns:
        1-D tensor of token ids (int64 for a tokenizer, uint8 for bytes — callers index, then cast).

    Raises:
        DataError: naming the path when the corpus is missing, unreadable or shorter than
            ``min_tokens``.
    """
    files = corpus_files(data)
    if isinstance(tokenizer, ByteTokenizer) and all(f.suffix != ".jsonl" for f in files):
        chunks = []
        for f in files:
            try:
                chunks.append(np.fromfile(f, dtype=np.uint8))
            except OSError as exc:
                raise DataError(f"{f}: cannot read ({exc.strerror})") from exc
        ids = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    else:
        ids = np.concatenate([tokenizer.encode(_read_text(f)) for f in files])
    where = data if data is not None else "standard library corpus"
    if ids.size < min_tokens:
        raise DataError(f"{where}: {ids.size} tokens, fewer than one sequence needs ({min_tokens})")
    return torch.from_numpy(np.ascontiguousarray(ids))


class Batches:
    """Deterministic language-model batches over a flat token tensor.

    ``get(step, micro_step, rank, world_size)`` returns an int64 tensor of shape
    ``(micro_batch, seq_len)``: rows start at offsets drawn uniformly from
    ``[0, len(tokens) - seq_len)`` by ``numpy.random.default_rng([seed, step, micro_step])``.
    The labels of a causal LM are the inputs themselves (the model shifts them).
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int, micro_batch: int, seed: int):
        if seq_len < 1 or micro_batch < 1:
            raise ValueError(f"seq_len ({seq_len}) and micro_batch ({micro_batch}) must be >= 1")
        if tokens.numel() <= seq_len:
            raise DataError(f"corpus of {tokens.numel()} tokens is shorter than seq_len {seq_len} + 1")
        self.tokens, self.seq_len, self.micro_batch, self.seed = tokens, seq_len, micro_batch, seed

    def global_offsets(self, step: int, micro_step: int, world_size: int) -> np.ndarray:
        """Row start offsets of the whole micro-step over all ranks, shape ``(micro_batch*world_size,)``."""
        rng = np.random.default_rng([self.seed, step, micro_step])
        return rng.integers(0, self.tokens.numel() - self.seq_len, size=self.micro_batch * world_size)

    def get(self, step: int, micro_step: int, rank: int = 0, world_size: int = 1,
            rows: Optional[slice] = None) -> torch.Tensor:
        """Input ids for ``rank`` at 1-based ``step``, 0-based ``micro_step``: ``(micro_batch, seq_len)``.

        ``rows`` overrides the rank's slice of the global batch (the single-process reference of a
        multi-rank run takes ``slice(None)``, all rows).
        """
        offs = self.global_offsets(step, micro_step, world_size)
        sel = offs[rows] if rows is not None else offs[rank * self.micro_batch:(rank + 1) * self.micro_batch]
        return torch.stack([self.tokens[o:o + self.seq_len] for o in sel.tolist()]).long()
