"""`sparq-cpp serve`: llama.cpp's OpenAI-compatible server (llama-server of the patched build) with
SparQ or Loki, its settings checked before the server starts."""
from __future__ import annotations

import os
import sys

import click

from sparq_cpp.cli.generate import _attention, _resolve_model
from sparq_cpp.cli.options import THREADS_HELP, attention_options, threads_type
from sparq_cpp.errors import SparqError


def sparse_attn_env(attention) -> str | None:
    """The LLAMA_SPARSE_ATTN value that switches `attention` on in a stock tool (None for dense)."""
    from sparq_cpp.attention import ALISA, Loki, SparQ

    if isinstance(attention, ALISA):
        return f"alisa:c={attention.c!r},min_n_kv={attention.min_n_kv}"
    if isinstance(attention, SparQ):
        return (f"sparq:r={attention.r},k={attention.k},l={attention.local},"
                f"mv={int(attention.mean_value)},min_n_kv={attention.min_n_kv}")
    if isinstance(attention, Loki):
        value = f"loki:d={attention.d},k={attention.k},l={attention.l},min_n_kv={attention.min_n_kv},variant={attention.variant}"
        if attention.projection is not None:
            proj = os.path.abspath(attention.projection)
            if "," in proj or any(c.isspace() for c in proj):
                raise SparqError(f"--loki-pca: the path {proj} holds a comma or white space, which the server's "
                                 "setting cannot carry; move or link the file")
            value += f",proj={proj}"
        return value
    return None


def server_command(path, attention, *, host, port, ctx_size, parallel, threads, cache_type, extra) -> tuple:
    """(argv, environment) that start llama-server for `path` with `attention`, after the checks a
    context creation would fail on (model, settings, projection)."""
    from sparq_cpp.attention import ALISA, Dense, Loki
    from sparq_cpp.gguf_check import check_gguf, check_sparse
    from sparq_cpp.llm import check_alisa, check_loki_projection, default_threads, display_name
    from sparq_cpp.pyext.build import tool_path

    summary = check_gguf(path)
    if not isinstance(attention, Dense):
        check_sparse(summary, display_name(attention))
    attention.check(summary.head_dim)
    if isinstance(attention, Loki):
        check_loki_projection(attention, path)
    if isinstance(attention, ALISA):
        check_alisa(path)
    if not 1 <= port <= 65535:
        raise SparqError(f"--port must be in 1..65535, got {port}")
    if ctx_size is not None and ctx_size < 1:
        raise SparqError(f"--ctx-size must be >= 1, got {ctx_size}")
    if parallel < 1:
        raise SparqError(f"--parallel must be >= 1, got {parallel}")
    if isinstance(attention, ALISA) and parallel != 1:
        raise SparqError(f"ALISA keeps one window of past weights, so one sequence: --parallel must be 1, got {parallel}")
    n_ctx = ctx_size if ctx_size is not None else min(4096, summary.n_ctx_train or 4096) * parallel
    argv = [str(tool_path("llama-server")), "-m", str(path), "--host", host, "--port", str(port),
            "-c", str(n_ctx), "-np", str(parallel), "-t", str(threads or default_threads()),
            "-ctk", cache_type, "-ctv", cache_type]
    if not isinstance(attention, Dense):
        argv += ["-fa", "on"]  # SparQ, Loki and ALISA read V row by row
    env = dict(os.environ)
    env.pop("LLAMA_SPARSE_ATTN", None)
    value = sparse_attn_env(attention)
    if value is not None:
        env["LLAMA_SPARSE_ATTN"] = value
    return argv + list(extra), env


@click.command("serve", context_settings={"ignore_unknown_options": True})
@click.option("--gguf", type=click.Path(dir_okay=False), default=None,
              help="GGUF model file (default: the demo model, models/austen.q8_0.gguf).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on.")
@click.option("--ctx-size", "-c", type=int, default=None,
              help="Context size of all slots together (default: 4096 per slot, or the model's training context).")
@click.option("--parallel", "-np", type=int, default=1, show_default=True, help="Slots (requests served at once).")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@click.option("--cache-type", type=click.Choice(["f16", "q8_0", "f32"]), default="f16", show_default=True,
              help="KV cache type.")
@attention_options
@click.option("--print-command", is_flag=True, help="Print the llama-server command and its setting, do not start it.")
@click.argument("server_args", nargs=-1, type=click.UNPROCESSED)
def command(gguf, host, port, ctx_size, parallel, threads, cache_type, attn, r, d, k, l, no_mean_value, loki_pca,
            loki_variant, c, print_command, server_args):
    """Serve a model over HTTP with OpenAI-style /v1/chat/completions and /v1/completions (llama-server),
    with SparQ, Loki or ALISA attention. Anything after `--` goes to llama-server as it is."""
    attention = _attention(attn, r, k, l, no_mean_value, d, loki_pca, loki_variant, c)
    path = _resolve_model(gguf)
    argv, env = server_command(path, attention, host=host, port=port, ctx_size=ctx_size, parallel=parallel,
                               threads=threads, cache_type=cache_type, extra=server_args)
    setting = env.get("LLAMA_SPARSE_ATTN", "dense")
    if print_command:
        click.echo(f"LLAMA_SPARSE_ATTN={setting} " + " ".join(argv))
        return
    click.echo(f"serving {path.name} on http://{host}:{port} with {attention.name} attention ({setting}); "
               "GET /props reports it as sparse_attn", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, env)  # the server takes over this process: signals and exit status are its own
