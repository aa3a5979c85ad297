"""The reference on quantized real-model files: a Q4_1 block dequantized by hand, the activation
rounding per weight type against ggml-cpu's own quantizer and dot product, and text tokenized by
llama.cpp for a GPT-2-style BPE vocabulary (SmolLM2's kind)."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from sparq_cpp.reference.forward import round_activation
from sparq_cpp.reference.gguf_model import SUPPORTED_WTYPES, dequant_tensor

QT = gguf.GGMLQuantizationType


def _write(path, tensors: dict, arch="llama", extra=None):
    w = gguf.GGUFWriter(str(path), arch)
    for name, (data, qtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=qtype)
    for fn in extra or ():
        fn(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_q4_1_block_dequantized_by_hand(tmp_path):
    # one row of two Q4_1 blocks: f16 d, f16 m, 16 bytes of nibbles; element j < 16 is the low nibble
    # of byte j, element j >= 16 the high nibble of byte j - 16; value = d * nibble + m
    blocks = [(0.25, -1.5, bytes(range(0, 256, 17))[:16]), (-0.125, 3.0, bytes((7 * i + 3) % 256 for i in range(16)))]
    raw = b"".join(np.float16(d).tobytes() + np.float16(m).tobytes() + qs for d, m, qs in blocks)
    expected = []
    for d, m, qs in blocks:
        expected += [d * (b & 15) + m for b in qs] + [d * (b >> 4) + m for b in qs]
    path = tmp_path / "q4_1.gguf"
    _write(path, {"w": (np.frombuffer(raw, np.uint8).reshape(1, 40), QT.Q4_1)})
    t = gguf.GGUFReader(path).tensors[0]
    assert t.tensor_type == QT.Q4_1 and QT.Q4_1 in SUPPORTED_WTYPES
    got = dequant_tensor(t)
    assert got.shape == (1, 64) and got.dtype == np.float32
    assert got[0].tolist() == expected  # every value is exact in f32


class _TypeTraits(ctypes.Structure):  # ggml.h: struct ggml_type_traits
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64), ("blck_size_interleave", ctypes.c_int64),
                ("type_size", ctypes.c_size_t), ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


class _TypeTraitsCpu(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


_FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
_VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.fixture(scope="module")
def ggml_cpu():
    from sparq_cpp.bindings.ggml_ops import lib

    L = lib()
    L.base.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    L.base.ggml_get_type_traits.argtypes = [ctypes.c_int]
    L.cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TypeTraitsCpu)
    L.cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    L.cpu.ggml_cpu_init.restype = None
    L.cpu.ggml_cpu_init()
    return L


def _ggml_matvec(L, wq: np.ndarray, qtype, n_in: int, x: np.ndarray) -> np.ndarray:
    """ggml-cpu's own y = W x for one activation row: x converted to the weight type's vec_dot_type by
    its from_float, then the type's vec_dot per weight row (what ggml_mul_mat does on the CPU)."""
    tc = L.cpu.ggml_get_type_traits_cpu(int(qtype)).contents
    vt = tc.vec_dot_type
    tv = L.base.ggml_get_type_traits(vt).contents
    qx = np.zeros(n_in // tv.blck_size * tv.type_size, np.uint8)
    x = np.ascontiguousarray(x, np.float32)
    _FROM_FLOAT(L.cpu.ggml_get_type_traits_cpu(vt).contents.from_float)(x.ctypes.data, qx.ctypes.data, n_in)
    dot, s = _VEC_DOT(tc.vec_dot), ctypes.c_float()
    out = np.empty(wq.shape[0], np.float32)
    for i in range(wq.shape[0]):
        row = np.ascontiguousarray(wq[i])
        dot(n_in, ctypes.byref(s), 0, row.ctypes.data, 0, qx.ctypes.data, 0, 1)
        out[i] = s.value
    return out


# (type, bound on max |reference - ggml| / max |ggml| with the emulation). Q8_0-/Q8_K-activation
# types agree to f32 summation order; q4_1/q5_1's Q8_1 also stores s = d * sum(q) as f16, which
# the reference does not emulate (the weights' m * s term), so they agree to ~1e-4.
_CASES = [(QT.Q8_0, 2e-6), (QT.Q4_0, 2e-6), (QT.Q5_0, 2e-6), (QT.Q4_1, 1e-3), (QT.Q5_1, 1e-3),
          (QT.Q4_K, 2e-6), (QT.Q5_K, 2e-6), (QT.Q6_K, 2e-6), (QT.Q2_K, 2e-6), (QT.Q3_K, 2e-6)]


@pytest.mark.parametrize("qtype,bound", _CASES, ids=[c[0].name for c in _CASES])
def test_activation_rounding_matches_ggml_cpu(ggml_cpu, qtype, bound):
    rng = np.random.default_rng(int(qtype))
    n_out, n_in = 48, 512
    w = rng.standard_normal((n_out, n_in)).astype(np.float32)
    x = rng.standard_normal(n_in).astype(np.float32)
    x[[3, 300]] = [40.0, -25.0]  # outliers, as real activations have: they set their blocks' scales
    wq = _ggml_quantize(ggml_cpu, w, qtype)
    wdq = gguf.quants.dequantize(wq, qtype).astype(np.float32)
    ours = (wdq.astype(np.float64) @ round_activation(x[None], qtype)[0].astype(np.float64)).astype(np.float32)
    plain = (wdq.astype(np.float64) @ x.astype(np.float64)).astype(np.float32)
    theirs = _ggml_matvec(ggml_cpu, wq, qtype, n_in, x)
    scale = np.abs(theirs).max()
    err, err_plain = np.abs(ours - theirs).max() / scale, np.abs(plain - theirs).max() / scale
    assert err <= bound, (qtype.name, err, err_plain)
    assert err < err_plain / 5, (qtype.name, err, err_plain)  # the rounding is what ggml does, not noise


def _ggml_quantize(L, w: np.ndarray, qtype) -> np.ndarray:
    """The weight rows quantized by ggml's reference quantizer for the type (uint8 [rows, bytes])."""
    tt = L.base.ggml_get_type_traits(int(qtype)).contents
    n_in = w.shape[1]
    out = np.zeros((w.shape[0], n_in // tt.blck_size * tt.type_size), np.uint8)
    fn = _FROM_FLOAT(tt.from_float_ref)
    for i in range(w.shape[0]):
        row = np.ascontiguousarray(w[i])
        fn(row.ctypes.data, out[i].ctypes.data, n_in)
    return out


def test_bpe_vocabulary_tokenized_by_llama_cpp(tmp_path):
    """A GPT-2-style byte-level BPE vocabulary without BOS (as SmolLM2's): the eval's tokenizer is
    llama.cpp's (merges applied), and bits-per-character samples then start with the text itself."""
    from sparq_cpp.evaluation.tasks import TaskConfig, Tokenizer, bpc_samples

    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):  # GPT-2's bytes_to_unicode
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    byte_tokens = [chr(c) for _, c in sorted(zip(bs, cs))]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"]
    merged = ["Ġt", "he", "Ġthe", "Ġc", "at", "Ġcat"]
    tokens = specials + byte_tokens + merged
    types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    path = tmp_path / "bpe-vocab.gguf"

    def meta(w):
        w.add_block_count(1)
        w.add_context_length(256)
        w.add_embedding_length(64)
        w.add_feed_forward_length(64)
        w.add_head_count(4)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    _write(path, {}, extra=[meta])
    tok = Tokenizer(path)
    ids = tok.encode(" the cat sat")
    assert [tokens[i] for i in ids] == ["Ġthe", "Ġcat", "Ġ", "s", "at"]
    assert tok.decode(ids) == " the cat sat"
    assert tok.add_bos is False and tok.start == [] and tok.encode("the", bos=True)[0] != tok.bos
    text = " the cat sat" * 400
    s = bpc_samples(text, tok, TaskConfig(samples=2, context=32, continuation=8), "(test)")
    assert all(x.prompt[0] != tok.bos and len(x.prompt) == 32 and len(x.target) == 8 for x in s)
