"""`sparq-cpp calibrate`: Loki's PCA of a model's keys (pre and post RoPE), written as a projection GGUF."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click

from sparq_cpp import lazy
from sparq_cpp.calib.budget import measure_budget
from sparq_cpp.calib.figure import rank_figure
from sparq_cpp.calib.probe import pick, probe as run_probe
from sparq_cpp.calib.projection import check_embeddable, embed_projection, write_projection
from sparq_cpp.calib.run import calibrate, check_sizes
from sparq_cpp.cli.options import (THREADS_HELP, model_option, progress_enabled, progress_option, resolve_model,
                                   threads_type)
from sparq_cpp.cli.runner import run_standalone
from sparq_cpp.auto import Fidelity, choose
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf, check_sparse
from sparq_cpp.outfile import check_writable
from sparq_cpp.train import domains as text_domains


def _read_texts(paths) -> str:
    parts = []
    for p in map(Path, paths):
        if not p.is_file():
            raise SparqError(f"calibration text not found: {p}")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SparqError(f"calibration text {p} is not UTF-8") from None
        if not text.strip():
            raise SparqError(f"calibration text {p} is empty")
        parts.append(text)
    return "\n\n".join(parts)


def _out_path(model: Path, out, embed: bool) -> Path:
    if out is not None:
        out = Path(out)
    else:
        out = model.with_name(model.stem + (".loki-embedded.gguf" if embed else ".loki.gguf"))
    if out.exists() and out.resolve() == model.resolve():
        raise SparqError(f"--out {out} is the model itself; choose another output path")
    return out


def fidelity_table(fid: dict, path) -> str:
    """Per ratio and candidate: the attention output's relative error and the attention mass kept (means over
    layers), with the exact top-k's, and for the probed ones the bits per character lost on text and on a
    retrieval; * = auto's pick (sparq_cpp.auto.choose)."""
    f = Fidelity.of(fid, path)
    names = f.probe_domains
    lines = [f"attention output error and mass kept at {fid['ctx']} positions (means over layers {fid['layers']}), "
             "bits per character lost end to end on text and on a retrieval; * = --attn auto",
             "error, mass: the setting's; topk_*: exact top-k at the same k; text, copy: bits per character over dense"
             + (" (text: the worst domain's, relative to dense's; then each domain's, in bits)" if names else ""),
             "ratio  method  rank      k      l sink  error topk_e   mass topk_m    text    copy"
             + "".join(f" {d[:7]:>7s}" for d in names)]
    for t in sorted(set(f.ratio), reverse=True):
        idx = [i for i in range(len(f.method)) if f.ratio[i] == t]
        best = choose(f, t)
        for i in idx:
            text = f"{f.worst_relative(i):+6.1%}" if names else f"{f.probe_text[i]:+7.3f}"
            probed = f"{text} {f.probe_copy[i]:+7.3f}" if f.probed[i] else ""
            if f.probed[i] and names:
                probed += "".join(f" {float(x):+7.3f}" for x in f.probe_domain_loss[i])
            lines.append(f"1/{round(1 / t):<4d} {f.method[i]:6s} {f.rank[i]:5d} {f.k[i]:6d} {f.l[i]:6d} {f.sink[i]:4d} "
                         + " ".join(f"{x:6.3f}" for x in (f.mean_error(i), float(f.exact_error[i].mean()),
                                                          f.mean_mass(i), float(f.exact_mass[i].mean())))
                         + (f" {probed}" if probed else "") + (" *" if i == best else ""))
    return "\n".join(lines)


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _table(pca) -> str:
    pre, post = pca.rank_at("pre").mean(axis=1), pca.rank_at("post").mean(axis=1)
    D = pca.explained_variance["pre"].shape[-1]
    lines = [f"rank at 90% explained variance (mean over KV heads, of {D})", "layer    pre   post"]
    lines += [f"{il:5d} {a:6.1f} {b:6.1f}" for il, (a, b) in enumerate(zip(pre, post))]
    lines.append(f"  all {pre.mean():6.1f} {post.mean():6.1f}")
    return "\n".join(lines)


@click.command("calibrate")
@model_option("Model GGUF file, or a known model name (smollm2-135m).", required=True)
@click.option("--text", "texts", multiple=True, metavar="FILE",
              help="UTF-8 calibration text (repeatable; the files are read in order). Default: the project's corpus "
                   "of four domains (prose, technical documentation, code, conversation; sparq_cpp.train.domains), "
                   "built in the cache on first use.")
@click.option("--tokens", "n_tokens", type=int, default=16384, show_default=True,
              help="Stop after this many calibration tokens.")
@click.option("--ctx-size", "-c", type=int, default=2048, show_default=True,
              help="Context size: the text is evaluated in chunks of this many tokens.")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--out", "-o", default=None, metavar="PATH",
              help="Output GGUF (default: <model stem>.loki.gguf, or .loki-embedded.gguf with --embed, "
                   "next to the model).")
@click.option("--embed", is_flag=True, help="Write a copy of the model with the projection inside instead.")
@click.option("--fidelity/--no-fidelity", default=True, show_default=True,
              help="Also measure, on the text after the calibration tokens, how much attention SparQ and Loki keep "
                   "at ratios 1/4, 1/8 and 1/16 (stored in the output; --attn auto chooses from it).")
@click.option("--fidelity-windows", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Windows of --ctx-size tokens the fidelity is measured on.")
@click.option("--probe/--no-probe", default=True, show_default=True,
              help="With --fidelity: also run the best setting of each method per ratio end to end on the text (bits "
                   "per character lost on ordinary text and on a repeated paragraph); --attn auto prefers it.")
@click.option("--probe-samples", type=click.IntRange(1, 16), default=2, show_default=True,
              help="Text windows per domain and retrievals (each of --ctx-size tokens) the probe runs every setting "
                   "on.")
@click.option("--domains/--no-domains", "probe_domains", default=True, show_default=True,
              help="The probe also scores the held-out parts of four domains (prose, docs, code, chat), and --attn "
                   "auto weighs the domain that loses most; --no-domains scores the --text's held-out part only.")
@click.option("--figure", default=None, metavar="PNG",
              help="Also write the Loki paper's Figure 2 for this model (PNG; needs matplotlib, the [plot] extra).")
@progress_option
def command(model, texts, n_tokens, ctx_size, threads, out, embed, fidelity, fidelity_windows, probe, probe_samples,
            probe_domains, figure, progress):
    """Fit Loki's per-layer, per-KV-head PCA bases of the keys, before and after RoPE."""
    # every check that needs no model run comes first
    check_sizes(n_tokens, ctx_size)
    model = resolve_model(model)
    summary = check_gguf(model)
    check_sparse(summary, "Loki")  # a projection is only of use to Loki
    if embed:
        check_embeddable(summary.arch)
    out = check_writable(_out_path(model, out, embed), "--out")
    if figure is not None:
        check_writable(figure, "--figure")
        lazy.need("matplotlib", "--figure")  # now, not after the run
    if not texts and not probe_domains:
        raise SparqError("--no-domains needs a calibration text of your own: give --text FILE")
    held = None  # {domain: held-out text} the probe scores beside the text's own held-out part
    if texts:
        text = _read_texts(texts)
        if fidelity and probe and probe_domains:
            try:
                held = text_domains.heldout_texts(text_domains.cached(log=lambda m: click.echo(m, err=True)))
            except SparqError as e:
                click.echo(f"warning: no held-out domains ({e}); the probe scores your text only", err=True)
    else:
        manifest = text_domains.cached(log=lambda m: click.echo(m, err=True))
        text = Path(manifest["mixed"]).read_text(encoding="utf-8")
        held = text_domains.heldout_texts(manifest)
        click.echo(f"calibration text: {manifest['mixed']} (the four domains' calibration parts in turns; "
                   "give --text FILE for your own)", err=True)
    n_domains = (1 if texts else 0) + len(held or {})
    stages = 1 + fidelity + (fidelity and probe)

    def stage(i, what):
        click.echo(f"[{i}/{stages}] {what}", err=True)

    def after_fit(rate: float) -> float:
        """Seconds of the stages after the fit, at the fit's speed in tokens/s. In units of that speed, from one
        run (SmolLM2-135M, -t 1: fit 16384 tokens in 71 s, fidelity on 4 windows of 2048 in 522 s, probe of 2 + 2
        samples in 160 s): the fidelity costs about 15 fit-tokens per window token (every candidate's selection),
        the probe about 4.5 per sample token (each setting and dense)."""
        if not fidelity:
            return 0.0
        return fidelity_windows * ctx_size * 15 / rate + (probe_samples * (n_domains + 1) * ctx_size * 4.5 / rate
                                                          if probe else 0)

    def first_chunk(done: int, total: int, seconds: float) -> None:
        # as soon as the machine's speed is known: the whole run, not only the fit
        if seconds > 0 and done > 0:
            rate0 = done / seconds
            click.echo(f"[1/{stages}] fitting the PCA bases on {total} tokens; the whole calibration will take about "
                       f"{_minutes(total / rate0 + after_fit(rate0))} (at the speed of its first {done} tokens)",
                       err=True)

    t0 = time.perf_counter()
    pca = calibrate(model, text, n_tokens=n_tokens, ctx_size=ctx_size, n_threads=threads,
                    progress=progress_enabled(progress), on_first_chunk=first_chunk)
    seconds = time.perf_counter() - t0
    rate = pca.n_tokens / seconds if seconds > 0 else 0.0
    stage(1, f"fitted the PCA bases on {pca.n_tokens} tokens in {seconds:.1f} s ({rate:.0f} tokens/s)")
    if fidelity and rate > 0:
        click.echo(f"        the rest will take about {_minutes(after_fit(rate))} at this speed", err=True)
    fid = None
    if fidelity:
        stage(2, f"measuring SparQ's and Loki's fidelity at 1/4, 1/8, 1/16 on {fidelity_windows} windows")
        t1 = time.perf_counter()
        fid = measure_budget(model, text, basis=pca.components["post"], skip_tokens=pca.n_tokens, S=ctx_size,
                             n_windows=fidelity_windows, n_threads=threads, log=lambda m: click.echo(m, err=True))
        click.echo(f"measured fidelity on {fid['windows']} windows of {ctx_size} tokens in "
                   f"{time.perf_counter() - t1:.1f} s" + ("" if fid["held_out"] else
                                                         " (the calibration text itself: give more text to hold "
                                                         "some out)"), err=True)
        if probe:
            t2 = time.perf_counter()
            idx = pick(fid)
            stage(3, f"probing {len(idx)} settings end to end on {probe_samples} text windows of each of "
                     f"{n_domains} domains and {probe_samples} retrievals")
            try:
                with tempfile.TemporaryDirectory() as tmp:  # the basis the Loki runs read, before the output exists
                    basis = write_projection(Path(tmp) / "probe.loki.gguf", pca, model, ctx_size=ctx_size)
                    fid["probe"] = run_probe(model, str(basis), text, fid["candidates"], idx, S=ctx_size,
                                             skip_tokens=pca.n_tokens, n_threads=threads, n_samples=probe_samples,
                                             domains=held, own_text=bool(texts),
                                             log=lambda m: click.echo(m, err=True))
                click.echo(f"probed {len(idx)} settings end to end in {time.perf_counter() - t2:.1f} s", err=True)
            except SparqError as e:  # the layer errors still stand; auto then chooses by them
                click.echo(f"warning: no end-to-end probe ({e}); --attn auto will choose by the layer errors", err=True)
    if embed:
        embed_projection(out, pca, model, ctx_size=ctx_size, fidelity=fid, what="--out")
    else:
        write_projection(out, pca, model, ctx_size=ctx_size, fidelity=fid, what="--out")
    click.echo(_table(pca))
    if fid is not None:
        click.echo(fidelity_table(fid, out))
    click.echo(f"calibrated {summary.name} on {pca.n_tokens} tokens in {seconds:.1f} s "
               f"({pca.n_tokens / seconds:.0f} tokens/s)", err=True)
    click.echo(f"wrote {out}", err=True)
    if figure is not None:
        rank_figure(figure, pca.rank_at("pre"), pca.rank_at("post"), summary.head_dim, summary.name, what="--figure")
        click.echo(f"wrote {figure}", err=True)


def main():
    """`python -m sparq_cpp.cli.calibrate`: the command on its own."""
    run_standalone(command)


if __name__ == "__main__":
    main()
