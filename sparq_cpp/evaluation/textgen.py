"""Default data, generated so that `sparq-cpp eval` works with no files: English-like prose (the
synthetic tokenizer's common words in simple sentences), a needle file and key-value pairs.

Deterministic for a seed. Real text (your own corpus, Tiny Shakespeare, essays) gives meaningful
scores on a real model; these only exercise the tasks.
"""
from __future__ import annotations

import uuid

import numpy as np

from sparq_cpp.tokenizer import WORDS

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
QUESTION = "What is the best thing to do in San Francisco?"
ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day"
ANSWER_PREFIX = "The best thing to do in San Francisco is"


def prose(n_chars: int, seed: int = 0) -> str:
    """Paragraphs of 3-7 sentences of 5-14 words, Zipf-weighted, at least n_chars long."""
    rng = np.random.default_rng(seed)
    words = WORDS.split()
    p = 1.0 / np.arange(1, len(words) + 1) ** 0.9
    p /= p.sum()
    out, size = [], 0
    while size < n_chars:
        sentences = []
        for _ in range(rng.integers(3, 8)):
            ws = [words[i] for i in rng.choice(len(words), size=rng.integers(5, 15), p=p)]
            sentences.append(" ".join(ws).capitalize() + rng.choice([".", ".", ".", "?", "!"]))
        para = " ".join(sentences)
        out.append(para)
        size += len(para) + 2
    return "\n\n".join(out) + "\n"


def needle_file(seed: int = 0, n_chars: int = 60_000) -> str:
    """A needle task file in the format evaluation.tasks documents."""
    return (f"needle: {NEEDLE}\nquestion: {QUESTION}\nanswer: {ANSWER}\nanswer_prefix: {ANSWER_PREFIX}\n---\n"
            + prose(n_chars, seed))


def kv_pairs_file(n: int = 2000, seed: int = 0) -> str:
    """n lines `key<TAB>value` of random UUIDs, as in the key-value retrieval task of Liu et al. (2023)."""
    rng = np.random.default_rng(seed)

    def uid():
        return str(uuid.UUID(bytes=rng.bytes(16), version=4))
    return "".join(f"{uid()}\t{uid()}\n" for _ in range(n))


PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


def passkey_file(key: str = "71432", repeats: int = 400) -> str:
    """Passkey retrieval (Mohtashami and Jaggi, 2023) in the needle task's file format: the key in a
    haystack of one repeated filler paragraph (~22 tokens per repeat for a BPE vocabulary; 400
    repeats hold 8k tokens). Nothing in the haystack hints at the key."""
    return (f"needle: The pass key is {key}. Remember it. {key} is the pass key.\n"
            "question: What is the pass key?\n"
            f"answer: {key}\n"
            "answer_prefix: The pass key is\n"
            "---\n" + " ".join([PASSKEY_FILLER] * repeats) + "\n")
