"""How every command runs: a SparqError is one line on stderr and exit status 2, Ctrl-C exits 130; for the
`sparq-cpp` group (sparq_cpp/cli/main.py) and for a command run on its own (`python -m ...`)."""
from __future__ import annotations

import sys

import click

from sparq_cpp.errors import SparqError

# -h as in llama.cpp; subcommands inherit it
CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"]}


class SparqGroup(click.Group):
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
