"""`sparq-cpp generate`: stream text from a GGUF model (through its chat template when it has one), then
report why it stopped, prompt and decode speed, and the KV-cache data the last step read."""
from __future__ import annotations

import codecs
import dataclasses
import json
import sys
import time
from fractions import Fraction
from pathlib import Path

import click
import numpy as np

from sparq_cpp import lazy
from sparq_cpp import system as host  # not `system`: generate's --system-prompt is
from sparq_cpp.attention import ALISA, Auto, Dense, Loki, SparQ, parse_attention
from sparq_cpp.auto import known_poor
from sparq_cpp.bindings.cpu_backend import gpu_device_count
from sparq_cpp.bench.machine import CpuMonitor
from sparq_cpp.cli.options import (CACHE_OPTION_NAMES, THREADS_HELP, Command, FiniteFloatRange, attention_options,
                                   flash_attn_for, flash_attn_option, model_option, projection_beside, resolve_model,
                                   threads_type)
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.llm import cache_types, open_model

DEFAULT_PROMPT = "It is a truth universally acknowledged"
BUSY_SHARE = 0.25  # of the machine's CPU time used by other processes: the footer's speeds are then not the model's
DEFAULT_CHAT_PROMPT = "Tell me about yourself."


def _read_prompt(prompt, prompt_file) -> str | None:
    if prompt is not None and prompt_file is not None:
        raise SparqError("give either --prompt or --file, not both")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            raise SparqError(f"prompt file not found: {path}")
        try:
            return path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise SparqError(f"prompt file {path} is not UTF-8 text") from None
    return prompt


class _Utf8Stream:
    """Detokenized pieces can split a UTF-8 character: write only complete characters (invalid bytes as U+FFFD)."""

    def __init__(self, out):
        self.out, self.decoder = out, codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, final: bool = False):
        self.out.write(self.decoder.decode(data, final=final))
        self.out.flush()


# the attention group's settings (cli.options) by their option names, for the errors
_SETTINGS = (("r", "--sparq-r"), ("d", "--loki-d"), ("k", "--sparse-k"), ("l", "--sparse-l"), ("sink", "--sparse-sink"),
             ("mean_value", "--[no-]mean-value"), ("loki_pca", "--loki-pca"), ("loki_variant", "--loki-variant"),
             ("c", "--alisa-c"))


def attention_from_options(attn=None, *, sparse_attn=None, r=None, d=None, k=None, l=None, sink=None, mean_value=None,
                           loki_pca=None, loki_variant=None, c=None, ratio=None, max_loss=None,
                           model: Path | None = None):
    """The attention settings the options of the attention group ask for (cli.options.attention_options; a value
    left out is None), with the defaults their help states. Loki without --loki-pca takes `<model stem>.loki.gguf`
    next to the model when there is one (what `sparq-cpp calibrate` writes) and says so; auto reads the same
    calibration (sparq_cpp.auto resolves it when the model is opened)."""
    values = {"r": r, "d": d, "k": k, "l": l, "sink": sink, "mean_value": mean_value, "loki_pca": loki_pca,
              "loki_variant": loki_variant, "c": c}
    if sparse_attn is not None:
        given = (["--attn"] if attn is not None else []) + [flag for name, flag in _SETTINGS if values[name] is not None] \
            + [flag for flag, v in (("--ratio", ratio), ("--max-loss", max_loss)) if v is not None]
        if given:
            raise SparqError(f"--sparse-attn is the whole setting; drop {', '.join(given)} or write it inside the "
                             "setting (e.g. sparq:r=8,k=64 or loki:d=16,proj=FILE)")
        attention = parse_attention(sparse_attn)
        if isinstance(attention, (Loki, Auto)) and attention.projection is not None \
                and not Path(attention.projection).is_file():
            raise SparqError(f"--sparse-attn: proj: file not found: {attention.projection}")
        if isinstance(attention, Loki) and attention.projection is None:
            attention = dataclasses.replace(attention, projection=projection_beside(model))
        return attention
    if attn == "auto":
        given = [flag for name, flag in _SETTINGS if values[name] is not None and name != "loki_pca"]
        if given:
            raise SparqError(f"--attn auto chooses the method and its settings; drop {', '.join(given)} (the budget "
                             "is --ratio)")
        if loki_pca is not None and not Path(loki_pca).is_file():
            raise SparqError(f"--loki-pca: file not found: {loki_pca}")
        return Auto(ratio=0.125 if ratio is None else _ratio(ratio), projection=loki_pca,
                    max_loss=None if max_loss is None else _max_loss(max_loss))
    if ratio is not None or max_loss is not None:
        raise SparqError(f"{'--ratio' if ratio is not None else '--max-loss'} is a bound of --attn auto; use --attn "
                         "auto, or set --sparq-r/--loki-d and --sparse-k")
    sparq_only = r is not None or mean_value is not None
    loki_only = d is not None or loki_pca is not None or loki_variant is not None
    shared = k is not None or l is not None or sink is not None
    if c is not None and (sparq_only or loki_only or shared):
        raise SparqError("--alisa-c is ALISA's setting and --sparq-r/--loki-d/--sparse-k/--sparse-l/--sparse-sink/"
                         "--[no-]mean-value/--loki-pca/--loki-variant are SparQ's and Loki's; ALISA takes only --alisa-c")
    if attn is None:
        if sparq_only and loki_only:
            raise SparqError("--sparq-r/--[no-]mean-value are SparQ settings and --loki-d/--loki-pca/--loki-variant "
                             "Loki ones; pick one --attn")
        attn = "alisa" if c is not None else "loki" if loki_only else "sparq" if (sparq_only or shared) else "dense"
    if attn == "dense" and (sparq_only or loki_only or shared or c is not None):
        raise SparqError("--sparq-r/--loki-d/--sparse-k/--sparse-l/--sparse-sink/--alisa-c/--[no-]mean-value/"
                         "--loki-pca/--loki-variant are sparse attention settings; drop them or use --attn sparq, "
                         "loki or alisa")
    if attn == "alisa":
        return ALISA(c=0.125 if c is None else c)
    if c is not None:
        raise SparqError("--alisa-c is an ALISA setting; use --attn alisa")
    if attn == "sparq" and loki_only:
        raise SparqError("--loki-d/--loki-pca/--loki-variant are Loki settings; use --attn loki")
    if attn == "loki" and sparq_only:
        raise SparqError("--sparq-r/--[no-]mean-value are SparQ settings; use --attn sparq")
    if attn == "sparq":
        return SparQ(r=16 if r is None else r, k=128 if k is None else k, l=l, mean_value=mean_value is not False,
                     sink=0 if sink is None else sink)
    if attn == "loki":
        if loki_pca is not None and not Path(loki_pca).is_file():
            raise SparqError(f"--loki-pca: file not found: {loki_pca}")
        return Loki(d=32 if d is None else d, k=128 if k is None else k, l=0 if l is None else l,
                    projection=loki_pca if loki_pca is not None else projection_beside(model),
                    variant=loki_variant or "post", sink=0 if sink is None else sink)
    return Dense()


def _max_loss(text: str) -> float:
    """--max-loss as a share: 0.03 or 3%."""
    t = text.strip()
    try:
        value = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise SparqError(f"--max-loss {text!r} is not a number like 0.03 or 3%") from None
    if not 0 < value < 1:
        raise SparqError(f"--max-loss must be in (0, 1) (bits per character lost / dense's), got {text}")
    return value


def _ratio(text: str) -> float:
    try:
        value = float(Fraction(str(text).strip()))
    except (ValueError, ZeroDivisionError):
        raise SparqError(f"--ratio {text!r} is not a number or a fraction like 1/8") from None
    if not 0 < value < 1:
        raise SparqError(f"--ratio must be in (0, 1) (attention data read / dense), got {text}")
    return value


def report_choice(llm, attention, path, projection=None) -> None:
    """What auto chose and why, or a warning when a fixed setting is known to be poor on this model."""
    if getattr(llm, "auto_choice", None):
        click.echo(llm.auto_choice, err=True)
        return
    warning = known_poor(attention, path, llm.summary, projection)
    if warning:
        click.echo(f"warning: {warning}", err=True)


def _chat_prompt(llm, text: str, system: str | None, template: str | None = None) -> tuple[list[int], str]:
    """The prompt's tokens through the model's own chat template, or `template` (llama-cpp-python's Jinja2
    formatter, as its create_chat_completion uses it), and the formatted prompt."""
    Jinja2ChatFormatter = lazy.llama_cpp("llama_chat_format").Jinja2ChatFormatter
    template = template if template is not None else llm.metadata["tokenizer.chat_template"]
    eos, bos = llm.token_eos(), llm.token_bos()
    formatter = Jinja2ChatFormatter(template=template,
                                    eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
                                    bos_token=llm._model.token_get_text(bos) if bos != -1 else "")
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
    try:
        result = formatter(messages=messages)
    except Exception as e:  # a template may raise_exception() on a conversation it does not take
        raise SparqError(f"the model's chat template refused the conversation: {e}") from None
    # the template writes BOS itself where the model wants one, as in llama-cpp-python's chat handler
    return llm.tokenize(result.prompt.encode("utf-8"), add_bos=not result.added_special, special=True), result.prompt


@click.command("generate", cls=Command)
@model_option("GGUF model file, or a known model name (smollm2-135m); default: the demo model, "
              "models/austen.q8_0.gguf.")
@click.option("--prompt", "-p", default=None,
              help=f"Prompt text; special tokens such as <|im_start|> are parsed [chat: {DEFAULT_CHAT_PROMPT!r}, "
                   f"raw: {DEFAULT_PROMPT!r}].")
@click.option("--file", "-f", "--prompt-file", "prompt_file", default=None, help="Read the prompt from this UTF-8 file.")
@click.option("--chat/--no-chat", "-cnv/-no-cnv", "chat", default=None,
              help="Send the prompt as a user message through the model's chat template [default: on when the "
                   "model has one]; --no-chat continues the raw text.")
@click.option("--system-prompt", "-sys", "--system", "system", default=None, help="Chat: a system message first.")
@click.option("-n", "--n-predict", "n_predict", type=int, default=64, show_default=True,
              help="Most tokens to generate; -1: until an end-of-generation token or a full context.")
@click.option("--ctx-size", "-c", type=click.IntRange(min=0), default=None,
              help="Context size; 0: the model's training context (default: 4096, or the model's training context "
                   "if that is shorter).")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--threads-batch", "-tb", type=threads_type(), default=None,
              help="Threads for the prompt (default: as --threads).")
@click.option("--gpu-layers", "-ngl", "--n-gpu-layers", "gpu_layers", type=int, default=None,
              help="Layers to offload to the GPU (a CUDA build; on a CPU-only build nothing is offloaded).")
@click.option("--parallel", "-np", "parallel", type=click.IntRange(min=1), default=None,
              help="Accepted as in llama.cpp; generate decodes one sequence (serve's -np sets slots).")
@click.option("--seed", "-s", type=int, default=-1, show_default=True, help="Sampling seed; -1: a random one.")
@click.option("--temp", "--temperature", "temp", type=FiniteFloatRange(min=0), default=0.8, show_default=True,
              help="Sampling temperature; 0 is greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=40, show_default=True,
              help="Sampling: the k most likely tokens; 0 = all. (Sparse attention's k is --sparse-k.)")
@click.option("--top-p", type=FiniteFloatRange(0, 1, min_open=True), default=0.95, show_default=True,
              help="Sample from the most likely tokens whose probabilities add up to p, in (0, 1].")
@click.option("--min-p", type=FiniteFloatRange(0, 1), default=0.05, show_default=True,
              help="Sampling: drop tokens less likely than min-p times the most likely one; 0 = off.")
@click.option("--repeat-penalty", type=FiniteFloatRange(min=0, min_open=True), default=1.0, show_default=True,
              help="Penalize repeated tokens (of the last 64); 1.0 = off.")
@click.option("--grammar", default=None, help="GBNF grammar the output must follow.")
@click.option("--grammar-file", default=None, type=click.Path(dir_okay=False), help="Read the GBNF grammar from a file.")
@click.option("--json-schema", "-j", "json_schema", default=None,
              help="JSON schema the output must follow (e.g. '{}' for any JSON object).")
@click.option("--reverse-prompt", "-r", "reverse_prompt", multiple=True,
              help="Stop when the output ends with this text (repeatable).")
@click.option("--ignore-eos", is_flag=True, help="Never stop at an end-of-generation token (they are not sampled).")
@click.option("--chat-template", default=None, help="A Jinja chat template used instead of the model's own.")
@click.option("--chat-template-file", default=None, type=click.Path(dir_okay=False),
              help="Read the Jinja chat template from a file.")
@click.option("--jinja", is_flag=True, hidden=True, help="Accepted as in llama.cpp: chat templates are Jinja here.")
@click.option("--display-prompt/--no-display-prompt", default=True, show_default=True,
              help="Print the raw prompt before its continuation (--no-chat).")
@flash_attn_option
@attention_options()
def command(model, prompt, prompt_file, chat, system, n_predict, ctx_size, threads, threads_batch, gpu_layers, parallel,
            seed, temp, top_k, top_p, min_p, repeat_penalty, grammar, grammar_file, json_schema, reverse_prompt,
            ignore_eos, chat_template, chat_template_file, jinja, display_prompt, flash_attn, cache_type, cache_type_k,
            cache_type_v, **options):
    """Generate text, streaming it: an instruct model answers the prompt through its chat template, other
    models continue it. Then print why generation stopped, prompt and decode speed, and the KV-cache data
    the last step read against dense."""
    if n_predict < 1 and n_predict != -1:
        raise SparqError(f"-n must be >= 1, or -1 for no limit, got {n_predict}")
    type_k, type_v = cache_types(cache_type, cache_type_k, cache_type_v, names=CACHE_OPTION_NAMES)
    text = _read_prompt(prompt, prompt_file)
    path = resolve_model(model)
    attention = attention_from_options(**options, model=path)
    fa = flash_attn_for(flash_attn, attention)
    if system is not None and chat is False:
        raise SparqError("--system-prompt is a chat message; drop it or drop --no-chat")
    grammar_text = _grammar_text(grammar, grammar_file, json_schema)
    template = _template_text(chat_template, chat_template_file)
    if ctx_size is None:
        ctx_size = min(4096, check_gguf(path).n_ctx_train or 4096)
    elif ctx_size == 0:  # llama.cpp: the model's own context
        ctx_size = check_gguf(path).n_ctx_train or 4096
    if parallel is not None and parallel > 1:
        click.echo(f"note    -np {parallel}: generate decodes one sequence (serve -np sets slots)", err=True)
    llm, summary = open_model(path, attention=attention, n_ctx=ctx_size, n_threads=threads, seed=seed,
                              cache_type_k=type_k, cache_type_v=type_v, n_threads_batch=threads_batch,
                              n_gpu_layers=gpu_layers,
                              flash_attn=fa != "off")  # llama-cpp-python takes on or off: auto is on
    if host.THREAD_WAIT_NOTE:
        click.echo(f"threads {host.THREAD_WAIT_NOTE}", err=True)
    if gpu_layers and not gpu_device_count():
        click.echo(f"note    -ngl {gpu_layers}: this build has no GPU backend, nothing is offloaded", err=True)
    report_choice(llm, attention, path, options["loki_pca"])
    attention = llm.attention  # auto: what it resolved to
    has_template = template is not None or "tokenizer.chat_template" in llm.metadata
    if chat and not has_template:
        raise SparqError(f"{path.name} has no chat template (tokenizer.chat_template); use --no-chat or give one "
                         "(--chat-template)")
    chat = has_template if chat is None else chat
    if system is not None and not chat:
        raise SparqError(f"--system-prompt needs chat mode, and {path.name} has no chat template")
    if template is not None and not chat:
        raise SparqError("--chat-template is for chat mode; drop it or drop --no-chat")
    if chat:
        tokens, _ = _chat_prompt(llm, DEFAULT_CHAT_PROMPT if text is None else text, system, template)
    else:
        text = DEFAULT_PROMPT if text is None else text
        tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    limit = ctx_size - len(tokens)
    if n_predict != -1 and n_predict > limit:
        raise SparqError(f"the prompt is {len(tokens)} tokens; with -n {n_predict} that needs "
                         f"{len(tokens) + n_predict} positions, more than --ctx-size {ctx_size}")
    if limit < 1:
        raise SparqError(f"the prompt is {len(tokens)} tokens, which leaves no room in --ctx-size {ctx_size}")

    out = _Utf8Stream(sys.stdout)
    if not chat and display_prompt:  # the raw text is continued, so it is shown; a chat shows only the answer
        out.write(text.encode("utf-8"))
    # one sampler for the whole answer: a grammar and the repeat penalty follow the tokens it has produced
    llm._sampler = llm._init_sampler(top_k=top_k, top_p=top_p, min_p=min_p, temp=temp, repeat_penalty=repeat_penalty,
                                     logits_processor=_no_eog(llm) if ignore_eos else None,
                                     grammar=_grammar(llm, grammar_text) if grammar_text else None)
    busy = CpuMonitor()  # whether other processes took the CPU meanwhile: then the speeds below are theirs too
    t0 = time.perf_counter()
    llm.eval(tokens)
    t_prompt = time.perf_counter() - t0

    llama_cpp = lazy.llama_cpp()
    vocab = llm._model.vocab
    generated, t_decode, prev = 0, 0.0, tokens[-1:]
    budget = limit if n_predict == -1 else n_predict
    stop = f"-n {n_predict} reached" if n_predict != -1 else f"context full (--ctx-size {ctx_size})"
    answer = ""
    while generated < budget:
        tok = llm.sample()
        if llama_cpp.llama_vocab_is_eog(vocab, tok) and not ignore_eos:  # EOS and every other end of generation (<|eot_id|>, <|im_end|>)
            what = ("EOS" if tok == llm.token_eos() else "end of turn" if tok == llama_cpp.llama_vocab_eot(vocab)
                    else "end of generation")
            stop = f"{what} ({llm._model.token_get_text(tok)})"
            break
        piece = llm.detokenize([tok], prev_tokens=prev)
        out.write(piece)
        prev = [tok]
        generated += 1
        t1 = time.perf_counter()
        llm.eval([tok])
        t_decode += time.perf_counter() - t1
        if reverse_prompt:
            answer = (answer + piece.decode("utf-8", errors="replace"))[-4096:]
            hit = next((rp for rp in reverse_prompt if answer.endswith(rp)), None)
            if hit is not None:
                stop = f"reverse prompt {hit!r}"
                break
    out.write(b"", final=True)
    sys.stdout.write("\n")
    sys.stdout.flush()
    click.echo(f"stop    {stop} after {generated} tokens", err=True)
    if chat:
        click.echo("chat    the model's chat template; --no-chat continues raw text instead", err=True)
    _report(summary, len(tokens), t_prompt, generated, t_decode, llm)
    foreign = busy.foreign_share()
    if foreign is not None and foreign > BUSY_SHARE:
        click.echo(f"warning: other processes used {foreign:.0%} of the CPU while this ran, so the speeds above are "
                   "not this model's (llama.cpp's threads wait for each other at every step: fewer threads, -t, "
                   "hold up better on a busy machine)", err=True)
    report_reads(llm, summary, llm.n_tokens, generated)


def step_reads(attention, summary, n_kv: int, cache_type: str) -> tuple[float, float, str]:
    """(bytes the step's attention read, bytes dense attention reads, how the layers split) at n_kv cached
    positions. Sliding-window layers (Gemma 3, ...) stay dense over at most their window in every mode;
    the sparse setting reads less only in the full-attention layers."""
    window = summary.swa_layers or ()
    n_swa_layers = sum(bool(w) for w in window)
    n_full = summary.n_layer - n_swa_layers
    d = summary.head_dim
    swa = Dense().reads(min(n_kv, summary.n_swa or n_kv), d, cache_type) * n_swa_layers * summary.n_head_kv
    used = attention.reads(n_kv, d, cache_type) * n_full * summary.n_head_kv + swa
    dense = Dense().reads(n_kv, d, cache_type) * n_full * summary.n_head_kv + swa
    split = (f"; {n_swa_layers} of {summary.n_layer} layers slide over a window of {summary.n_swa} and read it whole"
             if n_swa_layers else "")
    return used, dense, split


def report_reads(llm, summary, n_kv, n_steps):
    """Attention data the last decode step read, against dense, from docs/spec.md's transfer formulas."""
    name = llm.attention.name
    if n_steps < 1:
        click.echo("attn    no decode step ran: nothing to report", err=True)
        return
    if llm.cache_type is None:
        click.echo(f"attn    {name}: reads are modelled for one cache type, not -ctk {llm.cache_type_k} with "
                   f"-ctv {llm.cache_type_v}", err=True)
        return
    used, dense, split = step_reads(llm.attention, summary, n_kv, llm.cache_type)
    if isinstance(llm.attention, Dense):
        click.echo(f"attn    dense: the last step read {dense / 1e6:.2f} MB of KV cache at n_kv={n_kv}{split}", err=True)
    elif used < dense:
        click.echo(f"attn    {name}: the last step read {used / 1e6:.2f} MB of KV cache, dense reads "
                   f"{dense / 1e6:.2f} MB at n_kv={n_kv} ({used / dense:.3f} of dense){split}", err=True)
    else:  # too few positions for a sparse step to save anything: its ranking is extra work on top of them all
        click.echo(f"attn    {name}: the last step read {used / 1e6:.2f} MB of KV cache, dense reads {dense / 1e6:.2f} MB "
                   f"at n_kv={n_kv}: it read every position and ranked them too, so {name} saves nothing until the "
                   f"cache is well above what it attends to{split}", err=True)


def _grammar_text(grammar, grammar_file, json_schema) -> str | None:
    """The GBNF grammar from --grammar, --grammar-file or --json-schema (one of them)."""
    given = [g for g in (grammar, grammar_file, json_schema) if g is not None]
    if len(given) > 1:
        raise SparqError("give one of --grammar, --grammar-file and --json-schema")
    if grammar_file is not None:
        return _read_option_file(grammar_file, "--grammar-file")
    if json_schema is not None:
        try:
            json.loads(json_schema)
        except ValueError as e:
            raise SparqError(f"--json-schema is not JSON: {e}") from None
        from_schema = lazy.llama_cpp("llama_grammar").json_schema_to_gbnf
        try:
            return from_schema(json_schema)
        except Exception as e:  # the converter raises whatever the schema trips
            raise SparqError(f"--json-schema: {e}") from None
    return grammar


def _grammar(llm, text: str):
    """The grammar for the sampler, parsed once here: llama.cpp returns no sampler for one it cannot parse,
    and a chain without it would sample freely."""
    llama_cpp = lazy.llama_cpp()
    probe = llama_cpp.llama_sampler_init_grammar(llm._model.vocab, text.encode("utf-8"), b"root")
    if not probe:
        raise SparqError("the grammar does not parse (GBNF with a `root` rule; llama.cpp's log says where)")
    llama_cpp.llama_sampler_free(probe)
    return lazy.llama_cpp("llama_grammar").LlamaGrammar.from_string(text, verbose=False)


def _template_text(chat_template, chat_template_file) -> str | None:
    if chat_template is not None and chat_template_file is not None:
        raise SparqError("give --chat-template or --chat-template-file, not both")
    if chat_template_file is not None:
        return _read_option_file(chat_template_file, "--chat-template-file")
    return chat_template


def _read_option_file(path, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SparqError(f"{option} {path}: {e}") from None


def _no_eog(llm):
    """A logits processor that makes every end-of-generation token impossible (--ignore-eos)."""
    llama_cpp = lazy.llama_cpp()
    vocab = llm._model.vocab
    eog = np.array([t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)], dtype=np.int64)

    def processor(input_ids, scores):
        scores[eog] = -np.inf
        return scores

    return lazy.llama_cpp("llama").LogitsProcessorList([processor])


def _report(summary, n_prompt, t_prompt, n_gen, t_decode, llm):
    def rate(n, t):
        return f"{n / t:8.2f} tok/s, {1000 * t / n:8.2f} ms/token" if n and t > 0 else "   n/a"

    click.echo(f"model   {summary.path.name}: {summary.n_layer} layers, {summary.n_head} heads "
               f"({summary.n_head_kv} KV) of {summary.head_dim}, threads {llm.n_threads}", err=True)
    click.echo(f"prompt  {n_prompt:6d} tokens in {t_prompt:7.3f} s  {rate(n_prompt, t_prompt)}", err=True)
    click.echo(f"decode  {n_gen:6d} tokens in {t_decode:7.3f} s  {rate(n_gen, t_decode)}", err=True)
