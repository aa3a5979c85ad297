"""Fuzzing what a server restores and what a model file claims: corrupted and cross-mode state blobs loaded
into dense, SparQ, Loki and ALISA contexts, model metadata values that later code would assert on, projections
truncated inside their tensor data. Whatever a mutant does, no process may die of a signal, print a Python
traceback or hang; a refusal, or a load that continues decoding, are both fine.

Each run of mutants happens in a child process (a crash there is the finding, not the end of the test run); the
fast tier runs a sample, the slow tier (`make test-slow`) 600 state mutants and 400 metadata and projection ones."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from conftest import rewrite_gguf  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402

TIMEOUT = 600
MODES = {"dense": "dense", "sparq": "sparq:r=8,k=16,l=4", "alisa": "alisa:c=0.5"}  # loki: added with its projection

# the child: a context per mode, each mutant blob loaded into each (whole state, then sequence state), one decode
# step after a load that succeeded; prints one JSON line per mutant so that a crash names the mutant
CHILD = r'''
import ctypes, json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from llama_session import Session
from sparq_cpp.attention import parse_attention
model, modes, blobs = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
sessions = {m: Session(model, parse_attention(spec), cache_type="f16", n_ctx=256) for m, spec in modes.items()}
for path in blobs:
    data = open(path, "rb").read()
    out = {"blob": path}
    for m, s in sessions.items():
        buf = (ctypes.c_uint8 * max(1, len(data))).from_buffer_copy(data or b"\0")
        whole = path.endswith(".whole")
        n = (s.C.llama_state_set_data(s.ctx, buf, len(data)) if whole
             else s.C.llama_state_seq_set_data(s.ctx, buf, len(data), 0))
        if n:
            pos = s.C.llama_memory_seq_pos_max(s.mem, 0) + 1
            if 0 <= pos < 250:
                s.decode([(5, pos, 0, True)])
        s.clear()
        out[m] = bool(n)
    print(json.dumps(out), flush=True)
'''


def _mutate(blob: bytes, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    b = bytearray(blob)
    kind = seed % 4
    if kind == 0:  # flipped bits anywhere
        for _ in range(int(rng.integers(1, 6))):
            i = int(rng.integers(0, len(b)))
            b[i] ^= 1 << int(rng.integers(0, 8))
    elif kind == 1:  # an extreme integer in the first 64 bytes (magic, counts, the layout header)
        i = int(rng.integers(0, min(56, len(b) - 8)))
        b[i:i + 8] = int(rng.choice([0, 1, 2**31 - 1, 2**32 - 1, 2**63 - 1])).to_bytes(8, "little")
    elif kind == 2:  # truncated
        b = b[: int(rng.integers(0, len(b)))]
    else:  # random bytes over a run
        i = int(rng.integers(0, max(1, len(b) - 32)))
        b[i:i + 32] = rng.integers(0, 256, 32, dtype=np.uint8).tobytes()
    return bytes(b)


def _run_child(model, modes, blobs, tmp_path, child=CHILD):
    """Every blob through the child, restarted after a crash; returns (results, failures)."""
    here = str(Path(__file__).parent)
    results, failures, todo = [], [], list(blobs)
    while todo:
        proc = subprocess.run([sys.executable, "-c", child, here, str(model), json.dumps(modes), *map(str, todo)],
                              capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
        done = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
        results += done
        if proc.returncode != 0 or "Traceback" in proc.stderr:
            bad = todo[len(done)] if len(done) < len(todo) else "after the last blob"
            why = (f"signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
                   else f"exit {proc.returncode}")
            failures.append(f"{bad}: {why}: {proc.stderr.strip().splitlines()[-1:] if proc.stderr.strip() else ''}")
            todo = todo[len(done) + 1:]
        else:
            todo = todo[len(done):]
            assert not todo, proc.stderr[-2000:]
    return results, failures


@pytest.fixture(scope="module")
def states(tmp_path_factory):
    """State blobs (whole context and sequence 0) saved by a context of each mode after a short prompt."""
    from conftest import calibrated_projection
    from llama_session import Session

    from sparq_cpp.attention import parse_attention

    root = tmp_path_factory.mktemp("fuzz-states")
    model = write_model(root / "tiny.gguf", "tiny", wtype="f32", seed=3)
    proj = calibrated_projection(model, root)
    modes = {**MODES, "loki": f"loki:d=16,k=16,proj={proj}"}
    blobs = {}
    prompt = [1] + list(range(20, 80))
    for m, spec in modes.items():
        with Session(model, parse_attention(spec), cache_type="f16", n_ctx=256) as s:
            s.prompt(prompt)
            blobs[m] = {"whole": s.state(), "seq": s.seq_state(0)}
    return model, modes, blobs


def _state_mutants(blobs, n, out: Path):
    paths = []
    for i in range(n):
        mode = sorted(blobs)[i % len(blobs)]
        which = "whole" if (i // len(blobs)) % 2 else "seq"
        p = out / f"m{i:04d}-{mode}.{which}"
        # a quarter of the mutants is an intact blob of a mode, for the cross-mode loads
        data = blobs[mode][which] if i % 4 == 3 else _mutate(blobs[mode][which], seed=i)
        p.write_bytes(data)
        paths.append(p)
    return paths


def _check_states(states, n, tmp_path):
    model, modes, blobs = states
    paths = _state_mutants(blobs, n, tmp_path)
    results, failures = _run_child(model, modes, paths, tmp_path)
    assert not failures, failures[:5]
    assert len(results) == n
    # an intact blob loads into its own mode and is refused by the modes whose layout differs
    for r in results:
        name = Path(r["blob"]).name
        i, mode = int(name[1:5]), name.split("-")[1].split(".")[0]
        if i % 4 == 3:
            assert r[mode], r
            for other in ("loki", "alisa"):
                if other != mode:
                    assert not r[other], r


def test_state_mutants_sample(states, tmp_path):
    _check_states(states, 48, tmp_path)


@pytest.mark.slow
def test_state_mutants(states, tmp_path):
    _check_states(states, 600, tmp_path)


# ---- state files: every change to a saved file is refused --------------------------------------------------

# the child: each mutant file loaded into a context of its mode (a sequence file into sequence 0, a session file
# whole); prints one JSON line per file
FILE_CHILD = r"""
import ctypes, json, sys
sys.path.insert(0, sys.argv[1])
from llama_session import Session
from sparq_cpp.attention import parse_attention
model, modes, files = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4:]
sessions = {m: Session(model, parse_attention(spec), cache_type="f16", n_ctx=256) for m, spec in modes.items()}
out_tokens, n = (ctypes.c_int32 * 256)(), ctypes.c_size_t(0)
for path in files:
    mode = path.rsplit("-", 1)[1].split(".")[0]
    s = sessions[mode]
    if path.endswith(".seq"):
        ok = s.C.llama_state_seq_load_file(s.ctx, path.encode(), 0, out_tokens, 256, ctypes.byref(n)) != 0
    else:
        ok = bool(s.C.llama_state_load_file(s.ctx, path.encode(), out_tokens, 256, ctypes.byref(n)))
    if ok:
        s.decode([(5, s.C.llama_memory_seq_pos_max(s.mem, 0) + 1, 0, True)])
    s.clear()
    print(json.dumps({"file": path, "loaded": ok}), flush=True)
"""


@pytest.fixture(scope="module")
def state_files(states, tmp_path_factory):
    """Sequence and session files saved by a context of each mode after a short prompt."""
    import ctypes

    from llama_session import Session

    from sparq_cpp.attention import parse_attention

    model, modes, _ = states
    root = tmp_path_factory.mktemp("fuzz-state-files")
    prompt = [1] + list(range(20, 80))
    toks = (ctypes.c_int32 * len(prompt))(*prompt)
    files = {}
    for m, spec in modes.items():
        with Session(model, parse_attention(spec), cache_type="f16", n_ctx=256) as s:
            s.prompt(prompt)
            seq, whole = root / f"{m}.seq", root / f"{m}.whole"
            assert s.C.llama_state_seq_save_file(s.ctx, str(seq).encode(), 0, toks, len(prompt))
            assert s.C.llama_state_save_file(s.ctx, str(whole).encode(), toks, len(prompt))
            files[m] = {"seq": seq.read_bytes(), "whole": whole.read_bytes()}
    return model, modes, files


def _check_state_files(state_files, n, tmp_path):
    model, modes, files = state_files
    paths, intact = [], set()
    for i in range(n):
        mode = sorted(files)[i % len(files)]
        which = "whole" if (i // len(files)) % 2 else "seq"
        data = files[mode][which]
        mutant = data if i % 8 == 7 else _mutate(data, seed=5000 + i)
        p = tmp_path / f"f{i:04d}-{mode}.{which}"
        p.write_bytes(mutant)
        paths.append(p)
        if mutant == data:
            intact.add(str(p))
    results, failures = _run_child(model, modes, paths, tmp_path, child=FILE_CHILD)
    assert not failures, failures[:5]
    assert len(results) == n
    wrong = [r for r in results if r["loaded"] != (r["file"] in intact)]
    assert not wrong, wrong[:5]


def test_state_file_mutants_sample(state_files, tmp_path):
    _check_state_files(state_files, 48, tmp_path)


@pytest.mark.slow
def test_state_file_mutants(state_files, tmp_path):
    _check_state_files(state_files, 600, tmp_path)


# ---- model metadata values and truncated projections -------------------------------------------------------

F32 = gguf.GGUFValueType.FLOAT32
I32 = gguf.GGUFValueType.INT32
META_KEYS = [("llama.attention.layer_norm_rms_epsilon", F32, [-1.0, float("nan"), float("inf"), 0.0, 1e30]),
             ("llama.expert_count", None, [1, 4, 300, 2**31 - 1]),
             ("llama.expert_used_count", None, [1, 5, 2**31 - 1]),
             ("llama.rope.dimension_count", None, [0, 1, 63, 65, 2**31 - 1]),
             ("llama.block_count", None, [0, 3, 513, 65536]),
             ("llama.context_length", None, [0, 1, 2**31 - 1]),
             ("llama.attention.head_count", None, [0, 3, 2**31 - 1]),
             ("llama.attention.head_count_kv", None, [0, 3, 64]),
             ("llama.rope.freq_base", F32, [0.0, -1.0, float("nan")]),
             ("llama.embedding_length", None, [0, 1, 65])]


def _meta_mutant(model, i, out: Path) -> Path:
    rng = np.random.default_rng(1000 + i)
    changes = {}
    for _ in range(1 + i % 2):
        key, vtype, values = META_KEYS[int(rng.integers(0, len(META_KEYS)))]
        v = values[int(rng.integers(0, len(values)))]
        changes[key] = (v, vtype) if vtype is not None else v
    return rewrite_gguf(model, out / f"meta{i:04d}.gguf", changes)


def _no_signal(argv, env=None):
    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, errors="replace", timeout=120,
                          stdin=subprocess.DEVNULL, env=env)
    assert proc.returncode >= 0, (argv, signal.Signals(-proc.returncode).name, proc.stderr[-1500:])
    assert "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
    return proc


def _check_metadata(n, tmp_path):
    from sparq_cpp.pyext.build import tool_path

    model = write_model(tmp_path / "tiny.gguf", "tiny", wtype="f32", seed=3)
    exe = tool_path("llama-completion")
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}
    for i in range(n):
        bad = _meta_mutant(model, i, tmp_path)
        _no_signal([exe, "-m", bad, "-p", "hello", "-n", "2", "-no-cnv", "-c", "128", "-t", "1", "-fa", "on",
                    "--sparse-attn", ["dense", "sparq:r=8,k=16"][i % 2]], env)
        if i % 4 == 0:
            _no_signal([sys.executable, "-m", "sparq_cpp.cli.main", "generate", "-m", bad, "-n", "2", "-p", "hello",
                        "--no-chat"])
        bad.unlink()


def _check_truncated_projections(n, tmp_path):
    """A projection cut anywhere inside its tensor data is refused (llama_file reads short without an error)."""
    from conftest import calibrated_projection

    from sparq_cpp.pyext.build import tool_path

    model = write_model(tmp_path / "tiny.gguf", "tiny", wtype="f32", seed=3)
    proj = Path(calibrated_projection(model, tmp_path))
    data = proj.read_bytes()
    start = gguf.GGUFReader(proj).tensors[0].data_offset
    exe = tool_path("llama-completion")
    rng = np.random.default_rng(7)
    for i in range(n):
        cut = tmp_path / f"cut{i}.loki.gguf"
        cut.write_bytes(data[: int(rng.integers(start + 1, len(data)))])
        proc = _no_signal([exe, "-m", model, "-p", "hello", "-n", "2", "-no-cnv", "-c", "128", "-t", "1", "-fa", "on",
                           "--sparse-attn", f"loki:d=16,k=16,proj={cut}"])
        assert proc.returncode != 0, "a truncated projection ran"
        cut.unlink()


def test_metadata_and_projection_sample(tmp_path):
    _check_metadata(12, tmp_path)
    _check_truncated_projections(4, tmp_path)


@pytest.mark.slow
def test_metadata_and_projection_mutants(tmp_path):
    _check_metadata(300, tmp_path)
    _check_truncated_projections(100, tmp_path)
