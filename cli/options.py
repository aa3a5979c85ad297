"""Options shared by the subcommands, spelled as llama.cpp spells them (-m, -c, -t, -ctk, -ctv, -fa); click
reports a bad value as one line naming the option."""
from __future__ import annotations

import math
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path

import click

from sparq_cpp.attention import Dense
from sparq_cpp.demo_model import default_model
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import max_threads
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

# The cache types the transfer model, the reference and the tests cover.
CACHE_TYPES = ["f16", "q8_0", "f32"]


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


def cache_type_options(command):
    """-ctk/--cache-type-k, -ctv/--cache-type-v (llama.cpp's), and --cache-type for both at once."""
    options = [
        click.option("-ctk", "--cache-type-k", "cache_type_k", type=click.Choice(CACHE_TYPES), default=None,
                     help="KV cache type for K [f16]."),
        click.option("-ctv", "--cache-type-v", "cache_type_v", type=click.Choice(CACHE_TYPES), default=None,
                     help="KV cache type for V [f16]."),
        click.option("--cache-type", "cache_type", type=click.Choice(CACHE_TYPES), default=None,
                     help="KV cache type for both K and V."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def cache_types(cache_type, cache_type_k, cache_type_v) -> tuple[str, str]:
    """(K type, V type) from --cache-type and -ctk/-ctv; a contradiction is refused, not resolved."""
    for name, value in (("-ctk", cache_type_k), ("-ctv", cache_type_v)):
        if cache_type is not None and value is not None and value != cache_type:
            raise SparqError(f"--cache-type {cache_type} and {name} {value} disagree; give one of them")
    return cache_type_k or cache_type or "f16", cache_type_v or cache_type or "f16"


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


class _AmbiguousC(click.Option):
    """--c was ALISA's ratio beside -c (the context size): `--c 4096` meant as `-c 4096` ran ALISA at c = 4096."""

    def process_value(self, ctx, value):
        if value is not None:
            raise click.BadParameter("ambiguous beside -c (the context size); ALISA's caching ratio is --alisa-c",
                                     ctx=ctx, param=self)
        return value


def attention_options(command):
    """The attention options of `generate` and `serve`: --attn, SparQ's --sparq-r/--no-mean-value, Loki's
    --loki-d/--loki-pca/--loki-variant, --sparse-k/--sparse-l/--sparse-sink for both, ALISA's --alisa-c and auto's
    --ratio and --max-loss (see cli.generate.attention_from_options). --r, --d, --k, --l, --sink are kept as short aliases."""
    options = [
        click.option("--attn", type=click.Choice(["dense", "sparq", "loki", "alisa", "auto"]), default=None,
                     help="Attention: dense, sparq (the default when --sparq-r or --sparse-k is given), loki (the "
                          "default with --loki-d), alisa (the default with --alisa-c), or auto: the SparQ or Loki "
                          "setting the model's calibration (`sparq-cpp calibrate`) measured best within --ratio."),
        click.option("--ratio", type=str, default=None,
                     help="auto: attention data read per step at a full context / dense, in (0, 1), e.g. 1/8 [1/8]."),
        click.option("--max-loss", "max_loss", type=str, default=None,
                     help="auto: refuse a choice whose calibration probe lost more than this share of dense's bits "
                          "per character on any domain, e.g. 0.03 or 3% [no bound]."),
        click.option("--sparq-r", "--r", "r", type=int, default=None,
                     help="SparQ: query components used to rank positions, 1..head size [16]."),
        click.option("--loki-d", "--d", "d", type=int, default=None,
                     help="Loki: principal components used to rank positions, 1..head size [32]."),
        click.option("--sparse-k", "--k", "k", type=int, default=None,
                     help="SparQ/Loki: positions attended per step, >= 1 [128]."),
        click.option("--sparse-l", "--l", "l", type=int, default=None,
                     help="SparQ/Loki: most recent positions always kept, 0..k [SparQ k/4, Loki 0]."),
        click.option("--sparse-sink", "--sink", "sink", type=int, default=None,
                     help="SparQ/Loki: positions below this (the first tokens, an attention sink) always kept, "
                          "0..k - l [0]."),
        click.option("--no-mean-value", is_flag=True,
                     help="SparQ: no mean-value reallocation (the paper's choice for GQA models, e.g. Llama 3, Mistral)."),
        click.option("--loki-pca", type=click.Path(dir_okay=False), default=None,
                     help="Loki: projection GGUF from `sparq-cpp calibrate` (default: <model stem>.loki.gguf next "
                          "to the model if there is one, else the projection embedded in the model)."),
        click.option("--loki-variant", type=click.Choice(["post", "pre"]), default="post", show_default=True,
                     help="Loki: basis calibrated on keys after or before RoPE."),
        click.option("--alisa-c", "c", type=FiniteFloatRange(0, 1, min_open=True), default=None,
                     help="ALISA: caching ratio in (0, 1]; of n positions, the floor(n*c/2) most recent and as many "
                          "with the largest recent attention are attended [0.125]. Memory grows as n_ctx**2 * c/2 "
                          "per layer."),
        click.option("--c", "ambiguous_c", cls=_AmbiguousC, default=None, hidden=True, expose_value=False),
    ]
    for option in reversed(options):
        command = option(command)
    return command
