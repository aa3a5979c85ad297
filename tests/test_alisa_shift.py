"""ALISA's window follows the steps in order: a position shift (llama_memory_seq_add / seq_div, as a
context shift would do) is refused with an error line and leaves the cache as it was, instead of
aborting at the next decode; llama_memory_can_shift() says so beforehand."""
from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp")
from sparq_cpp.bindings import sparse_api  # noqa: E402

if not sparse_api.available():
    pytest.skip("the installed llama.cpp has no sparse attention API (run `make setup`)",
                allow_module_level=True)

from sparq_cpp import ALISA  # noqa: E402
from sparq_cpp.modelfactory import write_model  # noqa: E402
from llama_session import Session, captured_log  # noqa: E402


@pytest.mark.parametrize("edit", ["add-middle", "add-back", "add-forward", "div"])
def test_a_shift_is_refused_and_decoding_goes_on(tmp_path, edit):
    path = write_model(tmp_path / "tiny.gguf", "tiny", wtype="f32", seed=7)
    prompt = [1] + list(range(10, 60))
    with Session(path, ALISA(c=0.5), cache_type="f16") as s:
        s.prompt(prompt)
        before = s.steps([5, 6], pos0=len(prompt))
        assert not s.C.llama_memory_can_shift(s.mem)
        with captured_log() as log:
            if edit == "div":
                s.C.llama_memory_seq_div(s.mem, 0, 10, 20, 2)
            else:
                s.seq_add(0, *{"add-middle": (10, 20, 5), "add-back": (0, -1, -3), "add-forward": (0, -1, 7)}[edit])
        assert any("a position shift is not supported" in line for line in log), log
        assert s.C.llama_memory_seq_pos_min(s.mem, 0) == 0
        assert s.C.llama_memory_seq_pos_max(s.mem, 0) == len(prompt) + 1
        after = s.steps([7], pos0=len(prompt) + 2)
        assert len(after) == 1 and len(before) == 2
