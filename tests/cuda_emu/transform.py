"""ggml-cuda/sparse-attn.cu as host C++ for emu.h: the include, dynamic and static shared memory, kernel launches.
Nothing else of the source changes. `python transform.py sparse-attn.cu out.inc`"""
from __future__ import annotations

import re
import sys


def transform(src: str) -> str:
    s = src.replace('#include "sparse-attn.cuh"', '#include "emu.h"').replace('#include "fattn-common.cuh"', '')
    s = re.sub(r'extern __shared__ float (\w+)\[\];', r'float * \1 = (float *) emu_dyn_smem;', s)
    s = s.replace('__shared__', 'static')  # one block at a time: a function's statics are its block's shared memory
    n = s.count('<<<')
    s = re.sub(r'([\w:]+(?:<[^;{}()]*?>)?)<<<(.*?)>>>\(', r'emu_launch(\1, \2, ', s, flags=re.S)
    if n == 0 or '<<<' in s:
        raise ValueError("kernel launches not recognized")
    return s


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        out = transform(f.read())
    with open(sys.argv[2], "w") as f:
        f.write(out)
