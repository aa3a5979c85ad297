"""`sparq-cpp eval` scores bits per character through llama.cpp's decode path, one token and one row of logits at
a time (no logits_all context, whose n_ctx x vocabulary scores a 262k-vocabulary model cannot hold at length):
the bits are those the logits_all path gave."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.evaluation import runner, sweep, tasks  # noqa: E402
from sparq_cpp.evaluation.methods import LlamaSession, parse_methods  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("decode-scoring") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=3)


def _bits(model, method, params, logits_all, prompt, fed, targets):
    s = LlamaSession(model, method, n_ctx=512, cache_type="f32", threads=1, mean_value=False, logits_all=logits_all)
    try:
        s.prefill(prompt)
        s.use(params, method)
        if logits_all:  # the former path: every fed token's logits at once, then -log2 softmax
            x = s.feed(fed).astype(np.float64)
            m = x.max(axis=1)
            return (m + np.log(np.exp(x - m[:, None]).sum(axis=1)) - x[np.arange(len(targets)), targets]) / np.log(2)
        return s.score(fed, targets)
    finally:
        s.close()


@pytest.mark.parametrize("method,params", [("dense", {}), ("sparq", {"r": 8, "k": 40, "l": 10})])
def test_decode_path_bits_equal_the_logits_all_path(model, method, params):
    toks = [1] + np.random.default_rng(0).integers(3, 2048, size=299).tolist()
    prompt, fed, targets = toks[:260], toks[260:299], toks[261:300]
    old = _bits(model, method, params, True, prompt, fed, targets)
    new = _bits(model, method, params, False, prompt, fed, targets)
    assert len(new) == len(targets)
    np.testing.assert_allclose(new, old, rtol=1e-4, atol=1e-4)
    assert abs(new.sum() - old.sum()) <= 1e-5 * old.sum()


def test_eval_opens_no_logits_all_context(model, monkeypatch):
    """The eval's llama.cpp sessions are opened without logits_all and score through `score`."""
    opened = []
    real = LlamaSession.__init__

    def spy(self, *a, **kw):
        opened.append(kw.get("logits_all", False))
        real(self, *a, **kw)

    monkeypatch.setattr(LlamaSession, "__init__", spy)
    cfg = runner.EvalConfig(model_path=Path(model), tasks=["bpc"], methods=parse_methods("dense,sparq"),
                            ratios=sweep.parse_ratios("1,1/4"),
                            task_cfg=tasks.TaskConfig(samples=1, context=160, continuation=24), progress=False,
                            threads=1)
    doc = runner.run(cfg, log=lambda s: None)
    assert opened and not any(opened)
    assert {r["method"] for r in doc["records"]} == {"dense", "sparq"}
    assert all(np.isfinite(r["score"]) and r["score"] > 0 for r in doc["records"])
