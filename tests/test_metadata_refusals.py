"""Model metadata that ggml would assert on later (an abort, rc 134) is refused by name: by the
Python checks before llama.cpp is asked (`sparq-cpp generate`), and by llama.cpp's loader itself for
the stock tools (llama-completion exits with an error line, not a signal)."""
from __future__ import annotations

import subprocess

import gguf
import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from conftest import assert_one_line_error, rewrite_gguf, run_cli  # noqa: E402
from sparq_cpp import SparqError  # noqa: E402
from sparq_cpp.gguf_check import check_gguf  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from sparq_cpp.pyext.build import tool_path  # noqa: E402

F32 = gguf.GGUFValueType.FLOAT32
CASES = [
    ({"llama.attention.layer_norm_rms_epsilon": (-1.0, F32)}, "layer_norm_rms_epsilon must be a finite number >= 0",
     "layer norm epsilon"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32)}, "layer_norm_rms_epsilon must be a finite number",
     "layer norm epsilon"),
    ({"llama.expert_count": 4}, "expert_used_count must be in 1..expert_count (4), got 0",
     "expert_count = 4 without expert_used_count"),
    ({"llama.expert_count": 4, "llama.expert_used_count": 9}, "expert_used_count must be in 1..expert_count",
     "exceeds expert_count"),
    ({"llama.rope.dimension_count": 63}, "rope.dimension_count must be even", "invalid n_rot"),
    ({"llama.block_count": 0}, "block_count must be in 1..512, got 0", "block_count = 0"),
    ({"llama.block_count": 65536}, "block_count must be in 1..512, got 65536", "block_count = 65536"),
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("meta") / "tiny.gguf", "tiny", wtype="f32", seed=0)


@pytest.mark.parametrize("changes, python_message, loader_message", CASES)
def test_python_checks_refuse_by_name(tiny, tmp_path, changes, python_message, loader_message):
    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", changes)
    with pytest.raises(SparqError, match=python_message.replace("(", r"\(").replace(")", r"\)")):
        check_gguf(bad)


@pytest.mark.parametrize("changes, python_message, loader_message", CASES[:3] + CASES[5:])
def test_generate_gives_one_line(tiny, tmp_path, changes, python_message, loader_message):
    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", changes)
    assert_one_line_error(run_cli("generate", "-m", str(bad), "-n", "2"), python_message.split(" (")[0])


@pytest.mark.parametrize("changes, python_message, loader_message", CASES)
def test_stock_tool_refuses_without_a_signal(tiny, tmp_path, changes, python_message, loader_message):
    """llama.cpp's loader gives an error (its message checked in-process: the tools' asynchronous log may lose
    its last lines when they exit at once) and the tool an exit status, not a signal (these aborted: rc 134)."""
    import llama_cpp
    from llama_session import captured_log

    bad = rewrite_gguf(tiny, tmp_path / "bad.gguf", changes)
    with captured_log() as log:
        model = llama_cpp.llama_model_load_from_file(str(bad).encode(), llama_cpp.llama_model_default_params())
    assert not model
    assert any(loader_message in line for line in log), "".join(log[-5:])
    proc = subprocess.run([str(tool_path("llama-completion")), "-m", str(bad), "-p", "hello", "-n", "2", "-no-cnv",
                           "-c", "128", "-t", "1"], capture_output=True, text=True, errors="replace", timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-1500:])


def test_a_rope_dimension_count_above_the_head_size_is_refused(tmp_path):
    """gemma3.rope.dimension_count = 4096 on heads of 256 aborted generate and the stock tools in ggml_rope
    (GGML_ASSERT(n_dims <= ne0)); llama's own loader compares it with the head size, gemma3's did not."""
    import llama_cpp
    from llama_session import captured_log

    model = write_model(tmp_path / "g.gguf", "tiny-gemma3", wtype="f32", seed=0)
    bad = rewrite_gguf(model, tmp_path / "bad.gguf", {"gemma3.rope.dimension_count": 4096})
    with pytest.raises(SparqError, match="rope.dimension_count must be at most the key head size"):
        check_gguf(bad)
    with captured_log() as log:
        loaded = llama_cpp.llama_model_load_from_file(str(bad).encode(), llama_cpp.llama_model_default_params())
    assert not loaded
    assert any("rope dimension count 4096" in line and "exceeds the key head size" in line for line in log), \
        "".join(log[-5:])
    check_gguf(model)  # the model as written passes


def test_a_huge_training_context_does_not_size_the_tokenizer_buffer(tiny, tmp_path):
    """llama-cpp-python sizes its tokenize buffer by the training context: context_length = 2^31-1 allocated
    8 GiB and stalled for half a minute per call. sparq_cpp.Llama sizes it by the text."""
    import sys

    big = rewrite_gguf(tiny, tmp_path / "big.gguf", {"llama.context_length": 2**31 - 1})
    code = ("import resource, sys, time; from sparq_cpp import Llama; llm = Llama(sys.argv[1], n_ctx=256); "
            "t0 = time.time(); toks = llm.tokenize(b'hello world, once upon a time'); "
            "print(len(toks), time.time() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    proc = subprocess.run([sys.executable, "-c", code, str(big)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, seconds, max_rss_kib = proc.stdout.split()
    assert int(n) > 1 and float(seconds) < 1.0
    assert int(max_rss_kib) < 2 * 2**20, f"max RSS {int(max_rss_kib) / 2**20:.1f} GiB"


def test_a_tokenizer_that_adds_eos_is_an_error_in_llama_completion(tiny, tmp_path):
    """tokenizer.ggml.add_eos_token = true made llama-completion assert (SIGABRT); it now exits 1."""
    bad = rewrite_gguf(tiny, tmp_path / "eos.gguf", {"tokenizer.ggml.add_eos_token": True})
    proc = subprocess.run([str(tool_path("llama-completion")), "-m", str(bad), "-p", "hello", "-n", "2", "-no-cnv",
                           "-c", "128", "-t", "1"], capture_output=True, text=True, errors="replace", timeout=120,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-1500:])


def test_a_file_checked_again_unchanged_is_not_read_again(tiny, tmp_path):
    """check_gguf keeps the summary of an unchanged file (generate and serve ask twice); a file written again at
    the same path is read again."""
    path = tmp_path / "m.gguf"
    rewrite_gguf(tiny, path)
    first = check_gguf(path)
    assert check_gguf(path) is first and check_gguf(str(path)) is first
    rewrite_gguf(tiny, path, {"llama.context_length": 1234})
    again = check_gguf(path)
    assert again is not first and again.n_ctx_train == 1234
    path.unlink()
    with pytest.raises(SparqError, match="m.gguf"):
        check_gguf(path)
