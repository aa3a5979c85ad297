"""The Loki projection GGUF: write it, read it back with every check, or embed it into a model copy.

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

import numpy as np

from sparq_cpp.outfile import atomic_write
from sparq_cpp.calib.pca import VARIANTS, LokiPCA, explained_variance_ratio, rank_at
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import _field  # a metadata string that is not UTF-8 is a SparqError

LOKI_VERSION = 1
# llama.cpp creates the optional blk.N.loki_proj_* tensors in these architectures' tensor lists only;
# in any other model they are extra tensors, and llama.cpp refuses the file
EMBED_ARCHS = ("llama",)
_SAMPLE_BYTES = 4096  # of each tensor's data, hashed into the fingerprint
_COPY_CHUNK = 1 << 24


def proj_name(il: int, variant: str) -> str:
    return f"blk.{il}.loki_proj_{variant}"


def var_name(il: int, variant: str) -> str:
    return f"blk.{il}.loki_var_{variant}"


def _is_loki_tensor(name: str) -> bool:
    return ".loki_" in name


def _reader(path):
    import gguf

    path = Path(path)
    if not path.is_file():
        raise SparqError(f"file not found: {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the gguf package raises assorted errors on damaged files
        raise SparqError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


# ---- model identity ---------------------------------------------------------------------------

def model_fingerprint(path, reader=None) -> str:
    """sha256 over the model's metadata, tensor infos, data size and the first 4 KiB of each tensor.

    Reads a few MB even for a 7 GB model. loki.* keys and loki tensors are left out, so a model
    copy with the projection embedded (--embed) has the fingerprint of the model it came from;
    for the same reason the data size stands in for the file size (the copy's file is larger).
    """
    reader = reader or _reader(path)
    h = hashlib.sha256()
    # by name: key order is not part of a model's identity
    for field in sorted(reader.fields.values(), key=lambda f: f.name):
        if field.name.startswith(("GGUF.", "loki.")):
            continue
        for part in field.parts:  # the key, the value type, and the value with its lengths, as stored
            h.update(part.tobytes())
    end = 0
    with open(path, "rb") as f:
        for t in reader.tensors:
            if _is_loki_tensor(t.name):
                continue
            rel = int(t.data_offset - reader.data_offset)
            h.update(f"{t.name}|{int(t.tensor_type)}|{list(map(int, t.shape))}|{rel}".encode())
            f.seek(t.data_offset)
            h.update(f.read(min(_SAMPLE_BYTES, int(t.n_bytes))))
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
        from sparq_cpp.gguf_check import check_gguf

        s = check_gguf(model_path)
        return cls(name=s.name, size=Path(model_path).stat().st_size,
                   fingerprint=model_fingerprint(model_path, reader), arch=s.arch)


# ---- writing ---------------------------------------------------------------------------------

def _add_loki_metadata(w, pca: LokiPCA, model: ModelIdentity, ctx_size: int) -> None:
    L, H, D = pca.explained_variance["post"].shape
    w.add_uint32("loki.version", LOKI_VERSION)
    w.add_array("loki.variants", list(VARIANTS))
    w.add_uint64("loki.calibration_tokens", pca.n_tokens)
    w.add_uint32("loki.calibration_ctx", ctx_size)
    w.add_uint32("loki.n_layer", L)
    w.add_uint32("loki.n_head_kv", H)
    w.add_uint32("loki.head_dim", D)
    if pca.layers is not None:
        # models with sliding-window layers (gemma3): only these layers were calibrated; the others
        # hold the identity basis with zero variance, so a loader that rotates every layer is exact
        w.add_array("loki.calibrated_layers", list(pca.layers))
    w.add_string("loki.model.name", model.name)
    w.add_uint64("loki.model.size", model.size)
    w.add_string("loki.model.fingerprint", model.fingerprint)


def _loki_tensors(pca: LokiPCA):
    """(name, f32 array) in file order: per layer, proj then var, pre then post."""
    L = pca.explained_variance["post"].shape[0]
    for il in range(L):
        for v in VARIANTS:
            # P^T per head (see the module docstring for why the transpose)
            yield proj_name(il, v), np.ascontiguousarray(np.swapaxes(pca.components[v][il], -1, -2), np.float32)
            yield var_name(il, v), np.ascontiguousarray(pca.explained_variance[v][il], np.float32)


def write_projection(path, pca: LokiPCA, model_path, *, ctx_size: int) -> Path:
    """Write the standalone projection file for the model at model_path."""
    import gguf

    model = ModelIdentity.of(model_path)

    def write(tmp):
        w = gguf.GGUFWriter(tmp, model.arch)
        try:
            w.add_type("loki-projection")
            w.add_name(f"{model.name} Loki projection")
            _add_loki_metadata(w, pca, model, ctx_size)
            for name, arr in _loki_tensors(pca):
                w.add_tensor(name, arr)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()

    return atomic_write(path, write)


def check_embeddable(arch: str) -> None:
    if arch not in EMBED_ARCHS:
        raise SparqError(f"--embed: llama.cpp loads an embedded Loki projection in {', '.join(EMBED_ARCHS)} models "
                         f"only, not {arch}; write the projection file (without --embed) and pass it with --loki-pca")


def embed_projection(out_path, pca: LokiPCA, model_path, *, ctx_size: int) -> Path:
    """A copy of the model GGUF with the Loki tensors and loki.* keys added (gguf_new_metadata's
    approach); tensor data is streamed in 16 MiB pieces, so memory stays bounded."""
    import gguf

    model_path = Path(model_path)
    out_path = Path(out_path).expanduser()
    if out_path.exists() and out_path.resolve() == model_path.resolve():
        raise SparqError(f"the embedded copy cannot overwrite the model itself ({model_path}); choose another --out")
    reader = _reader(model_path)
    model = ModelIdentity.of(model_path, reader)
    check_embeddable(model.arch)
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise SparqError(f"{model_path} is a big-endian GGUF; --embed supports little-endian files only")
    if any(_is_loki_tensor(t.name) for t in reader.tensors):
        raise SparqError(f"{model_path} already has Loki tensors embedded; embed into the original model")
    new = list(_loki_tensors(pca))

    def write(tmp):
        w = gguf.GGUFWriter(tmp, model.arch)
        try:
            for field in reader.fields.values():
                # GGUFWriter writes general.architecture itself; GGUF.* are the reader's virtual fields
                if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                    continue
                if field.name == gguf.Keys.General.ALIGNMENT:  # must also set the writer's padding
                    w.add_custom_alignment(int(field.contents()))
                    continue
                vtype = field.types[0]
                sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
                w.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
            _add_loki_metadata(w, pca, model, ctx_size)
            for t in reader.tensors:  # old tensors first, in their order, then the new ones
                w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
            for name, arr in new:
                w.add_tensor_info(name, arr.shape, arr.dtype, arr.nbytes)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            with open(model_path, "rb") as src:
                for t in reader.tensors:
                    _write_streamed(w, src, int(t.data_offset), int(t.n_bytes))
            for _, arr in new:
                w.write_tensor_data(arr)
        finally:
            w.close()

    return atomic_write(out_path, write)


def _write_streamed(w, src, offset: int, nbytes: int) -> None:
    """GGUFWriter.write_tensor_data for bytes still in the source file, copied piece by piece
    (relies on GGUFWriter's internals as of gguf 0.19.0, which pyproject pins)."""
    from gguf.gguf_writer import WriterState

    fout = w.fout[0]
    ti = w.tensors[0].pop(next(iter(w.tensors[0])))
    assert ti.nbytes == nbytes
    w.write_padding(fout, fout.tell())
    src.seek(offset)
    left = nbytes
    while left:
        buf = src.read(min(_COPY_CHUNK, left))
        if not buf:
            raise SparqError(f"{src.name} ended inside tensor data; the model file is truncated")
        fout.write(buf)
        left -= len(buf)
    w.write_padding(fout, nbytes)
    w.state = WriterState.WEIGHTS


# ---- reading ---------------------------------------------------------------------------------

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
    r = _reader(path)
    if _field(r, "loki.version") is None:
        raise SparqError(f"{path} is not a Loki projection file (no loki.version key)")
    version = _int_field(r, path, "loki.version")
    if version != LOKI_VERSION:
        raise SparqError(f"{path}: loki.version {version} is not supported (this code reads {LOKI_VERSION})")
    variants = _field(r, "loki.variants", [])
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
    model_fp = str(_field(r, "loki.model.fingerprint", ""))
    proj = LokiProjection(variant=variant, P=P, explained_variance=var,
                          calibration_tokens=meta["calibration_tokens"],
                          model_name=str(_field(r, "loki.model.name", "")),
                          model_size=_int_field(r, path, "loki.model.size", 0), model_fingerprint=model_fp, path=path)
    if any(not _is_loki_tensor(t) for t in tensors):
        # an embedded copy: its own model part must be the model the projection was made for
        _check_model(proj, path, model_fingerprint(path, r), "the model it is embedded in")
    if model_path is not None:
        _check_model_file(proj, model_path)
    return proj


def _int_field(reader, path, key, default=None) -> int:
    value = _field(reader, key, default)
    if value is None:
        raise SparqError(f"{path}: missing key {key}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise SparqError(f"{path}: {key} must be an integer, got {str(value)[:60]}")
    return value


def _tensor(tensors, path, name, shape) -> np.ndarray:
    import gguf

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
    from sparq_cpp.gguf_check import check_gguf

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
