"""Save and load the torch model as a Hugging Face Llama checkpoint directory.

Files: config.json (LlamaForCausalLM fields), model.safetensors (HF tensor names, f32),
tokenizer.model (SentencePiece BPE, the project's vocabulary; sentencepiece itself tokenizes with
it exactly as llama.cpp does), tokenizer_config.json, special_tokens_map.json, generation_config.json.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import load_file, save_file

from sparq_cpp import spm_model
from sparq_cpp.errors import SparqError
from sparq_cpp.tokenizer import BOS_ID, EOS_ID, UNK_ID, build_vocab
from sparq_cpp.train.model import LlamaConfig, LlamaForCausalLM


def _json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_tokenizer(out: Path, n_vocab: int) -> None:
    v = build_vocab(n_vocab)
    model = spm_model.SpmModel(v.tokens, v.scores, v.types, add_dummy_prefix=False,
                               unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID)
    (out / "tokenizer.model").write_bytes(spm_model.dumps(model))
    special = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    _json(out / "special_tokens_map.json", special)
    _json(out / "tokenizer_config.json", {
        "tokenizer_class": "LlamaTokenizer", **special, "add_bos_token": True, "add_eos_token": False,
        "add_prefix_space": False, "legacy": False, "model_max_length": 1 << 30,
        "sp_model_kwargs": {}, "clean_up_tokenization_spaces": False})


def save(model: LlamaForCausalLM, out, extra: dict | None = None) -> Path:
    """Write the checkpoint directory `out` (replacing it whole, so a reader never sees half)."""
    out = Path(out)
    if out.exists() and (out.is_symlink() or not out.is_dir()):  # a device, a file: never moved aside
        raise SparqError(f"--out: {out} exists and is not a directory; a checkpoint is written as a directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
        cfg = model.config
        _json(tmp / "config.json", cfg.to_hf())
        _json(tmp / "generation_config.json", {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id})
        save_file(model.hf_state_dict(), tmp / "model.safetensors", metadata={"format": "pt"})
        write_tokenizer(tmp, cfg.vocab_size)
        if extra:
            _json(tmp / "training.json", extra)
        if out.exists():
            old = out.with_name(f".{out.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_config(path) -> LlamaConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise SparqError(f"{path}: no config.json; not a checkpoint directory")
    return LlamaConfig.from_hf(json.loads((path / "config.json").read_text()))


def load(path) -> LlamaForCausalLM:
    path = Path(path)
    cfg = load_config(path)
    model = LlamaForCausalLM(cfg)
    sd = load_file(path / "model.safetensors")
    if cfg.tie_word_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    model.load_state_dict(sd)
    return model.eval()

