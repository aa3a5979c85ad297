"""The `sparq-cpp` command: generate and info work; bad input gives one clear line and exit 2."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")

from sparq_cpp.modelfactory import default_model_path  # noqa: E402

from conftest import assert_one_line_error, run_cli  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    return default_model_path()


def test_generate_streams_and_reports_speed(tiny):
    proc = run_cli("generate", "--gguf", str(tiny), "-n", "8", "--prompt", "hello there", "--seed", "1")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hello there")
    assert "prompt" in proc.stderr and "decode" in proc.stderr and "ms/token" in proc.stderr


def test_generate_greedy_is_deterministic(tiny):
    a = run_cli("generate", "--gguf", str(tiny), "-n", "6", "--temp", "0", "--prompt", "abc")
    b = run_cli("generate", "--gguf", str(tiny), "-n", "6", "--temp", "0", "--prompt", "abc")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_generate_prompt_file(tiny, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("a prompt from a file")
    proc = run_cli("generate", "--gguf", str(tiny), "-n", "2", "--prompt-file", str(f))
    assert proc.returncode == 0 and proc.stdout.startswith("a prompt from a file")


def test_missing_model(tmp_path):
    assert_one_line_error(run_cli("generate", "--gguf", str(tmp_path / "nope.gguf")), "not found")


def test_not_a_gguf(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    assert_one_line_error(run_cli("generate", "--gguf", str(p)), "not a GGUF")


def test_truncated_gguf(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    data = tiny.read_bytes()
    p.write_bytes(data[: len(data) // 2])
    assert_one_line_error(run_cli("generate", "--gguf", str(p)), "truncated")


def test_other_architecture_missing_its_keys(tmp_path):
    """Any architecture may run dense; a file of one without its hyperparameters is refused by the checks
    (sparse attention's refusals: tests/test_architectures.py)."""
    import gguf
    import numpy as np

    p = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(p, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_one_line_error(run_cli("generate", "--gguf", str(p)), "missing key gpt2.attention.head_count")


def test_prompt_longer_than_context(tiny):
    proc = run_cli("generate", "--gguf", str(tiny), "--ctx-size", "32", "-n", "4",
                   "--prompt", "word " * 200)
    assert_one_line_error(proc, "--ctx-size 32")


@pytest.mark.parametrize("n", ["0", "-3"])
def test_bad_n(tiny, n):
    assert_one_line_error(run_cli("generate", "--gguf", str(tiny), "-n", n), "-n must be >= 1")


def test_prompt_and_prompt_file_conflict(tiny, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("x")
    assert_one_line_error(run_cli("generate", "--gguf", str(tiny), "-p", "a", "-f", str(f)), "not both")


@pytest.mark.build
def test_info():
    proc = run_cli("info")
    assert proc.returncode == 0, proc.stderr
    for word in ("llama-cpp-python 0.3.36", "patch series", "backends", "CPU", "cpu features"):
        assert word in proc.stdout, word
