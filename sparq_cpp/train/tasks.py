"""Training and evaluation sequences: corpus text with synthetic long-range tasks put in.

Every sequence is real text (whole paragraphs, in order) with task paragraphs put in at paragraph
boundaries, so llama.cpp tokenizes the decoded text to the same ids:
- copy: a passage from elsewhere in the corpus appears early and again late; the second copy is
  predictable only by finding the first (an induction head's job);
- key-value: sentences such as "Vorilane lives at number 482." early, the same sentences again
  late in another order; the value is predictable only by looking the key up;
- random words: a passage of common words drawn uniformly at random, repeated; nothing but copying
  predicts the repeats, a far stronger signal for forming induction heads than repeated text (which
  the language model partly predicts anyway). Either put in text like copy, or a whole sequence of
  one passage repeated (`repeated_words`, training only).
Spans record which targets belong to which task, so accuracy is measured on exactly those tokens.
Numpy only: the accuracy tests can build the same sequences for llama.cpp without torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.tokenizer import WORDS as COMMON_WORDS

NL = 0x0A + 3  # the byte token <0x0A>: ids 3..258 are bytes in sparq_cpp.tokenizer's layout

_SYLLABLES = ("ba be bi bo da de di do fa fe fi ka ke ki ko la le li lo ma me mi mo na ne ni no "
              "pa pe pi po ra re ri ro sa se si so ta te ti to va ve vi vo za ze").split()
_WORDS = ("garden river window silver candle letter orange castle winter meadow basket thunder "
          "pepper marble harbor lantern velvet crystal copper saddle violet anchor feather timber").split()
_TEMPLATES = ("{key} lives at number {value}.", "The password of {key} is {value}.",
              "{key} was born in the year {value}.", "The favourite word of {key} is {value}.")


def random_name(rng: np.random.Generator) -> str:
    """A made-up name of 2-3 syllables, e.g. "Dekedi": the keys of the key-value tasks."""
    return "".join(rng.choice(_SYLLABLES, size=rng.integers(2, 4))).capitalize()


@dataclass
class Sample:
    tokens: np.ndarray                      # int32, length T, starting with BOS
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (kind, start, end) of targets


class TaskBuilder:
    """Builds sequences of exactly T tokens from tokenized paragraphs.

    paragraphs: one list of int32 arrays per book (each array one paragraph, no separators);
    encode: text -> token ids (the same tokenizer); bos_id: the BOS token.
    """

    def __init__(self, paragraphs: list[list[np.ndarray]], encode: Callable[[str], np.ndarray],
                 bos_id: int = 1, rand_vocab: tuple[int, int] | None = None, rand_text: bool = False):
        self.books = [b for b in paragraphs if b]
        self.encode, self.bos_id = encode, bos_id
        self._sep = np.array([NL, NL], np.int32)
        # words that are one token after a space; no piece spans a space, so a run of them is
        # tokenized back to the same ids
        words = (encode(" " + w) for w in COMMON_WORDS.split())
        self.word_ids = np.array(sorted({int(t[0]) for t in words if len(t) == 1}), np.int32)
        if rand_vocab is not None and not 2 <= rand_vocab[0] <= rand_vocab[1] <= len(self.word_ids):
            raise SparqError(f"random-word vocabulary sizes must be in [2, {len(self.word_ids)}], not {rand_vocab}")
        self.rand_vocab = rand_vocab
        self.rand_text = rand_text

    # ---- pieces ---------------------------------------------------------------------------

    def _key(self, rng) -> str:
        return random_name(rng)

    def _record(self, rng) -> tuple[np.ndarray, int, int]:
        """One key-value sentence: (tokens, value start, value end)."""
        template = _TEMPLATES[rng.integers(len(_TEMPLATES))]
        if "number" in template or "year" in template:
            value = str(rng.integers(100, 2000))
        else:
            value = str(rng.choice(_WORDS))
        key = self._key(rng)
        text = template.format(key=key, value=value)
        head = template.split("{value}")[0].format(key=key)
        toks, head_toks, bare = self.encode(text), self.encode(head.rstrip()), self.encode(text[:-1])
        # tokens never merge across the space before the value or into the final ".", so the
        # head and the sentence without its "." are prefixes of the whole
        assert np.array_equal(toks[:len(head_toks)], head_toks), text
        assert np.array_equal(toks[:len(bare)], bare), text
        return toks, len(head_toks), len(bare)

    def _passage(self, rng, lo: int, hi: int) -> np.ndarray:
        """lo..hi tokens of consecutive whole paragraphs (the last one cut), from a random place."""
        n = int(rng.integers(lo, hi + 1))
        book = self.books[rng.integers(len(self.books))]
        i, parts, total = int(rng.integers(len(book))), [], 0
        while total < n:
            p = book[i % len(book)]
            parts += [p, self._sep] if total + len(p) < n else [p]
            total += len(p) + 2
            i += 1
        return np.concatenate(parts)[:n]

    def _words(self, rng, lo: int, hi: int) -> np.ndarray:
        """lo..hi common words drawn uniformly at random (one token each); with rand_vocab, from a random
        subset of them (its size log-uniform in rand_vocab): few distinct words make one word's
        earlier occurrences ambiguous, so copying has to match several words back, as in text."""
        if self.rand_text:  # passages of text instead: its common tokens recur, as they do in the text tasks
            return self._passage(rng, lo, hi)
        words = self.word_ids
        if self.rand_vocab is not None:
            lo_v, hi_v = self.rand_vocab
            v = int(np.exp(rng.uniform(np.log(lo_v), np.log(hi_v + 1))))
            words = rng.choice(words, size=min(v, len(words)), replace=False)
        return rng.choice(words, size=int(rng.integers(lo, hi + 1)))

    def _body(self, rng, n: int) -> tuple[np.ndarray, list[int]]:
        """n tokens of consecutive paragraphs and the offsets where paragraphs start."""
        book = self.books[rng.integers(len(self.books))]
        i = rng.integers(len(book))
        parts, starts, total = [], [], 0
        while total < n:
            starts.append(total)
            p = book[i % len(book)]
            parts += [p, self._sep]
            total += len(p) + 2
            i += 1
        return np.concatenate(parts)[:n], [s for s in starts if 0 < s < n]

    # ---- sequences ------------------------------------------------------------------------

    def repeated_words(self, rng: np.random.Generator, T: int, span: tuple[int, int]) -> Sample:
        """T tokens: BOS, then one passage of random words (length log-uniform in span) again and
        again, back to back, the last one cut. No separator between the copies: with one (a blank
        line) a 4-layer model learns to count from it, a positional shortcut that finds nothing in
        text."""
        n = int(np.exp(rng.uniform(np.log(span[0]), np.log(span[1] + 1))))
        p = self._words(rng, n, n)
        reps = -(-(T - 1) // n)
        tokens = np.concatenate([[self.bos_id], np.tile(p, reps)[:T - 1]]).astype(np.int32)
        spans = [("rand_first" if i == 0 else "rand_repeat", 1 + i * n + (i == 0), min(1 + (i + 1) * n, T))
                 for i in range(reps)]
        return Sample(tokens, [sp for sp in spans if sp[1] < sp[2]])

    def shuffled_chunks(self, rng: np.random.Generator, T: int, span: tuple[int, int],
                        run: tuple[int, int] = (2, 16)) -> Sample:
        """T tokens: BOS, one passage of random words (length log-uniform in span), then runs of
        `run` consecutive words of it, each from a random place, back to back to the end. Each run's
        first word is a guess; the rest are predictable only by finding the current word earlier and
        copying its successor (an induction head), at an offset that changes with every run, so no
        head that looks a fixed distance back can do it (back-to-back repeats of one passage teach
        such heads first)."""
        n = max(run[1], int(np.exp(rng.uniform(np.log(span[0]), np.log(span[1] + 1)))))
        p = self._words(rng, n, n)
        parts, spans, cursor = [np.array([self.bos_id], np.int32), p], [("rand_first", 2, 1 + n)], 1 + n
        while cursor < T:
            L = int(rng.integers(run[0], run[1] + 1))
            s = int(rng.integers(0, n - L + 1))
            parts.append(p[s:s + L])
            spans.append(("rand_repeat", cursor + 1, min(cursor + L, T)))
            cursor += L
        tokens = np.concatenate(parts)[:T].astype(np.int32)
        return Sample(tokens, [sp for sp in spans if sp[1] < sp[2]])

    def sample(self, rng: np.random.Generator, T: int, *, copy: int = 0, n_kv: int = 0,
               early: tuple[float, float] = (0.0, 0.5), late: tuple[float, float] = (0.6, 1.0),
               copy_len: tuple[int, int] = (24, 160), random_words: bool = False) -> Sample:
        """A sequence of T tokens: text with `copy` copied passages and `n_kv` key-value records,
        their first parts put in at paragraph boundaries in the `early` fraction of the text and
        their second parts in the `late` fraction (fractions of the text before anything is put in).
        random_words: the copied passages are random words (kinds rand_*)."""
        first, second = [], []  # (tokens, [(kind, start, end) relative to tokens])
        kind = "rand" if random_words else "copy"
        for _ in range(int(copy)):
            p = self._words(rng, *copy_len) if random_words else self._passage(rng, *copy_len)
            first.append((p, [(f"{kind}_first", 1, len(p))]))
            second.append((p, [(f"{kind}_repeat", 1, len(p))]))
        records = [self._record(rng) for _ in range(n_kv)]
        for toks, s, e in records:
            first.append((toks, [("kv_first", s, e)]))
        for j in rng.permutation(n_kv):
            toks, s, e = records[j]
            second.append((toks, [("kv_value", s, e)]))
        inserted = sum(len(t) + 2 for t, _ in first + second)
        n_body = T - 1 - inserted
        if n_body < T // 4:
            raise SparqError(f"tasks take {inserted} of {T} tokens; use a longer sequence (--ctx)")
        body, starts = self._body(rng, n_body)
        places = self._places(rng, starts, n_body, early, len(first)) + \
            self._places(rng, starts, n_body, late, len(second))
        out, spans, pos = [np.array([self.bos_id], np.int32)], [], 0
        cursor = 1
        for at, (toks, rel) in sorted(zip(places, first + second), key=lambda x: x[0]):
            out.append(body[pos:at])
            cursor += at - pos
            pos = at
            spans += [(k, cursor + s, cursor + e) for k, s, e in rel]
            out += [toks, self._sep]
            cursor += len(toks) + 2
        out.append(body[pos:])
        tokens = np.concatenate(out).astype(np.int32)
        assert len(tokens) == T
        return Sample(tokens, spans)

    @staticmethod
    def _places(rng, starts: list[int], n: int, frac: tuple[float, float], count: int) -> list[int]:
        """count paragraph starts in [frac0*n, frac1*n), in order (or the nearest ones)."""
        if count == 0:
            return []
        lo, hi = int(frac[0] * n), int(frac[1] * n)
        inside = [s for s in starts if lo <= s < hi] or [min(starts or [lo], key=lambda s: abs(s - lo))]
        return sorted(int(x) for x in rng.choice(inside, size=count, replace=True))


# ---- scoring ----------------------------------------------------------------------------------

def score(sample: Sample, logits: np.ndarray) -> dict[str, tuple[int, int]]:
    """{kind: (correct, total)} with greedy predictions from logits (T, vocab) of sample.tokens.

    Copy kinds (copy_*, rand_*) count tokens; kv kinds count values, correct only when every token is right.
    """
    pred = np.argmax(logits, axis=-1)
    out: dict[str, list[int]] = {}
    for kind, s, e in sample.spans:
        hit = pred[s - 1:e - 1] == sample.tokens[s:e]  # logits at t predict token t+1
        c = out.setdefault(kind, [0, 0])
        if kind.startswith(("copy", "rand")):
            c[0] += int(hit.sum())
            c[1] += len(hit)
        else:
            c[0] += int(hit.all())
            c[1] += 1
    return {k: (v[0], v[1]) for k, v in out.items()}


def merge(results: list[dict[str, tuple[int, int]]]) -> dict[str, float]:
    """Accuracy per kind over many samples."""
    tot: dict[str, list[int]] = {}
    for r in results:
        for k, (c, n) in r.items():
            t = tot.setdefault(k, [0, 0])
            t[0] += c
            t[1] += n
    return {k: c / n for k, (c, n) in sorted(tot.items()) if n}
