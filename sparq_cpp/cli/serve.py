"""`sparq-cpp serve`: llama.cpp's OpenAI-compatible server (llama-server of the patched build) with
SparQ or Loki, its settings checked before the server starts; safe by default (no cross-origin access
without an API key unless asked; a warning for the options that expose files or run tools); it stops
within a few seconds of SIGTERM or Ctrl-C, requests in flight or not."""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

import click

from sparq_cpp import system
from sparq_cpp.attention import ALISA, Dense, Loki, spec
from sparq_cpp.auto import known_poor
from sparq_cpp.cli.generate import attention_from_options
from sparq_cpp.cli.options import (CACHE_OPTION_NAMES, THREADS_HELP, Command, attention_options, flash_attn_for,
                                   flash_attn_option, model_option, resolve_model, threads_type)
from sparq_cpp.errors import SparqError
from sparq_cpp.gguf_check import check_gguf
from sparq_cpp.llm import default_threads, prepare
from sparq_cpp.memory import check_fits, context_estimate, shape_from_gguf
from sparq_cpp.outfile import fmt_bytes
from sparq_cpp.pyext.build import tool_path


def sparse_attn_env(attention) -> str | None:
    """The setting that switches `attention` on in a stock tool (None for dense), with an absolute path."""
    if isinstance(attention, Dense):
        return None
    if isinstance(attention, Loki) and attention.projection is not None:
        proj = os.path.abspath(attention.projection)
        if "," in proj or any(c.isspace() for c in proj):
            raise SparqError(f"--loki-pca: the path {proj} holds a comma or white space, which the server's "
                             "setting cannot carry; move or link the file")
        attention = dataclasses.replace(attention, projection=proj)
    return spec(attention)


# llama-server options that would replace what `sparq-cpp serve` checked, and its own option for each.
_CHECKED = {
    "-m": "-m", "--model": "-m", "-mu": "-m", "--model-url": "-m", "-hf": "-m", "-hfr": "-m", "--hf-repo": "-m",
    "-hff": "-m", "--hf-file": "-m", "-dr": "-m", "--docker-repo": "-m",
    "-c": "-c", "--ctx-size": "-c", "-np": "-np", "--parallel": "-np",
    "-ctk": "-ctk", "--cache-type-k": "-ctk", "-ctv": "-ctv", "--cache-type-v": "-ctv",
    "-fa": "-fa", "--flash-attn": "-fa", "-t": "-t", "--threads": "-t",
    "--host": "--host", "--port": "--port",
    "--sparse-attn": "--sparse-attn",  # serve takes it too (or --attn and its settings)
    "--cors-origins": "--cors",
}

# llama-server options (and the environment variables that set them) that let whoever can send the server a
# request read files or run commands on this machine: what each exposes, for the warning.
_EXPOSING = {
    "--tools": ("LLAMA_ARG_TOOLS", "built-in tools that read and write files and run shell commands"),
    "--agent": ("LLAMA_ARG_AGENT", "every built-in tool (files, shell commands) and the MCP CORS proxy"),
    "-ag": ("LLAMA_ARG_AGENT", "every built-in tool (files, shell commands) and the MCP CORS proxy"),
    "--mcp-servers-config": ("LLAMA_ARG_MCP_SERVERS_CONFIG", "the tools of MCP servers"),
    "--mcp-servers-json": ("LLAMA_ARG_MCP_SERVERS_JSON", "the tools of MCP servers"),
    "--ui-mcp-proxy": ("LLAMA_ARG_UI_MCP_PROXY", "a proxy that fetches any URL for the caller"),
    "--webui-mcp-proxy": ("LLAMA_ARG_UI_MCP_PROXY", "a proxy that fetches any URL for the caller"),
    "--path": ("LLAMA_ARG_STATIC_PATH", "every file under the folder, as static files"),
}
_API_KEY_OPTIONS = ("--api-key", "--api-key-file")
_API_KEY_ENV = ("LLAMA_API_KEY", "LLAMA_ARG_API_KEY_FILE")
_OFF = ("", "0", "false", "off", "no")  # an environment variable set to one of these leaves the option off


def check_forwarded(extra) -> None:
    """Options after `--` go to llama-server as they are, except those that would replace a setting this
    command checked (the model, context, slots, cache types, flash attention, threads, address): refused."""
    for arg in extra:
        name = arg.split("=", 1)[0]
        if name in _CHECKED:
            raise SparqError(f"{name} after `--` would override a setting sparq-cpp serve checks; give it as "
                             f"sparq-cpp serve's own {_CHECKED[name]} (before `--`)")


def _option_values(extra, names) -> list[tuple[str, str | None]]:
    """(name, value) of each of the options `names` in the arguments after `--`, as --name VALUE or
    --name=VALUE (value None for a flag, or an option given last without its value)."""
    out = []
    for i, arg in enumerate(extra):
        name, eq, value = arg.partition("=")
        if name in names:
            nxt = extra[i + 1] if i + 1 < len(extra) else None
            out.append((name, value if eq else nxt if nxt is not None and not nxt.startswith("-") else None))
    return out


def has_api_key(extra, env) -> bool:
    """Whether llama-server will require an API key: --api-key/--api-key-file after `--`, or their variables."""
    return bool(_option_values(extra, _API_KEY_OPTIONS)) or any(env.get(v) for v in _API_KEY_ENV)


def cors_args(cors: str | None, extra, env) -> list:
    """The CORS option for llama-server. Its default lets any web page the user opens call the API (every
    origin, with credentials); without an API key that includes saving, restoring and erasing slots. So
    without --api-key only the pages of this machine (a localhost Origin) get an Access-Control-Allow-Origin
    header, unless --cors asks for more; with a key, llama-server's default stands. LLAMA_ARG_CORS_ORIGINS
    set in the environment is the user's own choice, and stands too."""
    if cors is not None:
        if not cors.strip():
            raise SparqError("--cors: give the origins allowed to call the server (e.g. https://app.example.com, "
                             "a comma-separated list, localhost or *)")
        return ["--cors-origins", cors]
    if has_api_key(extra, env) or env.get("LLAMA_ARG_CORS_ORIGINS"):
        return []
    return ["--cors-origins", "localhost"]


def exposure_warnings(extra, env, host: str, cors: str | None) -> list[str]:
    """Warnings for what the server exposes beyond the model: the options after `--` (and the environment
    variables) that read files or run commands for whoever sends a request, a --host other than loopback
    without an API key, and --cors * without one. llama-server does as the user asked; serve says what it
    means (as llama.cpp's own help does for these options), and refuses none of them."""
    keyed = has_api_key(extra, env)
    who = ("whoever holds the API key" if keyed else
           "any process of this machine (no API key is set)" if _loopback(host) else
           f"anyone who can reach {host} (no API key is set)")
    warnings, seen = [], set()
    found = [(name, value, f"{name} {value}" if value is not None else name)
             for name, value in _option_values(extra, tuple(_EXPOSING))]
    found += [(name, env[var], f"{var}={env[var]}") for name, (var, _) in _EXPOSING.items()
              if env.get(var, "").strip().lower() not in _OFF]
    for name, value, shown in found:
        var, what = _EXPOSING[name]
        if var in seen:  # -ag and --agent, or an option and its variable: once
            continue
        seen.add(var)
        warnings.append(f"{shown} gives {who} {what}" +
                        ("" if name == "--path" else "; llama.cpp marks it experimental, not for untrusted use"))
    if not _loopback(host) and not keyed:
        warnings.append(f"--host {host} without an API key (-- --api-key KEY): anyone who can reach it can use "
                        "the server, its slots included")
    if cors is not None and "*" in cors.split(",") and not keyed:
        warnings.append("--cors * without an API key: any web page the user opens can call the server")
    return warnings


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Bind host:port once, as llama-server will (SO_REUSEADDR: a port in TIME_WAIT is free), so that a busy
    port is one clear error here rather than the server exiting after loading the model."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SparqError(f"--host {host}: cannot resolve it ({e.strerror})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise SparqError(f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); another server may "
                             "hold it, pick another --port") from None


def server_ctx(summary, ctx_size, parallel) -> int:
    """llama-server's -c: the context of all slots (each gets n_ctx / parallel)."""
    return ctx_size if ctx_size is not None else min(4096, summary.n_ctx_train or 4096) * parallel


def check_server_numbers(port: int, ctx_size, parallel: int) -> None:
    """The server's own numbers, before the model is read."""
    if not 1 <= port <= 65535:
        raise SparqError(f"--port must be in 1..65535, got {port}")
    if ctx_size is not None and ctx_size < 1:
        raise SparqError(f"--ctx-size must be >= 1, got {ctx_size}")
    if parallel < 1:
        raise SparqError(f"--parallel must be >= 1, got {parallel}")


def server_command(opening, *, host, port, ctx_size, parallel, threads, flash_attn="auto", extra=(),
                   cors=None) -> tuple:
    """(argv, environment) that start llama-server for `opening` (sparq_cpp.llm.prepare's: the model and the
    setting checked, as sparq_cpp.Llama checks them) with the server's settings (check_server_numbers'd) and the
    options after `--` (check_forwarded'd); what only the pair refuses is checked here: ALISA with more than one
    slot, -fa off with a sparse mode. The CORS origins as cors_args chooses them."""
    attention = opening.attention
    if isinstance(attention, ALISA) and parallel != 1:
        raise SparqError(f"ALISA keeps one window of past weights, so one sequence: --parallel must be 1, got {parallel}")
    fa = flash_attn_for(flash_attn, attention)  # SparQ, Loki and ALISA read V row by row
    n_ctx = server_ctx(opening.summary, ctx_size, parallel)
    argv = [str(tool_path("llama-server")), "-m", str(opening.path), "--host", host, "--port", str(port),
            "-c", str(n_ctx), "-np", str(parallel), "-t", str(threads or default_threads()),
            "-ctk", opening.type_k, "-ctv", opening.type_v, "-fa", fa]
    env = dict(os.environ)
    env.pop("LLAMA_SPARSE_ATTN", None)
    note = system.choose_thread_wait(env)  # llama-server's OpenMP threads: passive when the CPU is busy now
    if note:
        click.echo(f"threads {note}", err=True)
    value = sparse_attn_env(attention)
    if value is not None:
        env["LLAMA_SPARSE_ATTN"] = value
    return argv + list(extra) + cors_args(cors, extra, env), env


# After SIGTERM or SIGINT, the seconds llama-server gets to stop on its own. The patched server stops its
# generation and ends the requests waiting for results within a second; a server that still waits for its
# clients (a stock build) gets llama-server's own "second signal" (exit now) and, if that hangs too,
# SIGKILL after _KILL_S more.
_GRACE_S = 3.0
_KILL_S = 2.0
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _server_child_setup() -> None:
    """In the server's process before it starts: its own process group, so that a Ctrl-C in the terminal
    reaches serve alone, which passes it on once (llama-server takes a second one as "exit now"); and on
    Linux, SIGKILL when serve dies, so that `kill -9` of serve ends the server too."""
    os.setpgid(0, 0)
    if _LIBC is not None:
        parent = os.getppid()
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # serve died before the prctl took effect
            os._exit(1)


def run_server(argv, env, grace_s: float = _GRACE_S, kill_s: float = _KILL_S, watch_s: float = 10.0) -> int:
    """Run llama-server and return its exit status, passing SIGTERM, SIGINT and SIGHUP on to it. Once
    signalled, it gets grace_s to exit; then llama-server's second signal (it exits at once), then SIGKILL
    after kill_s more; the status is then 128 + the first signal, as for a process the signal ended.

    A server started on a quiet machine has threads that spin while they wait for each other; when other
    processes start to hold the CPU (two windows of watch_s in a row), it says so once, with what to do."""
    first: dict = {}
    started: list = []

    def forward(signum, frame):
        first.setdefault("signal", signum)
        first.setdefault("at", time.monotonic())
        for proc in started:  # a signal before the start is passed on once it has started
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)  # a user's second Ctrl-C goes on too: llama-server's "exit now"

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    proc = subprocess.Popen(argv, env=env, preexec_fn=_server_child_setup)
    started.append(proc)
    if "signal" in first:
        proc.send_signal(first["signal"])
    spinning = env.get("OMP_WAIT_POLICY", "").lower() != "passive" and "GOMP_SPINCOUNT" not in env
    watch = system.LoadWatch(proc.pid, watch_s) if spinning else None
    forced = False
    while True:
        try:
            rc = proc.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            pass
        if watch is not None and watch.busy():
            click.echo(f"threads: other processes now use {watch.share:.0%} of the CPU while the server's threads spin "
                       "as they wait for each other, which can slow decoding many times over; restart serve (it then "
                       "lets them sleep) or start it with OMP_WAIT_POLICY=passive", err=True)
            watch = None
        if "at" not in first:
            continue
        waited = time.monotonic() - first["at"]
        if waited > grace_s and not forced:
            forced = True
            click.echo(f"the server did not stop within {grace_s:.0f} s of {signal.Signals(first['signal']).name} "
                       "(a request in flight held it); ending it", err=True)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        elif waited > grace_s + kill_s:
            proc.kill()
    if forced:
        return 128 + first["signal"]
    return 128 - rc if rc < 0 else rc


def memory_estimate(path, attention, argv) -> dict:
    """What the llama-server of `argv` (from server_command) needs in memory for `attention`, by part
    (sparq_cpp.memory.context_estimate): weights, KV, SparQ's K^T, ALISA's window, compute."""
    opt = {argv[i]: argv[i + 1] for i in range(1, len(argv) - 1) if argv[i].startswith("-")}
    return context_estimate(shape_from_gguf(path), kind=attention.name, n_ctx=int(opt["-c"]),
                            n_seq=int(opt["-np"]), type_k=opt["-ctk"], type_v=opt["-ctv"],
                            flash_attn=opt["-fa"] != "off",  # auto: on, on a CPU
                            alisa_c=attention.c if isinstance(attention, ALISA) else None)


def memory_lines(est: dict, n_parallel: int) -> list:
    """The estimate as the lines `serve` prints before it starts the server."""
    parts = [f"weights {fmt_bytes(est['weights'])}", f"KV {fmt_bytes(est['kv_cache'])}"]
    if est["k_transposed"]:
        parts.append(f"SparQ's K^T {fmt_bytes(est['k_transposed'])}")
    if est["alisa_window"]:
        parts.append(f"ALISA's window {fmt_bytes(est['alisa_window'])}")
    parts += [f"compute {fmt_bytes(est['compute'])}", f"overhead {fmt_bytes(est['overhead'])}"]
    return [f"memory: {fmt_bytes(est['total'])} = " + " + ".join(parts),
            f"memory: {fmt_bytes(est['per_user'])} of caches per slot ({n_parallel} slot{'s' if n_parallel > 1 else ''} "
            f"of {est['cells_per_slot']} cells)"]


def check_memory(est: dict, available: int) -> None:
    """Refuses a setting whose estimate exceeds the memory available now (beyond it the server is killed
    without a word, or swaps), with the numbers and what to change."""
    check_fits(est, available, "the server", "use a smaller -c, fewer slots (-np) or a q8_0 cache (--cache-type q8_0)")


class _ServeCommand(Command):
    """Only what follows `--` goes to llama-server: an option before it that this command does not know is an
    error (a typo such as --temprature, or -m given twice), not forwarded."""

    def parse_args(self, ctx, args):
        args = list(args)
        if "--" in args:
            i = args.index("--")
            args, ctx.meta["server_args"] = args[:i], args[i + 1:]
        else:
            ctx.meta["server_args"] = []
        return super().parse_args(ctx, args)


@click.command("serve", cls=_ServeCommand)
@model_option("GGUF model file, or a known model name (smollm2-135m); default: the demo model, "
              "models/austen.q8_0.gguf.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to listen on (checked to be free).")
@click.option("--ctx-size", "-c", type=int, default=None,
              help="Context size of all slots together (default: 4096 per slot, or the model's training context).")
@click.option("--parallel", "-np", type=int, default=1, show_default=True, help="Slots (requests served at once).")
@click.option("--threads", "-t", type=threads_type(), default=None, help=THREADS_HELP)
@flash_attn_option
@click.option("--cors", default=None, metavar="ORIGINS",
              help="Web origins allowed to call the server from a browser (comma-separated, localhost, or *). "
                   "Default without an API key (-- --api-key KEY): pages of this machine only; with one, "
                   "llama-server's default (any origin).")
@click.option("--print-command", is_flag=True, help="Print the llama-server command and its setting, do not start it.")
@attention_options()
def command(model, host, port, ctx_size, parallel, threads, flash_attn, cors, print_command, cache_type, cache_type_k,
            cache_type_v, **options):
    """Serve a model over HTTP with OpenAI-style /v1/chat/completions and /v1/completions (llama-server),
    with SparQ, Loki or ALISA attention, its settings checked first. Options after `--` go to llama-server
    as they are (e.g. `-- --alias mymodel --metrics`), except those that would replace a checked setting."""
    server_args = click.get_current_context().meta["server_args"]
    check_forwarded(server_args)
    check_server_numbers(port, ctx_size, parallel)
    path = resolve_model(model)
    attention = attention_from_options(**options, model=path)
    summary = check_gguf(path)
    n_ctx = server_ctx(summary, ctx_size, parallel)
    # auto is resolved for one slot's context; a unified cache (-kvu after --) lets one request fill all of -c
    unified = any(a in ("-kvu", "--kv-unified") for a in server_args)
    n_ctx_seq = n_ctx if unified or parallel == 1 else max(1, n_ctx // parallel)
    opening = prepare(path, attention, n_ctx=n_ctx_seq, summary=summary, cache_type=cache_type, type_k=cache_type_k,
                      type_v=cache_type_v, cache_names=CACHE_OPTION_NAMES)
    if opening.auto_choice is not None:
        click.echo(opening.auto_choice, err=True)
        click.echo(f"sparse attention auto: n_ctx={n_ctx_seq} is " + (
            "the context of the one slot" if parallel == 1 else
            "what one request may fill of the unified cache" if unified else
            f"each of {parallel} slots' share of -c {n_ctx}"), err=True)
    else:
        warning = known_poor(attention, path, summary, options["loki_pca"])
        if warning:
            click.echo(f"warning: {warning}", err=True)
    argv, env = server_command(opening, host=host, port=port, ctx_size=ctx_size, parallel=parallel, threads=threads,
                               flash_attn=flash_attn, extra=server_args, cors=cors)
    attention = opening.attention
    for warning in exposure_warnings(server_args, env, host, cors):
        click.echo(f"warning: {warning}", err=True)
    setting = env.get("LLAMA_SPARSE_ATTN", "dense")
    est = memory_estimate(path, attention, argv)
    for line in memory_lines(est, parallel):
        click.echo(line, err=True)
    available = system.mem_available()
    if print_command:
        if available and est["total"] > available:
            click.echo(f"memory: more than the {fmt_bytes(available)} available here", err=True)
        click.echo(f"LLAMA_SPARSE_ATTN={setting} " + " ".join(argv))
        return
    check_memory(est, available)
    check_port_free(host, port)
    click.echo(f"serving {path.name} on http://{host}:{port} with {attention.name} attention ({setting}); "
               "GET /props reports it as sparse_attn", err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(run_server(argv, env))
