"""Verification batches: the rows of a sequence with a few tokens in a ubatch that all ask for their logits
(a speculative draft being checked) attend sparsely, each to the cells it sees, and give the logits that
decoding those tokens one at a time gives. A sequence with more tokens, or with rows that ask for no
logits (a prompt, or the end of one), attends densely."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp import Dense, Loki, SparQ  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from llama_session import Session  # noqa: E402

# the largest number of tokens of one sequence in a ubatch that still decodes sparsely
DECODE_MAX_TOKENS = 16
# one row in a matrix product of several differs from the row alone in the last bits
TOL = {"f32": 1e-5, "f16": 1e-4, "q8_0": 1e-4}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("verify") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=7)


@pytest.fixture(scope="module")
def projection(model, tmp_path_factory):
    from conftest import calibrated_projection

    return calibrated_projection(model, tmp_path_factory.mktemp("verify-loki"))


def tokens(n, seed):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


def rel(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / np.abs(b).max())


def one_by_one(path, att, prompt, draft, cache_type):
    with Session(path, att, cache_type=cache_type) as s:
        s.prompt(prompt)
        return s.steps(draft, pos0=len(prompt))


def batched(path, att, prompt, draft, cache_type):
    with Session(path, att, cache_type=cache_type) as s:
        s.prompt(prompt)
        return s.decode([(t, len(prompt) + i, 0, True) for i, t in enumerate(draft)])


ATTENTIONS = {
    "sparq": SparQ(r=8, k=16, l=4, mean_value=True),
    "sparq-no-mean": SparQ(r=8, k=16, l=4, mean_value=False),
}


@pytest.mark.parametrize("cache_type", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("n_draft", [2, 5, DECODE_MAX_TOKENS])
@pytest.mark.parametrize("name", list(ATTENTIONS))
def test_verification_batch_equals_one_by_one(model, cache_type, n_draft, name):
    att = ATTENTIONS[name]
    prompt, draft = tokens(150, seed=1), tokens(n_draft + 1, seed=2)[1:]
    want = one_by_one(model, att, prompt, draft, cache_type)
    got = batched(model, att, prompt, draft, cache_type)
    for i, (g, w) in enumerate(zip(got, want)):
        assert rel(g, w) <= TOL[cache_type], f"row {i}: rel {rel(g, w):.2e}"
    # and it is sparse: dense attention over the same cells gives other logits
    dense = batched(model, Dense(), prompt, draft, cache_type)
    assert max(rel(g, d) for g, d in zip(got, dense)) > 100 * TOL[cache_type]


def test_loki_verification_batch_equals_one_by_one(model, projection):
    att = Loki(d=16, k=16, l=2, projection=str(projection))
    prompt, draft = tokens(150, seed=3), tokens(6, seed=4)[1:]
    want = one_by_one(model, att, prompt, draft, "f16")
    got = batched(model, att, prompt, draft, "f16")
    assert max(rel(g, w) for g, w in zip(got, want)) <= TOL["f16"]


def test_more_tokens_than_a_draft_attend_densely(model):
    """A chunk of DECODE_MAX_TOKENS + 1 tokens is a prompt: dense, as with sparse attention off."""
    prompt, chunk = tokens(150, seed=5), tokens(DECODE_MAX_TOKENS + 2, seed=6)[1:]
    got = batched(model, ATTENTIONS["sparq"], prompt, chunk, "f16")
    dense = batched(model, Dense(), prompt, chunk, "f16")
    assert max(rel(g, d) for g, d in zip(got, dense)) <= 3e-3  # flash attention's own f16 variance


def last_logits(path, att, prompt, chunk):
    with Session(path, att, cache_type="f16") as s:
        s.prompt(prompt)
        return s.decode([(t, len(prompt) + i, 0, i == len(chunk) - 1) for i, t in enumerate(chunk)])[0]


def test_small_prompt_chunk_attends_densely(model):
    """A few tokens that do not all ask for logits are the end of a prompt (llama-server reprocessing the part
    of a prompt its cache lacks): dense, so a reused prompt gives what the whole prompt gives."""
    prompt, chunk = tokens(150, seed=13), tokens(6, seed=14)[1:]
    got = last_logits(model, ATTENTIONS["sparq"], prompt, chunk)
    assert rel(got, last_logits(model, Dense(), prompt, chunk)) <= 3e-3


def test_draft_beside_a_prompt_in_one_ubatch(model):
    """Sequence 0 checks 4 draft tokens while sequence 1's prompt is processed in the same ubatch: the draft
    rows are sparse and equal one-by-one decoding, whatever the other sequence does."""
    att = ATTENTIONS["sparq"]
    prompt, draft, other = tokens(120, seed=7), tokens(5, seed=8)[1:], tokens(60, seed=9)
    want = one_by_one(model, att, prompt, draft, "f16")
    with Session(model, att, cache_type="f16", n_seq=2) as s:
        s.prompt(prompt, seq=0)
        items = [(t, len(prompt) + i, 0, True) for i, t in enumerate(draft)]
        items += [(t, i, 1, False) for i, t in enumerate(other)]
        got = s.decode(items)
    assert max(rel(g, w) for g, w in zip(got, want)) <= TOL["f16"]


def test_rejected_draft_tokens_removed_then_decoding_continues(model):
    """Speculative decoding: verify 5 tokens, accept 2, remove the other 3, go on: the same logits as a
    context that only ever saw the accepted tokens."""
    att = ATTENTIONS["sparq"]
    prompt, draft, nxt = tokens(150, seed=10), tokens(6, seed=11)[1:], tokens(5, seed=12)[1:]
    want = one_by_one(model, att, prompt, draft[:2] + nxt, "f16")
    with Session(model, att, cache_type="f16") as s:
        s.prompt(prompt)
        s.decode([(t, len(prompt) + i, 0, True) for i, t in enumerate(draft)])
        s.seq_rm(0, len(prompt) + 2, -1)
        got = s.steps(nxt, pos0=len(prompt) + 2)
    assert max(rel(g, w) for g, w in zip(got, want[2:])) <= TOL["f16"]
