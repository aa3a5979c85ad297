"""Speculative decoding in llama-server with sparse attention on the target (and its draft): at temperature 0
the text with a draft model equals the text without one, for dense, SparQ and Loki (tools/spec_decode.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp.modelfactory import write_model  # noqa: E402
from tools import spec_decode  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("spec") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=7)


@pytest.fixture(scope="module")
def projection(model, tmp_path_factory):
    from conftest import calibrated_projection

    return calibrated_projection(model, tmp_path_factory.mktemp("spec-loki"))


@pytest.mark.parametrize("mode", ["dense", "sparq", "loki"])
def test_draft_model_keeps_the_text(model, projection, tmp_path, mode):
    attention = {"dense": None, "sparq": "sparq:r=8,k=16,l=4",
                 "loki": f"loki:d=16,k=16,l=2,proj={projection}"}[mode]
    runs = {d: spec_decode.run_config(model, model if d else None, 300, attention, n_predict=24, repeats=1,
                                      threads=2, draft_max=3, seed=0, log_dir=tmp_path)
            for d in (False, True)}
    assert runs[True]["draft_n"] > 0  # the draft drafted, and the target checked its tokens in batches
    # the first request (a fresh prompt) and the second (the prompt reused from the cache)
    assert runs[True]["texts"] == runs[False]["texts"]
