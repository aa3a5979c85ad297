"""The Loki projection GGUF: write it, or embed it into a model copy. The format (tensors, loki.* keys, the
model identity) is described, and read back with every check, in sparq_cpp.projection."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.gguf_writer import WriterState

from sparq_cpp.calib.pca import LokiPCA
from sparq_cpp.errors import SparqError
from sparq_cpp.outfile import atomic_write
from sparq_cpp.projection import (LOKI_VERSION, VARIANTS, ModelIdentity, is_loki_tensor, open_reader, proj_name,
                                  var_name)

# llama.cpp creates the optional blk.N.loki_proj_* tensors in these architectures' tensor lists only;
# in any other model they are extra tensors, and llama.cpp refuses the file
EMBED_ARCHS = ("llama",)
_COPY_CHUNK = 1 << 24


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


def _add_fidelity_metadata(w, fid: dict | None) -> None:
    """calib.budget's measurement (see sparq_cpp.projection.Fidelity for the keys)."""
    if fid is None:
        return
    c = fid["candidates"]
    w.add_uint32("loki.fidelity.ctx", fid["ctx"])
    w.add_uint32("loki.fidelity.windows", fid["windows"])
    w.add_bool("loki.fidelity.held_out", bool(fid.get("held_out", False)))
    w.add_array("loki.fidelity.layers", [int(x) for x in fid["layers"]])
    w.add_array("loki.fidelity.method", [x["method"] for x in c])
    w.add_array("loki.fidelity.ratio", [float(x["ratio"]) for x in c])
    w.add_array("loki.fidelity.rank", [int(x["rank"]) for x in c])
    w.add_array("loki.fidelity.k", [int(x["k"]) for x in c])
    w.add_array("loki.fidelity.l", [int(x["l"]) for x in c])
    w.add_array("loki.fidelity.sink", [int(x["sink"]) for x in c])
    w.add_array("loki.fidelity.mass", [float(v) for row in fid["mass"] for v in row])
    w.add_array("loki.fidelity.exact_mass", [float(v) for row in fid["exact_mass"] for v in row])
    w.add_array("loki.fidelity.error", [float(v) for row in fid["error"] for v in row])
    w.add_array("loki.fidelity.exact_error", [float(v) for row in fid["exact_error"] for v in row])
    probe = fid.get("probe")
    if probe is not None:  # calib.probe's end-to-end measurement of some candidates
        w.add_uint32("loki.fidelity.probe_samples", int(probe["samples"]))
        w.add_array("loki.fidelity.probed", [int(x) for x in probe["probed"]])
        w.add_array("loki.fidelity.probe_text", [float(x) for x in probe["text"]])
        w.add_array("loki.fidelity.probe_copy", [float(x) for x in probe["copy"]])
        w.add_array("loki.fidelity.probe_dense", [float(probe["dense_text"]), float(probe["dense_copy"])])
        if probe.get("domains"):  # the text's loss per domain (probe_text is the worst domain's)
            w.add_array("loki.fidelity.probe_domains", [str(d) for d in probe["domains"]])
            w.add_array("loki.fidelity.probe_domain_loss", [float(v) for row in probe["domain_text"] for v in row])
            w.add_array("loki.fidelity.probe_domain_dense", [float(x) for x in probe["domain_dense"]])


def _loki_tensors(pca: LokiPCA):
    """(name, f32 array) in file order: per layer, proj then var, pre then post."""
    L = pca.explained_variance["post"].shape[0]
    for il in range(L):
        for v in VARIANTS:
            # P^T per head (see the module docstring for why the transpose)
            yield proj_name(il, v), np.ascontiguousarray(np.swapaxes(pca.components[v][il], -1, -2), np.float32)
            yield var_name(il, v), np.ascontiguousarray(pca.explained_variance[v][il], np.float32)


def write_projection(path, pca: LokiPCA, model_path, *, ctx_size: int, fidelity: dict | None = None,
                     what: str = "output") -> Path:
    """Write the standalone projection file for the model at model_path (with calib.budget's `fidelity`);
    `what` (the option that named the path) starts an error's message."""
    model = ModelIdentity.of(model_path)

    def write(tmp):
        w = gguf.GGUFWriter(tmp, model.arch)
        try:
            w.add_type("loki-projection")
            w.add_name(f"{model.name} Loki projection")
            _add_loki_metadata(w, pca, model, ctx_size)
            _add_fidelity_metadata(w, fidelity)
            for name, arr in _loki_tensors(pca):
                w.add_tensor(name, arr)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()

    return atomic_write(path, write, what)


def check_embeddable(arch: str) -> None:
    if arch not in EMBED_ARCHS:
        raise SparqError(f"--embed: llama.cpp loads an embedded Loki projection in {', '.join(EMBED_ARCHS)} models "
                         f"only, not {arch}; write the projection file (without --embed) and pass it with --loki-pca")


def embed_projection(out_path, pca: LokiPCA, model_path, *, ctx_size: int, fidelity: dict | None = None,
                     what: str = "output") -> Path:
    """A copy of the model GGUF with the Loki tensors and loki.* keys added (gguf_new_metadata's
    approach); tensor data is streamed in 16 MiB pieces, so memory stays bounded."""
    model_path = Path(model_path)
    out_path = Path(out_path).expanduser()
    if out_path.exists() and out_path.resolve() == model_path.resolve():
        raise SparqError(f"the embedded copy cannot overwrite the model itself ({model_path}); choose another --out")
    reader = open_reader(model_path)
    model = ModelIdentity.of(model_path, reader)
    check_embeddable(model.arch)
    if reader.endianess != gguf.GGUFEndian.LITTLE:
        raise SparqError(f"{model_path} is a big-endian GGUF; --embed supports little-endian files only")
    if any(is_loki_tensor(t.name) for t in reader.tensors):
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
            _add_fidelity_metadata(w, fidelity)
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

    return atomic_write(out_path, write, what)


def _write_streamed(w, src, offset: int, nbytes: int) -> None:
    """GGUFWriter.write_tensor_data for bytes still in the source file, copied piece by piece
    (relies on GGUFWriter's internals as of gguf 0.19.0, which pyproject pins)."""
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


