"""Tokenized corpus (cached) and the training / validation streams built from it."""
from __future__ import annotations

import numpy as np

from sparq_cpp.train import corpus
from sparq_cpp.tokenizer import BOS_ID
from sparq_cpp.train.tasks import NL, Sample, TaskBuilder
from sparq_cpp.train.tokenize import Tokenizer

VAL_FRACTION = 0.05


def _cache_path(n_vocab: int):
    return corpus.cache_dir() / f"austen-v{n_vocab}-{corpus.DEB_SHA256[:12]}.npz"


def tokenized_books(tok: Tokenizer, deb=None) -> tuple[list[list[np.ndarray]], list[list[np.ndarray]]]:
    """(train, val): per book, its paragraphs as token arrays; the last VAL_FRACTION of each book's
    paragraphs are validation. Paragraphs are tokenized one at a time: no token spans a newline in
    this vocabulary, so that is the same as tokenizing the whole text."""
    path = _cache_path(tok.n_vocab)
    if not path.is_file():
        arrays = {}
        for b, text in enumerate(corpus.load_novels(deb).values()):
            paras = [tok.encode(p) for p in text.split("\n\n") if p.strip()]
            arrays[f"b{b}_lens"] = np.array([len(p) for p in paras], np.int64)
            arrays[f"b{b}_ids"] = np.concatenate(paras).astype(np.int16)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez_compressed(tmp, **arrays)
        tmp.replace(path)
    train, val = [], []
    with np.load(path) as z:
        for b in range(len(z.files) // 2):
            ids, lens = z[f"b{b}_ids"].astype(np.int32), z[f"b{b}_lens"]
            paras = np.split(ids, np.cumsum(lens)[:-1])
            cut = int(len(paras) * (1 - VAL_FRACTION))
            train.append(paras[:cut])
            val.append(paras[cut:])
    return train, val


class Stream:
    """Random training sequences, text with tasks put in. In p_long of them one long passage
    (T/8 to 5T/16 tokens) appears twice; in the others 1..max_copy passages (32-384 tokens, at most
    half the sequence in all) do; p_kv of all sequences also carry 2..max_kv key-value records.
    First parts go anywhere in the first half, second parts after. Repeats make up ~20% of the
    tokens: enough that predicting them by look-up pays off early (a first run with one short
    passage in 70% of sequences, ~3% of the tokens, had learned no copying after 2.5M tokens)."""

    def __init__(self, builder: TaskBuilder, T: int, seed: int, p_long: float = 0.35, max_copy: int = 3,
                 p_kv: float = 0.6, max_kv: int = 8):
        self.builder, self.T = builder, T
        self.rng = np.random.default_rng(seed)
        self.p_long, self.max_copy, self.p_kv, self.max_kv = p_long, max_copy, p_kv, max_kv

    def next(self) -> Sample:
        r = self.rng
        n_kv = int(r.integers(2, self.max_kv + 1)) if r.random() < self.p_kv else 0
        if r.random() < self.p_long:
            n_copy, lo, hi = 1, self.T // 8, 5 * self.T // 16
        else:
            n_copy = int(r.integers(1, self.max_copy + 1))
            lo, hi = 32, min(384, self.T // (4 * n_copy))
        return self.builder.sample(r, self.T, copy=n_copy, n_kv=n_kv, early=(0.0, 0.5), late=(0.55, 1.0),
                                   copy_len=(lo, hi))

    def batch(self, n: int) -> np.ndarray:
        return np.stack([self.next().tokens for _ in range(n)])


def eval_samples(builder: TaskBuilder, T: int, n: int, seed: int = 1234) -> list[Sample]:
    """Held-out long-range task sequences: first parts in the first 20%, second parts in the last
    15%, so every lookup spans more than 60% of T (over 1.2k tokens at T = 2048)."""
    rng = np.random.default_rng(seed)
    return [builder.sample(rng, T, copy=1, n_kv=4, early=(0.0, 0.2), late=(0.85, 1.0),
                           copy_len=(64, 160)) for _ in range(n)]


def text_windows(books: list[list[np.ndarray]], T: int, n: int, seed: int = 99) -> np.ndarray:
    """n plain-text windows of T tokens (BOS first) for validation loss."""
    rng = np.random.default_rng(seed)
    sep = np.array([NL, NL], np.int32)
    flat = [np.concatenate([x for p in book for x in (p, sep)]) for book in books]
    out = []
    for i in range(n):
        ids = flat[i % len(flat)]
        if len(ids) < T:
            raise ValueError(f"validation text of a book is shorter than T = {T}")
        s = int(rng.integers(0, len(ids) - T + 2))
        out.append(np.concatenate([[BOS_ID], ids[s:s + T - 1]]))
    return np.stack(out).astype(np.int32)

