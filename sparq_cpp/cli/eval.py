"""`sparq-cpp eval`: task scores against compression ratio, dense vs SparQ/Loki (llama.cpp) and the
baselines (reference), as a table per task, a JSON file of every sample and the paper-style plot."""
from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import click

from sparq_cpp import lazy
from sparq_cpp.bench.machine import machine_info
from sparq_cpp.cli.options import (CACHE_OPTION_NAMES, THREADS_HELP, Command, attention_options, model_option,
                                   progress_enabled, progress_option, projection_beside, resolve_model, threads_type)
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import cache_types
from sparq_cpp.evaluation import results, tasks
from sparq_cpp.evaluation.methods import parse_methods
from sparq_cpp.evaluation.runner import EvalConfig, run
from sparq_cpp.evaluation.sweep import parse_ratios
from sparq_cpp.outfile import check_writable
from sparq_cpp.pyext.build import installed_build

DEFAULT_METHODS = "dense,sparq,h2o,lm-infinite"


def _ints(text, what):
    try:
        out = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise SparqError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not out or min(out) < 1:
        raise SparqError(f"{what} must be integers >= 1, got {text!r}")
    return out


def _depths(text):
    try:
        out = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise SparqError(f"--depths must be comma-separated numbers in 0..1, got {text!r}") from None
    if not out or min(out) < 0 or max(out) > 1:
        raise SparqError(f"--depths must be numbers in 0..1, got {text!r}")
    return out


def _data(items):
    out = {}
    for item in items:
        task, eq, path = item.partition("=")
        if not eq or not path:
            raise SparqError(f"--data takes TASK=PATH, got {item!r}")
        if task not in tasks.TASKS:
            raise SparqError(f"--data: unknown task {task!r} (known: {', '.join(tasks.TASKS)})")
        out[task] = Path(path)
    return out


def _share(text, option) -> float:
    try:
        share = float(Fraction(str(text)))
    except (ValueError, ZeroDivisionError):
        raise SparqError(f"{option} must be a number or fraction like 1/4, got {text!r}") from None
    if not 0 <= share <= 1:
        raise SparqError(f"{option} must be in [0, 1] (a share of k), got {text}")
    return share


def _domains(items) -> dict:
    """--domain NAME=PATH: {"bpc:NAME": path}, names unique."""
    out = {}
    for item in items:
        name, eq, path = item.partition("=")
        if not eq or not path:
            raise SparqError(f"--domain takes NAME=PATH, got {item!r}")
        task = tasks.domain_task(name)
        if task in out:
            raise SparqError(f"--domain {name} is given twice")
        out[task] = Path(path)
    return out


def _machine(threads) -> dict:
    """What ran the figures: the CPU, the threads and the llama.cpp build installed (its key names the patches)."""
    build = installed_build()
    return {**machine_info(), "threads": threads,
            "build": None if build is None else {k: build.get(k) for k in ("key", "series_hash", "pin")}}


# the attention group's options eval takes: the methods and ratios choose the rest (k, l and ALISA's c per ratio)
EVAL_OPTIONS = ("--sparq-r", "--loki-d", "--sparse-sink", "--mean-value", "--loki-pca", "--cache-type-k", "--cache-type-v",
                "--cache-type")


@click.command("eval", cls=Command)
@model_option("GGUF model file, or a real model fetched on first use and checked by sha256 "
              "(sparq_cpp/real_models.py): smollm2-135m; default: the demo model, models/austen.q8_0.gguf.")
@click.option("--tasks", "task_list", default="bpc,repetition,needle,kv,copy", show_default=True,
              help="Comma-separated, from: bpc, repetition, needle, kv, copy.")
@click.option("--data", "data", multiple=True, metavar="TASK=PATH",
              help="Read a task's samples from this file (formats: `sparq-cpp eval --help-formats`); "
                   "default: generated data.")
@click.option("--domain", "domain_items", multiple=True, metavar="NAME=PATH",
              help="Also score bits per character on this domain's text (repeatable; task bpc:NAME, with --samples, "
                   "--context and --continuation as bpc): the table and the JSON's \"domains\" give each domain's "
                   "loss against dense and the worst. `python -m sparq_cpp.train eval-data` writes four.")
@click.option("--methods", default=DEFAULT_METHODS, show_default=True,
              help="Comma-separated, from: dense, sparq, loki (llama.cpp), exact-topk, h2o, lm-infinite, alisa "
                   "(reference); METHOD@ref or METHOD@llama picks the backend (alisa@llama: llama.cpp's alisa; "
                   "exact-topk@llama: llama.cpp's SparQ with r = the head size, l = 0, no mean value).")
@click.option("--ratios", default="1,1/2,1/4,1/8,1/16", show_default=True,
              help="Target compression ratios (attention data read / dense, docs/spec.md).")
@click.option("--samples", type=int, default=4, show_default=True, help="bpc / repetition / copy: samples per task.")
@click.option("--context", type=int, default=512, show_default=True, help="bpc / repetition / copy: context tokens.")
@click.option("--continuation", type=int, default=64, show_default=True, help="bpc: tokens scored per sample.")
@click.option("--max-new", type=int, default=64, show_default=True, help="repetition: most tokens generated.")
@click.option("--copy-words", type=int, default=32, show_default=True,
              help="copy: words in the paragraph that is repeated (the first is given, the rest scored).")
@click.option("--lengths", default="512,1024", show_default=True, help="needle / kv: prompt lengths in tokens.")
@click.option("--depths", default="0,0.5,1", show_default=True, help="needle / kv: depths (0 = start, 1 = end).")
@click.option("--local", "sparq_local", default="1/4", show_default=True,
              help="SparQ: the most recent positions kept (l) as a share of k, in [0, 1].")
@click.option("--loki-local", default="0", show_default=True,
              help="Loki: the most recent positions kept (l) as a share of k, in [0, 1].")
@click.option("--threads", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the generated default data.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the config, every sample's record and the summary here.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG: score vs compression per method, a panel per task.")
@progress_option
@click.option("--help-formats", is_flag=True, help="Print the task file formats and exit.")
@attention_options(*EVAL_OPTIONS)
def command(model, task_list, data, domain_items, methods, ratios, samples, context, continuation, max_new, copy_words,
            lengths, depths, sparq_local, loki_local, threads, seed, json_path, plot_path, progress, help_formats, r, d,
            sink, mean_value, loki_pca, cache_type_k, cache_type_v, cache_type):
    """Score tasks at target compression ratios for each method: bits per character, text repetition,
    needle in a haystack, key-value retrieval, copying a paragraph of random words. The reference (exact top-k, H2O, LM-Infinite, and any
    METHOD@ref) is a numpy forward pass: practical for small models only (see the README)."""
    if help_formats:
        click.echo(tasks.__doc__)
        return
    for name, v in (("--samples", samples), ("--context", context), ("--continuation", continuation),
                    ("--max-new", max_new), ("--copy-words", copy_words)):
        if v < 1:
            raise SparqError(f"{name} must be >= 1, got {v}")
    type_k, type_v = cache_types(cache_type, cache_type_k, cache_type_v, names=CACHE_OPTION_NAMES)
    if type_k != type_v:
        raise SparqError(f"eval runs one cache type for K and V (the reference's and the transfer model's), not "
                         f"-ctk {type_k} with -ctv {type_v}; give --cache-type")
    local_share, loki_share = (_share(sparq_local, "--local"), _share(loki_local, "--loki-local"))
    if context < 2:
        raise SparqError("--context must be at least 2 tokens")
    task_names = [t.strip() for t in task_list.split(",") if t.strip()]
    for t in task_names:
        if t not in tasks.TASKS:
            raise SparqError(f"unknown task {t!r} (known: {', '.join(tasks.TASKS)})")
    domain_data = _domains(domain_items)
    task_names += list(domain_data)
    if not task_names:
        raise SparqError("no tasks: give --tasks or --domain NAME=PATH")
    for path, option in ((json_path, "--json"), (plot_path, "--plot")):
        if path:
            check_writable(path, option)  # now, not after the run
    if plot_path:
        lazy.need("matplotlib", "--plot")
    gguf = resolve_model(model)
    method_specs = parse_methods(methods)
    if loki_pca is None and any(spec.method == "loki" for spec in method_specs):
        loki_pca = projection_beside(gguf)  # as generate and serve: else the projection embedded in the model
    cfg = EvalConfig(
        model_path=Path(gguf), tasks=task_names, methods=method_specs, ratios=parse_ratios(ratios),
        task_cfg=tasks.TaskConfig(samples=samples, context=context, continuation=continuation, max_new=max_new, copy_words=copy_words,
                                  lengths=_ints(lengths, "--lengths"), depths=_depths(depths)),
        data={**_data(data), **domain_data}, cache_type=type_k, threads=threads, sparq_r=r, sparq_local=local_share,
        loki_local=loki_share, loki_d=d, sink=0 if sink is None else sink, mean_value=mean_value,
        loki_projection=loki_pca, seed=seed, progress=progress_enabled(progress))
    doc = run(cfg, log=lambda s: click.echo(s, err=True))
    doc["machine"] = _machine(cfg.threads)
    doc["summary"] = results.summarize(doc["records"])
    doc["grid"] = results.grid(doc["records"])
    doc["domains"] = results.domains(doc["summary"])
    click.echo(results.format_table(doc))
    if json_path:
        click.echo(f"json: {results.write_json(doc, json_path)}", err=True)
    if plot_path:
        if doc["records"]:
            click.echo(f"plot: {results.plot(doc, plot_path)}", err=True)
        else:
            click.echo("plot: nothing to plot (no runs)", err=True)
