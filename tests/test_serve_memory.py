"""`sparq-cpp serve` says the memory its -c / -np / mode needs before it starts the server (weights, KV, SparQ's
K^T, ALISA's window, compute), and refuses a setting that does not fit the memory available, with the numbers."""
from __future__ import annotations

import pytest
from click.testing import CliRunner

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.memory import MIB, context_estimate, shape_from_geometry  # noqa: E402
from sparq_cpp.cli.main import cli  # noqa: E402
from sparq_cpp.modelfactory import resolve_geometry, write_model  # noqa: E402

from conftest import run_cli  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("serve-mem") / "tiny.gguf", "tiny", wtype="f32", seed=6)


def test_the_estimate_counts_each_part():
    shape = shape_from_geometry(resolve_geometry("tiny", wtype="f32"), "f32")  # 2 layers, 4 KV heads of 64
    cells_row = shape.n_layer * shape.n_embd_kv  # one cell of every layer
    dense = context_estimate(shape, kind="dense", n_ctx=4000, n_seq=2)
    assert dense["cells_per_slot"] == 2048  # 2000 cells a slot, padded to 256
    assert dense["kv_cache"] == 2 * 2048 * cells_row * (2 + 2) and dense["k_transposed"] == 0
    assert dense["per_user"] == dense["kv_cache"] // 2
    sparq = context_estimate(shape, kind="sparq", n_ctx=4000, n_seq=2, type_k="q8_0", type_v="q8_0")
    assert sparq["kv_cache"] == int(2 * 2048 * cells_row * 2 * 34 / 32)
    assert sparq["k_transposed"] == 2 * 2048 * cells_row * 2  # f16 beside a q8_0 K
    alisa = context_estimate(shape, kind="alisa", n_ctx=1024, n_seq=1, alisa_c=0.5)
    assert alisa["alisa_window"] > 0 and alisa["per_user"] == alisa["kv_cache"] + alisa["alisa_window"]
    nofa = context_estimate(shape, kind="dense", n_ctx=4000, n_seq=2, flash_attn=False)
    assert nofa["compute"] > dense["compute"]
    for est in (dense, sparq, alisa):
        parts = ("weights", "kv_cache", "k_transposed", "alisa_window", "compute", "overhead")
        assert est["total"] == sum(est[p] for p in parts)


def test_sliding_window_layers_keep_their_window():
    shape = shape_from_geometry(resolve_geometry("tiny-gemma3", wtype="f32"), "f32")  # n_swa 32, every other layer
    est = context_estimate(shape, kind="dense", n_ctx=8192, n_seq=1)
    full, window = 8192, 768  # a window layer: 32 + a micro-batch of 512, padded to 256
    n_full = sum(not shape.is_swa(il) for il in range(shape.n_layer))
    n_window = shape.n_layer - n_full
    assert n_window and est["kv_cache"] == (n_full * full + n_window * window) * shape.n_embd_kv * 4


def test_serve_prints_the_memory_before_it_starts(model):
    proc = run_cli("serve", "-m", str(model), "-c", "2048", "-np", "2", "--sparq-r", "8", "--print-command")
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("memory: ")]
    assert len(lines) == 2, proc.stderr
    assert "weights " in lines[0] and " + KV " in lines[0] and "SparQ's K^T" in lines[0] and "compute" in lines[0]
    assert "of caches per slot (2 slots of 1024 cells)" in lines[1]


def test_a_setting_that_does_not_fit_is_refused_with_the_numbers(model, monkeypatch):
    started = []
    monkeypatch.setattr("sparq_cpp.system.mem_available", lambda: 64 * MIB)
    monkeypatch.setattr("sparq_cpp.cli.serve.os.execve", lambda *a: started.append(a))
    res = CliRunner().invoke(cli, ["serve", "-m", str(model), "-c", "65536", "-np", "4", "--sparq-r", "8",
                                   "--port", "1"])
    assert res.exit_code == 2 and not started, res.output
    assert "error: the server would need about" in res.output and "more than the 64.0 MiB available" in res.output
    assert "use a smaller -c, fewer slots (-np) or a q8_0 cache" in res.output and "Traceback" not in res.output


def test_the_python_api_and_generate_refuse_a_context_that_does_not_fit(model, monkeypatch):
    """The estimate (weights, caches, compute) is checked before llama.cpp allocates anything: beyond the memory
    free, a process is killed without a word."""
    from sparq_cpp import Llama, SparqError

    monkeypatch.setattr("sparq_cpp.system.mem_available", lambda: 64 * MIB)
    with pytest.raises(SparqError, match=r"with a context of 65536 tokens would need about .* more than the 64\.0 MiB "
                                         r"available; use a smaller context"):
        Llama(str(model), "sparq:r=8,k=64", n_ctx=65536)
    res = CliRunner().invoke(cli, ["generate", "-m", str(model), "-c", "65536", "-n", "2", "-p", "hi"])
    assert res.exit_code != 0 and "would need about" in res.output and "Traceback" not in res.output, res.output
    monkeypatch.setattr("sparq_cpp.system.mem_available", lambda: 64 * 2**30)
    Llama(str(model), "sparq:r=8,k=64", n_ctx=1024).close()
