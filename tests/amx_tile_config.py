"""What ggml's AMX code really hands to `ldtilecfg`, read from the compiler's output.

ggml-cpu/amx/mmq.cpp configures the tiles once per thread (`ggml_tile_config_init`). If the compiler drops
the stores that fill the 64-byte config, the tiles stay unconfigured and the first tile instruction raises
SIGILL, on AMX machines only. This module compiles that function, cut from the source as it is, for
Sapphire Rapids at -O3 with the machine's compiler (on any x86 machine: nothing runs), and rebuilds from
the assembly the 64 bytes `ldtilecfg` reads: a constant's data directives, or the stores to the stack
that precede the instruction (immediates and vector registers of known content; anything else is
unknown, None).
"""
from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

CONFIG_BYTES = 64  # palette_id, start_row, 14 reserved, colsb[16] (u16), rows[16]
COLSB_AT, ROWS_AT = 16, 48


@dataclass
class TileConfig:
    raw: list  # 64 entries: a byte value, or None where the code leaves it unknown

    @property
    def palette_id(self):
        return self.raw[0]

    def rows(self, n: int) -> list:
        return self.raw[ROWS_AT:ROWS_AT + n]

    def colsb(self, n: int) -> list:
        out = []
        for i in range(n):
            lo, hi = self.raw[COLSB_AT + 2 * i], self.raw[COLSB_AT + 2 * i + 1]
            out.append(None if lo is None or hi is None else lo | hi << 8)
        return out


def config_path_source(mmq_cpp: str) -> str:
    """The tile config's struct and everything up to the end of ggml_tile_config_init, as one translation
    unit with a caller, so the compiler sees what it sees inside mmq.cpp."""
    start = mmq_cpp.index("struct tile_config_t")
    fn = mmq_cpp.index("void ggml_tile_config_init(void)", start)
    open_brace = mmq_cpp.index("{", fn)
    depth, i = 0, open_brace
    while True:
        c = mmq_cpp[i]
        depth += c == "{"
        depth -= c == "}"
        i += 1
        if depth == 0:
            break
    return ("#include <immintrin.h>\n#include <cstdint>\n" + mmq_cpp[start:i]
            + "\nvoid sparq_probe_tile_config(void) { ggml_tile_config_init(); }\n")


def expected_config(mmq_cpp: str) -> tuple[list[int], list[int]]:
    """rows[] and colsb[] as the source assigns them (`tc.rows[i] = R;  tc.colsb[i] = C;`)."""
    pairs = re.findall(r"tc\.rows\[(\d+)\]\s*=\s*(\d+);\s*tc\.colsb\[\1\]\s*=\s*(\d+);", mmq_cpp)
    if not pairs:
        raise ValueError("no `tc.rows[i] = R; tc.colsb[i] = C;` assignments found in mmq.cpp")
    pairs.sort(key=lambda p: int(p[0]))
    return [int(p[1]) for p in pairs], [int(p[2]) for p in pairs]


def compiler() -> str | None:
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    return None


def compile_to_asm(source: str, cxx: str) -> str:
    proc = subprocess.run([cxx, "-std=c++17", "-O3", "-march=sapphirerapids", "-S", "-x", "c++", "-", "-o", "-"],
                          input=source, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"{cxx} failed on the tile config path:\n{proc.stderr[-2000:]}")
    return proc.stdout


_VREG = re.compile(r"%([xyz])mm(\d+)$")
_VSIZE = {"x": 16, "y": 32, "z": 64}
_MEM = re.compile(r"^(-?\w*(?:[+-]\d+)?)\((%\w+)\)$")  # disp(%base) or SYMBOL(%rip) / SYMBOL+8(%rip)


def _int(text: str) -> int:
    return int(text, 0)


def _operands(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for c in args:
        if c == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += c == "("
        depth -= c == ")"
        cur += c
    if cur.strip():
        out.append(cur.strip())
    return out


def _data_of(lines: list[str], symbol: str) -> list:
    """The bytes a data label's directives emit (.byte/.value/.short/.long/.quad/.zero/.string/.ascii)."""
    sizes = {".byte": 1, ".value": 2, ".short": 2, ".2byte": 2, ".long": 4, ".4byte": 4, ".quad": 8, ".8byte": 8}
    try:
        i = next(k for k, line in enumerate(lines) if line.strip() == f"{symbol}:")
    except StopIteration:
        raise ValueError(f"no data label {symbol} in the assembly") from None
    data: list = []
    for line in lines[i + 1:]:
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if s.endswith(":") or not s.startswith("."):
            break
        op, _, arg = s.partition("\t") if "\t" in s else s.partition(" ")
        arg = arg.strip()
        if op in sizes:
            for v in arg.split(","):
                data += list((_int(v.strip()) & (1 << 8 * sizes[op]) - 1).to_bytes(sizes[op], "little"))
        elif op == ".zero":
            data += [0] * _int(arg)
        elif op in (".string", ".ascii"):
            raw = arg.strip('"').encode().decode("unicode_escape").encode("latin-1")
            data += list(raw) + ([0] if op == ".string" else [])
        elif op in (".align", ".p2align", ".type", ".size", ".weak", ".globl", ".local"):
            continue
        else:
            break
    return data


def ldtilecfg_config(asm: str) -> TileConfig:
    """The 64 bytes the (first) ldtilecfg of this assembly loads."""
    lines = asm.splitlines()
    at = next((k for k, line in enumerate(lines) if line.strip().startswith("ldtilecfg")), None)
    if at is None:
        raise ValueError("no ldtilecfg instruction in the assembly")
    operand = lines[at].strip().split(None, 1)[1].strip()
    m = _MEM.match(operand)
    if not m:
        raise ValueError(f"ldtilecfg operand {operand!r} not understood")
    disp, base = m.groups()
    if base == "%rip":  # a constant: its bytes are in the data section
        sym, _, off = disp.partition("+")
        data = _data_of(lines, sym)[int(off or 0):]
        return TileConfig(raw=(data + [None] * CONFIG_BYTES)[:CONFIG_BYTES])
    origin = _int(disp) if disp else 0

    # a config in memory at origin(%base): replay the stores of the function before ldtilecfg
    start = max((k for k in range(at) if re.match(r"^[A-Za-z_][\w.$]*:$", lines[k].strip())
                 and not lines[k].strip().startswith(".L")), default=0)
    image: list = [None] * CONFIG_BYTES
    vregs: dict[str, list | None] = {}

    def store(offset: int, values: list) -> None:
        for j, v in enumerate(values):
            pos = offset - origin + j
            if 0 <= pos < CONFIG_BYTES:
                image[pos] = v

    for line in lines[start + 1:at]:
        s = line.strip()
        if not s or s.startswith((".", "#")) or s.endswith(":"):
            continue
        mnemonic, _, rest = s.partition("\t") if "\t" in s else s.partition(" ")
        ops = _operands(rest)
        dst = ops[-1] if ops else ""
        if base == "%rsp" and mnemonic.startswith(("push", "pop", "call")) or dst == base:
            image = [None] * CONFIG_BYTES  # the base register moved: earlier stores are elsewhere
            continue
        vm = _VREG.match(dst)
        if vm:  # a vector register is written
            kind, num = vm.groups()
            if mnemonic in ("vpxor", "vpxord", "vpxorq", "vxorps", "vxorpd") and len(set(ops)) == 1:
                vregs[num] = [0] * 64
            elif mnemonic.startswith(("vmovdq", "vmovap", "vmovup")) and _MEM.match(ops[0]) \
                    and _MEM.match(ops[0]).group(2) == "%rip":
                sym, _, off = _MEM.match(ops[0]).group(1).partition("+")
                data = _data_of(lines, sym)[int(off or 0):]
                vregs[num] = (data + [None] * 64)[:_VSIZE[kind]] + [None] * (64 - _VSIZE[kind])
            else:
                vregs[num] = None
            continue
        mm = _MEM.match(dst)
        if not mm or mm.group(2) != base:
            continue
        offset = _int(mm.group(1)) if mm.group(1) else 0
        src = ops[0]
        if src.startswith("$") and mnemonic in ("movb", "movw", "movl", "movq"):
            size = {"b": 1, "w": 2, "l": 4, "q": 8}[mnemonic[-1]]
            store(offset, list((_int(src[1:]) & (1 << 8 * size) - 1).to_bytes(size, "little")))
        elif _VREG.match(src):
            kind, num = _VREG.match(src).groups()
            content = vregs.get(num)
            size = _VSIZE[kind]
            store(offset, content[:size] if content else [None] * size)
        else:  # a store we cannot follow: its bytes are unknown
            size = {"b": 1, "w": 2, "l": 4, "q": 8}.get(mnemonic[-1], 8)
            store(offset, [None] * size)
    return TileConfig(raw=image)
