"""Option types shared by the subcommands: click reports a bad value as one line naming the option."""
from __future__ import annotations

import math

import click


class FiniteFloatRange(click.FloatRange):
    """click.FloatRange that also refuses nan and inf (nan passes every range comparison)."""

    def convert(self, value, param, ctx):
        number = click.FLOAT.convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return super().convert(number, param, ctx)


def threads_type() -> click.IntRange:
    """1 up to max_threads() (see sparq_cpp.llm.max_threads)."""
    from sparq_cpp.llm import max_threads

    return click.IntRange(1, max_threads())


THREADS_HELP = "Threads (default: all usable cores; at most 4 per logical CPU, and 512)."


def attention_options(command):
    """The attention options of `generate` and `serve`: --attn, SparQ's --r/--no-mean-value, Loki's
    --d/--loki-pca/--loki-variant, --k/--l for both, and ALISA's --c (see cli.generate._attention)."""
    options = [
        click.option("--attn", type=click.Choice(["dense", "sparq", "loki", "alisa"]), default=None,
                     help="Attention: dense, sparq (the default when --r or --k is given), loki (the default with --d) "
                          "or alisa (the default with --c)."),
        click.option("--r", "r", type=int, default=None, help="SparQ: query components used to rank positions [16]."),
        click.option("--d", "d", type=int, default=None, help="Loki: principal components used to rank positions [32]."),
        click.option("--k", "k", type=int, default=None, help="SparQ/Loki: positions attended per step [128]."),
        click.option("--l", "l", type=int, default=None,
                     help="SparQ/Loki: most recent positions always kept [SparQ k/4, Loki 0]."),
        click.option("--no-mean-value", is_flag=True,
                     help="SparQ: no mean-value reallocation (the paper's choice for GQA models, e.g. Llama 3, Mistral)."),
        click.option("--loki-pca", type=click.Path(dir_okay=False), default=None,
                     help="Loki: projection GGUF from `sparq-cpp calibrate` (default: the one embedded in the model)."),
        click.option("--loki-variant", type=click.Choice(["post", "pre"]), default="post", show_default=True,
                     help="Loki: basis calibrated on keys after or before RoPE."),
        click.option("--c", "c", type=FiniteFloatRange(min=0, min_open=True), default=None,
                     help="ALISA: caching ratio; of n positions, the floor(n*c/2) most recent and as many with the "
                          "largest recent attention are attended [0.125]. Memory grows as n_ctx**2 * c/2 per layer."),
    ]
    for option in reversed(options):
        command = option(command)
    return command
