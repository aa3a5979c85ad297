"""`sparq-cpp convert`: a Hugging Face Llama-family checkpoint directory -> GGUF (f32, f16, q8_0).

Does for Llama and Mistral checkpoints with a SentencePiece tokenizer what upstream's
convert_hf_to_gguf.py does, with the gguf package only (no torch, transformers or sentencepiece):
the same metadata, tensor names (gguf's TensorNameMap), q/k row permutation and tokenizer layout.
Tensors are read, converted and written one at a time; the file appears atomically.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import (GGMLQuantizationType, GGUFWriter, LlamaFileType, MODEL_ARCH, MODEL_ARCH_NAMES,
                  SpecialVocab, get_tensor_name_map)
from gguf.constants import GGML_QUANT_VERSION
from gguf.quants import quantize

from sparq_cpp.errors import SparqError
from sparq_cpp.geometry import add_geometry
from sparq_cpp.outfile import atomic_write
from sparq_cpp.hf_checkpoint import CheckpointConfig, Tensors, read_config, read_vocabulary

OUTTYPES = {"f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
            "f16": (GGMLQuantizationType.F16, LlamaFileType.MOSTLY_F16),
            "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0)}
_QK8_0 = 32
_SKIP = ("rotary_emb.inv_freq",)  # recomputed by llama.cpp


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF stores q/k rows for rotate_half RoPE (pairs i, i + D/2); llama.cpp's LLAMA arch rotates
    adjacent pairs (2i, 2i+1). Upstream's LlamaModel.permute, for one head count."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _expected(hp: CheckpointConfig) -> dict[str, tuple[int, ...]]:
    """GGUF name -> HF shape (rows, cols) of every tensor llama.cpp's LLAMA graph needs."""
    q, kv = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    shapes = {"token_embd.weight": (hp.n_vocab, hp.n_embd), "output_norm.weight": (hp.n_embd,)}
    if not hp.tied_embeddings:
        shapes["output.weight"] = (hp.n_vocab, hp.n_embd)
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        shapes.update({b + "attn_norm.weight": (hp.n_embd,), b + "attn_q.weight": (q, hp.n_embd),
                       b + "attn_k.weight": (kv, hp.n_embd), b + "attn_v.weight": (kv, hp.n_embd),
                       b + "attn_output.weight": (hp.n_embd, q), b + "ffn_norm.weight": (hp.n_embd,),
                       b + "ffn_gate.weight": (hp.n_ff, hp.n_embd), b + "ffn_up.weight": (hp.n_ff, hp.n_embd),
                       b + "ffn_down.weight": (hp.n_embd, hp.n_ff)})
    return shapes


def _plan(hp: CheckpointConfig, tensors: Tensors) -> list[tuple[str, str]]:
    """(GGUF name, HF name) in llama.cpp's order, every name and shape checked."""
    name_map = get_tensor_name_map(MODEL_ARCH.LLAMA, hp.n_layer)
    expected = _expected(hp)
    found: dict[str, str] = {}
    for hf_name in tensors.names():
        if hf_name.endswith(_SKIP):
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None or gguf_name not in expected:
            if hf_name == "lm_head.weight" and hp.tied_embeddings:
                continue  # some tied checkpoints still store it; llama.cpp uses token_embd
            raise SparqError(f"tensor {hf_name}: not part of a Llama model with this config.json")
        if tuple(tensors.shape(hf_name)) != expected[gguf_name]:
            raise SparqError(f"tensor {hf_name}: shape {list(tensors.shape(hf_name))}, "
                             f"config.json implies {list(expected[gguf_name])}")
        found[gguf_name] = hf_name
    missing = [n for n in expected if n not in found]
    if missing:
        raise SparqError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[0]}")
    return [(n, found[n]) for n in expected]


def _qtype(name: str, shape: tuple[int, ...], outtype: str) -> GGMLQuantizationType:
    """Norms stay f32 (as upstream); q8_0 needs rows that are whole blocks, else f16."""
    if len(shape) == 1:
        return GGMLQuantizationType.F32
    qtype = OUTTYPES[outtype][0]
    if qtype == GGMLQuantizationType.Q8_0 and shape[-1] % _QK8_0:
        return GGMLQuantizationType.F16
    return qtype


def _encode(arr: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    if qtype == GGMLQuantizationType.F32:
        return np.ascontiguousarray(arr, np.float32)
    if qtype == GGMLQuantizationType.F16:
        return np.ascontiguousarray(arr, np.float16)
    return quantize(np.ascontiguousarray(arr, np.float32), qtype)


def _nbytes(shape, qtype: GGMLQuantizationType) -> int:
    n = int(np.prod(shape))
    if qtype == GGMLQuantizationType.F32:
        return 4 * n
    if qtype == GGMLQuantizationType.F16:
        return 2 * n
    return n // _QK8_0 * (2 + _QK8_0)


def _metadata(w: GGUFWriter, hp: CheckpointConfig, outtype: str) -> None:
    w.add_name(hp.name)
    w.add_file_type(int(OUTTYPES[outtype][1]))
    w.add_quantization_version(GGML_QUANT_VERSION)
    add_geometry(w, hp)


def _tokenizer(w: GGUFWriter, model_dir: Path, hp: CheckpointConfig) -> None:
    vocab = read_vocabulary(model_dir, hp.n_vocab)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(vocab.tokens)
    w.add_token_scores(vocab.scores)
    w.add_token_types(vocab.types)
    w.add_add_space_prefix(vocab.add_space_prefix)
    special = SpecialVocab(model_dir, n_vocab=len(vocab.tokens))
    if "unk" not in special.special_token_ids and vocab.unk_id >= 0:
        w.add_unk_token_id(vocab.unk_id)
    special.add_to_gguf(w, quiet=True)


def default_out(model_dir: Path, outtype: str) -> Path:
    return model_dir / f"{model_dir.resolve().name}-{outtype}.gguf"


def convert(model_dir, out=None, outtype: str = "f16") -> Path:
    """Write the GGUF of the checkpoint in model_dir to out (default: inside model_dir)."""
    if outtype not in OUTTYPES:
        raise SparqError(f"--outtype: unknown {outtype!r} (choose from {', '.join(OUTTYPES)})")
    model_dir = Path(model_dir).expanduser()
    hp = read_config(model_dir)
    tensors = Tensors(model_dir)
    plan = _plan(hp, tensors)
    read_vocabulary(model_dir, hp.n_vocab)  # fail on the tokenizer before writing anything
    out = Path(out).expanduser() if out is not None else default_out(model_dir, outtype)
    if out.is_dir():
        raise SparqError(f"--out {out} is a directory")
    return atomic_write(out, lambda tmp: _write(tmp, model_dir, hp, tensors, plan, outtype), "--out")


def _write(tmp: Path, model_dir: Path, hp: CheckpointConfig, tensors: Tensors, plan, outtype: str) -> None:
    w = GGUFWriter(tmp, MODEL_ARCH_NAMES[MODEL_ARCH.LLAMA])
    try:
        _metadata(w, hp, outtype)
        _tokenizer(w, model_dir, hp)
        qtypes = []
        for gguf_name, hf_name in plan:
            shape = tensors.shape(hf_name)
            qtype = _qtype(gguf_name, shape, outtype)
            qtypes.append(qtype)
            w.add_tensor_info(gguf_name, shape, np.dtype(np.float32), _nbytes(shape, qtype), raw_dtype=qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for (gguf_name, hf_name), qtype in zip(plan, qtypes):
            arr = tensors.get(hf_name)
            if gguf_name.endswith("attn_q.weight"):
                arr = permute_qk(arr, hp.n_head)
            elif gguf_name.endswith("attn_k.weight"):
                arr = permute_qk(arr, hp.n_head_kv)
            w.write_tensor_data(_encode(arr, qtype))
    finally:
        w.close()
