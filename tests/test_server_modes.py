"""A day of llama-server in every sparse mode: many requests whose prompts share a prefix of different
lengths with the one before (the server reuses the cached prefix and removes the rest), slots saved and
restored, a slot saved in one mode restored in a server of another. No process death, health always
ok, and a cross-mode restore refused with both modes named."""
from __future__ import annotations

import time
import urllib.error

import numpy as np
import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from llama_server import LlamaServer  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402

N_REQUESTS = 100
WORDS = ("the house stood at the end of a long lane and every morning the family walked down to the "
         "river where the boats came in with fish and letters and news of the town").split()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("server-modes") / "tiny-gqa.gguf", "tiny-gqa", wtype="f32", seed=3)


@pytest.fixture(scope="module")
def projection(model, tmp_path_factory):
    from conftest import calibrated_projection

    return calibrated_projection(model, tmp_path_factory.mktemp("server-modes-loki"))


def spec(mode, projection):
    return {"sparq": "sparq:r=8,k=32,l=8", "loki": f"loki:d=16,k=32,proj={projection}",
            "alisa": "alisa:c=0.5"}[mode]


def logged(server, text, timeout_s=10.0) -> bool:
    """Whether the server's log holds `text`, waiting a little: a thread of its own writes the log."""
    deadline = time.time() + timeout_s
    while text not in server.text():
        if time.time() > deadline:
            return False
        time.sleep(0.1)
    return True


def prompts(n, seed=0):
    """Prompts of 150-400 words; each shares a prefix of random length with the one before it."""
    rng = np.random.default_rng(seed)
    prev = list(rng.choice(WORDS, 300))
    for _ in range(n):
        keep = int(rng.integers(0, len(prev)))
        prev = prev[:keep] + list(rng.choice(WORDS, int(rng.integers(150, 400)) - keep if keep < 150 else 20))
        yield " ".join(prev)


@pytest.mark.parametrize("mode", ["sparq", "loki", "alisa"])
def test_a_hundred_requests_with_reused_prompts(model, projection, tmp_path, mode):
    server = LlamaServer(model, spec(mode, projection), tmp_path, tmp_path)
    try:
        for i, prompt in enumerate(prompts(N_REQUESTS, seed=1)):
            server.complete(prompt)
            if i % 10 == 0:
                assert server.get("/health")["status"] == "ok"
        assert server.proc.poll() is None
        if mode == "alisa":  # the removals ALISA cannot follow were processed again, not aborted
            assert logged(server, "processing the whole prompt again")
    finally:
        server.close()


@pytest.mark.parametrize("mode", ["sparq", "loki"])
def test_a_reused_prompt_continues_as_a_fresh_one(model, projection, tmp_path, mode):
    """The same request twice (the second reuses the whole cached prompt), and a request one token longer than a
    cached one: the prompt's last token is evaluated in a prompt batch (dense), as for a fresh request, so the
    text is the same as a server that never saw the prompt gives."""
    prompt = next(prompts(1, seed=4))
    fresh = {}
    for variant in ("same", "longer"):
        p = prompt if variant == "same" else prompt + " river"
        server = LlamaServer(model, spec(mode, projection), tmp_path, tmp_path)
        try:
            fresh[variant] = server.complete(p, n=8)
        finally:
            server.close()
    server = LlamaServer(model, spec(mode, projection), tmp_path, tmp_path)
    try:
        first = server.complete(prompt, n=8)
        assert first == fresh["same"]
        assert server.complete(prompt, n=8) == fresh["same"]  # the whole prompt from the cache
        server.complete(prompt, n=1)
        assert server.complete(prompt + " river", n=8) == fresh["longer"]  # one token beyond the cache
    finally:
        server.close()


def test_a_slot_restores_only_into_its_own_mode(model, projection, tmp_path):
    prompt = next(prompts(1, seed=3))
    saved = {}
    for mode in ("sparq", "loki", "alisa"):
        server = LlamaServer(model, spec(mode, projection), tmp_path, tmp_path)
        try:
            server.complete(prompt)
            assert server.post("/slots/0?action=save", {"filename": f"{mode}.bin"})["n_saved"] > 0
            saved[mode] = server.complete(prompt, n=8)
        finally:
            server.close()
    for mode in ("sparq", "loki", "alisa"):
        server = LlamaServer(model, spec(mode, projection), tmp_path, tmp_path)
        try:
            for other in ("sparq", "loki", "alisa"):
                if other == mode:
                    assert server.post("/slots/0?action=restore", {"filename": f"{mode}.bin"})["n_restored"] > 0
                    assert server.complete(prompt, n=8) == saved[mode]
                    continue
                with pytest.raises(urllib.error.HTTPError):
                    server.post("/slots/0?action=restore", {"filename": f"{other}.bin"})
                assert server.get("/health")["status"] == "ok"
            assert logged(server, "the state was saved with")
        finally:
            server.close()
