"""Whole-model numpy reference of llama.cpp's graphs for the ordinary-attention architectures
(src/models/{llama,qwen2,qwen3,phi3,gemma3,olmo2,granite}.cpp), with pluggable attention.

Per architecture, on top of the llama graph below: qwen2 adds the q/k/v biases after the matmuls;
qwen3 and gemma3 RMS-norm q and k per head before RoPE, olmo2 over the whole projection (and has no
pre-norms: its attention and FFN outputs are RMS-normed before each residual add, as gemma3's are
in addition to its pre-norms); qwen2, qwen3, phi3, gemma3 and olmo2 use NeoX RoPE (pairs (x[i],
x[i + n_rot/2])); phi3 and gemma3 multiply q by 1/sqrtf(D) after RoPE and attend with scale 1;
gemma3 multiplies the embeddings by sqrtf(n_embd), uses a GELU-gated FFN (ggml's f16 GELU table)
and, on its sliding-window layers, a separate RoPE base and the window mask (a cell at p0 is
hidden from a token at p1 when p1 - p0 >= n_swa, LLAMA_SWA_TYPE_STANDARD); granite multiplies the
embeddings by embedding_scale, the attention and FFN outputs by residual_scale, and divides the
logits by logit_scale. Window layers always attend densely (``window_attention``); the pluggable
``attention`` runs on the full-attention layers, as llama.cpp's sparse modes do.

Follows src/models/llama.cpp and the ggml CPU ops step by step: RMSNorm as ggml_rms_norm (squares
summed in double, scale = 1/sqrtf(mean + eps), y = x*scale*w in f32); RoPE type NORM (adjacent pairs
(x[2i], x[2i+1]), theta built as ggml does: theta_0 = pos, theta_{i+1} = theta_i * base^(-2/n_rot)
in f32, optional per-pair rope_freqs divisors and linear freq_scale); kq_scale = 1/sqrtf(D) unless
the GGUF sets attention.scale; GQA by head // (n_head / n_head_kv); SwiGLU FFN; final norm; LM head.
One sequence; the KV cache keeps cells in append order with their token positions.

``emulate_ggml=True`` mimics how ggml-cpu rounds a matmul's activations to the weight type's
``vec_dot_type``: f16 weights see the activation rounded to f16; q8_0 weights see it quantized to
q8_0 blocks of 32 (d = amax/127 stored as f16, q = round-half-even(x * 127/amax), as the AVX path of
quantize_row_q8_0 does). Matmuls run in float64 and round to f32 (so results do not depend on the
batch size), elementwise ops run in f32 as ggml does, attention in float64 (kernels.py). The f16
cache stores K and V rounded to f16; q stays f32 (as in ggml's tiled flash-attention kernel).

Measured against llama.cpp on this project's tiny/tiny-gqa models, max |logit diff| / max |logit|
(tests/test_logits_match.py; prompts of 10-2048 tokens and 16-step greedy decodes, f32 cache):
- f32 weights, flash attention off: <= 7e-7 (every intermediate agrees to f32 rounding; bound 1e-5).
- flash attention on: llama.cpp casts K/V to f16, so compare with ``cache_type="f16"``; its
  one-row kernel (decode, prompts < 64 tokens) also rounds q to f16 and accumulates V in f16:
  <= 1.4e-3 (bound 3e-3).
- f16 weights: <= 5e-4 with flash attention off, 1.7e-3 on (bounds 2e-3, 4e-3). q8_0 weights:
  <= 1.1e-2 off, 1.9e-2 on (bounds 3e-2, 4e-2). The emulation is exact until an activation that
  f32 noise puts on the other side of an f16 / q8_0 rounding boundary flips by one step; most
  rows then still agree to ~1e-7, but a flip cascades through later layers. Without emulation
  these errors are about twice as large.
The other families' tiny presets (tests/test_architectures.py, 96-token prompts and greedy decodes),
f32 weights: flash attention off <= 2.1e-6, except gemma3 1.4e-4 (a gate an f32 ulp apart can look
up the neighbouring entry of the f16 GELU table); flash attention on an f16 cache <= 1.8e-3.
f16 weights <= 2.2e-3, q8_0 weights <= 4.1e-2 (gemma3 decode; the others <= 2.1e-2), flash attention on.
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
from gguf import GGMLQuantizationType as QT

from sparq_cpp.errors import SparqError
from sparq_cpp.reference.attention import DenseAttention
from sparq_cpp.reference.gguf_model import LlamaModel, load_llama

F32 = np.float32


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm then ggml_mul: squares in f32 summed in double, scale and multiply in f32."""
    x = x.astype(F32, copy=False)
    ssum = (x * x).astype(np.float64).sum(axis=-1, keepdims=True)
    mean = (ssum / x.shape[-1]).astype(F32)
    scale = F32(1.0) / np.sqrt(mean + F32(eps))
    return (x * scale) * w


@numba.njit(cache=True)
def _rope_table(positions, n_rot, freq_base, freq_scale, freq_factors):
    # float32 throughout: Numba's float32 math.pow/cos/sin call libm's powf/cosf/sinf, which ggml
    # uses too (numpy's own float32 pow/cos differ by an ulp, and theta = pos * ... reaches 1e3 rad).
    theta_scale = math.pow(np.float32(freq_base), np.float32(-2.0) / np.float32(n_rot))
    cos = np.empty((positions.shape[0], n_rot // 2), np.float32)
    sin = np.empty((positions.shape[0], n_rot // 2), np.float32)
    for t in range(positions.shape[0]):
        theta = np.float32(positions[t])
        for i in range(n_rot // 2):
            th = np.float32(freq_scale) * (theta / freq_factors[i])
            cos[t, i] = math.cos(th)
            sin[t, i] = math.sin(th)
            theta = np.float32(theta * theta_scale)
    return cos, sin


def rope_cos_sin(positions, n_rot, freq_base, freq_scale=1.0, freq_factors=None):
    """cos/sin [n_tokens, n_rot/2] exactly as ggml_rope_cache_init (ext_factor 0, attn_factor 1):
    theta_0 = pos, theta_{i+1} = theta_i * powf(base, -2/n_rot) in f32, divided by freq_factors[i]."""
    ff = np.ones(n_rot // 2, np.float32) if freq_factors is None else np.asarray(freq_factors, np.float32)
    return _rope_table(np.asarray(positions, np.int32), int(n_rot), np.float32(freq_base),
                       np.float32(freq_scale), ff)


def rope_neox(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE type NEOX on x [n_tokens, n_heads, D] (n_rot == D): rotate (x[i], x[i + D/2]) by theta_i."""
    h = x.shape[-1] // 2
    x0, x1 = x[..., :h], x[..., h:]
    c, s = cos[:, None, :], sin[:, None, :]
    y = np.empty_like(x)
    y[..., :h] = x0 * c - x1 * s
    y[..., h:] = x0 * s + x1 * c
    return y


@numba.njit(cache=True)
def _gelu_f32(xs):
    # ggml_gelu_f32 in f32 with tanhf (Numba's float32 math.tanh calls libm's tanhf, as ggml does)
    out = np.empty(xs.shape[0], np.float32)
    c = np.float32(0.79788456080286535587989211986876)
    a = np.float32(0.044715)
    for i in range(xs.shape[0]):
        x = xs[i]
        out[i] = np.float32(0.5) * x * (np.float32(1.0) + math.tanh(c * x * (np.float32(1.0) + a * x * x)))
    return out


_GELU_TABLE = None


def geglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """ggml_geglu_split on the CPU (GGML_GELU_FP16): gelu(gate) * up, gelu looked up at f16(gate)."""
    global _GELU_TABLE
    if _GELU_TABLE is None:
        # ggml_table_gelu_f16: gelu of every f16 value, rounded to f16
        xs = np.arange(65536).astype(np.uint16).view(np.float16).astype(F32)
        _GELU_TABLE = _gelu_f32(xs).astype(np.float16).astype(F32)
    idx = gate.astype(np.float16).view(np.uint16)
    g = _GELU_TABLE[idx]
    g = np.where(gate <= F32(-10.0), F32(0.0), np.where(gate >= F32(10.0), gate, g)).astype(F32)
    return g * up


def rope_norm(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """RoPE type NORM on x [n_tokens, n_heads, D]: rotate (x[2i], x[2i+1]) by theta_i."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    y = np.empty_like(x)
    y[..., 0::2] = x0 * c - x1 * s
    y[..., 1::2] = x0 * s + x1 * c
    return y


def round_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(F32)


def quant_dequant_q8_0(x: np.ndarray) -> np.ndarray:
    """What a q8_0 vec_dot sees of an f32 activation row (x86 quantize_row_q8_0)."""
    n = x.shape[-1]
    if n % 32:
        raise SparqError(f"q8_0 matmul needs a row length divisible by 32, got {n}")
    xb = x.astype(F32).reshape(*x.shape[:-1], n // 32, 32)
    amax = np.abs(xb).max(axis=-1, keepdims=True)
    d = (amax / F32(127.0)).astype(np.float16).astype(F32)
    with np.errstate(divide="ignore"):
        idv = np.where(amax != 0, F32(127.0) / amax, F32(0.0)).astype(F32)
    q = np.rint(xb * idv)  # _mm256_round_ps(_MM_ROUND_NEAREST): half to even
    return (q * d).reshape(x.shape).astype(F32)


def quant_dequant_q8_K(x: np.ndarray) -> np.ndarray:
    """What a K-quant vec_dot sees of an f32 activation row (quantize_row_q8_K_ref, which x86 uses):
    blocks of 256, iscale = -127/x_max (x_max the element of largest |x|, the first if tied),
    q = min(127, round-half-even(iscale * x)), d = 1/iscale kept in f32."""
    n = x.shape[-1]
    if n % 256:
        raise SparqError(f"K-quant matmul needs a row length divisible by 256, got {n}")
    xb = x.astype(F32).reshape(*x.shape[:-1], n // 256, 256)
    imax = np.abs(xb).argmax(axis=-1)[..., None]  # first index of the largest |x|, as the C loop keeps
    xmax = np.take_along_axis(xb, imax, axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(xmax != 0, F32(-127.0) / xmax, F32(0.0)).astype(F32)
        d = np.where(xmax != 0, F32(1.0) / iscale, F32(0.0)).astype(F32)
    q = np.minimum(np.rint((iscale * xb).astype(F32)), F32(127.0))  # nearest_int: half to even
    return (q * d).reshape(x.shape).astype(F32)


# ggml-cpu's vec_dot_type per weight type: the form the activation is converted to before the dot.
_Q8_0_ACT = (QT.Q8_0, QT.Q4_0, QT.Q5_0)
_Q8_1_ACT = (QT.Q4_1, QT.Q5_1)
_Q8_K_ACT = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def round_activation(x: np.ndarray, wtype) -> np.ndarray:
    """The activation as ggml-cpu's matmul for this weight type sees it.

    q8_1 (q4_1/q5_1 weights) quantizes exactly as q8_0 (d = amax/127 as f16, q = rint(x/d)); its
    block also stores s = d * sum(q) as f16, which the dot uses for the weights' offset m
    (m * s instead of m * sum(q * d_f16)). That rounding of s (< 2^-11 relative) is not emulated:
    the weights' m is not visible here. K-quant weights see Q8_K (quant_dequant_q8_K). ggml's
    repacked CPU paths (q4_0, q4_K, iq4_nl on AVX2 and up) quantize activations with their own
    code (quantize_mat_q8_*), which this follows only as far as it matches the row quantizers."""
    if wtype == QT.F16:
        return round_f16(x)
    if wtype in _Q8_0_ACT or wtype in _Q8_1_ACT:
        return quant_dequant_q8_0(x)
    if wtype in _Q8_K_ACT:
        return quant_dequant_q8_K(x)
    return x


class LlamaReference:
    """A llama.cpp-equivalent forward pass with a KV cache. ``forward`` appends and returns logits.

    ``attention`` is any callable with the attention.py interface (default DenseAttention). The
    cache is ``k_cache[layer][:n_cells]`` / ``v_cache`` [n_cells, n_head_kv, D] with ``kv_pos``.
    Float64 copies of the weights are kept per instance: meant for small models.
    """

    def __init__(self, path_or_model, attention=None, cache_type="f32", emulate_ggml=True, window_attention=None):
        if isinstance(path_or_model, LlamaModel):
            self.model = path_or_model
        elif isinstance(path_or_model, (str, os.PathLike)):
            self.model = load_llama(path_or_model)
        else:
            raise SparqError(f"expected a GGUF path or LlamaModel, got {type(path_or_model).__name__}")
        if cache_type not in ("f32", "f16"):
            raise SparqError(f"cache_type must be 'f32' or 'f16', got {cache_type!r}")
        self.hp = self.model.hparams
        self.attention = attention if attention is not None else DenseAttention()
        # sliding-window layers (gemma3): dense over the window, whatever runs on the full layers
        self.window_attention = window_attention if window_attention is not None else DenseAttention()
        self.cache_type = cache_type
        self.emulate_ggml = bool(emulate_ggml)
        self._w64 = {}
        self.reset()

    def reset(self):
        """Empty the KV cache."""
        hp = self.hp
        self._cap = 0
        self.n_cells = 0
        self.kv_pos = np.empty(0, dtype=np.int32)
        self.k_cache = [np.empty((0, hp.n_head_kv, hp.head_dim), F32) for _ in range(hp.n_layer)]
        self.v_cache = [np.empty((0, hp.n_head_kv, hp.head_dim), F32) for _ in range(hp.n_layer)]

    @property
    def n_past(self) -> int:
        """The position the next token gets by default."""
        return int(self.kv_pos[: self.n_cells].max()) + 1 if self.n_cells else 0

    def _grow(self, need):
        if need <= self._cap:
            return
        cap = max(need, 2 * self._cap, 64)

        def grow(a):
            b = np.zeros((cap,) + a.shape[1:], a.dtype)
            b[: self.n_cells] = a[: self.n_cells]
            return b
        self.kv_pos = grow(self.kv_pos)
        self.k_cache = [grow(a) for a in self.k_cache]
        self.v_cache = [grow(a) for a in self.v_cache]
        self._cap = cap

    def _mm(self, x, w, name):
        """y = x @ w^T as ggml_mul_mat(w, x) computes it."""
        if self.emulate_ggml:
            x = round_activation(x, self.model.wtypes[name])
        w64 = self._w64.get(name)
        if w64 is None:  # float64 products round to the same f32 at any batch size
            w64 = self._w64[name] = w.astype(np.float64).T
        x64 = x.astype(np.float64)
        if x.shape[0] <= 16:  # decode: einsum's own loop; OpenBLAS threads thrash on a busy machine
            return np.einsum("ij,jk->ik", x64, w64).astype(F32)
        return (x64 @ w64).astype(F32)

    def _store(self, a):
        return round_f16(a) if self.cache_type == "f16" else a

    def forward(self, tokens, positions=None, trace=None, logits=True) -> np.ndarray | None:
        """Run tokens through the model, appending their K/V; returns float32 logits [n, n_vocab]
        (None with ``logits=False``: a prefill that only fills the cache skips the output layer).

        ``trace``, a dict, receives the intermediates under llama.cpp's graph names ("attn_norm-0",
        "Qcur-0" (after RoPE), "kqv_out-0", "ffn_out-0" (before the residual), "l_out-0",
        "result_norm", ...) as float32 arrays with one row per token."""
        def cb(name, a, il=None):
            if trace is not None:
                trace[name if il is None else f"{name}-{il}"] = a.reshape(n, -1).copy()

        hp, m = self.hp, self.model
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = len(tokens)
        if n == 0:
            raise SparqError("forward needs at least one token")
        if tokens.min() < 0 or tokens.max() >= m.tok_embd.shape[0]:
            raise SparqError(f"token id out of range 0..{m.tok_embd.shape[0] - 1}")
        if positions is None:
            positions = np.arange(self.n_past, self.n_past + n, dtype=np.int32)
        positions = np.asarray(positions, dtype=np.int32).reshape(-1)
        if positions.shape != (n,):
            raise SparqError(f"positions has {positions.shape[0]} entries for {n} tokens")

        c0 = self.n_cells
        self._grow(c0 + n)
        self.kv_pos[c0 : c0 + n] = positions
        n_kv = c0 + n
        kv_pos = self.kv_pos[:n_kv]
        mask = kv_pos[None, :] <= positions[:, None]  # llama.cpp masks cells with pos > token pos
        # is_masked_swa (STANDARD): a cell at p0 is hidden from a token at p1 when p1 - p0 >= n_swa
        swa_mask = mask & (positions[:, None] - kv_pos[None, :] < hp.n_swa) if hp.swa_layers else None
        cos, sin = rope_cos_sin(positions, hp.n_rot, hp.rope_freq_base, hp.rope_freq_scale, m.rope_freqs)
        cos_swa = sin_swa = None
        if hp.swa_layers:
            cos_swa, sin_swa = rope_cos_sin(positions, hp.n_rot, hp.rope_freq_base_swa, hp.rope_freq_scale_swa,
                                            m.rope_freqs)
        rope = rope_neox if hp.rope_neox else rope_norm
        H, Hkv, D = hp.n_head, hp.n_head_kv, hp.head_dim

        x = m.tok_embd[tokens].astype(F32)
        if hp.embd_scale:
            x = x * F32(hp.embd_scale)
        for il, L in enumerate(m.layers):
            p = f"blk.{il}."
            swa = hp.is_swa(il)
            inp = x
            cur = rms_norm(x, L.attn_norm, hp.rms_eps) if L.attn_norm is not None else x
            cb("attn_norm", cur, il)
            q = self._mm(cur, L.wq, p + "attn_q.weight")
            k = self._mm(cur, L.wk, p + "attn_k.weight")
            v = self._mm(cur, L.wv, p + "attn_v.weight")
            if L.bq is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            if hp.arch == "olmo2":  # q/k norm over the whole projection, before the per-head view
                q, k = rms_norm(q, L.q_norm, hp.rms_eps), rms_norm(k, L.k_norm, hp.rms_eps)
            q, k, v = q.reshape(n, H, D), k.reshape(n, Hkv, D), v.reshape(n, Hkv, D)
            if hp.arch in ("qwen3", "gemma3"):  # per head
                q, k = rms_norm(q, L.q_norm, hp.rms_eps), rms_norm(k, L.k_norm, hp.rms_eps)
            q = rope(q, cos_swa, sin_swa) if swa else rope(q, cos, sin)
            k = rope(k, cos_swa, sin_swa) if swa else rope(k, cos, sin)
            if hp.q_scale:
                q = q * F32(hp.q_scale)
            for name, a in (("Qcur", q), ("Kcur", k), ("Vcur", v)):
                cb(name, a, il)
            self.k_cache[il][c0 : c0 + n] = self._store(k)
            self.v_cache[il][c0 : c0 + n] = self._store(v)
            attn = self.window_attention if swa else self.attention
            y = attn(q, self.k_cache[il][:n_kv], self.v_cache[il][:n_kv], swa_mask if swa else mask, kv_pos,
                     hp.kq_scale, il)
            cb("kqv_out", y, il)
            attn_out = self._mm(y.reshape(n, H * D), L.wo, p + "attn_output.weight")
            cb("attn_out", attn_out, il)
            if L.attn_post_norm is not None:
                attn_out = rms_norm(attn_out, L.attn_post_norm, hp.rms_eps)
            if hp.residual_scale:
                attn_out = attn_out * F32(hp.residual_scale)
            x = attn_out + inp
            cb("ffn_inp", x, il)

            cur = rms_norm(x, L.ffn_norm, hp.rms_eps) if L.ffn_norm is not None else x
            cb("ffn_norm", cur, il)
            gate = self._mm(cur, L.ffn_gate, p + "ffn_gate.weight")
            up = self._mm(cur, L.ffn_up, p + "ffn_up.weight")
            if hp.ffn_gelu:
                act = geglu(gate, up)
            else:
                with np.errstate(over="ignore"):  # exp(-gate) = inf gives silu = -0, as in ggml
                    act = (gate / (F32(1.0) + np.exp(-gate))) * up  # silu(gate) * up, in f32
            for name, a in (("ffn_gate", gate), ("ffn_up", up), ("ffn_swiglu", act)):
                cb(name, a, il)
            ffn_out = self._mm(act, L.ffn_down, p + "ffn_down.weight")
            if L.ffn_post_norm is not None:
                ffn_out = rms_norm(ffn_out, L.ffn_post_norm, hp.rms_eps)
            if hp.residual_scale:
                ffn_out = ffn_out * F32(hp.residual_scale)
            cb("ffn_out", ffn_out, il)
            x = x + ffn_out
            cb("l_out", x, il)

        self.n_cells = n_kv
        if not logits:
            return None
        cur = rms_norm(x, m.output_norm, hp.rms_eps)
        cb("result_norm", cur)
        out = self._mm(cur, m.output, "output.weight")
        if hp.logit_scale:
            out = out * (F32(1.0) / F32(hp.logit_scale))
        cb("result_output", out)
        return out
