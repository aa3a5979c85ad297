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
