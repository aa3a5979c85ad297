"""Whole-model reference: loading, errors, prefill == decode, SparQ-selecting-all == dense."""

from __future__ import annotations

import numpy as np
import pytest
import gguf

from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention, ExactTopKAttention, SparQAttention
from sparq_cpp.reference.forward import LlamaReference, quant_dequant_q8_0, rope_cos_sin, rope_norm
from sparq_cpp.reference.gguf_model import load_llama


def write_tiny_gguf(path, *, n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=96, n_vocab=80,
                    wtype="f32", tied=False, seed=0, arch="llama"):
    """A small random llama GGUF; only for tests that must not depend on sparq_cpp.modelfactory."""
    rng = np.random.default_rng(seed)
    D = n_embd // n_head
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(n_embd)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(D)
    w.add_vocab_size(n_vocab)
    qt = {"f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
          "q8_0": gguf.GGMLQuantizationType.Q8_0}[wtype]

    def mat(name, n_out, n_in, quant=True):
        a = (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)
        t = qt if quant else gguf.GGMLQuantizationType.F32
        w.add_tensor(name, gguf.quants.quantize(a, t), raw_dtype=t)

    def vec(name, n):
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", n_vocab, n_embd)
    vec("output_norm.weight", n_embd)
    if not tied:
        mat("output.weight", n_vocab, n_embd)
    for i in range(n_layer):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", n_embd)
        mat(p + "attn_q.weight", n_head * D, n_embd)
        mat(p + "attn_k.weight", n_head_kv * D, n_embd)
        mat(p + "attn_v.weight", n_head_kv * D, n_embd)
        mat(p + "attn_output.weight", n_embd, n_head * D)
        vec(p + "ffn_norm.weight", n_embd)
        mat(p + "ffn_gate.weight", n_ff, n_embd)
        mat(p + "ffn_up.weight", n_ff, n_embd)
        mat(p + "ffn_down.weight", n_embd, n_ff)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny-gqa.gguf")


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return load_llama(tiny_path)


@pytest.fixture(scope="module", params=["tiny", "tiny-gqa"])
def factory_path(request, tmp_path_factory):
    """The project's synthetic models (peaked attention, real tokenizer)."""
    modelfactory = pytest.importorskip("sparq_cpp.modelfactory")
    return modelfactory.write_model(tmp_path_factory.mktemp("f") / f"{request.param}.gguf", request.param,
                                    wtype="f32", seed=0)


def test_load_hparams_and_shapes(tiny_model):
    hp = tiny_model.hparams
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab) == (2, 64, 4, 2, 96, 80)
    assert hp.head_dim == 16 and hp.n_rot == 16 and hp.n_ctx_train == 4096
    assert hp.kq_scale == pytest.approx(0.25)
    assert tiny_model.layers[0].wk.shape == (32, 64)  # numpy shape = ggml ne reversed
    assert tiny_model.output.shape == (80, 64) and tiny_model.output.dtype == np.float32


def test_tied_output_and_quantized_weights(tmp_path):
    m = load_llama(write_tiny_gguf(tmp_path / "t.gguf", tied=True, wtype="q8_0"))
    assert m.output is m.tok_embd
    assert m.wtypes["output.weight"] == gguf.GGMLQuantizationType.Q8_0
    m16 = load_llama(write_tiny_gguf(tmp_path / "h.gguf", wtype="f16"))
    m32 = load_llama(write_tiny_gguf(tmp_path / "f.gguf", wtype="f32"))
    assert np.abs(m16.layers[1].wq - m32.layers[1].wq).max() < 1e-3


def test_errors(tmp_path, tiny_path):
    with pytest.raises(SparqError, match="not found"):
        load_llama(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(SparqError, match="not a GGUF"):
        load_llama(bad)
    data = tiny_path.read_bytes()
    for cut in (10, 200, len(data) - 100):  # inside the header, the tensor infos, the last tensor
        short = tmp_path / f"short{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(SparqError, match="truncated"):
            load_llama(short)
    with pytest.raises(SparqError, match="architecture"):
        load_llama(write_tiny_gguf(tmp_path / "g.gguf", arch="gpt2"))
    with pytest.raises(SparqError, match="cache_type"):
        LlamaReference(tiny_path, cache_type="q4_0")


def test_unsupported_weight_type(tmp_path):
    path = tmp_path / "q4.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    # bf16: gguf.quants reads it, the reference has no activation rounding for it, so it refuses it
    w.add_tensor("token_embd.weight", gguf.quants.quantize(np.ones((4, 64), np.float32), gguf.GGMLQuantizationType.BF16),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_feed_forward_length(64)
    w.add_layer_norm_rms_eps(1e-5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(SparqError, match="BF16"):
        load_llama(path)


def test_rope_matches_closed_form():
    pos = np.array([0, 1, 7, 300], dtype=np.int32)
    cos, sin = rope_cos_sin(pos, 16, 10000.0)
    theta = pos[:, None] * 10000.0 ** (-2 * np.arange(8) / 16)
    assert np.allclose(cos, np.cos(theta), atol=1e-5) and np.allclose(sin, np.sin(theta), atol=1e-5)
    x = np.arange(2 * 16, dtype=np.float32).reshape(1, 2, 16).repeat(4, 0)
    y = rope_norm(x, cos, sin)
    # adjacent pairs rotate: (x0, x1) -> (x0 c - x1 s, x0 s + x1 c)
    assert np.allclose(y[2, 1, 2], x[2, 1, 2] * cos[2, 1] - x[2, 1, 3] * sin[2, 1])
    assert np.allclose(y[2, 1, 3], x[2, 1, 2] * sin[2, 1] + x[2, 1, 3] * cos[2, 1])
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-6)


def test_q8_0_activation_rounding():
    x = np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)
    y = quant_dequant_q8_0(x)
    # same as gguf's own q8_0 round trip up to the rounding of x*id (ties, 1/d vs 127/amax)
    ref = gguf.quants.dequantize(gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0),
                                 gguf.GGMLQuantizationType.Q8_0)
    assert np.abs(y - ref).max() <= np.abs(x).max() / 127 + 1e-7
    assert np.mean(y == ref) > 0.99
    assert np.all(quant_dequant_q8_0(np.zeros((1, 32), np.float32)) == 0)


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_prefill_equals_decode(tiny_path, cache_type):
    toks = np.random.default_rng(2).integers(0, 80, size=40)
    ref = LlamaReference(tiny_path, cache_type=cache_type)
    full = ref.forward(toks)
    assert full.shape == (40, 80) and full.dtype == np.float32
    ref.reset()
    steps = [ref.forward(toks[:17])]
    steps += [ref.forward(toks[i : i + 1]) for i in range(17, 40)]
    split = np.concatenate(steps)
    assert np.abs(full - split).max() <= 1e-5 * np.abs(full).max()
    assert ref.n_past == 40


def test_sparq_selecting_all_equals_dense(tiny_path):
    toks = np.random.default_rng(3).integers(0, 80, size=30)
    dense = LlamaReference(tiny_path).forward(toks)
    for attn in (SparQAttention(r=4, k=30, l=2), SparQAttention(r=1, k=64, mean_value=False),
                 ExactTopKAttention(k=30)):
        out = LlamaReference(tiny_path, attention=attn).forward(toks)
        assert np.abs(out - dense).max() <= 1e-5 * np.abs(dense).max(), attn


@pytest.mark.parametrize("cache_type", ["f32", "f16"])
def test_factory_model_prefill_equals_decode_and_sparq_all_equals_dense(factory_path, cache_type):
    toks = np.random.default_rng(5).integers(3, 2048, size=64)
    ref = LlamaReference(factory_path, cache_type=cache_type)
    full = ref.forward(toks)
    ref.reset()
    split = np.concatenate([ref.forward(toks[:40])] + [ref.forward(toks[i : i + 1]) for i in range(40, 64)])
    assert np.abs(full - split).max() <= 1e-5 * np.abs(full).max()
    sparq = LlamaReference(factory_path, cache_type=cache_type, attention=SparQAttention(r=8, k=64))
    assert np.abs(sparq.forward(toks) - full).max() <= 1e-5 * np.abs(full).max()
    hp = ref.model.hparams
    assert ref.k_cache[0][: ref.n_cells].shape == (64, hp.n_head_kv, hp.head_dim)
    if cache_type == "f16":  # the cache holds exactly f16 values
        k = ref.k_cache[1][: ref.n_cells]
        assert np.array_equal(k, k.astype(np.float16).astype(np.float32))


def test_sparse_attention_changes_logits_when_it_drops_positions(tiny_path):
    toks = np.random.default_rng(4).integers(0, 80, size=48)
    dense = LlamaReference(tiny_path).forward(toks)
    sparse = LlamaReference(tiny_path, attention=SparQAttention(r=2, k=4, l=1)).forward(toks)
    assert np.allclose(sparse[:4], dense[:4], rtol=1e-5, atol=1e-5 * np.abs(dense).max())
    assert np.abs(sparse[8:] - dense[8:]).max() > 1e-3


def test_explicit_positions_and_attention_plugin(tiny_path):
    seen = []

    class Spy(DenseAttention):
        def __call__(self, q, k, v, mask, kv_pos, kq_scale, layer=0):
            seen.append((q.shape, k.shape, mask.copy(), kv_pos.copy(), kq_scale, layer))
            return super().__call__(q, k, v, mask, kv_pos, kq_scale, layer)

    ref = LlamaReference(tiny_path, attention=Spy())
    ref.forward([1, 2, 3], positions=[10, 11, 12])
    ref.forward([4])
    q_shape, k_shape, mask, kv_pos, scale, layer = seen[-1]
    assert q_shape == (1, 4, 16) and k_shape == (4, 2, 16) and layer == 1
    assert kv_pos.tolist() == [10, 11, 12, 13] and mask.all() and scale == pytest.approx(0.25)
    assert seen[0][2].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    with pytest.raises(SparqError, match="positions"):
        ref.forward([1, 2], positions=[5])
    with pytest.raises(SparqError, match="token id"):
        ref.forward([999])
