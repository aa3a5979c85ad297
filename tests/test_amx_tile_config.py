"""ggml's AMX matmul configures its tiles with the bytes its source says (a GCC 12 miscompile made the first
prompt batch raise SIGILL on Xeons with AMX). Compiled for Sapphire Rapids on any x86 machine; nothing runs.
The check is shown to catch the miscompile on the unpatched source wherever the compiler's
`_tile_loadconfig` has the narrow memory operand that causes it."""
from __future__ import annotations

import platform
import re
import tarfile
from pathlib import Path

import pytest

from sparq_cpp.pyext.upstream import Pin, fetch_sdist
from tests.amx_tile_config import compile_to_asm, compiler, config_path_source, expected_config, ldtilecfg_config
from tests.cuda_sources import patched_tree

MMQ = "ggml/src/ggml-cpu/amx/mmq.cpp"

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or compiler() is None,
                                reason="needs an x86-64 C++ compiler")


def _upstream_mmq() -> str:
    pin = Pin.load()
    top = pin.sdist.removesuffix(".tar.gz")
    with tarfile.open(fetch_sdist(pin, log=lambda *_: None)) as tar:
        return tar.extractfile(f"{top}/vendor/llama.cpp/{MMQ}").read().decode()


def _narrow_loadconfig_operand(cxx: str) -> bool:
    """Whether this compiler's _tile_loadconfig tells the optimizer it reads fewer than 64 bytes (GCC 12: 8),
    so that a store to byte 48 of a local config before it is dropped."""
    probe = ("#include <immintrin.h>\nvoid f(void) { alignas(64) unsigned char c[64] = {};"
             " c[0] = 1; c[48] = 16; _tile_loadconfig(c); }\n")
    return "$16" not in compile_to_asm(probe, cxx)


def _check(mmq: str) -> list[str]:
    """What is wrong with the config ldtilecfg loads, compiled from this mmq.cpp (empty: nothing)."""
    rows, colsb = expected_config(mmq)
    cfg = ldtilecfg_config(compile_to_asm(config_path_source(mmq), compiler()))
    wrong = []
    if cfg.palette_id != 1:
        wrong.append(f"palette_id {cfg.palette_id}, not 1")
    if cfg.rows(len(rows)) != rows:
        wrong.append(f"rows {cfg.rows(len(rows))}, source says {rows}")
    if cfg.colsb(len(colsb)) != colsb:
        wrong.append(f"colsb {cfg.colsb(len(colsb))}, source says {colsb}")
    return wrong


def test_patched_tile_config_reaches_ldtilecfg(tmp_path):
    mmq = (patched_tree(tmp_path) / MMQ).read_text()
    assert _check(mmq) == []


def test_the_check_catches_the_unpatched_miscompile():
    mmq = _upstream_mmq()
    wrong = _check(mmq)
    if _narrow_loadconfig_operand(compiler()):
        # GCC 12: the stores to rows[] and colsb[] are dropped; the check must see it
        assert any(w.startswith("rows") for w in wrong), wrong
        assert any(w.startswith("colsb") for w in wrong), wrong
    else:
        # a compiler without the narrow operand compiles upstream's code right, and the check says so
        assert wrong == []


def test_reader_follows_stack_stores_and_constants():
    asm = """f:
\tvpxor\t%xmm0, %xmm0, %xmm0
\tvmovdqa64\t%zmm0, -64(%rsp)
\tmovb\t$1, -64(%rsp)
\tmovw\t$64, -48(%rsp)
\tmovb\t$8, -16(%rsp)
\tmovb\t%al, -15(%rsp)
\tldtilecfg\t-64(%rsp)
\tret
"""
    cfg = ldtilecfg_config(asm)
    assert cfg.palette_id == 1 and cfg.colsb(2) == [64, 0] and cfg.rows(3) == [8, None, 0]
    asm = "f:\n\tldtilecfg\tcfg+0(%rip)\n\tret\n\t.section .rodata\ncfg:\n\t.byte\t1\n\t.string\t\"\"\n\t.zero\t14\n" \
          "\t.value\t64,32\n\t.zero\t28\n\t.byte\t8\n\t.zero\t15\n"
    cfg = ldtilecfg_config(asm)
    assert cfg.palette_id == 1 and cfg.colsb(3) == [64, 32, 0] and cfg.rows(2) == [8, 0]
