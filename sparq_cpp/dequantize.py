"""An f32 copy of a GGUF model: every tensor dequantized, every metadata key kept (file type set to
all-f32). llama.cpp then runs the same model without weight-quantization rounding (its q8_0 matmuls
also quantize the activations), so the sparse attention paths can be checked against the reference
to f32 tolerance on a model that was shipped quantized."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import open_gguf
from sparq_cpp.outfile import atomic_write, check_writable

_FILE_TYPE_ALL_F32 = 0


def dequantize_gguf(src, out, progress=None) -> Path:
    """Write `out`, an f32 copy of the GGUF `src`; `progress(i, n)` after each tensor."""
    import gguf
    from gguf.quants import dequantize

    src, out = Path(src), Path(out).expanduser()
    reader = open_gguf(src)
    if "general.architecture" not in reader.fields:
        raise SparqError(f"{src} has no general.architecture: not a model file")
    if out.resolve() == src.resolve():
        raise SparqError("--out: the copy cannot replace the model it is made from")
    check_writable(out, "--out")
    arch = reader.fields["general.architecture"].contents()

    def write(tmp: Path) -> None:
        w = gguf.GGUFWriter(tmp, arch)
        for name, field in reader.fields.items():
            if name.startswith("GGUF.") or name == "general.architecture":
                continue  # the reader's own fields; the writer adds the architecture
            if name == "general.file_type":
                w.add_uint32(name, _FILE_TYPE_ALL_F32)
            elif field.types[0] == gguf.GGUFValueType.ARRAY:
                w.add_array(name, field.contents())
            else:
                w.add_key_value(name, field.contents(), field.types[0])
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
