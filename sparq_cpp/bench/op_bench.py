"""Time ggml_sparq_attn and ggml_loki_attn against dense ggml_flash_attn_ext on the CPU, one decode
step (batch 1).

Defaults: 32 query heads = 32 KV heads, D = 128, f16 cache, SparQ r = 16, k = 128, l = 32, Loki d = 32,
k = 128, l = 0, 2 threads, n_kv = 1k..32k. Each graph holds L layers with their own cache (like a model's attention layers),
so that the data read per step exceeds the last-level cache wherever the memory budget allows;
the time per layer is the median over repeats of (graph time / L).

Bytes per layer follow docs/spec.md's transfer formulas (elements x 2 bytes for f16), per head:
dense 2*n*D (+2*D), SparQ n*r + 2*k*D + 4*D, Loki n*d + 2*k*D + 2*D (the ranking reads
the first d elements of each K row, which the Loki op gets already rotated). The machine's read
bandwidth is measured as the end-to-end bench measures it (sparq_cpp/bench/machine.py: a small multi-threaded
C loop, numpy fallback), at the start and after every n_kv, so each row also has the two measurements
taken just before and just after it (a shared machine's bandwidth can move within minutes): %bw is
against the start's figure, %adj against the higher of the row's two. The repeats of the sparse and
dense graphs alternate. The caches are numpy buffers, which numpy backs with transparent huge pages
where the kernel allows (``--pages 4k`` turns that off, as llama.cpp's cache is allocated). Run:
``python -m sparq_cpp.bench.op_bench`` (with SPARQ_CPP_LIB_DIR pointing at a patched build).
"""
from __future__ import annotations

import importlib
import json
import statistics
import time

import click
import numpy as np

from sparq_cpp import transfer
from sparq_cpp.outfile import atomic_write, check_writable
from sparq_cpp.errors import SparqError
from sparq_cpp.bindings import ggml_ops as go
from sparq_cpp.bench import machine

def measure_bandwidth(n_threads: int = 2, nbytes: int = 1 << 30) -> tuple[float, str]:
    """Best-of-passes read bandwidth in GB/s and how it was measured: the end-to-end bench's measurement
    (sparq_cpp/bench/machine.py), so both benchmarks hold their kernels against the same number."""
    bw = machine.measure_bandwidth(n_threads, nbytes)
    return bw["best_gbs"], f"{bw['method']}, {nbytes >> 20} MiB, best of {len(bw['passes_gbs'])} passes"


def _numpy_huge_pages(on: bool) -> bool | None:
    """Turn numpy's madvise(MADV_HUGEPAGE) for its large arrays on or off; the previous setting, None where
    this numpy has no switch. numpy asks for transparent huge pages by default on Linux, so where the
    kernel's THP mode is 'madvise' the bench's caches are on 2 MiB pages, while llama.cpp's cache
    (ggml_aligned_malloc, no madvise) is on 4 KiB pages."""
    for name in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            mod = importlib.import_module(name)
            return bool(mod._set_madvise_hugepage(on))
        except (ImportError, AttributeError):
            continue
    return None


def _thp_mode() -> str:
    """The kernel's transparent huge page mode ('always', 'madvise', 'never'), or 'unknown'."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "unknown"
    return text[text.find("[") + 1:text.find("]")] if "[" in text else "unknown"


def bytes_dense(n, D, n_head_kv, cache_type="f16"):
    return n_head_kv * transfer.dense_bytes(n, D, cache_type)


def bytes_sparq(n, D, n_head_kv, r, k, cache_type="f16"):
    # K^T is f16 whatever the cache (f32 with an f32 cache, which the bench does not run)
    return n_head_kv * transfer.sparq_bytes(n, D, r, k, cache_type, "f16")


def bytes_loki(n, D, n_head_kv, d, k, cache_type="f16"):
    return n_head_kv * transfer.loki_bytes(n, D, d, k, cache_type)


def _counts(text: str, what: str, example: str, option: str) -> list[int]:
    """A comma-separated list of counts, each at least 1."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise click.BadParameter(f"{text!r}: a comma-separated list of {what}, e.g. {example}",
                                 param_hint=option) from None
    if any(n < 1 for n in out):
        raise click.BadParameter(f"{text!r}: {what} must be at least 1", param_hint=option)
    return out


def phase_line(row: dict, m: str, ns, threads: int, bw: float, rank_bytes: int) -> str:
    """The kernel's phases of method m into row (per layer: ms of one thread's share, GB/s of what each reads:
    ranking its K^T rows or Loki's prefixes, attention the rest of the op's bytes) and the line that says them."""
    ms = [x / threads / 1e6 for x in ns]  # the threads' summed time over their number: the wall time if balanced
    attend_bytes = row[f"{m}_bytes"] - rank_bytes
    row[f"{m}_phases"] = {
        "rank_ms": ms[0], "select_ms": ms[1], "attend_ms": ms[2], "rank_bytes": rank_bytes, "attend_bytes": attend_bytes,
        "rank_gbs": rank_bytes / ms[0] / 1e6 if ms[0] else None,
        "attend_gbs": attend_bytes / ms[2] / 1e6 if ms[2] else None,
        "covered": sum(ms) / (row[f"{m}_s"] * 1e3)}  # the share of the op's time the phases account for
    p = row[f"{m}_phases"]
    gbs = lambda x: "-" if x is None else f"{x:.1f} GB/s ({100 * x / bw:.0f}%)"  # noqa: E731
    return (f"{m} phases: rank {ms[0]:.3f} ms {gbs(p['rank_gbs'])}, select {ms[1]:.3f} ms, attend {ms[2]:.3f} ms "
            f"{gbs(p['attend_gbs'])}; {100 * p['covered']:.0f}% of the op's time")


def _layers(n_kv, n_head_kv, D, budget):
    per_layer = 3 * n_kv * n_head_kv * D * 2  # k, v, kt f16
    return int(max(2, min(16, budget // per_layer)))


def random_layer(rng, n_kv, n_head, n_head_kv, D, n_seq=1):
    """One layer's queries (one row per sequence), K and V (standard normal, f32 [n_seq * n_kv, n_head_kv, D]:
    the sequences' cells one after the other, as in a unified cache) and each sequence's mean of V."""
    q = rng.standard_normal((n_seq, n_head, D), dtype=np.float32)
    kk = rng.standard_normal((n_seq * n_kv, n_head_kv, D), dtype=np.float32)
    vv = rng.standard_normal((n_seq * n_kv, n_head_kv, D), dtype=np.float32)
    vm = vv.reshape(n_seq, n_kv, n_head_kv, D).mean(axis=1).astype(np.float32)
    return q, kk, vv, vm


def time_layers(n_kv, n_head, n_head_kv, D, r, k, l, n_threads, reps, budget, mean_value=True, seed=0,
                loki_d=None, loki_l=0, n_seq=1, phases=None, cache_type="f16"):
    """{"sparq"|"dense"|"loki": (median, min) seconds per layer} and the number of layers; Loki (on the
    same K/V, standing in for the rotated cache: the op's cost does not depend on the basis) only with
    loki_d. n_seq sequences decode together (llama-server's slots in one batch): a query row each, each seeing
    its own n_kv cells of a unified cache (the mask), as llama.cpp's graph gives the op."""
    rng = np.random.default_rng(seed)
    L = _layers(n_seq * n_kv, n_head_kv, D, budget)
    scale = 1.0 / np.sqrt(D)
    mask = np.kron(np.eye(n_seq, dtype=bool), np.ones((1, n_kv), dtype=bool))  # row s sees sequence s's cells
    pos = np.tile(np.arange(n_kv, dtype=np.int32), n_seq)
    with go.Graph(n_tensors=32 * L) as gs, go.Graph(n_tensors=32 * L) as gd, go.Graph(n_tensors=32 * L) as gl:
        for _ in range(L):
            q, kk, vv, vm = random_layer(rng, n_kv, n_head, n_head_kv, D, n_seq)
            cache = go.KVCache(gs, kk, vv, cache_type)
            del kk, vv
            qt = go.q_tensor(gs, q)
            mt = go.mask_tensor(gs, mask)
            pt = gs.tensor(pos, "i32")
            vt = gs.tensor(vm, "f32") if mean_value else None
            gs.output(gs.sparq_attn(qt, cache.k, cache.kt, cache.v, mt, pt, vt, scale, r, k, l, mean_value), q.shape)
            # dense reads the same K/V views (tensors of another context are fine as sources)
            qd = go.q_tensor(gd, q)
            md = go.mask_tensor(gd, mask)
            gd.output(gd.flash_attn_ext(qd, cache.k, cache.v, md, scale), q.shape)
            if loki_d:
                ql = go.q_tensor(gl, q)
                ml = go.mask_tensor(gl, mask)
                pl = gl.tensor(pos, "i32")
                gl.output(gl.loki_attn(ql, cache.k, cache.v, ml, pl, scale, loki_d, k, loki_l), q.shape)
        graphs = [("sparq", gs), ("dense", gd)] + ([("loki", gl)] if loki_d else [])
        for _, g in graphs:
            g.build(n_threads)
            g.compute(n_threads)  # warm-up
        # the repeats of the graphs alternate, so that a slow spell of a shared machine hits them alike
        ts = {name: [] for name, _ in graphs}
        for _ in range(reps):
            for name, g in graphs:
                t0 = time.perf_counter()
                g.compute(n_threads)
                ts[name].append((time.perf_counter() - t0) / L)
        res = {name: (statistics.median(t), min(t)) for name, t in ts.items()}
        if phases is not None:  # the kernel's phase counters (a profiling build), over repeats of their own
            for name, g in graphs:
                if name == "dense":
                    continue
                go.sparse_attn_phases()
                for _ in range(reps):
                    g.compute(n_threads)
                phases[name] = [ns / (reps * L) for ns in go.sparse_attn_phases()]
    return res, L


@click.command()
@click.option("--n-kv", "n_kvs", default="1024,2048,4096,8192,16384,32768", show_default=True)
@click.option("--n-head", default=32, show_default=True)
@click.option("--n-head-kv", default=32, show_default=True)
@click.option("--head-dim", "D", default=128, show_default=True)
@click.option("-r", "r", default=16, show_default=True)
@click.option("-k", "k", default=128, show_default=True)
@click.option("-l", "l", default=32, show_default=True)
@click.option("--loki-d", default=32, show_default=True, help="Loki: components used for ranking (0: no Loki)")
@click.option("--loki-l", default=0, show_default=True, help="Loki: most recent positions always kept")
@click.option("--n-seq", "n_seqs", default="1", show_default=True,
              help="Sequences decoding together (comma-separated list): a query row each over its own n_kv cells "
                   "of one unified cache, as llama-server's slots; times, bytes and GB/s are of the whole step, and "
                   "each row says how it compares with n_seq steps of one sequence.")
@click.option("--phases", is_flag=True,
              help="Also time the kernel's phases (ranking, selection, attention) by its counters: needs a build "
                   "with them (python -m sparq_cpp.pyext.build --no-install "
                   "--cmake-arg=-DCMAKE_CXX_FLAGS=-DGGML_SPARSE_ATTN_PROFILE, then SPARQ_CPP_LIB_DIR=its bin folder).")
@click.option("--cache-type", type=click.Choice(["f16", "q8_0"]), default="f16", show_default=True,
              help="K and V cache type (SparQ's K^T is f16 either way).")
@click.option("--threads", default=2, show_default=True)
@click.option("--reps", default=7, show_default=True)
@click.option("--mem-budget-gb", default=3.0, show_default=True, help="cache memory per graph")
@click.option("--pages", type=click.Choice(["huge", "4k"]), default="huge", show_default=True,
              help="cache buffers: 'huge' leaves numpy's request for transparent huge pages on (2 MiB pages where "
                   "the kernel's THP mode is 'madvise' or 'always'); '4k' turns it off, the pages llama.cpp's cache "
                   "gets unless THP is 'always'")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None)
def main(n_kvs, n_head, n_head_kv, D, r, k, l, loki_d, loki_l, n_seqs, phases, cache_type, threads, reps,
         mem_budget_gb, pages, json_out):
    sizes = _counts(n_kvs, "cell counts", "1024,16384", "--n-kv")
    seqs = _counts(n_seqs, "sequence counts", "1,4,8", "--n-seq")
    if not go.has_sparq_attn():
        raise SparqError(f"ggml_sparq_attn is missing from {go.lib_dir()}: build the patched ggml")
    if phases and go.sparse_attn_phases() is None:
        raise SparqError(f"--phases: the ggml of {go.lib_dir()} has no phase counters; build one with "
                         "`python -m sparq_cpp.pyext.build --no-install --cmake-arg=-DCMAKE_CXX_FLAGS="
                         "-DGGML_SPARSE_ATTN_PROFILE` and set SPARQ_CPP_LIB_DIR to its cmake-build/bin")
    if json_out:
        check_writable(json_out, "--json")  # now, not after the long run
    huge_before = _numpy_huge_pages(pages == "huge")
    if huge_before is None and pages == "4k":
        raise click.BadParameter("this numpy has no switch for its huge-page requests", param_hint="--pages")
    if huge_before is not None:
        click.get_current_context().call_on_close(lambda: _numpy_huge_pages(huge_before))  # also on errors
    thp = _thp_mode()
    bw, how = measure_bandwidth(threads)
    click.echo(f"cache pages: {pages} (transparent huge pages: {thp})")
    click.echo(f"read bandwidth: {bw:.1f} GB/s ({how})")
    click.echo("times are per layer: median of the repeats (min in brackets); speedup over dense and %bw "
               "(achieved GB/s / read bandwidth) from the medians; %adj: against the higher of the bandwidths "
               "measured just before and just after the row (GB/s in the last column)")
    methods = ["sparq"] + (["loki"] if loki_d else [])
    head = f"{'n_kv':>6} {'seq':>3} {'L':>3} {'dense ms':>17}"
    for m in methods:
        head += f" {m + ' ms':>15} {'speedup':>8} {'%bw':>5} {'%adj':>5} {'MB':>7}"
    click.echo(head + f" {'MB dense':>9} {'dense GB/s':>10} {'GB/s before / after':>19}")
    rows = []
    bw_before = bw
    for n in sizes:
        one = None  # the n_seq = 1 row of this n_kv, for the per-sequence comparison
        for s in seqs:
            ph = {} if phases else None
            res, L = time_layers(n, n_head, n_head_kv, D, r, k, l, threads, reps, int(mem_budget_gb * 2**30),
                                 loki_d=loki_d or None, loki_l=loki_l, n_seq=s, phases=ph, cache_type=cache_type)
            bw_after, _ = measure_bandwidth(threads)
            bw_adj = max(bw_before, bw_after)
            td, td_min = res["dense"]
            nbytes = {"dense": s * bytes_dense(n, D, n_head_kv, cache_type),
                      "sparq": s * bytes_sparq(n, D, n_head_kv, r, k, cache_type)}
            if loki_d:
                nbytes["loki"] = s * bytes_loki(n, D, n_head_kv, loki_d, k, cache_type)
            row = dict(n_kv=n, n_seq=s, layers=L, dense_s=td, dense_min_s=td_min, dense_bytes=nbytes["dense"],
                       dense_gbs=nbytes["dense"] / td / 1e9, bandwidth_before_gbs=bw_before,
                       bandwidth_after_gbs=bw_after)
            line = f"{n:>6} {s:>3} {L:>3} {td*1e3:>8.3f} ({td_min*1e3:>6.2f})"
            for m in methods:
                t, t_min = res[m]
                gbs = nbytes[m] / t / 1e9
                row.update({f"{m}_s": t, f"{m}_min_s": t_min, f"{m}_bytes": nbytes[m], f"{m}_gbs": gbs,
                            f"{m}_speedup": td / t, f"{m}_bw_frac": gbs / bw, f"{m}_bw_frac_adj": gbs / bw_adj})
                if one is not None:  # the step of s sequences against s steps of one
                    row[f"{m}_vs_separate"] = t / (s * one[f"{m}_s"])
                line += (f" {t*1e3:>6.3f} ({t_min*1e3:>5.2f}) {td / t:>7.1f}x {100 * gbs / bw:>4.0f}%"
                         f" {100 * gbs / bw_adj:>4.0f}% {nbytes[m]/1e6:>7.2f}")
            if one is not None:
                row["dense_vs_separate"] = td / (s * one["dense_s"])
                line += "  vs separate: " + ", ".join(f"{m} {row[f'{m}_vs_separate']:.2f}x"
                                                      for m in ["dense"] + methods)
            if s == 1:
                one = row
            rows.append(row)
            click.echo(line + f" {nbytes['dense']/1e6:>9.1f} {row['dense_gbs']:>10.1f} {bw_before:>9.1f} / "
                       f"{bw_after:.1f}")
            for m, ns in (ph or {}).items():
                rank = (n * r * 2 if m == "sparq"
                        else transfer.loki_bytes(n, D, loki_d, 0, cache_type) - 2 * D * transfer.bytes_per_element(cache_type))
                click.echo("       " + phase_line(row, m, ns, threads, bw_adj, rank_bytes=int(s * n_head_kv * rank)))
            bw_before = bw_after
    bw_end = bw_before
    for row in rows:
        for m in methods:
            row[f"{m}_bw_frac_end"] = row[f"{m}_gbs"] / bw_end
    last = rows[-1]
    click.echo(f"read bandwidth at the end: {bw_end:.1f} GB/s (%bw above is against the {bw:.1f} GB/s of the start); "
               f"against the end's, at n_kv = {last['n_kv']}: "
               + ", ".join(f"{m} {100 * last[f'{m}_bw_frac_end']:.0f}%" for m in methods))
    if json_out:
        doc = dict(bandwidth_gbs=bw, bandwidth_end_gbs=bw_end, bandwidth_how=how, n_head=n_head, n_head_kv=n_head_kv, D=D, r=r, k=k, l=l,
                   loki_d=loki_d, loki_l=loki_l, threads=threads, pages=pages, thp_mode=thp, cpu_model=machine.cpu_model(),
                   cache_type=cache_type,
                   rows=rows)
        atomic_write(json_out, lambda tmp: tmp.write_text(json.dumps(doc, indent=2)), "--json")


if __name__ == "__main__":
    main()
