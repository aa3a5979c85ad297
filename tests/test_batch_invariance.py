"""Whether a row attends sparsely depends on its own sequence only: a sequence decoding one token gets
SparQ's (or Loki's) logits whether it is decoded alone, beside other decoding sequences, or beside other
sequences' prompt rows (which attend densely). Not bitwise: llama.cpp's own kernels round differently
for different batch sizes (a dense context's logits move by ~6e-6 here when another row joins), so the
check is against that variance, and against dense to show the mixed step really was sparse."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from llama_session import Session  # noqa: E402
from sparq_cpp import Dense, Loki, SparQ  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402

VARIANCE = 2e-5  # the engine's batch-size rounding, with margin


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("batch") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=7)


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    """Interleaved sliding-window layers: sparse on the full layers, the window layers stay dense."""
    return write_model(tmp_path_factory.mktemp("batch") / "tiny-gemma3.gguf", "tiny-gemma3", wtype="f32", seed=7)


@pytest.fixture(scope="module")
def projection(model, tmp_path_factory):
    from conftest import calibrated_projection

    return calibrated_projection(model, tmp_path_factory.mktemp("batch-loki"))


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def _prompt(n, seed):
    return [1] + np.random.default_rng(seed).integers(3, 2048, size=n - 1).tolist()


PA, PB, PC = _prompt(100, 1), _prompt(80, 2), _prompt(60, 3)

# the other rows of the ubatch beside sequence 0's decode token at position 100
BESIDE = {
    "alone": [],
    "another decode row": [(6, 80, 1, False)],
    "another sequence's prompt rows": [(7 + i, 80 + i, 1, False) for i in range(12)],
    "prompt rows and a decode row": [(7 + i, 80 + i, 1, False) for i in range(12)] + [(9, 60, 2, False)],
}


def _decode_a(model, att, beside):
    with Session(model, att, cache_type="f32", n_seq=3) as s:
        s.prompt(PA, seq=0)
        s.prompt(PB, seq=1)
        s.prompt(PC, seq=2)
        items = [(5, 100, 0, True)] + beside
        return s.decode(items)[0]


@pytest.mark.parametrize("kind", ["sparq", "loki"])
def test_a_decode_row_is_sparse_whatever_is_beside_it(model, projection, kind):
    att = SparQ(r=8, k=16, l=4) if kind == "sparq" else Loki(d=16, k=16, l=2, projection=str(projection))
    got = {name: _decode_a(model, att, beside) for name, beside in BESIDE.items()}
    dense = _decode_a(model, Dense(), [])
    assert rel(got["alone"], dense) > 1e-2, "k = 16 of 100 positions should not give dense's logits"
    for name, logits in got.items():
        assert rel(logits, got["alone"]) <= VARIANCE, f"{kind}, {name}: {rel(logits, got['alone']):.1e}"


def test_sliding_window_model_decode_row_is_sparse_whatever_is_beside_it(window_model):
    """The engine's batch variance is larger on this model (dense moves by ~4e-4 when another row joins,
    its window layers stay on that path), so the bound is dense's own variance, measured here."""
    att = SparQ(r=8, k=16, l=4)
    got = {name: _decode_a(window_model, att, beside) for name, beside in BESIDE.items()}
    dense = {name: _decode_a(window_model, Dense(), beside) for name, beside in BESIDE.items()}
    variance = max(VARIANCE, max(rel(v, dense["alone"]) for v in dense.values()))
    assert variance < 1e-3
    assert rel(got["alone"], dense["alone"]) > 1e-2, "k = 16 of 100 positions should not give dense's logits"
    for name, logits in got.items():
        assert rel(logits, got["alone"]) <= variance, f"{name}: {rel(logits, got['alone']):.1e} > {variance:.1e}"


def test_prompt_rows_beside_a_decode_row_stay_dense(model):
    """Sequence 1's prompt rows attend densely whether or not sequence 0 decodes in the same ubatch."""
    rows = [(7 + i, 80 + i, 1, i == 11) for i in range(12)]
    out = {}
    for name, att in (("sparq", SparQ(r=8, k=16, l=4)), ("dense", Dense())):
        for beside in (False, True):
            with Session(model, att, cache_type="f32", n_seq=2) as s:
                s.prompt(PA, seq=0)
                s.prompt(PB, seq=1)
                items = ([(5, 100, 0, False)] if beside else []) + rows
                out[name, beside] = s.decode(items)[-1]
    assert rel(out["sparq", True], out["dense", False]) <= VARIANCE
    assert rel(out["sparq", False], out["dense", False]) <= VARIANCE
