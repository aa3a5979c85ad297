"""Bad input never reaches llama.cpp or a traceback: values that do not fit the C API, damaged model
and projection metadata, output paths, resources and option values each give one clear error."""
from __future__ import annotations

import errno
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from conftest import assert_one_line_error, rewrite_gguf, run_cli
from sparq_cpp.attention import Loki, SparQ
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.modelfactory import default_model_path

ROOT = Path(__file__).resolve().parents[1]
DEMO_PROJECTION = ROOT / "models" / "austen.loki.gguf"


@pytest.fixture(scope="module")
def tiny():
    return default_model_path()


# ---- values passed to the C API ------------------------------------------------------------------

@pytest.mark.parametrize("make, message", [
    (lambda: SparQ(r=8, k=2**32 + 5), r"k must be in -2147483648\.\.2147483647 \(a C int32\), got 4294967301"),
    (lambda: SparQ(l=-2**31 - 1), r"l must be in .* got -2147483649"),
    (lambda: SparQ(min_n_kv=2**31), r"min_n_kv must be in .* got 2147483648"),
    (lambda: Loki(d=2**40), r"d must be in .* got 1099511627776"),
    (lambda: Loki(k=2**32 + 128), r"k must be in .* got 4294967424"),
    (lambda: SparQ(k=1.5), r"k must be an integer, got 1\.5"),
])
def test_settings_refuse_values_that_do_not_fit_an_int32(make, message):
    with pytest.raises(SparqError, match=message):
        make()


def test_c_params_refuse_a_value_ctypes_would_wrap():
    from sparq_cpp.bindings import sparse_api

    assert SparQ(k=2**31 - 1).k == 2**31 - 1 and Loki(k=np.int64(7)).k == 7  # what fits is kept
    p = sparse_api.fill(sparse_api.llama_sparse_attn_params(), k=7, r=3)
    assert (p.k, p.r) == (7, 3)
    with pytest.raises(SparqError, match=r"k must be in .* got 4294967301"):
        sparse_api.fill(p, k=2**32 + 5)
    assert p.k == 7  # not 5


# ---- model and projection metadata -----------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"llama.attention.head_count": 0}, "attention.head_count must be >= 1, got 0"),
    ({"llama.attention.head_count_kv": 0}, "attention.head_count_kv must be >= 1 and divide head_count"),
    ({"llama.attention.head_count_kv": 3}, "attention.head_count_kv must be >= 1 and divide head_count"),
    ({"llama.block_count": 0}, "block_count must be in 1..512, got 0"),
    ({"llama.block_count": 513}, "block_count must be in 1..512, got 513"),
    ({"llama.embedding_length": 2}, "embedding_length must be at least head_count"),
    ({"llama.attention.head_count": ([4, 4], gguf.GGUFValueType.ARRAY)}, "head_count must be one integer"),
    ({"general.name": b"\xff\xfe model"}, "metadata key general.name is not UTF-8 text"),
])
def test_check_gguf_refuses_what_llama_cpp_would_divide_by_or_abort_on(tiny, tmp_path, changes, message):
    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", changes)
    with pytest.raises(SparqError, match=message):
        check_gguf(bad)


@pytest.mark.parametrize("changes, message", [
    ({"llama.attention.head_count": 0}, "head_count must be >= 1"),
    ({"llama.block_count": 513}, "block_count must be in 1..512"),
])
def test_cli_gives_one_line_for_a_bad_geometry(tiny, tmp_path, changes, message):
    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", changes)
    assert_one_line_error(run_cli("generate", "--gguf", str(bad), "-n", "2"), message)


def test_projection_with_a_fingerprint_that_is_not_utf8(tmp_path):
    from sparq_cpp.projection import read_projection

    bad = rewrite_gguf(DEMO_PROJECTION, tmp_path / "bad.loki.gguf", {"loki.model.fingerprint": b"\xff" * 64})
    with pytest.raises(SparqError, match="bad.loki.gguf: metadata key loki.model.fingerprint is not UTF-8 text"):
        read_projection(bad)


@pytest.mark.parametrize("changes, message", [
    ({"loki.version": ("one", gguf.GGUFValueType.STRING)}, "loki.version must be an integer"),
    ({"loki.n_layer": 0}, "must be >= 1"),
    ({"loki.n_layer": 10**9}, r"tensor blk\.4\.loki_proj_post is missing"),  # no 10**9-layer allocation first
])
def test_projection_with_damaged_sizes(tmp_path, changes, message):
    from sparq_cpp.projection import read_projection

    bad = rewrite_gguf(DEMO_PROJECTION, tmp_path / "bad.loki.gguf", changes)
    with pytest.raises(SparqError, match=message):
        read_projection(bad)


def test_eval_on_a_model_llama_cpp_rejects(tiny, tmp_path):
    pytest.importorskip("llama_cpp")
    from sparq_cpp.evaluation.tasks import Tokenizer

    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", {"tokenizer.ggml.model": "no-such-tokenizer"})
    with pytest.raises(SparqError, match="llama.cpp could not load the tokenizer of"):
        Tokenizer(bad)
    assert_one_line_error(run_cli("eval", "--gguf", str(bad), "--tasks", "bpc", "--methods", "dense", "--samples", "1",
                                  "--context", "64", "--continuation", "8", "--no-progress"),
                          "could not load the tokenizer")


# ---- output files ------------------------------------------------------------------------------------

def test_sigterm_while_writing_leaves_no_temporary_file(tmp_path):
    script = """
import sys, time
from pathlib import Path
from sparq_cpp.outfile import atomic_write

def write(tmp):
    tmp.write_text("half of it")
    print("writing", flush=True)
    time.sleep(60)

atomic_write(Path(sys.argv[1]), write)
"""
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "out.gguf")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        assert any(p.suffix == ".tmp" for p in tmp_path.iterdir())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, (proc.returncode, err)
    assert list(tmp_path.iterdir()) == []


def test_full_disk_is_one_error(tmp_path):
    from sparq_cpp.outfile import atomic_write

    def write(tmp):
        tmp.write_text("x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(SparqError, match="--out: no space left on the device for"):
        atomic_write(tmp_path / "m.gguf", write, "--out")
    assert list(tmp_path.iterdir()) == []


def test_dequantize_refuses_an_unsupported_model_before_writing(tiny, tmp_path):
    from sparq_cpp.dequantize import dequantize_gguf

    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", {"llama.attention.head_count": 0})
    out = tmp_path / "out" / "copy.gguf"
    out.parent.mkdir()
    with pytest.raises(SparqError, match="bad.gguf: llama.attention.head_count must be >= 1"):
        dequantize_gguf(bad, out)
    assert list(out.parent.iterdir()) == []
    proc = run_cli("dequantize", str(bad), "--out", str(out))
    assert_one_line_error(proc, "bad.gguf", "head_count")
    assert "copy.gguf" not in proc.stderr and list(out.parent.iterdir()) == []


def test_dequantize_checks_memory_and_disk_first(tiny, tmp_path, monkeypatch):
    from sparq_cpp import outfile, system
    from sparq_cpp.dequantize import dequantize_gguf

    monkeypatch.setattr(system, "mem_available", lambda: 1 << 20)
    with pytest.raises(SparqError, match=r"the f32 copy is about .* MiB, built in memory; 1\.0 MiB is available"):
        dequantize_gguf(tiny, tmp_path / "copy.gguf")
    monkeypatch.undo()
    monkeypatch.setattr(outfile.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    with pytest.raises(SparqError, match=r"--out: copy.gguf will take about .* MiB; .* has 1\.0 MiB free"):
        dequantize_gguf(tiny, tmp_path / "copy.gguf")
    assert list(tmp_path.iterdir()) == []


def test_make_model_does_not_create_directories(tmp_path):
    out = tmp_path / "no" / "such" / "m.gguf"
    assert_one_line_error(run_cli("make-model", "--out", str(out), "--no-progress"),
                          f"--out: directory {out.parent} does not exist")
    assert not (tmp_path / "no").exists()


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_eval_does_not_create_directories(tmp_path, option):
    out = tmp_path / "no" / "such" / "result"
    assert_one_line_error(run_cli("eval", option, str(out), "--gguf", str(tmp_path / "missing.gguf")),
                          f"{option}: directory {out.parent} does not exist")
    assert not (tmp_path / "no").exists()


# ---- resources -------------------------------------------------------------------------------------

def test_make_model_larger_than_memory_is_refused_up_front(tmp_path):
    proc = run_cli("make-model", "--out", str(tmp_path / "m.gguf"), "--n-ff", str(2**34), "--no-progress")
    assert_one_line_error(proc, "needs about", "of memory", "blk.0.ffn_gate.weight", "is available")
    assert list(tmp_path.iterdir()) == []


def test_write_model_compares_with_the_memory_available(tmp_path, monkeypatch):
    from sparq_cpp import system
    from sparq_cpp.modelfactory import write_model

    monkeypatch.setattr(system, "mem_available", lambda: 1 << 20)
    with pytest.raises(SparqError, match=r"needs about .* MiB of memory .* token_embd.weight.* 1\.0 MiB is available"):
        write_model(tmp_path / "m.gguf", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_write_model_checks_the_disk(tmp_path, monkeypatch):
    from sparq_cpp import outfile
    from sparq_cpp.modelfactory import write_model

    monkeypatch.setattr(outfile.shutil, "disk_usage", lambda p: type("U", (), {"free": 1 << 20})())
    with pytest.raises(SparqError, match=r"m.gguf will take about .* MiB; .* has 1\.0 MiB free"):
        write_model(tmp_path / "m.gguf", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_more_layers_than_llama_cpp_loads(tmp_path):
    assert_one_line_error(run_cli("make-model", "--out", str(tmp_path / "m.gguf"), "--layers", "513"),
                          "llama.cpp loads at most 512 layers")


# ---- option values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("args, option", [
    (["generate", "--temp", "nan"], "--temp"),
    (["generate", "--temp", "inf"], "--temp"),
    (["generate", "--temp", "-0.5"], "--temp"),
    (["generate", "--top-p", "2"], "--top-p"),
    (["generate", "--top-p", "-1"], "--top-p"),
    (["generate", "--top-p", "nan"], "--top-p"),
    (["generate", "--top-p", "0"], "--top-p"),
    (["generate", "--top-k", "-1"], "--top-k"),
    (["generate", "-t", "1000"], "--threads"),
    (["generate", "-t", "0"], "--threads"),
    (["eval", "--r", "0"], "--r"),
    (["eval", "--d", "0"], "--d"),
    (["eval", "--threads", "100000"], "--threads"),
    (["bench", "--bandwidth-mib", "0"], "--bandwidth-mib"),
    (["bench", "--disturbed-frac", "nan"], "--disturbed-frac"),
    (["bench", "--threads", "100000"], "--threads"),
    (["calibrate", "x.gguf", "-t", "100000"], "--threads"),
])
def test_option_values_are_checked(tmp_path, args, option):
    missing = ["--gguf", str(tmp_path / "missing.gguf")] if args[0] in ("generate", "eval") else \
        ["--model", str(tmp_path / "missing.gguf")] if args[0] == "bench" else []
    proc = run_cli(*args, *missing)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"Invalid value for '{option}'" in proc.stderr or f"/ '{option}'" in proc.stderr, proc.stderr


def test_generate_refuses_a_k_that_does_not_fit_an_int32(tmp_path):
    assert_one_line_error(run_cli("generate", "--gguf", str(tmp_path / "missing.gguf"), "--k", str(2**32 + 5)),
                          "k must be in", "4294967301")


def test_threads_are_bounded_in_python_too():
    from sparq_cpp.llm import max_threads, open_model

    assert 4 <= max_threads() <= 512
    with pytest.raises(SparqError, match=rf"--threads must be in 1\.\.{max_threads()} .* got 100000"):
        open_model("any.gguf", n_threads=100000)


def test_bench_bandwidth_buffer_is_checked():
    from sparq_cpp.bench import e2e_config

    for nbytes, message in [(0, "--bandwidth-mib: must be >= 1"), (1 << 60, "more than the memory available")]:
        with pytest.raises(SparqError, match=message):
            e2e_config.validate(e2e_config.BenchConfig(depths=[64], modes=["dense-fa"], threads=1, bandwidth_bytes=nbytes))


def test_fixed_rank_zero_is_refused_not_ignored():
    from sparq_cpp.evaluation import sweep

    with pytest.raises(SparqError, match="a fixed r or d must be in 1..64"):
        sweep.settings("sparq", 1 / 8, 1024, 64, r=0)
    assert sweep.settings("sparq", 1 / 8, 1024, 64, r=8)["r"] == 8


def test_check_gguf_reads_only_the_metadata(tiny, tmp_path, monkeypatch):
    """The summary comes from the header alone (the gguf package's reader decodes every array element:
    seconds for a 49k-token vocabulary), and agrees with that reader."""
    import gguf as gguf_pkg

    want = gguf_pkg.GGUFReader(tiny)
    monkeypatch.setattr(gguf_pkg, "GGUFReader", None)  # any use would fail
    s = check_gguf(tiny)
    assert s.n_vocab == len(want.fields["tokenizer.ggml.tokens"].data)
    assert (s.n_layer, s.n_head) == (want.fields["llama.block_count"].contents(),
                                     want.fields["llama.attention.head_count"].contents())
    assert s.head_dim == s.n_embd // s.n_head


def test_head_dim_comes_from_the_key_length_where_a_model_sets_it(tiny, tmp_path):
    path = rewrite_gguf(tiny, tmp_path / "keylen.gguf", {"llama.attention.key_length": 256})
    assert check_gguf(path).head_dim == 256
