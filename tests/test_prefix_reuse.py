"""The same request twice gives the same text at temperature 0, in every mode: llama-cpp-python reuses the cached
prompt and re-evaluates only its last token, which sparq_cpp.Llama evaluates with the 63 tokens before it as one
batch: a lone token would be a sparse decode step, and in a SparQ or Loki context a batch of fewer than 64 rows
computes its last row otherwise than the prompt batch did (this prompt: SparQ's text changed with 2 tokens)."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp import ALISA, Dense, Llama, Loki, SparQ  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "austen.q8_0.gguf"
PROJECTION = REPO / "models" / "austen.loki.gguf"
PROMPT = (REPO / "models" / "README.md").read_text()[:1500]  # not Austen: the sparse settings lose something here

MODES = {
    "dense": Dense(),
    "sparq": SparQ(r=16, k=32),
    "loki": Loki(d=16, k=32, projection=str(PROJECTION)),
    "alisa": ALISA(c=0.125),
}


@pytest.mark.parametrize("mode", MODES)
def test_same_request_same_text_with_a_cached_prompt(mode):
    llm = Llama(str(MODEL), attention=MODES[mode], n_ctx=2048, n_threads=1)
    texts = [llm(PROMPT, max_tokens=24, temperature=0)["choices"][0]["text"] for _ in range(3)]
    assert texts[1] == texts[0] and texts[2] == texts[0], texts
    # and a longer prompt that extends the cached one (several new tokens: a batch anyway)
    longer = llm(PROMPT + " and then", max_tokens=8, temperature=0)["choices"][0]["text"]
    fresh = Llama(str(MODEL), attention=MODES[mode], n_ctx=2048, n_threads=1)
    assert fresh(PROMPT + " and then", max_tokens=8, temperature=0)["choices"][0]["text"] == longer
