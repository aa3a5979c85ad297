"""Helpers shared by test files: GGUF rewriting, text, the `sparq-cpp` command and server, op inputs
and tolerances, models run in llama.cpp. Nothing here imports llama_cpp or the patched libraries at
import time, so a test file can import from it before or after its own skip."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sparq_cpp.bench.server_process import ServerProcess

# ---- checks that must not be skipped ----------------------------------------------------------

# The checks behind the README's claims. Each needs only what a fresh machine can install (`make test` does,
# as root: tools/test-prereqs.sh). Where CI is set a run that skips one of them fails, naming it and the
# reason; elsewhere the skip is a notice in the summary. A GPU is the one thing a skip may wait for.
REQUIRED_TESTS = (
    "tests/test_arm_op.py::test_kernel_compiles_for_aarch64",               # NEON body compiles on aarch64
    "tests/test_arm_op.py::test_neon_subset_matches_reference_on_aarch64",  # and runs right, under qemu
    "tests/test_train_convert.py::",                                        # the demo model's training path
    "tests/test_cuda_compile.py::",                                         # the CUDA kernels compile (nvcc)
    "tests/test_cuda_emulated.py::",                                        # and agree with the CPU op, emulated
)

_required_skipped: list[str] = []


def pytest_runtest_logreport(report):
    if report.skipped and report.nodeid.startswith(REQUIRED_TESTS):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _required_skipped.append(f"{report.nodeid}: {reason}")


def pytest_collectreport(report):
    # a module-level skip (importorskip) skips the whole file at collection
    if report.skipped and report.nodeid.startswith(tuple(t.split("::")[0] for t in REQUIRED_TESTS)):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _required_skipped.append(f"{report.nodeid}: {reason}")


def _ci() -> bool:
    import os

    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def pytest_terminal_summary(terminalreporter):
    if _required_skipped:
        if _ci():
            terminalreporter.section("required checks skipped: the run fails (CI is set)")
        else:
            terminalreporter.section("notice: checks skipped for what this machine lacks (CI would fail here)")
            terminalreporter.write_line("`make test` as root on Debian/Ubuntu installs it (tools/test-prereqs.sh)")
        for line in _required_skipped:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session, exitstatus):
    if _required_skipped and exitstatus == 0 and _ci():
        session.exitstatus = 1


# ---- a native crash fails its test, not the run ------------------------------------------------

# Tests run in a pytest-xdist worker process (`-n 1` in pyproject's addopts): when the patched engine dies
# of a signal inside a test, xdist fails that test by name and starts a new worker for the rest. Each worker
# writes Python's fatal-error dump (faulthandler: the signal and the stack) to a file of its own, and the
# controller puts the signal and the test's frames into that test's failure.
_CRASH_DIR_ENV = "SPARQ_PYTEST_CRASH_DIR"


@pytest.hookimpl(trylast=True)  # after pytest's own faulthandler plugin, which points it at stderr
def pytest_configure(config):
    import faulthandler
    import os
    import tempfile

    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        os.environ.setdefault(_CRASH_DIR_ENV, tempfile.mkdtemp(prefix="sparq-pytest-crash-"))
    elif os.environ.get(_CRASH_DIR_ENV):
        f = open(Path(os.environ[_CRASH_DIR_ENV]) / f"{worker}.txt", "w")  # noqa: SIM115 (kept open: the dump target)
        config._sparq_crash_file = f
        faulthandler.enable(file=f, all_threads=False)


def crash_summary(dump: str, max_frames: int = 8) -> str:
    """The first line of a faulthandler dump (the signal) and the innermost frames outside the Python
    installation (the test's own and the project's)."""
    lines = dump.strip().splitlines()
    if not lines:
        return "the worker died without a fatal-error dump (killed, or out of memory?)"
    head = lines[0].strip()
    frames = [ln.strip() for ln in lines[1:] if ln.strip().startswith("File")
              and not any(s in ln for s in ("site-packages", "/lib/python", "<string>", "<frozen"))]
    return "\n".join([head] + frames[:max_frames])


@pytest.hookimpl(optionalhook=True)  # an xdist hook: the controller, when a worker died running crashitem
def pytest_handlecrashitem(crashitem, report, sched):
    import os

    crash_dir = os.environ.get(_CRASH_DIR_ENV)
    worker = getattr(getattr(getattr(report, "node", None), "gateway", None), "id", None)
    path = Path(crash_dir) / f"{worker}.txt" if crash_dir and worker else None
    dump = path.read_text(errors="replace") if path and path.is_file() else ""
    report.longrepr = f"{report.longrepr}\n{crash_summary(dump)}"


# ---- GGUF files -------------------------------------------------------------------------------



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


# ---- text -------------------------------------------------------------------------------------

_WORDS = ("the of and to a in is it you that he was for on are with as his they be at one have this from "
          "or had by hot word but what some we can out other were all there when up use your how said an "
          "each she which do their time if will way about many then them write would like so these her").split()


def calibrated_projection(model, directory) -> Path:
    """A Loki projection of `model` calibrated on calibration_text(), written into `directory`."""
    from sparq_cpp.calib import calibrate, write_projection

    pca = calibrate(model, calibration_text(), n_tokens=1024, ctx_size=512, n_threads=2)
    return write_projection(Path(directory) / f"{Path(model).stem}.loki.gguf", pca, model, ctx_size=512)


def calibration_text(n_words=3000, seed=0) -> str:
    """Deterministic text of common words (the synthetic models' vocabulary has them as pieces)."""
    rng = np.random.default_rng(seed)
    words = rng.choice(_WORDS, n_words)
    return "\n".join(" ".join(words[i:i + 12]) + "." for i in range(0, n_words, 12))


# ---- the sparq-cpp command and server ---------------------------------------------------------

def run_cli(*args, timeout=300, **kw):
    """`sparq-cpp ARGS` in a subprocess."""
    return subprocess.run([sys.executable, "-m", "sparq_cpp.cli.main", *args],
                          capture_output=True, text=True, timeout=timeout, **kw)


def assert_one_line_error(proc, *needles):
    """Exit status 2 and one error line holding every needle, no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    err = proc.stderr.strip()
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.lower().startswith("error:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture
def small_fs(tmp_path):
    """A 64 KiB tmpfs at tmp_path/fs (a full or, remounted, read-only file system), unmounted after the
    test; the test is skipped where mounting is not allowed (not root, a container without the right)."""
    where = tmp_path / "fs"
    where.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small file system needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


SERVER_N_CTX = 1024


class Server(ServerProcess):
    """`sparq-cpp serve` on a free port of 127.0.0.1 (its arguments after the model's), up and healthy."""

    def __init__(self, model, *args, tmp_path=None):
        extra = ["--", "--slot-save-path", str(tmp_path)] if tmp_path is not None else []
        super().__init__(lambda port: [sys.executable, "-m", "sparq_cpp.cli.main", "serve", "--gguf", model,
                                       "--port", port, "--ctx-size", SERVER_N_CTX, "--threads", 2, *args, *extra],
                         log_dir=tmp_path)

    def stream(self, path, body):
        """The data events of a streamed response, parsed."""
        events = []
        with self._req(path, {**body, "stream": True}) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
        return events

    def complete(self, prompt, n=12, **kw):
        body = {"prompt": prompt, "max_tokens": n, "temperature": 0, **kw}
        return self.post("/v1/completions", body)["choices"][0]["text"]



def assert_slot_restore_continues(server, prompt, n, filename):
    """Slot 0 saved after `prompt`, then erased and restored: it continues with the tokens it gave before."""
    first = server.complete(prompt, n=n, id_slot=0, cache_prompt=True)
    assert server.post("/slots/0?action=save", {"filename": filename})["n_saved"] > 0
    cont = {"id_slot": 0, "cache_prompt": True}
    want = server.complete(prompt + first, n=n, **cont)
    server.post("/slots/0?action=erase", {})
    assert server.post("/slots/0?action=restore", {"filename": filename})["n_restored"] > 0
    assert server.complete(prompt + first, n=n, **cont) == want


# ---- tolerances from the arithmetic ----------------------------------------------------------------

# llama.cpp against the reference (f64 on the same dequantized weights): the difference is rounding that llama.cpp
# does and the reference does not. To first order each rounding adds at most its unit roundoff, relative to the
# largest value, to the logits (max |diff| / max |logit|). Per layer: 4 matmul inputs (QKV, O, FFN up/gate, FFN
# down) converted to the weights' dot type (f32: none; f16: u = 2^-11; q8_0: blocks scaled to their largest value,
# u = 1/254), and up to 4 f16 roundings in attention (K and V in an f16 cache or cast by flash attention, q and the
# softmax-weighted sum in flash attention; Gemma 3's f16 GELU table is of the same size); plus the output head's
# input. f32 throughout is ulp-level: only the order of summation differs.
U_F16, U_Q8_0 = 2.0 ** -11, 1.0 / 254
TOL_F32 = 1e-5


def tol_rounding(wtype: str, n_layer: int, f16_attention: bool = True) -> float:
    u_dot = {"f32": 0.0, "f16": U_F16, "q8_0": U_Q8_0}[wtype]
    bound = (4 * n_layer + 1) * u_dot + (4 * n_layer * U_F16 if f16_attention else 0.0)
    return max(TOL_F32, bound)


# ---- op inputs --------------------------------------------------------------------------------

# SPEC "Numerical contract": max|diff| <= tol * max|y| of an op against the reference, by cache type
OP_TOL = {"f32": 1e-5, "f16": 1e-3, "q8_0": 1e-3}


def make_cache(rng, n_kv, n_seq=1, hole_frac=0.0, shuffle=False):
    """Cell -> (sequence, position). Cells of each sequence hold positions 0..n-1, in cell order or
    shuffled; holes are empty cells (seq -1). Returns seq [n_kv], pos int32 [n_kv]."""
    seq = rng.integers(0, n_seq, n_kv) if n_seq > 1 else np.zeros(n_kv, dtype=np.int64)
    if hole_frac > 0:
        seq[rng.random(n_kv) < hole_frac] = -1
    pos = np.zeros(n_kv, dtype=np.int32)
    for s in range(n_seq):
        cells = np.nonzero(seq == s)[0]
        p = np.arange(cells.size, dtype=np.int32)
        if shuffle:
            rng.shuffle(p)
        pos[cells] = p
    pos[seq < 0] = rng.integers(0, max(n_kv, 1), int((seq < 0).sum()))
    return seq, pos


def make_mask(rng, seq, pos, n_q, n_seq=1, causal=False):
    """Query rows: one per (sequence, position); decode rows see everything of their sequence,
    causal rows see positions <= their own. Returns mask bool [n_q, n_kv]."""
    mask = np.zeros((n_q, seq.size), dtype=bool)
    for t in range(n_q):
        s = t % n_seq
        vis = seq == s
        if causal and vis.any():
            p_max = pos[vis].max()
            p_t = p_max - (n_q - 1 - t) // n_seq  # the last rows of the sequence, in order
            vis &= pos <= p_t
        mask[t] = vis
    return mask


def make_qkv(rng, n_q, n_head, n_head_kv, D, n_kv, kind="random"):
    if kind == "random":
        q = rng.standard_normal((n_q, n_head, D))
        k = rng.standard_normal((n_kv, n_head_kv, D))
    elif kind == "planted":
        # heavy-tailed queries, keys mostly noise plus a few aligned with the group's queries
        q = rng.standard_t(2.0, (n_q, n_head, D))
        q /= np.abs(q).max(axis=-1, keepdims=True) / 3.0
        k = 0.5 * rng.standard_normal((n_kv, n_head_kv, D))
        g = n_head // n_head_kv
        for h in range(n_head_kv):
            qa = q[:, h * g:(h + 1) * g].mean(axis=(0, 1))
            hot = rng.choice(n_kv, size=min(8, n_kv), replace=False)
            k[hot, h] += 2.0 * qa / np.linalg.norm(qa) * np.sqrt(D) * rng.uniform(0.5, 1.0, (hot.size, 1))
    else:
        raise ValueError(kind)
    v = rng.standard_normal((n_kv, n_head_kv, D))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


def assert_close(y, ref, tol):
    assert np.all(np.isfinite(y))
    err = np.abs(y - ref).max()
    bound = tol * max(np.abs(ref).max(), 1e-30)
    assert err <= bound, f"max|diff| = {err:.3e} > {bound:.3e}"


def identity(D, n_head_kv=1):
    """The identity basis, as LokiAttention takes one: [1, n_head_kv, D, D]."""
    return np.broadcast_to(np.eye(D), (1, n_head_kv, D, D))


# ---- models in llama.cpp ----------------------------------------------------------------------

def rel(a, b):
    """max|a - b| / max|b|."""
    return float(np.abs(a - b).max() / np.abs(b).max())


def open_llm(path, attention, n_ctx=512, n_threads=1):
    """A Llama with an f32 cache and every position's logits."""
    from sparq_cpp import Llama

    return Llama(path, attention, cache_type="f32", n_ctx=n_ctx, n_batch=256, n_ubatch=256,
                 logits_all=True, n_threads=n_threads, n_threads_batch=n_threads, seed=0)


def decode_one_by_one(llm, toks):
    """Single-token steps (decode rows); the last step's logits."""
    for t in toks:
        llm.eval([t])
    return np.array(llm.scores[llm.n_tokens - 1])


def assert_rewind_and_reload_continue_as_fresh(path, att, prompt, keep, steps=()):
    """A context given `prompt` (then `steps` one by one) and rewound to `keep` tokens (llama_cpp's eval removes
    the cells >= n_tokens before the next batch) decodes as a fresh one given prompt[:keep]; and a state saved
    from that one, loaded into a third context, continues as it does."""
    a = open_llm(path, att)
    a.eval(prompt)
    decode_one_by_one(a, steps)
    a.n_tokens = keep
    got = decode_one_by_one(a, [7, 8, 9])
    b = open_llm(path, att)
    b.eval(prompt[:keep])
    want = decode_one_by_one(b, [7, 8, 9])
    assert rel(got, want) <= 1e-6
    state = b.save_state()
    b.eval([11])
    c = open_llm(path, att)
    c.load_state(state)
    c.eval([11])
    assert rel(np.array(c.scores[keep + 3]), np.array(b.scores[keep + 3])) <= 1e-6


def tokens(n, seed=0):
    """BOS and n - 1 random tokens of the synthetic models' vocabulary."""
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()
