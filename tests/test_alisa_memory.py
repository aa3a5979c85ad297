"""ALISA's window of past weights grows with the square of the context (n_layer x n_ctx^2 x c/2 floats):
it is estimated before llama.cpp allocates it, and a context it cannot fit is refused with the number."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
from conftest import assert_one_line_error, run_cli  # noqa: E402
from sparq_cpp import ALISA, Llama, SparqError  # noqa: E402
from sparq_cpp.memory import alisa_window_bytes  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402


def test_the_estimate_is_what_llama_cpp_allocates():
    # the log of a 2-layer context of 512 cells at c = 0.5: "weights of the last 130 steps" (130 + 2 rows of 512 f32)
    assert alisa_window_bytes(2, 512, 0.5) == 2 * 512 * 132 * 4
    # SmolLM2 (30 layers) at 131,072 tokens and c = 0.125: 8,194 steps held
    assert alisa_window_bytes(30, 131072, 0.125) == 30 * 131072 * 8196 * 4


def test_a_window_larger_than_free_memory_is_refused(tmp_path, monkeypatch):
    path = write_model(tmp_path / "tiny.gguf", "tiny", wtype="f32", seed=0)
    monkeypatch.setattr("sparq_cpp.system.mem_available", lambda: 100 * 2**20)
    with pytest.raises(SparqError, match=r"keeps \d+\.\d GiB of past weights .* more than the 0\.1 GiB free"):
        Llama(path, ALISA(c=1.0), n_ctx=16384)
    Llama(path, ALISA(c=0.5), n_ctx=512).close()  # 0.5 MiB fits


def test_generate_says_so_in_one_line(tmp_path):
    path = write_model(tmp_path / "tiny.gguf", "tiny", wtype="f32", seed=0)
    proc = run_cli("generate", "-m", str(path), "-n", "2", "--attn", "alisa", "--alisa-c", "1", "-c", "131072")
    assert_one_line_error(proc, "GiB of past weights")
