"""Measure a converted model through llama.cpp and write its model card (JSON)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sparq_cpp.outfile import atomic_write
from sparq_cpp.train import corpus, data
from sparq_cpp.train.gguf_eval import GGUFScorer
from sparq_cpp.train.tasks import TaskBuilder
from sparq_cpp.train.tokenize import Tokenizer

EVAL_NOTE = ("validation loss: mean next-token cross-entropy (nats/token) over n plain-text windows of "
             "ctx tokens from the held-out last 5% of each novel; task accuracy: greedy, teacher-forced, "
             "on n held-out sequences of ctx tokens (held-out text, one copied passage of 64-160 tokens "
             "and 4 key-value sentences, first parts in the first 20%, second parts in the last 15%): "
             "copy_repeat = tokens of the second copy predicted right (copy_first: the same tokens at "
             "their first occurrence, for reference), kv_value = values predicted entirely right "
             "(kv_first: the same values at their first mention, i.e. guessing); random_word_copy: the same "
             "sequences with a passage of random common words as the copied passage (rand_repeat: its second "
             "occurrence, over 60% of ctx after the first; rand_first: the first, i.e. guessing)")


def measure(gguf_path, *, ctx: int = 2048, n_eval: int = 16, threads: int = 1, deb=None) -> dict:
    scorer = GGUFScorer(gguf_path, n_ctx=ctx + 1, n_threads=threads)
    try:
        tok = Tokenizer(scorer.summary.n_vocab)
        _, val_books = data.tokenized_books(tok, deb)
        windows = data.text_windows(val_books, ctx + 1, n_eval)
        builder = TaskBuilder(val_books, tok.encode, tok.bos_id)
        samples = data.eval_samples(builder, ctx, n_eval)
        words = data.eval_samples(builder, ctx, n_eval, random_words=True)
        return {"ctx": ctx, "n": n_eval, "val_loss": round(scorer.val_loss(windows), 4),
                "task_accuracy": {k: round(v, 4) for k, v in scorer.task_accuracy(samples).items()},
                "random_word_copy": {k: round(v, 4) for k, v in scorer.task_accuracy(words).items()
                                     if k.startswith("rand")}}
    finally:
        scorer.close()


def write_card(path, gguf_path, result: dict, ckpt=None) -> None:
    gguf_path = Path(gguf_path)
    card = {"model": gguf_path.name, "sha256": hashlib.sha256(gguf_path.read_bytes()).hexdigest(),
            "data": corpus.SOURCE, "licence": "text: public domain; packaging: MIT (janeaustenr)",
            "fetch_command": f"apt-get download {corpus.PACKAGE}={corpus.VERSION}",
            "llama_cpp": result, "eval_note": EVAL_NOTE}
    if ckpt is not None:
        training = json.loads((Path(ckpt) / "training.json").read_text())
        card.update(training_command=training["command"], training_args=training["args"],
                    n_params=training["n_params"], training_history=training["history"],
                    training_init=training.get("init"))
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(card, indent=2) + "\n"), "--card", make_parents=True)
