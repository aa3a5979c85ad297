"""SmolLM2-135M-Instruct (a real pretrained model, Q4_1, 3 KV heads of 64, 8k context): SparQ at 1/8
against dense and the baselines, as docs/accuracy.md reports it ("A real model").

Slow tier: the model is fetched once (sparq_cpp/real_models.py); on 2 cores an 8k-token prefill
takes 3-10 minutes and the reference's 2k-token prefill (H2O, LM-Infinite) about 4, so this file
takes the better part of an hour there. Held-out text and the needle: the Austen evaluation files
(`python -m sparq_cpp.train eval-data`); the passkey: evaluation/textgen.passkey_file()."""
from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.pyext import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)", allow_module_level=True)

from sparq_cpp.evaluation import sweep, tasks, textgen  # noqa: E402
from sparq_cpp.evaluation.methods import parse_methods  # noqa: E402
from sparq_cpp.evaluation.runner import EvalConfig, run  # noqa: E402

pytestmark = pytest.mark.slow

THREADS = 2
DEPTHS = (0.25, 0.5, 0.75)  # not 0: LM-Infinite keeps the first 16 positions, so a needle there says nothing


@pytest.fixture(scope="module")
def model():
    from sparq_cpp.real_models import fetch

    return fetch("smollm2-135m")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from sparq_cpp.train import evaldata

    root = tmp_path_factory.mktemp("smollm2-data")
    paths = evaldata.write(root)
    paths["passkey"] = root / "passkey.txt"
    paths["passkey"].write_text(textgen.passkey_file(), encoding="utf-8")
    return paths


def _run(model, methods, task, path, **task_cfg):
    cfg = EvalConfig(model_path=Path(model), tasks=[task], methods=parse_methods(methods),
                     ratios=sweep.parse_ratios("1,1/8"), task_cfg=tasks.TaskConfig(**task_cfg),
                     data={task: path}, threads=THREADS, progress=False)
    return run(cfg, log=lambda s: None)["records"]


def _scores(records, method):
    return {r["sample"]: r["score"] for r in records if r["method"] == method}


@pytest.mark.parametrize("context", [1984, 8128])
def test_sparq_bits_per_character_within_2_percent_of_dense(model, data, context):
    recs = _run(model, "dense,sparq", "bpc", data["bpc"], samples=2 if context < 4096 else 1, context=context,
                continuation=64)
    dense, sparq = _scores(recs, "dense"), _scores(recs, "sparq")
    assert dense.keys() == sparq.keys() and dense
    assert all(r["ratio"] <= 0.13 for r in recs if r["method"] == "sparq")
    rel = sum(sparq.values()) / sum(dense.values()) - 1
    assert rel <= 0.02, f"SparQ at 1/8, S={context}: {rel:+.2%} bits per character against dense"


def test_sparq_retrieves_as_dense_at_8k(model, data):
    found = {"dense": 0, "sparq": 0}
    n = 0
    for task_file in ("needle", "passkey"):
        recs = _run(model, "dense,sparq", "needle", data[task_file], lengths=(8000,), depths=DEPTHS)
        for m in found:
            found[m] += sum(_scores(recs, m).values())
        n += len(DEPTHS)
    assert found["dense"] >= n - 1, f"dense found {found['dense']} of {n}: the check needs a model that retrieves"
    assert found["sparq"] >= found["dense"] - 1, found


def test_h2o_and_lm_infinite_lose_retrieval_at_2k(model, data):
    """The reference runs H2O and LM-Infinite (numpy/Numba: 2k tokens, not 8k, in the time a test
    has); dense and SparQ run in llama.cpp on the same prompts. The needle only: at 2k this model
    misses the passkey with dense attention too (docs/accuracy.md). H2O and LM-Infinite evict what
    they have not kept, so a needle inside the window is gone: each finds at least 2 fewer of the 3.
    On the runs in docs/accuracy.md dense misses the needle at depth 0.5 at 2k, so this fails there:
    the model cannot show the claim at 2k, and the check is left as the claim."""
    recs = _run(model, "dense,sparq,h2o,lm-infinite", "needle", data["needle"], lengths=(2000,), depths=DEPTHS)
    found = {m: sum(_scores(recs, m).values()) for m in ("dense", "sparq", "h2o", "lm-infinite")}
    assert found["dense"] == len(DEPTHS), found
    assert found["sparq"] >= found["dense"] - 1, found
    assert found["h2o"] <= found["dense"] - 2 and found["lm-infinite"] <= found["dense"] - 2, found
