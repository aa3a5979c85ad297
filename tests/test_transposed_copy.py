"""ggml's CPU copy of a transposed source into a row-major destination (the tiled path of ggml-cpu's
dup, which keeps SparQ's transposed K copy after a state load): every type pair the KV cache uses,
sizes that are not multiples of the tile, a destination inside a wider buffer (K^T's rows are
kv_size cells long), several streams, and thread counts that split the rows unevenly."""
from __future__ import annotations

import numpy as np
import pytest

from sparq_cpp.bindings import ggml_ops

if not ggml_ops.has_sparq_attn():
    pytest.skip("the ggml build is not the patched one (set SPARQ_CPP_LIB_DIR to a patched build)",
                allow_module_level=True)

from tools.micro import transposed_copy  # noqa: E402

NP = {"f32": np.float32, "f16": np.float16}
ELEM = {"f32": 4, "f16": 2}


@pytest.mark.parametrize("src_type,dst_type", [("f16", "f16"), ("f32", "f32"), ("f32", "f16"), ("f16", "f32")])
@pytest.mark.parametrize("n_cells,n_embd,n_stream", [(1, 64, 1), (33, 64, 1), (100, 192, 2), (1000, 200, 1),
                                                     (257, 96, 3), (70, 50, 2)])
@pytest.mark.parametrize("n_threads", [1, 3])
def test_transposed_copy_into_wider_rows(src_type, dst_type, n_cells, n_embd, n_stream, n_threads):
    rng = np.random.default_rng(n_cells * 7 + n_embd)
    kv_size = n_cells + 40
    # K: [n_stream, kv_size, n_embd] row-major (ggml ne = n_embd, kv_size, n_stream)
    k = rng.standard_normal((n_stream, kv_size, n_embd)).astype(NP[src_type])
    sentinel = np.asarray(12345.0, dtype=NP[dst_type])
    kt = ggml_ops.aligned(np.full((n_stream, n_embd, kv_size), sentinel, dtype=NP[dst_type]))  # used in place
    with ggml_ops.Graph() as g:
        tk = g.tensor(k, src_type)
        tkt = g.tensor(kt, dst_type)
        es, ed = ELEM[src_type], ELEM[dst_type]
        # the first n_cells cells of every stream, as [n_embd, n_cells, n_stream], transposed
        src = g.transpose(g.view(tk, (n_embd, n_cells, n_stream, 1), (n_embd * es, kv_size * n_embd * es,
                                                                       kv_size * n_embd * es * n_stream)))
        dst = g.view(tkt, (n_cells, n_embd, n_stream, 1), (kv_size * ed, kv_size * n_embd * ed,
                                                           kv_size * n_embd * ed * n_stream))
        g.copy(src, dst)
        g.compute(n_threads)
    got = kt
    want = np.swapaxes(k[:, :n_cells, :].astype(np.float32), 1, 2).astype(NP[dst_type])
    assert np.array_equal(got[:, :, :n_cells], want)
    assert np.all(got[:, :, n_cells:] == sentinel), "wrote past the view"


def test_the_transposed_copy_bench_runs():
    r = transposed_copy.measure(300, 200, reps=2, threads=2)
    assert r["transposed"]["median_s"] > 0 and r["plain"]["median_s"] > 0 and r["ratio"] > 0
