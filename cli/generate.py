"""`sparq-cpp generate`: stream text from a GGUF model, then report prompt and decode speed."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click

from sparq_cpp.cli.options import THREADS_HELP, FiniteFloatRange, attention_options, threads_type
from sparq_cpp.errors import SparqError

DEFAULT_PROMPT = "It is a truth universally acknowledged"


def _read_prompt(prompt, prompt_file) -> str:
    if prompt is not None and prompt_file is not None:
        raise SparqError("give either --prompt or --prompt-file, not both")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            raise SparqError(f"prompt file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SparqError(f"prompt file {path} is not UTF-8 text") from None
    return DEFAULT_PROMPT if prompt is None else prompt


def _resolve_model(gguf):
    if gguf is not None:
        return Path(gguf)
    from sparq_cpp.demo_model import default_model

    return default_model(lambda msg: click.echo(msg, err=True))


class _Utf8Stream:
    """Detokenized pieces can split a UTF-8 character; print only complete characters."""

    def __init__(self, out):
        self.out, self.pending = out, b""

    def write(self, data: bytes):
        self.pending += data
        text = self.pending.decode("utf-8", errors="ignore")
        # keep an incomplete trailing sequence for the next piece
        complete = len(text.encode("utf-8"))
        if complete < len(self.pending) and len(self.pending) - complete < 4:
            self.pending = self.pending[complete:]
        else:
            self.pending = b""
        self.out.write(text)
        self.out.flush()


@click.command("generate")
@click.option("--gguf", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file (default: the demo model, models/austen.q8_0.gguf).")
@click.option("--prompt", "-p", default=None, help=f"Prompt text (default: {DEFAULT_PROMPT!r}).")
@click.option("--prompt-file", "-f", default=None, help="Read the prompt from this UTF-8 file.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=64, show_default=True,
              help="Tokens to generate.")
@click.option("--ctx-size", "-c", type=int, default=None,
              help="Context size (default: 4096, or the model's training context if that is shorter).")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--seed", type=int, default=0, show_default=True, help="Sampling seed.")
@click.option("--temp", "--temperature", "temp", type=FiniteFloatRange(min=0), default=0.8, show_default=True,
              help="Sampling temperature; 0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True,
              help="Sample from the k most likely tokens; 0 = all.")
@click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True), default=0.95, show_default=True,
              help="Sample from the most likely tokens whose probabilities add up to p, in (0, 1].")
@click.option("--cache-type", type=click.Choice(["f16", "q8_0", "f32"]), default="f16", show_default=True,
              help="KV cache type.")
@attention_options
def command(gguf, prompt, prompt_file, n_predict, ctx_size, threads, seed, temp, top_k, top_p, cache_type,
            attn, r, d, k, l, no_mean_value, loki_pca, loki_variant, c):
    """Generate text, streaming it, then print prompt and decode speed."""
    from sparq_cpp.llm import open_model

    attention = _attention(attn, r, k, l, no_mean_value, d, loki_pca, loki_variant, c)
    if n_predict < 1:
        raise SparqError(f"-n must be >= 1, got {n_predict}")
    text = _read_prompt(prompt, prompt_file)
    path = _resolve_model(gguf)
    if ctx_size is None:
        from sparq_cpp.gguf_check import check_gguf

        ctx_size = min(4096, check_gguf(path).n_ctx_train or 4096)
    llm, summary = open_model(path, attention=attention, n_ctx=ctx_size,
                              n_threads=threads, seed=seed, cache_type=cache_type)
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True)
    if len(tokens) + n_predict > ctx_size:
        raise SparqError(f"the prompt is {len(tokens)} tokens; with -n {n_predict} that needs "
                         f"{len(tokens) + n_predict} positions, more than --ctx-size {ctx_size}")

    out = _Utf8Stream(sys.stdout)
    out.write(text.encode("utf-8"))
    t0 = time.perf_counter()
    llm.eval(tokens)
    t_prompt = time.perf_counter() - t0

    eos, generated, t_decode = llm.token_eos(), 0, 0.0
    prev = tokens[-1:]
    for _ in range(n_predict):
        tok = llm.sample(temp=temp, top_k=top_k, top_p=top_p) if temp > 0 else _greedy(llm)
        if tok == eos:
            break
        out.write(llm.detokenize([tok], prev_tokens=prev))
        prev = [tok]
        generated += 1
        t1 = time.perf_counter()
        llm.eval([tok])
        t_decode += time.perf_counter() - t1
    sys.stdout.write("\n")
    _report(summary, len(tokens), t_prompt, generated, t_decode, llm)
    _report_reads(llm, summary, len(tokens) + generated)


def _attention(attn, r, k, l, no_mean_value, d=None, loki_pca=None, loki_variant="post", c=None):
    from sparq_cpp.attention import ALISA, Dense, Loki, SparQ

    sparq_only = r is not None or no_mean_value
    loki_only = d is not None or loki_pca is not None
    shared = k is not None or l is not None
    if c is not None and (sparq_only or loki_only or shared):
        raise SparqError("--c is ALISA's setting and --r/--d/--k/--l/--no-mean-value/--loki-pca are SparQ's and Loki's; "
                         "ALISA takes only --c")
    if attn is None:
        if sparq_only and loki_only:
            raise SparqError("--r/--no-mean-value are SparQ settings and --d/--loki-pca Loki ones; pick one --attn")
        attn = "alisa" if c is not None else "loki" if loki_only else "sparq" if (sparq_only or shared) else "dense"
    if attn == "dense" and (sparq_only or loki_only or shared or c is not None):
        raise SparqError("--r/--d/--k/--l/--c/--no-mean-value/--loki-pca are sparse attention settings; "
                         "drop them or use --attn sparq, loki or alisa")
    if attn == "alisa":
        if sparq_only or loki_only or shared:
            raise SparqError("--r/--d/--k/--l/--no-mean-value/--loki-pca are SparQ and Loki settings; ALISA takes --c")
        return ALISA(c=0.125 if c is None else c)
    if c is not None:
        raise SparqError("--c is an ALISA setting; use --attn alisa")
    if attn == "sparq" and loki_only:
        raise SparqError("--d/--loki-pca are Loki settings; use --attn loki")
    if attn == "loki" and sparq_only:
        raise SparqError("--r/--no-mean-value are SparQ settings; use --attn sparq")
    if attn == "sparq":
        return SparQ(r=16 if r is None else r, k=128 if k is None else k, l=l, mean_value=not no_mean_value)
    if attn == "loki":
        if loki_pca is not None and not Path(loki_pca).is_file():
            raise SparqError(f"--loki-pca: file not found: {loki_pca}")
        return Loki(d=32 if d is None else d, k=128 if k is None else k, l=0 if l is None else l,
                    projection=loki_pca, variant=loki_variant)
    return Dense()


def _report_reads(llm, summary, n_kv):
    """Attention data the last step read, against dense, from docs/spec.md's transfer formulas."""
    from sparq_cpp.attention import Dense

    heads = summary.n_layer * summary.n_head_kv
    dense = Dense().reads(n_kv, summary.head_dim, llm.cache_type) * heads
    used = llm.attention.reads(n_kv, summary.head_dim, llm.cache_type) * heads
    click.echo(f"attn    {llm.attention.name}: the last step read {used / 1e6:.2f} MB of KV cache, dense reads "
               f"{dense / 1e6:.2f} MB at n_kv={n_kv} ({used / dense:.3f} of dense)", err=True)


def _greedy(llm):
    return llm.sample(top_k=1, top_p=1.0, min_p=0.0, temp=0.0)


def _report(summary, n_prompt, t_prompt, n_gen, t_decode, llm):
    def rate(n, t):
        return f"{n / t:8.2f} tok/s, {1000 * t / n:8.2f} ms/token" if n and t > 0 else "   n/a"

    click.echo(f"model   {summary.path.name}: {summary.n_layer} layers, {summary.n_head} heads "
               f"({summary.n_head_kv} KV) of {summary.head_dim}, threads {llm.n_threads}", err=True)
    click.echo(f"prompt  {n_prompt:6d} tokens in {t_prompt:7.3f} s  {rate(n_prompt, t_prompt)}", err=True)
    click.echo(f"decode  {n_gen:6d} tokens in {t_decode:7.3f} s  {rate(n_gen, t_decode)}", err=True)
