"""The SparQ op, its K^T stream floor and the machine's read bandwidth, measured in turns.

On a VM whose read bandwidth switches between levels within minutes, a figure for "the op's share of
the bandwidth" depends on which level the measurement caught. This script measures, round after round:
the read bandwidth (sparq_cpp/bench/machine.py's C loop, 2 threads), the SparQ op at batch 1 (op bench geometry:
32 heads of D = 128, f16 cache, r = 16, k = 128, l = 32; an L-layer graph, each timed compute after an
evicting one, as in op_ab.py), the floor of its scoring stream (`sparq_floors stream 2 2`: the 16 K^T
rows of every kv head read in the kernel's order with its arithmetic, and nothing else), and the
bandwidth again. Each round's line puts the op's and the floor's achieved bandwidth beside the higher of
the two bandwidth figures (the conservative one), so one run shows whether either follows the level.

    SPARQ_CPP_LIB_DIR=.sparq-build/tree/build/bin python -m tools.micro.bw_watch --rounds 20 --json F
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import click

from sparq_cpp.bench import machine
from sparq_cpp.bench.op_bench import bytes_sparq
from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.outfile import atomic_write, check_writable
from tools.micro.op_ab import sparq_graph

FLOOR_SRC = Path(__file__).with_name("sparq_floors.c")
_FLOOR_LINE = re.compile(r"([0-9.]+) ms per layer .*?, ([0-9.]+) GB/s")


def build_floor(workdir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise click.ClickException("no C compiler (cc or gcc) to build sparq_floors.c")
    exe = workdir / "sparq_floors"
    r = subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(FLOOR_SRC), "-o", str(exe)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise click.ClickException(f"sparq_floors.c did not build (it needs AVX-512):\n{r.stderr.strip()}")
    return exe


def floor_stream(exe: Path, passes: int) -> tuple[float, float]:
    """(ms per layer, GB/s) of the best pass of the K^T stream in the kernel's order, 2 threads."""
    out = subprocess.run([str(exe), "stream", "2", "2", str(passes)], capture_output=True, text=True, check=True).stdout
    m = _FLOOR_LINE.search(out)
    if m is None:
        raise click.ClickException(f"unexpected sparq_floors output: {out!r}")
    return float(m.group(1)), float(m.group(2))


def time_op(g: go.Graph, evict: go.Graph, reps: int, layers: int, threads: int) -> float:
    """Median ms per layer of reps computes, each after an evicting compute."""
    ts = []
    for _ in range(reps):
        evict.compute(threads)
        t0 = time.perf_counter()
        g.compute(threads)
        ts.append((time.perf_counter() - t0) / layers * 1e3)
    return statistics.median(ts)


@click.command()
@click.option("--rounds", default=20, show_default=True)
@click.option("--n-kv", default=16384, show_default=True)
@click.option("--layers", default=6, show_default=True)
@click.option("--reps", default=15, show_default=True, help="timed computes of the op per round")
@click.option("--floor-passes", default=5, show_default=True)
@click.option("--threads", default=2, show_default=True)
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(rounds, n_kv, layers, reps, floor_passes, threads, json_out):
    if json_out:
        check_writable(json_out, "--json")
    op_bytes = bytes_sparq(n_kv, 128, 32, 16, 128)
    rows = []
    with contextlib.ExitStack() as stack:
        exe = build_floor(Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sparq-floors-"))))
        g, evict = (sparq_graph(stack.enter_context(go.Graph(n_tensors=32 * layers)), n_kv, n_head=32, n_head_kv=32,
                                D=128, r=16, k=128, l=32, layers=layers, seed=seed, n_threads=threads)
                    for seed in (0, 1))
        bw_after = machine.measure_bandwidth(threads, passes=5)["best_gbs"]
        click.echo(f"n_kv {n_kv}: the op reads {op_bytes / 1e6:.1f} MB per layer; the floor is the K^T stream of "
                   f"n_kv 16384 (16.8 MB per layer); bandwidth = higher of the figures before and after")
        for i in range(rounds):
            bw_before = bw_after
            op_ms = time_op(g, evict, reps, layers, threads)
            floor_ms, floor_gbs = floor_stream(exe, floor_passes)
            bw_after = machine.measure_bandwidth(threads, passes=5)["best_gbs"]
            bw = max(bw_before, bw_after)
            op_gbs = op_bytes / op_ms / 1e6
            rows.append({"round": i, "bandwidth_before_gbs": bw_before, "bandwidth_after_gbs": bw_after,
                         "op_ms": op_ms, "op_gbs": op_gbs, "op_bw_frac": op_gbs / bw,
                         "floor_ms": floor_ms, "floor_gbs": floor_gbs, "floor_bw_frac": floor_gbs / bw})
            click.echo(f"round {i:2d}: bandwidth {bw_before:5.1f} / {bw_after:5.1f} GB/s | op {op_ms:.3f} ms, "
                       f"{op_gbs:4.1f} GB/s, {op_gbs / bw:4.0%} | K^T stream floor {floor_ms:.3f} ms, "
                       f"{floor_gbs:4.1f} GB/s, {floor_gbs / bw:4.0%}")
    if json_out:
        meta = {"n_kv": n_kv, "layers": layers, "reps": reps, "threads": threads, "op_bytes_per_layer": op_bytes,
                "machine": machine.machine_info(), "rows": rows}
        atomic_write(json_out, lambda tmp: tmp.write_text(json.dumps(meta, indent=2)), "--json")


if __name__ == "__main__":
    main()
