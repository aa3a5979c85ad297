"""The `sparq-cpp` command. Each subcommand lives in its own module of this package."""
from __future__ import annotations

import sys

import click

from sparq_cpp.errors import SparqError


class _Group(click.Group):
    """Turns SparqError into one clear line on stderr and exit status 2, with no traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except SparqError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


# -h as in llama.cpp; subcommands inherit it
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


@click.group(cls=_Group, context_settings=CONTEXT_SETTINGS)
@click.version_option(package_name="sparq-cpp")
def cli():
    """SparQ and Loki sparse attention for llama.cpp."""


def _register():
    from sparq_cpp.cli import bench, calibrate, convert, dequantize, eval, generate, info, make_model, serve

    for mod in (generate, serve, calibrate, bench, eval, make_model, convert, dequantize, info):
        cli.add_command(mod.command)
    cli.add_command(bench.compare_command)


def main():
    _register()
    cli(prog_name="sparq-cpp")


def run_standalone(command) -> None:
    """Run a click command outside `sparq-cpp` (`python -m ...`) with the same error contract:
    a SparqError is one line on stderr and exit status 2, Ctrl-C exits 130."""
    try:
        command(standalone_mode=False, help_option_names=CONTEXT_SETTINGS["help_option_names"])
    except SparqError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(2)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        sys.exit(130)


if __name__ == "__main__":
    main()
