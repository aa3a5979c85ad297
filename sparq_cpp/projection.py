"""The Loki projection GGUF: its layout, the model identity it carries, and reading it back with every check
(calib.projection writes it, or embeds it into a model copy).

Tensors (f32, never quantized: llama-quantize only touches names ending in "weight"):
  blk.<il>.loki_proj_pre, blk.<il>.loki_proj_post  numpy [n_head_kv, D, D] = P_h^T per KV head
  blk.<il>.loki_var_pre,  blk.<il>.loki_var_post   numpy [n_head_kv, D], explained variance
                                                   (covariance eigenvalues) per component
numpy shape is ggml ne reversed, so a head's matrix is ggml [D, D] with row j = column j of P_h;
ggml_mul_mat(proj, k) computes out[j] = sum_i proj[h, j, i] * k[i] = sum_i P_h[i, j] * k[i],
i.e. k' = k P_h. Metadata: loki.* keys (below), including the identity of the model they belong to.
Models with sliding-window layers (gemma3) are calibrated on their full-attention layers only: every
layer still has its tensors, the window layers' holding the identity and zero variance, and
loki.calibrated_layers (u32 array) lists the calibrated ones. llama.cpp skips window layers' bases.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf, metadata_value

LOKI_VERSION = 1
VARIANTS = ("pre", "post")  # keys before and after RoPE
SAMPLE_BYTES = 4096  # of each tensor's data, hashed into the fingerprint


def proj_name(il: int, variant: str) -> str:
    return f"blk.{il}.loki_proj_{variant}"


def var_name(il: int, variant: str) -> str:
    return f"blk.{il}.loki_var_{variant}"


def is_loki_tensor(name: str) -> bool:
    return ".loki_" in name


def open_reader(path) -> gguf.GGUFReader:
    """gguf's reader of `path`; SparqError for a missing or unreadable file."""
    path = Path(path)
    if not path.is_file():
        raise SparqError(f"file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on damaged files
        raise SparqError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def explained_variance_ratio(var: np.ndarray) -> np.ndarray:
    total = var.sum(axis=-1, keepdims=True)
    return np.divide(var, total, out=np.zeros_like(var, dtype=np.float64), where=total > 0)


def rank_at(var: np.ndarray, fraction: float = 0.9) -> np.ndarray:
    """Loki's Rank_l,h@v: the least d with sum_{j<=d} lambda_j / sum lambda >= v."""
    cum = np.cumsum(explained_variance_ratio(np.asarray(var, np.float64)), axis=-1)
    return np.argmax(cum >= fraction - 1e-12, axis=-1) + 1


# ---- model identity ---------------------------------------------------------------------------

def model_fingerprint(path, reader=None) -> str:
    """sha256 over the model's metadata, tensor infos, data size and the first 4 KiB of each tensor.

    Reads a few MB even for a 7 GB model. loki.* keys and loki tensors are left out, so a model
    copy with the projection embedded (--embed) has the fingerprint of the model it came from;
    for the same reason the data size stands in for the file size (the copy's file is larger).
    """
    reader = reader or open_reader(path)
    h = hashlib.sha256()
    # by name: key order is not part of a model's identity
    for kv in sorted(reader.fields.values(), key=lambda f: f.name):
        if kv.name.startswith(("GGUF.", "loki.")):
            continue
        for part in kv.parts:  # the key, the value type, and the value with its lengths, as stored
            h.update(part.tobytes())
    end = 0
    with open(path, "rb") as f:
        for t in reader.tensors:
            if is_loki_tensor(t.name):
                continue
            rel = int(t.data_offset - reader.data_offset)
            h.update(f"{t.name}|{int(t.tensor_type)}|{list(map(int, t.shape))}|{rel}".encode())
            f.seek(t.data_offset)
            h.update(f.read(min(SAMPLE_BYTES, int(t.n_bytes))))
            end = max(end, rel + int(t.n_bytes))
    h.update(f"data_size={end}".encode())
    return h.hexdigest()


@dataclass(frozen=True)
class ModelIdentity:
    name: str
    size: int
    fingerprint: str
    arch: str

    @classmethod
    def of(cls, model_path, reader=None) -> "ModelIdentity":
        s = check_gguf(model_path)
        return cls(name=s.name, size=Path(model_path).stat().st_size,
                   fingerprint=model_fingerprint(model_path, reader), arch=s.arch)


# ---- reading ---------------------------------------------------------------------------------

def default_projection(model: Path) -> Path:
    """Where `sparq-cpp calibrate` writes a model's calibration (the Loki projection) by default."""
    return Path(model).with_name(Path(model).stem + ".loki.gguf")


@dataclass
class LokiProjection:
    """One variant's basis: P float32 [n_layer, n_head_kv, D, D] (column c = component c; k' = k P[il, h]),
    explained_variance float32 [n_layer, n_head_kv, D], and the file's metadata."""

    variant: str
    P: np.ndarray
    explained_variance: np.ndarray
    calibration_tokens: int
    model_name: str
    model_size: int
    model_fingerprint: str
    path: Path

    @property
    def n_layer(self) -> int:
        return self.P.shape[0]

    @property
    def n_head_kv(self) -> int:
        return self.P.shape[1]

    @property
    def head_dim(self) -> int:
        return self.P.shape[2]

    def explained_variance_ratio(self) -> np.ndarray:
        return explained_variance_ratio(self.explained_variance.astype(np.float64))

    def rank_at(self, fraction: float = 0.9) -> np.ndarray:
        return rank_at(self.explained_variance, fraction)


def read_projection(path, model_path=None, variant: str = "post") -> LokiProjection:
    """Read and check a projection file (or a model with one embedded). With model_path, also check
    that the projection was made for that model; SparqError names whatever does not match."""
    if variant not in VARIANTS:
        raise SparqError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    path = Path(path)
    r = open_reader(path)
    if metadata_value(r, "loki.version") is None:
        raise SparqError(f"{path} is not a Loki projection file (no loki.version key)")
    version = _int_field(r, path, "loki.version")
    if version != LOKI_VERSION:
        raise SparqError(f"{path}: loki.version {version} is not supported (this code reads {LOKI_VERSION})")
    variants = metadata_value(r, "loki.variants", [])
    variants = variants if isinstance(variants, list) else []  # a list of names, nothing else
    if variant not in variants:
        raise SparqError(f"{path} has no {variant!r} projection (it has {', '.join(map(str, variants)) or 'none'})")
    meta = {key: _int_field(r, path, f"loki.{key}") for key in ("n_layer", "n_head_kv", "head_dim", "calibration_tokens")}
    L, H, D = meta["n_layer"], meta["n_head_kv"], meta["head_dim"]
    if min(L, H, D) < 1:
        raise SparqError(f"{path}: loki.n_layer, loki.n_head_kv and loki.head_dim must be >= 1, got {L}, {H}, {D}")
    tensors = {t.name: t for t in r.tensors}
    # stacked from the checked tensors: sizes from the metadata alone could ask for any amount of memory
    P = np.ascontiguousarray(np.stack([np.swapaxes(_tensor(tensors, path, proj_name(il, variant), (H, D, D)), -1, -2)
                                       for il in range(L)]), np.float32)
    var = np.ascontiguousarray(np.stack([_tensor(tensors, path, var_name(il, variant), (H, D)) for il in range(L)]),
                               np.float32)
    if not np.isfinite(P).all():
        il = int(np.argwhere(~np.isfinite(P))[0][0])
        raise SparqError(f"{path}: {proj_name(il, variant)} holds a value that is not finite (NaN or inf); "
                         "calibrate the projection again")
    model_fp = str(metadata_value(r, "loki.model.fingerprint", ""))
    proj = LokiProjection(variant=variant, P=P, explained_variance=var,
                          calibration_tokens=meta["calibration_tokens"],
                          model_name=str(metadata_value(r, "loki.model.name", "")),
                          model_size=_int_field(r, path, "loki.model.size", 0), model_fingerprint=model_fp, path=path)
    if any(not is_loki_tensor(t) for t in tensors):
        # an embedded copy: its own model part must be the model the projection was made for
        _check_model(proj, path, model_fingerprint(path, r), "the model it is embedded in")
    if model_path is not None:
        _check_model_file(proj, model_path)
    return proj


def _int_field(reader, path, key, default=None) -> int:
    value = metadata_value(reader, key, default)
    if value is None:
        raise SparqError(f"{path}: missing key {key}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise SparqError(f"{path}: {key} must be an integer, got {str(value)[:60]}")
    return value


def _tensor(tensors, path, name, shape) -> np.ndarray:
    t = tensors.get(name)
    if t is None:
        raise SparqError(f"{path}: tensor {name} is missing")
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
        raise SparqError(f"{path}: tensor {name} is {t.tensor_type.name}, expected F32")
    data = np.asarray(t.data)
    if data.shape != shape:
        raise SparqError(f"{path}: tensor {name} has shape {list(data.shape)}, expected {list(shape)}")
    return data


def _check_model_file(proj: LokiProjection, model_path) -> None:
    s = check_gguf(model_path)
    got = (s.n_layer, s.n_head_kv, s.head_dim)
    want = (proj.n_layer, proj.n_head_kv, proj.head_dim)
    if got != want:
        raise SparqError(f"{proj.path} was made for a model with n_layer, n_head_kv, head_dim = {want}; "
                         f"{model_path} has {got}")
    _check_model(proj, proj.path, model_fingerprint(model_path), str(model_path))


def _check_model(proj: LokiProjection, path, fingerprint: str, what: str) -> None:
    if fingerprint != proj.model_fingerprint:
        raise SparqError(f"{path} was made for another model ({proj.model_name!r}, {proj.model_size} bytes, "
                         f"fingerprint {proj.model_fingerprint[:12]}), not {what} (fingerprint {fingerprint[:12]})")
