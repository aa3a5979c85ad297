"""llama.cpp's logits equal the numpy reference's (sparq_cpp.reference.forward).

The bound is max |diff| <= tol * max |logit| over the compared rows. Flash attention in llama.cpp
casts an f32 K/V cache to f16, so flash-attention runs are compared with a reference whose cache is
f16; see the reference module docstring for the measured errors.
"""

from __future__ import annotations

import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")

from sparq_cpp.modelfactory import write_model  # noqa: E402
from conftest import tol_rounding  # noqa: E402
from sparq_cpp.reference.forward import LlamaReference  # noqa: E402
from sparq_cpp.reference.gguf_model import load_llama  # noqa: E402

# max |diff| / max |logit|: conftest.tol_rounding, from the roundings llama.cpp does and the reference does not (f16
# attention: flash attention casts K and V, and q and the weighted sum, to f16; the cache here is f32)


def tol(path, wtype, flash_attn) -> float:
    return tol_rounding(wtype, load_model(path).hparams.n_layer, f16_attention=flash_attn)


PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144, 233, 377, 610, 987",
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    made = {}

    def get(preset, wtype):
        if (preset, wtype) not in made:
            made[preset, wtype] = write_model(root / f"{preset}-{wtype}.gguf", preset, wtype=wtype, seed=0)
        return made[preset, wtype]

    return get


def make_llama(path, flash_attn, n_ctx=1024, n_batch=512, n_threads=1):
    # One thread by default: ggml's spinning barrier makes 2 threads ~1000x slower per decode step
    # when the 2-core machine is shared; the multi-batch and slow tests use 2 threads.
    return llama_cpp.Llama(
        model_path=str(path), n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, logits_all=True,
        type_k=0, type_v=0, flash_attn=flash_attn, n_threads=n_threads, n_threads_batch=n_threads,
        seed=0, verbose=False)


_models = {}


def load_model(path):
    if path not in _models:  # parse and dequantize each file once
        _models[path] = load_llama(path)
    return _models[path]


def make_ref(path, flash_attn):
    return LlamaReference(load_model(path), cache_type="f16" if flash_attn else "f32")


def rel_diff(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def random_tokens(n, n_vocab=2048, seed=0):
    return [1] + np.random.default_rng(seed).integers(3, n_vocab, size=n - 1).tolist()  # BOS first


def prefill_diff(path, tokens, flash_attn, n_ctx=1024):
    llm = make_llama(path, flash_attn, n_ctx=n_ctx, n_threads=2)
    llm.eval(tokens)
    got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    want = make_ref(path, flash_attn).forward(tokens)
    return rel_diff(got, want)


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_prompt_logits(model_path, preset, wtype, flash_attn):
    path = model_path(preset, wtype)
    llm, ref = make_llama(path, flash_attn), make_ref(path, flash_attn)
    for text in PROMPTS:
        tokens = llm.tokenize(text.encode(), add_bos=True)
        llm.reset()
        ref.reset()
        llm.eval(tokens)
        got = np.array(llm.scores[: len(tokens)], dtype=np.float32)
        want = ref.forward(tokens)
        assert rel_diff(got, want) <= tol(path, wtype, flash_attn), (text, rel_diff(got, want))


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_long_prompt_over_several_batches(model_path, preset, flash_attn):
    # 700 tokens: two ubatches of 512, KV cache past one 256-cell padding step
    d = prefill_diff(model_path(preset, "f32"), random_tokens(700, seed=1), flash_attn)
    assert d <= tol(model_path(preset, "f32"), "f32", flash_attn)


@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_greedy_decode_loop(model_path, preset, wtype, flash_attn):
    path = model_path(preset, wtype)
    llm = make_llama(path, flash_attn)
    ref = make_ref(path, flash_attn)
    tokens = llm.tokenize(PROMPTS[1].encode(), add_bos=True)
    llm.eval(tokens)
    want = ref.forward(tokens)[-1]
    for step in range(16):
        got = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        assert rel_diff(got, want) <= tol(path, wtype, flash_attn), step
        nxt = int(np.argmax(got))  # llama.cpp's choice drives both, so a near-tie cannot split them
        llm.eval([nxt])
        want = ref.forward([nxt])[-1]


@pytest.mark.slow
@pytest.mark.parametrize("flash_attn", [False, True])
@pytest.mark.parametrize("wtype", ["f32", "f16", "q8_0"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-gqa"])
def test_prompt_length_sweep(model_path, preset, wtype, flash_attn):
    path = model_path(preset, wtype)
    for n in (1, 31, 256, 513, 1024, 2048):
        d = prefill_diff(path, random_tokens(n, seed=n), flash_attn, n_ctx=2048)
        assert d <= tol(path, wtype, flash_attn), (n, d)
