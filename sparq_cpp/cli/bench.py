"""`sparq-cpp bench`: end-to-end time per token against sequence length S, dense vs sparse attention; and
`sparq-cpp bench serve`: many users at long context on the OpenAI-compatible server."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import click
from click.core import ParameterSource

from sparq_cpp.bench.compare import RERUN_TOL, compare, format_comparison, load
from sparq_cpp.bench.e2e import run
from sparq_cpp.bench.e2e_config import DEFAULT_DEPTHS, DEFAULT_MODES, FILLS, MODES, BenchConfig, parse_depths
from sparq_cpp.bench.e2e_report import format_table
from sparq_cpp.bench import serve_load
from sparq_cpp.cli.options import (OLD_NAMES_USED, THREADS_HELP, Command, FiniteFloatRange, Group, OldName,
                                   attention_options, model_option, progress_enabled, progress_option, resolve_model,
                                   threads_type)
from sparq_cpp.errors import SparqError
from sparq_cpp.modelfactory import PRESETS, WTYPES


# the attention group's options `bench` and `bench serve` take (the modes choose the method and the cache type)
BENCH_OPTIONS = ("--sparq-r", "--loki-d", "--sparse-k", "--sparse-l", "--sparse-sink", "--mean-value", "--loki-pca")


@click.group("bench", cls=Group, invoke_without_command=True)
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
@attention_options(*BENCH_OPTIONS)
@click.option("--loki-l", "loki_l", cls=OldName, new="--sparse-l", type=int, default=None,
              help="Loki's l alone (--sparse-l sets SparQ's and Loki's).")
@click.pass_context
def command(ctx, model, preset, wtype, layers, depths, modes, repeats, rounds, warmup, threads, fill, prefill_max, seed,
            json_path, plot_path, beyond_train_ctx, mem_fraction, bandwidth_mib, disturbed_frac, max_extra_steps,
            wait_quiet, interleave, block, progress, r, d, k, l, sink, mean_value, loki_pca, loki_l):
    """Time decoding one token at a time from depth S for each mode, as generation runs it (median and IQR
    of steady steps), with the bytes each token reads, the machine's read bandwidth and the speed-up bound;
    the first step after filling the cache and a step right after removing the last token are reported apart.

    `sparq-cpp bench serve` (its own options: `sparq-cpp bench serve -h`) loads the OpenAI-compatible server
    with many users at long context instead."""
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if ctx.get_parameter_source(p.name) not in (ParameterSource.DEFAULT, None)]
        if given:
            raise click.UsageError(f"{', '.join(given)} belong{'s' if len(given) == 1 else ''} to `sparq-cpp bench` "
                                   f"itself, not to `bench {ctx.invoked_subcommand}`; give "
                                   f"`bench {ctx.invoked_subcommand}` its own options after its name")
        return
    if loki_l is None:  # --sparse-l sets Loki's l too; the old --l was SparQ's alone
        loki_l = 0 if l is None or "--l" in ctx.meta.get(OLD_NAMES_USED, ()) else l
    cfg = BenchConfig(depths=depths, modes=modes, model=model, preset=preset, wtype=wtype, layers=layers,
                      r=16 if r is None else r, k=128 if k is None else k, l=l, d=32 if d is None else d, loki_l=loki_l,
                      sink=0 if sink is None else sink, loki_pca=loki_pca, mean_value=mean_value is not False,
                      repeats=repeats, rounds=rounds, warmup=warmup, fill=fill,
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


@command.command("serve", cls=Command)
@model_option("GGUF model file, or a known model name (smollm2-135m); default: the demo model, "
              "models/austen.q8_0.gguf.")
@click.option("--users", default="1,4", show_default=True,
              help="Comma-separated numbers of concurrent users (a server with that many slots for each).")
@click.option("--depth", "depths", default="4k", show_default=True,
              help="Comma-separated tokens of each user's document (k = 1024).")
@click.option("--modes", default=serve_load.DEFAULT_MODES, show_default=True,
              help=f"Comma-separated, from: {', '.join(serve_load.SERVE_MODES)} (dense: -fa auto; the others as in "
                   "`sparq-cpp bench`).")
@click.option("--turns", type=int, default=2, show_default=True,
              help="Turns per user: the document and a question, then follow-ups served from the prompt cache.")
@click.option("--max-tokens", type=int, default=64, show_default=True,
              help="Tokens of every answer (the end of text is ignored, so that every mode decodes as many).")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--text", type=click.Path(dir_okay=False), default=None,
              help="UTF-8 text the users' documents are cut from, one passage each (default: Jane Austen's "
                   "novels, fetched once with apt-get).")
@click.option("--request-timeout", type=FiniteFloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a request may take; a request that runs out is a failed request.")
@click.option("-o", "--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write every request's timings, the machine, the build and the command here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: decode tokens/s and inter-token p99 against users (default with -o: beside it).")
@click.option("--log-dir", type=click.Path(file_okay=False), default=None,
              help="Keep each server's log here (server-PORT.log).")
@click.option("--alone/--no-alone", default=True, show_default=True,
              help="After the users together, run each conversation again alone on the same server and report "
                   "whether every reply's text is the same (temperature 0).")
@progress_option
@attention_options(*BENCH_OPTIONS)
def serve_command(model, users, depths, modes, turns, max_tokens, threads, text, request_timeout, json_path, plot_path,
                  log_dir, alone, progress, r, d, k, l, sink, mean_value, loki_pca):
    """Load the OpenAI-compatible server (started through `sparq-cpp serve`, once per number of users and mode)
    with concurrent users, each in its own streamed conversation over its own long document, follow-up turns
    reusing the prompt cache. Reports per mode and number of users: aggregate decode tokens/s, time to first
    token p50/p95, inter-token latency p50/p99, prompt tokens/s, the server's peak RSS, the caches one user
    costs and the share of requests served from the prompt cache; then, with --alone, whether each user gets the
    same texts alone. A failed request is reported with the server's error and fails the run (after the JSON is
    written)."""
    sparse = []  # passed on to `sparq-cpp serve` under the same names
    for flag, value in (("--sparq-r", r), ("--sparse-k", k), ("--sparse-l", l), ("--sparse-sink", sink),
                        ("--loki-d", d), ("--loki-pca", loki_pca)):
        if value is not None:
            sparse += [flag, str(Path(value).resolve()) if flag == "--loki-pca" else str(value)]
    if mean_value is not None:
        sparse.append("--mean-value" if mean_value else "--no-mean-value")
    if plot_path is None and json_path is not None:
        plot_path = str(Path(json_path).with_suffix(".png"))
    if log_dir is not None:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
    cfg = serve_load.ServeBenchConfig(
        model=None, users=users, depths=depths, modes=modes, turns=turns, max_tokens=max_tokens,
        threads=threads, text=text, sparse=tuple(sparse), request_timeout=request_timeout, json_path=json_path,
        plot_path=plot_path, log_dir=log_dir, progress=progress_enabled(progress), alone=alone)
    cfg = dataclasses.replace(serve_load.validate(cfg), model=resolve_model(model))  # settings first, then the model
    doc = serve_load.run(cfg, log=lambda s: click.echo(s, err=True))
    click.echo(serve_load.format_table(doc))
    for path, what in ((doc["config"]["json_path"], "json"), (doc["config"]["plot_path"], "plot")):
        if path:
            click.echo(f"{what}: {path}", err=True)
    failed = serve_load.failures(doc)
    if failed:
        raise SparqError(failed)
