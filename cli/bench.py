"""`sparq-cpp bench`: end-to-end time per token against sequence length S, dense vs sparse attention."""
from __future__ import annotations

import click

from sparq_cpp.bench.compare import RERUN_TOL, compare, format_comparison, load
from sparq_cpp.bench.e2e import run
from sparq_cpp.bench.e2e_config import DEFAULT_DEPTHS, DEFAULT_MODES, FILLS, MODES, BenchConfig, parse_depths
from sparq_cpp.bench.e2e_report import format_table
from sparq_cpp.cli.options import THREADS_HELP, FiniteFloatRange, progress_enabled, progress_option, threads_type
from sparq_cpp.modelfactory import PRESETS, WTYPES


@click.command("bench")
@click.option("-m", "--model", "--gguf", "model", type=click.Path(dir_okay=False), default=None,
              help="GGUF to time (default: a synthetic Llama 2 7B-shaped model, written once and cached).")
@click.option("--preset", type=click.Choice(list(PRESETS)), default="llama2-7b", show_default=True,
              help="Geometry of the synthetic model.")
@click.option("--wtype", type=click.Choice(list(WTYPES)), default="q8_0", show_default=True,
              help="Weight type of the synthetic model.")
@click.option("--layers", type=int, default=None,
              help="Layers of the synthetic model (default: as many as fit memory at the largest depth).")
@click.option("--depths", default=DEFAULT_DEPTHS, show_default=True, help="Comma-separated S values (k = 1024).")
@click.option("--modes", default=DEFAULT_MODES, show_default=True,
              help=f"Comma-separated, from: {', '.join(MODES)}.")
@click.option("--r", "r", type=int, default=16, show_default=True, help="SparQ: query components used for ranking.")
@click.option("--k", "k", type=int, default=128, show_default=True, help="SparQ/Loki: positions attended to.")
@click.option("--l", "l", type=int, default=32, show_default=True, help="SparQ: most recent positions always kept.")
@click.option("--d", "d", type=int, default=32, show_default=True, help="Loki: principal components used for ranking.")
@click.option("--loki-l", type=int, default=0, show_default=True, help="Loki: most recent positions always kept.")
@click.option("--sink", type=int, default=0, show_default=True,
              help="SparQ and Loki: positions below this (the first tokens) always kept, 0..k - l.")
@click.option("--loki-pca", type=click.Path(dir_okay=False), default=None,
              help="Loki: projection GGUF for --model (default: a synthetic random basis; timing only).")
@click.option("--mean-value/--no-mean-value", default=True, show_default=True,
              help="SparQ's mean-value reallocation (the paper turns it off for GQA models).")
@click.option("--repeats", type=int, default=15, show_default=True,
              help="Timed single-token steps per (S, mode) and round; on a 2-vCPU VM, reruns with 15 x 1 round "
                   "and with 7 x 3 rounds differed by up to 14-15% at some S.")
@click.option("--rounds", type=int, default=1, show_default=True,
              help="Run the sweep this many times, with fresh contexts, and pool the steps: a slow spell "
                   "or a bad memory placement in one round is outvoted.")
@click.option("--warmup", type=int, default=2, show_default=True, help="Untimed steps first.")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--fill", type=click.Choice(FILLS), default="synthetic", show_default=True,
              help="How the cache reaches depth S: a synthetic state load, a real prefill, or both (compared).")
@click.option("--prefill-max", default="4k", show_default=True,
              help="With --fill both: the largest S that also gets a real prefill.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every sample, the machine and the build here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: latency vs S, speed-up vs S with the bandwidth bound.")
@click.option("--beyond-train-ctx", is_flag=True, help="Allow depths beyond the model's trained context.")
@click.option("--mem-fraction", type=float, default=0.8, show_default=True,
              help="Share of available memory a run may use (checked before allocating).")
@click.option("--bandwidth-mib", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Buffer size of the read-bandwidth measurement.")
@click.option("--disturbed-frac", type=FiniteFloatRange(min=0), default=0.02, show_default=True,
              help="A step whose threads waited for a CPU longer than this share of it is disturbed: retaken.")
@click.option("--max-extra-steps", type=int, default=None,
              help="Most steps retaken per (S, mode) for disturbed ones (default 3 x repeats).")
@click.option("--wait-quiet", type=FiniteFloatRange(min=0), default=0.0, show_default=True,
              help="Before timing each (S, mode), wait up to this many seconds for other processes to go quiet.")
@click.option("--interleave/--no-interleave", default=True, show_default=True,
              help="Alternate the timed steps of the modes at one depth where memory allows their contexts together.")
@click.option("--block", type=click.IntRange(min=1), default=4, show_default=True,
              help="Interleaved: steps of one mode per turn, after one untimed step that pays for the switch.")
@progress_option
def command(model, preset, wtype, layers, depths, modes, r, k, l, d, loki_l, sink, loki_pca, mean_value, repeats, rounds, warmup, threads,
            fill, prefill_max, seed, json_path, plot_path, beyond_train_ctx, mem_fraction, bandwidth_mib, disturbed_frac,
            max_extra_steps, wait_quiet, interleave, block, progress):
    """Time decoding one token at a time from depth S for each mode, as generation runs it (median and IQR
    of steady steps), with the bytes each token reads, the machine's read bandwidth and the speed-up bound;
    the first step after filling the cache and a step right after removing the last token are reported apart."""
    cfg = BenchConfig(depths=depths, modes=modes, model=model, preset=preset, wtype=wtype, layers=layers,
                      r=r, k=k, l=l, d=d, loki_l=loki_l, sink=sink, loki_pca=loki_pca, mean_value=mean_value, repeats=repeats, rounds=rounds, warmup=warmup, fill=fill,
                      prefill_max=parse_depths(prefill_max)[0], threads=threads, seed=seed,
                      json_path=json_path, plot_path=plot_path, beyond_train_ctx=beyond_train_ctx,
                      mem_fraction=mem_fraction, bandwidth_bytes=bandwidth_mib << 20, disturbed_frac=disturbed_frac,
                      max_extra_steps=max_extra_steps, wait_quiet=wait_quiet, interleave=interleave, block=block,
                      progress=progress_enabled(progress))
    doc = run(cfg, log=lambda s: click.echo(s, err=True))
    click.echo(format_table(doc))
    for path, what in ((doc["config"]["json_path"], "json"), (doc["config"]["plot_path"], "plot")):
        if path:
            click.echo(f"{what}: {path}", err=True)


@click.command("bench-compare")
@click.argument("run_a", type=click.Path(dir_okay=False))
@click.argument("run_b", type=click.Path(dir_okay=False))
@click.option("--tolerance", type=float, default=RERUN_TOL, show_default=True, help="Relative difference counted as reproduced.")
def compare_command(run_a, run_b, tolerance):
    """Compare the step times and speed-ups of two `sparq-cpp bench --json` runs (a rerun, or interleaved against --no-interleave)."""
    click.echo(format_comparison(compare(load(run_a), load(run_b), tolerance), tolerance))
