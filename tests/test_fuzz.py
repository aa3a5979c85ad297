"""Fuzzing: damaged model and projection files through `sparq-cpp generate` and through the stock
llama-completion with LLAMA_SPARSE_ATTN. Whatever a mutant does, no process may die of a signal
(segfault, abort), print a Python traceback, or hang; a clear refusal or a run are both fine.

Mutants are deterministic (seeded): bytes flipped in the metadata, the tensor table or the tensor
data, runs of bytes overwritten with NaN/inf/huge floats, truncations. The fast tier runs a sample;
the slow tier (`make test-slow`) runs 400 model and 100 projection mutants."""
from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402

TIMEOUT = 60
PROMPT = "Once upon a time there was a little house by the sea, and in it lived an old man and his dog."
SPECIAL = [np.nan, np.inf, -np.inf, 65504.0, 1e30, -1e30]


def mutate(data: bytes, seed: int, data_start: int, f32_tensors=()) -> bytes:
    """One mutant of `data` (a GGUF), the kind chosen by the seed. f32_tensors: (start, n) of f32
    tensors in the file, whose values the last kind replaces (q/k weights, projections)."""
    rng = np.random.default_rng(seed)
    b = bytearray(data)
    kind = seed % 6 if f32_tensors else seed % 5
    if kind == 0:  # flip bytes in the metadata and the tensor table
        for _ in range(int(rng.integers(1, 8))):
            i = int(rng.integers(4, data_start))
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # overwrite a little-endian integer in the header with an extreme value
        i = int(rng.integers(4, data_start - 8))
        b[i:i + 8] = struct.pack("<q", int(rng.choice([0, -1, 2**31 - 1, 2**31, 2**62, 1])))
    elif kind == 2:  # special floats in the tensor data
        for _ in range(int(rng.integers(1, 6))):
            i = int(rng.integers(data_start, len(b) - 4)) & ~3
            b[i:i + 4] = struct.pack("<f", float(rng.choice(SPECIAL)))
    elif kind == 3:  # random bytes over the tensor data
        i = int(rng.integers(data_start, len(b) - 64))
        b[i:i + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    elif kind == 4:  # truncated
        b = b[: int(rng.integers(8, len(b)))]
    else:  # special or huge values in a whole f32 tensor's elements, or all of them scaled
        start, n = f32_tensors[int(rng.integers(0, len(f32_tensors)))]
        x = np.frombuffer(bytes(b[start:start + 4 * n]), dtype=np.float32).copy()
        if rng.random() < 0.5:
            x *= np.float32(rng.choice([1e4, 1e8, 1e30]))
        else:
            x[rng.integers(0, n, int(rng.integers(1, 8)))] = rng.choice(SPECIAL)
        b[start:start + 4 * n] = x.tobytes()
    return bytes(b)


def _layout(path, names=("attn_q", "attn_k", "loki_proj")):
    """(data start, [(start, n)] of the f32 tensors whose name holds one of `names`)."""
    from sparq_cpp.gguf_check import GGUFHeader

    h = GGUFHeader(path)
    tensors = [(h.data_start + off, int(np.prod(dims))) for name, dims, ttype, off in h.tensors
               if ttype == 0 and any(k in name for k in names)]
    return h.data_start, tensors


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    model = write_model(root / "small.gguf", "tiny-gqa", layers=1, wtype="f32", seed=9, n_embd=256, n_head=4,
                        n_head_kv=2, n_ff=256, n_vocab=512, n_ctx_train=512)
    from sparq_cpp.calib import calibrate, write_projection
    from conftest import calibration_text

    pca = calibrate(model, calibration_text(), n_tokens=256, ctx_size=256, n_threads=1)
    proj = write_projection(root / "small.loki.gguf", pca, model, ctx_size=256)
    return root, model, proj


def _check(proc_args, env=None, what=""):
    try:
        proc = subprocess.run(proc_args, capture_output=True, text=True, errors="replace", timeout=TIMEOUT,
                              stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        return f"{what}: hang (no exit within {TIMEOUT} s)"
    if proc.returncode < 0:
        return f"{what}: killed by {signal.Signals(-proc.returncode).name}: {proc.stderr[-600:]}"
    if "Traceback" in proc.stderr:
        return f"{what}: Python traceback: {proc.stderr[-1200:]}"
    return None


def _cli(*args):
    return [sys.executable, "-m", "sparq_cpp.cli.main", *map(str, args)]


def run_model_mutants(base, seeds):
    root, model, _ = base
    data, (start, tensors) = model.read_bytes(), _layout(model)
    completion = str(tool_path("llama-completion"))
    env = dict(os.environ, LLAMA_SPARSE_ATTN="sparq:r=8,k=8,l=2")
    failures = []
    for seed in seeds:
        path = root / f"mutant-{seed}.gguf"
        path.write_bytes(mutate(data, seed, start, tensors))
        # a prompt longer than k, so that decoding selects (the path a NaN used to abort)
        for args, e in ((_cli("generate", "--gguf", path, "-n", "4", "--r", "8", "--k", "8", "--l", "2", "-c", "128",
                              "-t", "1", "--temp", "0", "-p", PROMPT), None),
                        ([completion, "-m", path, "-n", "4", "-c", "128", "-fa", "on", "-no-cnv", "-t", "1",
                          "-p", PROMPT], env)):
            msg = _check(args, e, f"model mutant {seed}, {os.path.basename(args[0])}")
            if msg:
                failures.append(msg)
        path.unlink()
    return failures


def run_projection_mutants(base, seeds):
    root, model, proj = base
    data, (start, tensors) = proj.read_bytes(), _layout(proj)
    failures = []
    for seed in seeds:
        path = root / f"mutant-{seed}.loki.gguf"
        path.write_bytes(mutate(data, seed, start, tensors))
        msg = _check(_cli("generate", "--gguf", model, "-n", "4", "--attn", "loki", "--d", "8", "--k", "8",
                          "--loki-pca", path, "-c", "128", "-t", "1", "--temp", "0", "-p", PROMPT), None,
                     f"projection mutant {seed}")
        if msg:
            failures.append(msg)
        path.unlink()
    return failures


def test_fuzz_sample(base):
    failures = run_model_mutants(base, range(10)) + run_projection_mutants(base, range(5))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_fuzz_400_model_and_100_projection_mutants(base):
    failures = run_model_mutants(base, range(1000, 1400)) + run_projection_mutants(base, range(2000, 2100))
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:20])
