"""The committed demo model (models/austen.q8_0.gguf): it loads, writes text like its training text,
and looks keys up over a long context. llama.cpp only: no torch needed."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from texts import AUSTEN

DEMO = Path(__file__).resolve().parents[1] / "models" / "austen.q8_0.gguf"

needs_demo = pytest.mark.skipif(not DEMO.is_file(), reason=f"{DEMO.name} is not in this checkout")


def _demo():
    from sparq_cpp.llm import open_model

    return open_model(DEMO, n_ctx=2048, n_threads=2, cache_type="f32")


@pytest.mark.build
@needs_demo
def test_demo_model_writes_text_like_its_training_text():
    from sparq_cpp.tokenizer import _WORDS

    llm, summary = _demo()
    try:
        assert summary.head_dim == 128
        text = llm(AUSTEN[:600], max_tokens=96, temperature=0.0)["choices"][0]["text"]
    finally:
        llm.close()
    words = [w.lower() for w in re.findall(r"[A-Za-z]+", text)]
    assert len(words) >= 20, text
    # 64% of the words of held-out Austen text are in the tokenizer's common-word list; noise is ~0%
    common = sum(w in set(_WORDS.split()) for w in words) / len(words)
    assert common > 0.45, (common, text)
    assert all(c.isprintable() or c == "\n" for c in text), text


@pytest.mark.build
@needs_demo
def test_demo_model_looks_keys_up_across_1k_tokens():
    records = [("Vorilane lives at number", " 482"), ("The password of Dekedi is", " candle"),
               ("Piva was born in the year", " 937"), ("The favourite word of Sotama is", " anchor")]
    facts = "".join(f"{k}{v}.\n\n" for k, v in records)
    filler = AUSTEN * 4  # ~1.2k tokens between each fact and its question
    llm, _ = _demo()
    try:
        hits = []
        for k, v in records[::-1]:
            prompt = AUSTEN[:300] + facts + filler + k
            assert len(llm.tokenize(prompt.encode())) > 1200
            hits.append(llm(prompt, max_tokens=4, temperature=0.0)["choices"][0]["text"].startswith(v))
    finally:
        llm.close()
    assert sum(hits) >= 3, hits


def test_default_model_is_the_demo_model_when_installed(tmp_path, monkeypatch):
    """generate and eval without --gguf: the committed demo model, or, where an install lacks it, the
    synthetic model, and the message says which."""
    from sparq_cpp import demo_model

    fake = tmp_path / "austen.q8_0.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setattr(demo_model, "DEMO_MODEL", fake)
    said = []
    assert demo_model.default_model(said.append) == fake and "demo model austen.q8_0.gguf" in said[0]
    monkeypatch.setattr(demo_model, "DEMO_MODEL", tmp_path / "missing.gguf")
    synthetic = demo_model.default_model(said.append)
    assert synthetic.suffix == ".gguf" and synthetic != fake and "synthetic model" in said[1]
