"""Options shared by the subcommands, spelled as llama.cpp spells them (-m, -c, -t, -ctk, -ctv, -fa,
--sparse-attn); click reports a bad value as one line naming the option.

The attention options (the setting and its parameters, and the KV cache types) are one group, defined once
here: every command that takes one of them takes it under the same name, with the same default and the same
help text, and `--help` lists them under one heading (tests/test_cli_vocabulary.py compares the commands)."""
from __future__ import annotations

import math
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import click
from click.core import ParameterSource

from sparq_cpp.attention import Dense
from sparq_cpp.demo_model import default_model
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import CACHE_TYPES, max_threads
from sparq_cpp.projection import default_projection
from sparq_cpp.real_models import MODELS, fetch


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every range comparison), and compares a
    value given as text exactly: 1.00000000000000001 is above 1, though it reads as the float 1.0."""

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        number = super().convert(number, param, ctx)
        try:
            exact = Decimal(value.strip()) if isinstance(value, str) else None
        except InvalidOperation:
            exact = None
        if exact is not None and not self._in_range(exact):
            self.fail(f"{value} is not in the range {self._describe_range()}.", param, ctx)
        return number

    def _in_range(self, x: Decimal) -> bool:
        lo = self.min is None or (x > Decimal(self.min) if self.min_open else x >= Decimal(self.min))
        hi = self.max is None or (x < Decimal(self.max) if self.max_open else x <= Decimal(self.max))
        return lo and hi


def threads_type() -> click.IntRange:
    """1 up to max_threads() (see sparq_cpp.llm.max_threads)."""
    return click.IntRange(1, max_threads())


THREADS_HELP = "Threads (default: all usable cores; at most 4 per logical CPU, and 512)."

def model_option(help_text: str, **kw):
    """-m/--model FILE as in llama.cpp; --gguf is the older spelling."""
    return click.option("-m", "--model", "--gguf", "model", default=None, metavar="FILE", help=help_text, **kw)


def resolve_model(model, log=lambda msg: click.echo(msg, err=True)) -> Path:
    """The model file: `model` itself; a name from sparq_cpp.real_models (e.g. smollm2-135m) when no file
    has that name (fetched and checked on first use); the demo model when None."""
    if model is None:
        return default_model(log)
    if model in MODELS and not Path(model).exists():
        return Path(fetch(model, log=log))
    return Path(model)


def projection_beside(model: Path | None) -> str | None:
    """Loki's default projection: `<model stem>.loki.gguf` next to the model when there is one (what `sparq-cpp
    calibrate` writes; said on stderr), else None (the projection embedded in the model)."""
    if model is None:
        return None
    beside = default_projection(Path(model))
    if not beside.is_file():
        return None
    click.echo(f"loki    projection {beside} (next to the model; --loki-pca picks another)", err=True)
    return str(beside)


def flash_attn_option(command):
    return click.option("-fa", "--flash-attn", "flash_attn", type=click.Choice(["on", "off", "auto"]), default="auto",
                        show_default=True,
                        help="Flash attention; sparse attention needs it (auto: on for SparQ, Loki and ALISA).")(command)


def flash_attn_for(flash_attn: str, attention) -> str:
    """-fa's value for `attention`: `auto` is `on` for a sparse mode, and `off` with one is refused."""
    if isinstance(attention, Dense):
        return flash_attn
    if flash_attn == "off":
        raise SparqError(f"-fa off: {attention.name} attention needs flash attention (V stored row-major); "
                         "drop -fa off or use --attn dense")
    return "on"


def progress_option(command):
    return click.option("--progress/--no-progress", "progress", default=None,
                        help="Progress bars on stderr [default: on when stderr is a terminal].")(command)


def progress_enabled(progress) -> bool:
    """--progress/--no-progress, or by default whether stderr is a terminal (no bar frames in a log file)."""
    return sys.stderr.isatty() if progress is None else progress


ATTENTION_HEADING = "Attention and KV cache"
OLD_NAMES_USED = "sparq_cpp.old_names"  # ctx.meta key: the old names given (where one kept a narrower meaning)


class GroupOption(click.Option):
    """An option of the attention group: listed under ATTENTION_HEADING in --help."""

    group = ATTENTION_HEADING


class OldName(GroupOption):
    """An option's old name, hidden from --help: it still works, with a one-line note on stderr naming the new
    one (scripts written for an earlier release keep running). Its value goes to the option `dest` (the new
    name's variable) when given; with no dest it is an option of its own."""

    def __init__(self, decls, *, new: str, dest: str | None = None, **kw):
        super().__init__(decls, hidden=True, expose_value=dest is None, **kw)
        self.new, self.dest = new, dest

    def process_value(self, ctx, value):
        value = super().process_value(ctx, value)
        if value is not None and ctx.get_parameter_source(self.name) is ParameterSource.COMMANDLINE:
            click.echo(f"note: {self.opts[0]} is now {self.new} (the old name still works)", err=True)
            ctx.meta.setdefault(OLD_NAMES_USED, set()).add(self.opts[0])
            if self.dest is not None:  # the new name's variable holds it (given as well: the last one given wins)
                ctx.params[self.dest] = value
                ctx.set_parameter_source(self.dest, ParameterSource.COMMANDLINE)
        return value


class _AmbiguousC(click.Option):
    """--c was ALISA's ratio beside -c (the context size): `--c 4096` meant as `-c 4096` ran ALISA at c = 4096."""

    def process_value(self, ctx, value):
        if value is not None:
            raise click.BadParameter("ambiguous beside -c (the context size); ALISA's caching ratio is --alisa-c",
                                     ctx=ctx, param=self)
        return value


def _option(*decls, **kw):
    return click.option(*decls, cls=GroupOption, **kw)


def _old(decl: str, dest: str, new: str, **kw):
    return click.option(decl, "old_" + decl.lstrip("-").replace("-", "_"), cls=OldName, new=new, dest=dest,
                        default=None, **kw)


# The attention group: its options by their name, each with the old names it still takes (hidden, with a note).
# Every default is None here and stated in the help: a command resolves it (cli.generate.attention_from_options
# for generate and serve; bench and eval for their sweeps), so that a value given is told from one left out.
ATTENTION_OPTIONS = {
    "--attn": [_option(
        "--attn", type=click.Choice(["dense", "sparq", "loki", "alisa", "auto"]), default=None,
        help="Attention: dense, sparq (the default when --sparq-r or --sparse-k is given), loki (the default with "
             "--loki-d), alisa (the default with --alisa-c), or auto: the SparQ or Loki setting the model's "
             "calibration (`sparq-cpp calibrate`) measured best within --ratio.")],
    "--sparse-attn": [_option(
        "--sparse-attn", "sparse_attn", metavar="SPEC", default=None,
        help="The attention in one string, as llama.cpp's tools take it (--sparse-attn, LLAMA_SPARSE_ATTN), "
             "instead of --attn and the settings below: dense, sparq:r=16,k=128, loki:d=32,proj=FILE, "
             "alisa:c=0.125 or auto:ratio=1/8; a key left out keeps its default.")],
    "--ratio": [_option(
        "--ratio", type=str, default=None,
        help="auto: attention data read per step at a full context / dense, in (0, 1), e.g. 1/8 [1/8].")],
    "--max-loss": [_option(
        "--max-loss", "max_loss", type=str, default=None,
        help="auto: refuse a choice whose calibration probe lost more than this share of dense's bits per "
             "character on any domain, e.g. 0.03 or 3% [no bound].")],
    "--sparq-r": [_option(
        "--sparq-r", "r", type=click.IntRange(min=1), default=None,
        help="SparQ: query components used to rank positions, 1..head size [16; eval: swept with --ratios]."),
        _old("--r", "r", "--sparq-r", type=click.IntRange(min=1))],
    "--loki-d": [_option(
        "--loki-d", "d", type=click.IntRange(min=1), default=None,
        help="Loki: principal components used to rank positions, 1..head size [32; eval: swept with --ratios]."),
        _old("--d", "d", "--loki-d", type=click.IntRange(min=1))],
    "--sparse-k": [_option(
        "--sparse-k", "k", type=int, default=None, help="SparQ/Loki: positions attended per step, >= 1 [128]."),
        _old("--k", "k", "--sparse-k", type=int)],
    "--sparse-l": [_option(
        "--sparse-l", "l", type=click.IntRange(min=0), default=None,
        help="SparQ/Loki: most recent positions always kept, 0..k [SparQ k/4, Loki 0]."),
        _old("--l", "l", "--sparse-l", type=click.IntRange(min=0))],
    "--sparse-sink": [_option(
        "--sparse-sink", "sink", type=click.IntRange(min=0), default=None,
        help="SparQ/Loki: positions below this (the first tokens, an attention sink) always kept, 0..k - l [0]."),
        _old("--sink", "sink", "--sparse-sink", type=click.IntRange(min=0))],
    "--mean-value": [_option(
        "--mean-value/--no-mean-value", "mean_value", default=None,
        help="SparQ: mean-value reallocation [on; eval: off for GQA models (Llama 3, Mistral), as in the paper].")],
    "--loki-pca": [_option(
        "--loki-pca", "loki_pca", type=click.Path(dir_okay=False), default=None,
        help="Loki: projection GGUF from `sparq-cpp calibrate` [<model stem>.loki.gguf next to the model, or the "
             "one embedded in it; bench: a random basis, timing only]."),
        _old("--loki-projection", "loki_pca", "--loki-pca", type=click.Path(dir_okay=False))],
    "--loki-variant": [_option(
        "--loki-variant", type=click.Choice(["post", "pre"]), default=None,
        help="Loki: basis calibrated on keys after or before RoPE [post].")],
    "--alisa-c": [_option(
        "--alisa-c", "c", type=FiniteFloatRange(0, 1, min_open=True), default=None,
        help="ALISA: caching ratio in (0, 1]; of n positions, the floor(n*c/2) most recent and as many with the "
             "largest recent attention are attended [0.125]. Memory grows as n_ctx**2 * c/2 per layer."),
        click.option("--c", "ambiguous_c", cls=_AmbiguousC, default=None, hidden=True, expose_value=False)],
    "--cache-type-k": [_option(
        "-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(list(CACHE_TYPES)), default=None,
        help="KV cache type for K [f16].")],
    "--cache-type-v": [_option(
        "-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(list(CACHE_TYPES)), default=None,
        help="KV cache type for V [f16].")],
    "--cache-type": [_option(
        "--cache-type", "cache_type", type=click.Choice(list(CACHE_TYPES)), default=None,
        help="KV cache type for both K and V [f16].")],
}
CACHE_OPTIONS = ("--cache-type-k", "--cache-type-v", "--cache-type")


def attention_options(*names: str):
    """The attention group's options `names` (all of them when none is named), in the group's order, with their
    old names: a decorator for a click command."""
    unknown = set(names) - set(ATTENTION_OPTIONS)
    if unknown:
        raise ValueError(f"not in the attention group: {sorted(unknown)}")
    chosen = [o for name, opts in ATTENTION_OPTIONS.items() if not names or name in names for o in opts]

    def decorate(command):
        for option in reversed(chosen):
            command = option(command)
        return command

    return decorate


# sparq_cpp.llm.cache_types's names for its arguments, as the commands spell them
CACHE_OPTION_NAMES = ("--cache-type", "-ctk", "-ctv")


class _GroupedHelp:
    """--help lists the attention group's options under their own heading, after the command's own."""

    def format_options(self, ctx, formatter):
        own, grouped = [], []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and not isinstance(param, click.Argument):
                (grouped if getattr(param, "group", None) == ATTENTION_HEADING else own).append(record)
        if own:
            with formatter.section("Options"):
                formatter.write_dl(own)
        if grouped:
            with formatter.section(ATTENTION_HEADING):
                formatter.write_dl(grouped)
        if isinstance(self, click.Group):
            self.format_commands(ctx, formatter)


class Command(_GroupedHelp, click.Command):
    """A command whose --help lists the attention group under its own heading."""


class Group(_GroupedHelp, click.Group):
    """A command group whose --help lists the attention group under its own heading."""
