"""The project's SPM vocabulary (sparq_cpp.tokenizer), tokenized by llama.cpp itself.

Training and inference must split text identically, so rather than reimplementing llama.cpp's SPM
merge rules, training tokenizes with llama.cpp: a one-layer synthetic model carrying the vocabulary
is written once and loaded vocab-only.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from sparq_cpp import lazy
from sparq_cpp.modelfactory import write_model
from sparq_cpp.tokenizer import BOS_ID, EOS_ID, build_vocab


class Tokenizer:
    def __init__(self, n_vocab: int):
        llama_cpp = lazy.llama_cpp()
        self.n_vocab = n_vocab
        self.vocab = build_vocab(n_vocab)
        self.bos_id, self.eos_id = BOS_ID, EOS_ID
        with tempfile.TemporaryDirectory() as tmp:
            path = write_model(Path(tmp) / "vocab.gguf", "tiny", layers=1, n_vocab=n_vocab,
                               n_embd=32, n_head=1, n_head_kv=1, n_ff=32)
            self._llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of text, no BOS."""
        ids = self._llm.tokenize(text.encode("utf-8"), add_bos=False, special=False)
        return np.asarray(ids, np.int32)

    def decode(self, ids) -> str:
        return self._llm.detokenize([int(i) for i in ids]).decode("utf-8", errors="replace")
