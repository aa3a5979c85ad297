"""Tokenized corpus (cached) and the training / validation streams built from it."""
from __future__ import annotations

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write
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
        def write(tmp):
            with open(tmp, "wb") as f:  # a file object: given a name, numpy would add ".npz" to it
                np.savez_compressed(f, **arrays)
        atomic_write(path, write, "token cache")
    train, val = [], []
    with np.load(path) as z:
        for b in range(len(z.files) // 2):
            ids, lens = z[f"b{b}_ids"].astype(np.int32), z[f"b{b}_lens"]
            paras = np.split(ids, np.cumsum(lens)[:-1])
            cut = int(len(paras) * (1 - VAL_FRACTION))
            train.append(paras[:cut])
            val.append(paras[cut:])
    return train, val


# TaskBuilder.repeated_words, .shuffled_chunks, half each, or text whose copied passages are random words
RAND_LAYOUTS = ("repeat", "chunks", "mix", "text")


class Stream:
    """Random training sequences. p_rand of them are one passage of random words (T/64 to T/2
    tokens, log-uniform) repeated to the end (rand_layout "repeat"), or followed by runs of it
    taken from random places ("chunks"), or either ("mix"): pure induction training, nothing else
    predicts the repeats; or ("text") text whose copied passages are random words, the same copying
    amid text (a model trained on pure random-word sequences copies there and not in text). The others are text with tasks put in: in p_long of them one long passage (T/8 to
    5T/16 tokens) appears twice; in the others 1..max_copy passages (up to 32-384 tokens, at most
    half the sequence in all) do; p_kv of them also carry 2..max_kv key-value records, as many as
    fit in what the copies leave of 3/4 of the sequence. First parts go anywhere in the first half,
    second parts after. At T = 2048 repeats make up ~20% of those tokens (a first recipe with one
    short passage in 70% of sequences, ~3% of the tokens, learned no copying after 2.5M tokens)."""

    KV_ROOM = 48  # tokens a key-value record takes, both mentions with separators (at most ~44)

    def __init__(self, builder: TaskBuilder, T: int, seed: int, p_long: float = 0.35, max_copy: int = 3,
                 p_kv: float = 0.6, max_kv: int = 8, p_rand: float = 0.0, rand_layout: str = "repeat"):
        if not 0 <= p_rand <= 1:
            raise SparqError(f"the fraction of random-word sequences must be in [0, 1], not {p_rand}")
        if rand_layout not in RAND_LAYOUTS:
            raise SparqError(f"random-word layout must be one of {', '.join(RAND_LAYOUTS)}, not {rand_layout!r}")
        self.rand_layout = rand_layout
        self.builder, self.T = builder, T
        self.rng = np.random.default_rng(seed)
        self.p_long, self.max_copy, self.p_kv, self.max_kv, self.p_rand = p_long, max_copy, p_kv, max_kv, p_rand

    def next(self) -> Sample:
        r, T = self.rng, self.T
        in_text = False
        if r.random() < self.p_rand:
            span = (max(2, T // 64), T // 2)
            if self.rand_layout == "text":
                in_text = True
            elif self.rand_layout == "chunks" or (self.rand_layout == "mix" and r.random() < 0.5):
                return self.builder.shuffled_chunks(r, T, span)
            else:
                return self.builder.repeated_words(r, T, span)
        if r.random() < self.p_long:
            n_copy, lo, hi = 1, T // 8, 5 * T // 16
        else:
            n_copy = int(r.integers(1, self.max_copy + 1))
            hi = min(384, T // (4 * n_copy))
            lo = min(32, hi // 2)
        room = (3 * T // 4 - 1 - 2 * n_copy * (hi + 2)) // self.KV_ROOM
        n_kv = min(int(r.integers(2, self.max_kv + 1)), max(room, 0)) if r.random() < self.p_kv else 0
        return self.builder.sample(r, T, copy=n_copy, n_kv=n_kv, early=(0.0, 0.5), late=(0.55, 1.0),
                                   copy_len=(lo, hi), random_words=in_text)

    def batch(self, n: int) -> np.ndarray:
        return np.stack([self.next().tokens for _ in range(n)])


def eval_samples(builder: TaskBuilder, T: int, n: int, seed: int = 1234, random_words: bool = False) -> list[Sample]:
    """Held-out long-range task sequences: one copied passage of T/32..5T/64 tokens and 4 key-value
    records (fewer below T = 512), first parts in the first 20%, second parts in the last 15%, so
    every lookup spans more than 60% of T (over 1.2k tokens at T = 2048). random_words: the passage
    is random words (kinds rand_*), a probe of induction on its own."""
    rng = np.random.default_rng(seed)
    return [builder.sample(rng, T, copy=1, n_kv=min(4, T // 128), early=(0.0, 0.2), late=(0.85, 1.0),
                           copy_len=(T // 32, 5 * T // 64), random_words=random_words) for _ in range(n)]


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

