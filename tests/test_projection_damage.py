"""One check of a Loki projection file, wherever it is loaded: the same damaged files go to the Python reader
(`generate`, the Python API, `eval`) and to libllama's loader (every stock tool, `--sparse-attn loki:...,proj=`),
and each is refused by both, naming what is wrong."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

llama_cpp = pytest.importorskip("llama_cpp")
from conftest import calibrated_projection, rewrite_gguf  # noqa: E402
from llama_session import captured_log  # noqa: E402
from sparq_cpp.bindings import sparse_api  # noqa: E402
from sparq_cpp.errors import SparqError  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.projection import read_projection  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402


def _retensor(src: Path, dst: Path, drop=(), reshape=()) -> Path:
    """src copied to dst with the tensors named in drop left out and those in reshape given one column less."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, r.fields["general.architecture"].contents())
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub_type=sub)
    for t in r.tensors:
        if t.name in drop:
            continue
        data = np.asarray(t.data)
        w.add_tensor(t.name, np.ascontiguousarray(data[..., :-1]) if t.name in reshape else data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    root = tmp_path_factory.mktemp("projection-damage")
    model = write_model(root / "tiny.gguf", "tiny", wtype="f32", seed=3)
    other = write_model(root / "other.gguf", "tiny", wtype="f32", seed=4)  # same shape and name, other weights
    proj = calibrated_projection(model, root)
    foreign = calibrated_projection(other, root)
    data = proj.read_bytes()
    files = {
        "cut by one byte": root / "cut.loki.gguf",
        "a blank model fingerprint": rewrite_gguf(proj, root / "blank.loki.gguf", {"loki.model.fingerprint": ""}),
        "another model's fingerprint": foreign,
        "a missing variance tensor": _retensor(proj, root / "novar.loki.gguf", drop=("blk.1.loki_var_post",)),
        "a missing basis tensor": _retensor(proj, root / "noproj.loki.gguf", drop=("blk.0.loki_proj_post",)),
        "a variance tensor of the wrong shape": _retensor(proj, root / "shape.loki.gguf", reshape=("blk.0.loki_var_post",)),
        "an unknown version": rewrite_gguf(proj, root / "v2.loki.gguf", {"loki.version": 2}),
        "no post-RoPE variant": rewrite_gguf(proj, root / "pre.loki.gguf", {"loki.variants": (["pre"], gguf.GGUFValueType.ARRAY)}),
    }
    files["cut by one byte"].write_bytes(data[:-1])
    return model, proj, files


def _stock(model, proj) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}
    return subprocess.run([tool_path("llama-completion"), "-m", str(model), "-p", "hello", "-n", "2", "-no-cnv",
                           "-c", "128", "-t", "1", "-fa", "on", "--sparse-attn", f"loki:d=16,k=16,proj={proj}"],
                          capture_output=True, text=True, errors="replace", timeout=120, stdin=subprocess.DEVNULL,
                          env=env)


def test_the_intact_projection_loads_in_both(damaged):
    model, proj, _ = damaged
    read_projection(proj, model)
    proc = _stock(model, proj)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("kind", ["cut by one byte", "a blank model fingerprint", "another model's fingerprint",
                                  "a missing variance tensor", "a missing basis tensor",
                                  "a variance tensor of the wrong shape", "an unknown version",
                                  "no post-RoPE variant"])
def test_a_damaged_projection_is_refused_by_python_and_by_libllama(damaged, kind):
    """Refused by the Python reader, by libllama's loader (its message checked in-process: a tool's asynchronous
    log may lose its last lines when it exits at once) and so by llama-completion, with an exit status."""
    model, _, files = damaged
    with pytest.raises(SparqError):
        read_projection(files[kind], model)
    loaded = llama_cpp.llama_model_load_from_file(str(model).encode(), llama_cpp.llama_model_default_params())
    try:
        with captured_log() as log:
            rc = sparse_api.lib().llama_sparse_attn_load_projection(loaded, str(files[kind]).encode(), False)
    finally:
        llama_cpp.llama_model_free(loaded)
    assert rc != 0, f"libllama loaded a projection with {kind}"
    assert any(str(files[kind]) in line for line in log), "".join(log[-5:])
    proc = _stock(model, files[kind])
    assert proc.returncode > 0, f"a projection with {kind} ran in llama-completion ({proc.returncode})"
