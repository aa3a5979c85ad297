"""The Python API as a llama-cpp-python user meets it: type_k/type_v honoured or refused with the reason,
SparqError caught as ValueError, `attention=` as a string as llama.cpp's --sparse-attn reads it, typing marker."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import sparq_cpp
from sparq_cpp import ALISA, Dense, Loki, SparQ, SparqError
from sparq_cpp.attention import parse_attention


@pytest.mark.parametrize("spec,want", [
    ("dense", Dense()),
    ("sparq", SparQ()),
    ("sparq:r=8,k=32", SparQ(r=8, k=32)),
    ("sparq:r=8,k=32,l=4,mv=0,min_n_kv=256,prompt=sparse",
     SparQ(r=8, k=32, l=4, mean_value=False, min_n_kv=256, sparse_prompt=True)),
    ("loki:d=16,k=64,proj=m.loki.gguf,variant=pre", Loki(d=16, k=64, projection="m.loki.gguf", variant="pre")),
    ("sparq:r=8,k=32,sink=1", SparQ(r=8, k=32, sink=1)),
    ("loki:d=32,k=128,sink=4", Loki(d=32, k=128, sink=4)),
    ("alisa:c=0.25", ALISA(c=0.25)),
    ("alisa:c=1", ALISA(c=1.0)),
    ("alisa:c=1e0,min_n_kv=4", ALISA(c=1.0, min_n_kv=4)),
])
def test_attention_spec_strings(spec, want):
    pytest.importorskip("llama_cpp")
    assert parse_attention(spec) == want


@pytest.mark.parametrize("spec,message", [
    ("sparse", "unknown mode 'sparse' (expected 'sparq', 'loki', 'alisa' or 'dense')"),
    ("sparq:r=8,d=4", "key 'd' is for loki, not sparq"),
    ("sparq:r=8,r=9", "key 'r' given more than once"),
    ("sparq:r=", "invalid value '' for key 'r' (expected an integer)"),
    ("sparq:r=eight", "invalid value 'eight' for key 'r' (expected an integer)"),
    ("sparq:mv=yes", "invalid value 'yes' for key 'mv' (expected 0 or 1)"),
    ("loki:prompt=all", "invalid value 'all' for key 'prompt' (expected 'dense' or 'sparse')"),
    ("alisa:c=0", "c must be"),
    # c is a share of the positions: at most 1, exactly (llama.cpp reads 1.0000001 as the float32 1.0)
    ("alisa:c=1.0000001", "c must be at most 1 (ALISA's caching ratio, a share of the positions in (0, 1]), got 1.0000001"),
    ("alisa:c=1.00000000000000001", "got 1.00000000000000001"),
    ("alisa:min_n_kv=0,c=2", "c must be at most 1"),
    ("alisa:k=4", "key 'k' is not for alisa (expected c or min_n_kv)"),
    ("alisa:sink=1", "key 'sink' is not for alisa (expected c or min_n_kv)"),
    ("sparq:sink=x", "invalid value 'x' for key 'sink' (expected an integer)"),
    ("dense:k=4", "mode 'dense' takes no parameters"),
])
def test_bad_attention_specs_are_refused(spec, message):
    """llama.cpp's own parser (llama_sparse_attn_parse) reads the string, as the tools' --sparse-attn does."""
    pytest.importorskip("llama_cpp")
    with pytest.raises(SparqError, match=re.escape(message)):
        parse_attention(spec)


@pytest.mark.parametrize("attention", [Dense(), SparQ(r=8, k=32), SparQ(l=0, mean_value=False, sparse_prompt=True),
                                       Loki(d=16, k=64, projection="m.loki.gguf", variant="pre"), ALISA(c=0.2),
                                       SparQ(r=8, k=32, l=8, sink=24), Loki(d=8, k=16, sink=1)])
def test_each_mode_renders_the_string_llama_cpp_reads_back(attention):
    from sparq_cpp.attention import spec

    pytest.importorskip("llama_cpp")
    assert parse_attention(spec(attention)) == attention


@pytest.mark.parametrize("attention", [SparQ(k=32, sink=25), SparQ(k=32, l=0, sink=33), Loki(k=16, l=8, sink=9),
                                       SparQ(sink=-1)])
def test_a_sink_beyond_k_minus_l_is_refused(attention):
    with pytest.raises(SparqError, match=r"sink must be in 0\.\.k - l"):
        attention.check(64)


def test_sparq_error_is_a_value_error():
    assert issubclass(SparqError, ValueError)


def test_typing_marker_and_docstrings():
    assert (Path(sparq_cpp.__file__).parent / "py.typed").is_file()
    pytest.importorskip("llama_cpp")
    from sparq_cpp import Llama

    for name in ("Loki", "ALISA", "type_k", "ValueError"):
        assert name in Llama.__doc__, name
    assert "Dense()" in Llama.set_attention.__doc__


@pytest.fixture(scope="module")
def tiny():
    pytest.importorskip("llama_cpp")
    from sparq_cpp.modelfactory import default_model_path

    return default_model_path()


def test_missing_file_is_caught_as_value_error(tmp_path):
    pytest.importorskip("llama_cpp")
    from sparq_cpp import Llama

    with pytest.raises(ValueError, match="not found"):
        Llama(tmp_path / "missing.gguf")


@pytest.mark.parametrize("kwargs,want", [
    ({}, (1, 1, "f16")),
    ({"type_k": 8, "type_v": 8}, (8, 8, "q8_0")),
    ({"type_k": "q8_0"}, (8, 1, None)),
    ({"type_v": 0}, (1, 0, None)),
    ({"cache_type": "f32"}, (0, 0, "f32")),
    ({"cache_type": "q8_0", "type_k": "q8_0", "type_v": 8}, (8, 8, "q8_0")),
])
def test_type_k_and_type_v_are_honoured(tiny, kwargs, want):
    from sparq_cpp import Llama

    llm = Llama(tiny, "sparq:r=8,k=16", n_ctx=64, **kwargs)
    try:
        assert (llm.context_params.type_k, llm.context_params.type_v, llm.cache_type) == want
        assert llm.attention == SparQ(r=8, k=16)
        llm.eval(llm.tokenize(b"hello there"))
        llm.set_attention("sparq:r=4,k=8")
        assert llm.attention == SparQ(r=4, k=8)
    finally:
        llm.close()


@pytest.mark.parametrize("kwargs,message", [
    ({"type_k": 2}, "type_k=2: sparq-cpp runs f32, f16 and q8_0 caches"),
    ({"type_v": "q4_0"}, "type_v='q4_0': sparq-cpp runs f32, f16 and q8_0 caches"),
    ({"cache_type": "f16", "type_k": 8}, "type_k=8 contradicts cache_type='f16'"),
    ({"cache_type": "bf16"}, "cache_type='bf16'"),
])
def test_unsupported_or_contradicting_cache_types_are_refused(tiny, kwargs, message):
    from sparq_cpp import Llama

    with pytest.raises(SparqError, match=message.replace("(", r"\(")):
        Llama(tiny, n_ctx=64, **kwargs)


def test_attention_of_another_type_is_refused(tiny):
    from sparq_cpp import Llama

    with pytest.raises(SparqError, match="attention must be Dense"):
        Llama(tiny, attention=16, n_ctx=64)
