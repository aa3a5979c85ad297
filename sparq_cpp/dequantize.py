"""An f32 copy of a GGUF model: every tensor dequantized, every metadata key kept (file type set to
all-f32). llama.cpp then runs the same model without weight-quantization rounding (its q8_0 matmuls
also quantize the activations), so the sparse attention paths can be checked against the reference
to f32 tolerance on a model that was shipped quantized."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf.quants import dequantize

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf, metadata_value, open_gguf
from sparq_cpp.outfile import atomic_write, check_space, check_writable, fmt_bytes
from sparq_cpp import system

_FILE_TYPE_ALL_F32 = 0


def dequantize_gguf(src, out, progress=None) -> Path:
    """Write `out`, an f32 copy of the GGUF `src`; `progress(i, n)` after each tensor."""
    src, out = Path(src), Path(out).expanduser()
    summary = check_gguf(src)  # a model the copy could not be used as is refused before writing
    reader = open_gguf(src)
    if out.resolve() == src.resolve():
        raise SparqError("--out: the copy cannot replace the model it is made from")
    check_writable(out, "--out")
    _check_dequantizable(reader, src)
    _check_resources(reader, out)
    metadata = _metadata(reader, src)

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, summary.arch)
        for name, value, vtype in metadata:
            if name == "general.file_type":
                w.add_uint32(name, _FILE_TYPE_ALL_F32)
            elif vtype == gguf.GGUFValueType.ARRAY:
                w.add_array(name, value)
            else:
                w.add_key_value(name, value, vtype)
        n = len(reader.tensors)
        for i, t in enumerate(reader.tensors):
            shape = tuple(int(x) for x in reversed(t.shape.tolist()))
            w.add_tensor(t.name, np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape))
            if progress:
                progress(i + 1, n)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()

    return atomic_write(out, write, "--out")


def _check_dequantizable(reader, src: Path) -> None:
    """Each tensor type the gguf package can dequantize (one row of each tried), before writing."""
    tried = set()
    for t in reader.tensors:
        if t.tensor_type in tried:
            continue
        try:
            dequantize(np.asarray(t.data)[:1], t.tensor_type)
        except NotImplementedError:
            raise SparqError(f"{src}: tensor {t.name} is {t.tensor_type.name}, "
                             "which the gguf package cannot dequantize") from None
        tried.add(t.tensor_type)


def _metadata(reader, src: Path) -> list:
    """(name, value, type) of every key to copy, read now: a value that cannot be read fails before
    anything is written. The reader's own GGUF.* fields and the architecture (the writer adds it) are left out."""
    return [(name, metadata_value(reader, name), field.types[0]) for name, field in reader.fields.items()
            if not name.startswith("GGUF.") and name != "general.architecture"]


def _check_resources(reader, out: Path) -> None:
    """The writer holds every f32 tensor until it writes the file: memory and disk for all of them."""
    nbytes = sum(int(np.prod(t.shape, dtype=np.int64)) * 4 for t in reader.tensors)
    avail = system.mem_available()  # 0: unknown
    if avail and nbytes > avail:
        raise SparqError(f"the f32 copy is about {fmt_bytes(nbytes)}, built in memory; {fmt_bytes(avail)} is available")
    check_space(out, nbytes, "--out")
