"""generate's footer counts the KV reads of each layer type: a sliding-window layer stays dense over its window in
every mode, so on Gemma 3-like models the saving is that of the full-attention layers only."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from conftest import run_cli
from sparq_cpp.attention import Dense, SparQ
from sparq_cpp.cli.generate import report_reads, step_reads
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.modelfactory import write_model


@pytest.fixture(scope="module")
def iswa(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("iswa") / "tiny-gemma3.gguf", "tiny-gemma3", wtype="f32", seed=3)


def test_window_layers_read_their_window_whole(iswa):
    s = check_gguf(iswa)
    n_swa_layers = sum(s.swa_layers)
    assert 0 < n_swa_layers < s.n_layer and s.n_swa == 32
    att, n = SparQ(r=8, k=16), 200
    used, dense, split = step_reads(att, s, n, "f16")
    full, hk, d = s.n_layer - n_swa_layers, s.n_head_kv, s.head_dim
    window = Dense().reads(32, d, "f16") * n_swa_layers * hk
    assert used == pytest.approx(att.reads(n, d, "f16") * full * hk + window)
    assert dense == pytest.approx(Dense().reads(n, d, "f16") * full * hk + window)
    assert f"{n_swa_layers} of {s.n_layer} layers slide over a window of 32" in split
    # inside the window every layer reads all it holds
    assert step_reads(Dense(), s, 20, "f16")[1] == pytest.approx(Dense().reads(20, d, "f16") * s.n_layer * hk)


def test_footer_of_generate(iswa):
    pytest.importorskip("llama_cpp")
    proc = run_cli("generate", "-m", str(iswa), "-p", " ".join(["word"] * 150), "--no-chat", "-n", "4", "-t", "1",
                   "--sparq-r", "8", "--sparse-k", "16", "-c", "512")
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = re.search(r"read ([\d.]+) MB of KV cache, dense reads ([\d.]+) MB at n_kv=(\d+) \(([\d.]+) of dense\); "
                  r"2 of 4 layers slide over a window of 32", proc.stderr)
    assert m, proc.stderr[-1500:]
    s = check_gguf(iswa)
    used, dense, _ = step_reads(SparQ(r=8, k=16), s, int(m.group(3)), "f16")
    assert float(m.group(1)) == pytest.approx(used / 1e6, abs=0.006)
    assert float(m.group(2)) == pytest.approx(dense / 1e6, abs=0.006)


def test_no_decode_step_no_reads(iswa, capsys):
    """The first token sampled ends the text (EOS): no decode step ran, so no step's reads are reported."""
    llm = SimpleNamespace(attention=SparQ(r=8, k=16), cache_type="f16")
    report_reads(llm, check_gguf(iswa), 150, 0)
    err = capsys.readouterr().err
    assert "no decode step ran" in err and "the last step read" not in err
