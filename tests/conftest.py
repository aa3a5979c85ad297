"""Helpers shared by test files."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def rewrite_gguf(src, dst, changes: dict | None = None, drop=()) -> Path:
    """Copy the GGUF `src` to `dst` with metadata keys changed or dropped; tensors are copied as stored.

    A change is a value or (value, GGUFValueType). A bare value keeps an existing key's type; a new
    int is a uint32, a new str or bytes a string. Bytes are written as they are (need not be UTF-8)."""
    import gguf

    changes = dict(changes or {})
    reader = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in drop:
            continue
        if name in changes:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for name, value in changes.items():
        if isinstance(value, tuple):
            value, vtype = value
        elif name in reader.fields:
            vtype = reader.fields[name].types[0]
        else:
            vtype = gguf.GGUFValueType.UINT32 if isinstance(value, int) else gguf.GGUFValueType.STRING
        w.add_key_value(name, value, vtype)
    for t in reader.tensors:  # the reader's arrays have numpy's shape (quantized: bytes per row)
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def retag_gguf(src, dst, arch: str, extra: dict | None = None, extra_tensors: dict | None = None) -> Path:
    """Copy the GGUF `src` to `dst` as architecture `arch`: keys under the old architecture's prefix are
    renamed, `extra` keys added (a value, or (value, "f32") for a float32; ints become uint32) and
    `extra_tensors` (name: f32 array) appended. Tensors are copied as stored."""
    import gguf

    reader = gguf.GGUFReader(src)
    old = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        new = arch + name[len(old):] if name.startswith(old + ".") else name
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(new, field.contents(), field.types[0], sub_type=sub_type)
    for name, value in (extra or {}).items():
        if isinstance(value, tuple):
            w.add_float32(name, float(value[0]))
        elif isinstance(value, int):
            w.add_uint32(name, value)
        else:
            w.add_string(name, value)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)
