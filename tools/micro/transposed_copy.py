"""The CPU's transposed copy (what SparQ's cache upkeep does to rebuild K^T after a state load) against a
plain copy of the same bytes, alternating in one process: median of --reps each, GB/s read + written.

    python -m tools.micro.transposed_copy --cells 32768 --width 4096      # a 7B layer's K at 32k, f16
"""
from __future__ import annotations

import statistics
import time

import click
import numpy as np

from sparq_cpp.bindings import ggml_ops as go


def measure(n_cells: int, width: int, reps: int = 7, threads: int = 2) -> dict:
    rng = np.random.default_rng(0)
    k = go.aligned(rng.standard_normal((n_cells, width)).astype(np.float16))
    kt = go.aligned(np.ones((width, n_cells), np.float16))
    flat = go.aligned(np.ones((n_cells, width), np.float16))
    times = {"transposed": [], "plain": []}
    with go.Graph() as gt, go.Graph() as gp:
        gt.copy(gt.transpose(gt.tensor(k, "f16")), gt.tensor(kt, "f16"))
        gp.copy(gp.tensor(k, "f16"), gp.tensor(flat, "f16"))
        for _ in range(reps):
            for name, g in (("transposed", gt), ("plain", gp)):
                t0 = time.perf_counter()
                g.compute(threads)
                times[name].append(time.perf_counter() - t0)
    if not np.array_equal(kt, k.T):
        raise AssertionError("the transposed copy is wrong")
    moved = 2 * k.nbytes
    out = {name: {"median_s": statistics.median(t), "gbs": moved / statistics.median(t) / 1e9} for name, t in times.items()}
    out["ratio"] = out["transposed"]["median_s"] / out["plain"]["median_s"]
    return out


@click.command()
@click.option("--cells", type=click.IntRange(min=1), default=32768, show_default=True)
@click.option("--width", type=click.IntRange(min=1), default=4096, show_default=True, help="K row: n_embd_k_gqa")
@click.option("--reps", type=click.IntRange(min=1), default=7, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=2, show_default=True)
def main(cells, width, reps, threads):
    r = measure(cells, width, reps, threads)
    click.echo(f"{cells} x {width} f16: transposed {1e3 * r['transposed']['median_s']:.1f} ms "
               f"({r['transposed']['gbs']:.1f} GB/s), plain {1e3 * r['plain']['median_s']:.1f} ms "
               f"({r['plain']['gbs']:.1f} GB/s): {r['ratio']:.2f}x")


if __name__ == "__main__":
    main()
