"""The `sparq-cpp` command. Each subcommand lives in its own module of this package."""
from __future__ import annotations

import click

from sparq_cpp.cli import bench, calibrate, convert, dequantize, eval, generate, info, make_model, serve
from sparq_cpp.cli.runner import CONTEXT_SETTINGS, SparqGroup


@click.group(cls=SparqGroup, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="sparq-cpp")
def cli():
    """Sparse attention for llama.cpp: SparQ, Loki and ALISA (and --attn auto, the measured best of them)."""


for _module in (generate, serve, calibrate, bench, eval, make_model, convert, dequantize, info):
    cli.add_command(_module.command)
cli.add_command(bench.compare_command)


def main():
    cli(prog_name="sparq-cpp")


if __name__ == "__main__":
    main()
