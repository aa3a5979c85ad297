"""Variants of the SparQ op timed in one process, alternating.

On a VM whose read bandwidth changes state within minutes, separate runs cannot show a difference of a
few percent; variants that alternate inside one process can. A variant is a set of environment
variables that a measurement build of the kernel reads (a getenv() added to ops.cpp for the
experiment, never part of the patches); "-" sets none of them. Each pass times every variant (median
of --reps computes of an L-layer SparQ graph, per layer); the result is each variant's median time
and the median (and range) of its per-pass ratio to the first variant.

By default every timed compute follows a compute of a second graph on other data, which evicts the L3
as a model's other layers do. Back to back (--warm), a graph finds its gathered K/V rows (2 MB per
layer at 32 kv heads) still in a 32 MiB L3 and runs 10-15% faster than it does inside a model.

    SPARQ_CPP_LIB_DIR=.sparq-build/tree/build/bin \\
        python -m tools.micro.op_ab -v - -v SPQ_X=1 -v SPQ_X=2+SPQ_Y=1 --n-kv 16384
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import click
import numpy as np

from sparq_cpp.bench.op_bench import random_layer
from sparq_cpp.bindings import ggml_ops as go


def sparq_graph(g: go.Graph, n_kv: int, n_head: int, n_head_kv: int, D: int, r: int, k: int, l: int, layers: int,
                seed: int, n_threads: int, rank: str = "sparq", kv_type: str = "f16") -> go.Graph:
    """g filled with an L-layer graph of one-query SparQ (or Loki, r = d) ops on random caches, built and
    computed once."""
    rng = np.random.default_rng(seed)
    mask = np.ones((1, n_kv), dtype=bool)
    pos = np.arange(n_kv, dtype=np.int32)
    for _ in range(layers):
        q, kk, vv, vm = random_layer(rng, n_kv, n_head, n_head_kv, D)
        cache = go.KVCache(g, kk, vv, kv_type, need_kt=rank == "sparq")
        del kk, vv
        qt, mt, pt = go.q_tensor(g, q), go.mask_tensor(g, mask), g.tensor(pos, "i32")
        if rank == "loki":
            out = g.loki_attn(qt, cache.k, cache.v, mt, pt, 1.0 / np.sqrt(D), r, k, l)
        else:
            out = g.sparq_attn(qt, cache.k, cache.kt, cache.v, mt, pt, g.tensor(vm, "f32"), 1.0 / np.sqrt(D),
                               r, k, l, True)
        g.output(out, q.shape)
    g.build(n_threads)
    g.compute(n_threads)
    return g


def parse_variant(v: str) -> dict[str, str]:
    if v == "-":
        return {}
    env = {}
    for item in v.split("+"):
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise click.BadParameter(f"{v!r}: '-' or NAME=VALUE[+NAME=VALUE...]", param_hint="--variant")
        env[name] = value
    return env


def _alternate(g, evict, envs, passes, reps, layers, threads) -> list[list[float]]:
    """Per variant, the median ms per layer of each pass; the variables are unset afterwards."""
    names = sorted({name for env in envs for name in env})
    times = [[] for _ in envs]  # per variant (a variant may be given twice: the noise between equals)
    for _ in range(passes):
        for iv, env in enumerate(envs):
            for name in names:
                os.environ.pop(name, None)
            os.environ.update(env)
            ts = []
            for _ in range(reps):
                if evict is not None:
                    evict.compute(threads)
                t0 = time.perf_counter()
                g.compute(threads)
                ts.append((time.perf_counter() - t0) / layers * 1e3)
            times[iv].append(statistics.median(ts))
    for name in names:
        os.environ.pop(name, None)
    return times


@click.command()
@click.option("-v", "--variant", "variants", multiple=True, required=True,
              help="'-' (no variables) or NAME=VALUE[+NAME=VALUE...]; the first is the reference")
@click.option("--n-kv", default=16384, show_default=True)
@click.option("--n-head-kv", default=32, show_default=True)
@click.option("--layers", default=6, show_default=True)
@click.option("--passes", default=8, show_default=True)
@click.option("--reps", default=20, show_default=True, help="timed computes per variant and pass")
@click.option("--warm", is_flag=True, help="no evicting compute between the timed ones")
@click.option("--threads", default=2, show_default=True)
@click.option("--rank", type=click.Choice(["sparq", "loki"]), default="sparq", show_default=True,
              help="loki: r is d, l the local window")
@click.option("-r", "r", default=16, show_default=True)
@click.option("-l", "l", default=32, show_default=True)
@click.option("--kv-type", type=click.Choice(["f16", "q8_0"]), default="f16", show_default=True)
def main(variants, n_kv, n_head_kv, layers, passes, reps, warm, threads, rank, r, l, kv_type):
    envs = [parse_variant(v) for v in variants]
    with contextlib.ExitStack() as stack:
        # the op bench's geometry: 32 query heads of D = 128, k = 128
        graphs = [sparq_graph(stack.enter_context(go.Graph(n_tensors=32 * layers)), n_kv, n_head=32, n_head_kv=n_head_kv,
                              D=128, r=r, k=128, l=l, layers=layers, seed=seed, n_threads=threads, rank=rank,
                              kv_type=kv_type)
                  for seed in ((0,) if warm else (0, 1))]
        times = _alternate(graphs[0], graphs[1] if len(graphs) > 1 else None, envs, passes, reps, layers, threads)
    for v, ts in zip(variants, times):
        ratios = sorted(b / a for a, b in zip(times[0], ts))
        click.echo(f"{'warm' if warm else 'cold'} {rank} {kv_type} n_kv {n_kv}, {n_head_kv} kv heads, {v}: "
                   f"{statistics.median(ts):.3f} ms per layer; to {variants[0]}: "
                   f"{statistics.median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f})")


if __name__ == "__main__":
    main()
