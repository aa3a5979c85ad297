"""How llama.cpp's threads wait, on a quiet and on a busy machine: decode ms/token of `sparq-cpp generate`
for each OpenMP wait policy (default: what sparq-cpp chooses; gomp: GNU OpenMP's default, spin a while then
sleep; active: spin; passive: sleep; spinN: GOMP_SPINCOUNT=N, spin N times then sleep), dense and sparse, with the other cores idle and with one busy process per core (what a machine
shared with other work looks like).

    python -m tools.thread_wait -m smollm2-135m --json docs/thread-wait.json

With --tools, llama-bench of the given llama.cpp builds runs instead (the cache filled to the prompt's length), so that a build with OpenMP (its
policies as above) and one without it (ggml's own thread pool; pollN: --poll N, how long a thread polls before it
waits, 0-100) are timed side by side.

Every configuration runs as its own `generate` child process; the configurations alternate within each
repeat, so drift hits them alike. Reports the median of the repeats and writes JSON.
"""
from __future__ import annotations

import datetime as _dt
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import time

import click

from sparq_cpp.bench import machine
from sparq_cpp.cli.options import resolve_model
from sparq_cpp.outfile import atomic_write

# default: nothing set, what sparq-cpp chooses (passive when other processes hold the CPU at start, else GNU OpenMP's
# default); gomp: GNU OpenMP's default whatever the load (GOMP_SPINCOUNT=300000, the spin count it uses unset)
POLICIES = ("default", "gomp", "active", "passive")
_DECODE = re.compile(r"decode\s+(\d+) tokens in\s+([\d.]+) s")


def _burn(stop):
    while not stop.is_set():
        pass


class Load:
    """n busy processes (one per core: a machine running other work) for the duration of a with-block."""

    def __init__(self, n: int):
        self.n, self.stop, self.procs = n, mp.Event(), []

    def __enter__(self):
        self.procs = [mp.Process(target=_burn, args=(self.stop,), daemon=True) for _ in range(self.n)]
        for p in self.procs:
            p.start()
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


def decode_ms(model: str, attention: list[str], policy: str, threads: int, n_predict: int, prompt: str,
              timeout: float, tools: str | None = None) -> float | None:
    """ms per decoded token of one `generate` run, or with `tools` (a llama.cpp build's bin folder) of one
    llama-bench run (None: it did not finish within timeout). pollN: llama.cpp's --poll N, how much ggml's own
    thread pool (a build without OpenMP) polls before it waits."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    extra = []
    if policy.startswith("spin"):  # spinN: GNU OpenMP spins N times at a barrier, then sleeps
        env["GOMP_SPINCOUNT"] = policy[len("spin"):]
    elif policy.startswith("poll"):
        extra = ["--poll", policy[len("poll"):]]
    elif policy == "gomp":
        env["GOMP_SPINCOUNT"] = "300000"
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    if tools:  # the cache filled to about the prompt's length, then n_predict steps timed
        depth = len(prompt.split()) * 4 // 3
        cmd = [os.path.join(tools, "llama-bench"), "-m", model, "-p", "0", "-n", str(n_predict), "-d", str(depth),
               "-r", "1", "-t", str(threads), "-fa", "1", "-o", "json", *(attention or ["--sparse-attn", "dense"]),
               *extra]
    else:
        if extra:
            raise click.ClickException(f"--policies {policy}: --poll is llama-bench's; give --tools")
        cmd = [sys.executable, "-m", "sparq_cpp.cli.main", "generate", "-m", model, "--no-chat", "--no-display-prompt",
               "-p", prompt, "-n", str(n_predict), "--temp", "0", "--ignore-eos", "-t", str(threads), *attention]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    if tools:
        try:
            row = json.loads(proc.stdout)[0]
        except (ValueError, IndexError, KeyError):
            raise click.ClickException(f"llama-bench failed ({proc.returncode}): {proc.stderr[-800:]}") from None
        return row["avg_ns"] / 1e6 / n_predict
    m = _DECODE.search(proc.stderr)
    if proc.returncode != 0 or not m:
        raise click.ClickException(f"generate failed ({proc.returncode}): {proc.stderr[-800:]}")
    return 1000 * float(m.group(2)) / int(m.group(1))


def build_threads(tools: str, model: str) -> str:
    """How a llama.cpp build's CPU threads wait: "OpenMP" or "ggml thread pool" (from the system info it logs)."""
    proc = subprocess.run([os.path.join(tools, "llama-completion"), "-m", model, "-no-cnv", "-p", "hi", "-n", "1",
                           "-t", "1"], capture_output=True, text=True, errors="replace", timeout=120,
                          stdin=subprocess.DEVNULL)
    return "OpenMP" if "OPENMP = 1" in proc.stdout + proc.stderr else "ggml thread pool"


@click.command()
@click.option("-m", "--model", default="smollm2-135m", show_default=True)
@click.option("--threads", "-t", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--n-predict", type=int, default=32, show_default=True)
@click.option("--prompt-words", type=int, default=600, show_default=True,
              help="Prompt length (words of filler text), so that the sparse step has a cache to select from.")
@click.option("--policies", default=",".join(POLICIES), show_default=True,
              help="default, gomp, active, passive, spinN (GOMP_SPINCOUNT=N) or pollN (--poll N, with --tools), "
                   "comma-separated.")
@click.option("--timeout", type=float, default=240, show_default=True, help="Seconds per run before it counts as stuck.")
@click.option("--tools", "tools_dirs", multiple=True, metavar="DIR",
              help="Time llama-bench of this llama.cpp build's bin folder instead of `generate` (repeatable: "
                   "the builds alternate; a build without OpenMP takes the pollN policies, one with it the others).")
@click.option("--json", "json_out", default=None, metavar="FILE")
def main(model, threads, repeats, n_predict, prompt_words, policies, timeout, tools_dirs, json_out):
    """Decode speed per thread wait policy, quiet and loaded, dense and SparQ."""
    model = str(resolve_model(model))
    prompt = " ".join(["the quiet house stood by the river and the people came and went all day"] * (prompt_words // 15))
    pols = [p.strip() for p in policies.split(",")]
    if tools_dirs:
        modes = {"dense": [], "sparq": ["--sparse-attn", "sparq:r=16,k=64"]}
        builds = {d: build_threads(d, model) for d in tools_dirs}
        configs = [(d, pol) for d, kind in builds.items() for pol in pols
                   if pol.startswith("poll") == (kind == "ggml thread pool")]
    else:
        modes = {"dense": [], "sparq": ["--sparq-r", "16", "--sparse-k", "64"]}
        builds = {None: "generate (OpenMP)"}
        configs = [(None, pol) for pol in pols]
    if not configs:
        raise click.UsageError("no policy applies to the builds given (pollN: a build without OpenMP)")
    cpu = machine.cpu_model()
    results = {}
    for load in ("quiet", "loaded"):
        n_burn = 0 if load == "quiet" else (os.cpu_count() or 1)
        for rep in range(repeats):
            with Load(n_burn):
                for mode, args in modes.items():
                    for tools, pol in configs:
                        ms = decode_ms(model, args, pol, threads, n_predict, prompt, timeout, tools)
                        results.setdefault((load, mode, builds[tools], pol), []).append(ms)
                        click.echo(f"{load:6s} {mode:5s} {builds[tools]:16s} {pol:7s} repeat {rep + 1}: "
                                   + (f"{ms:8.2f} ms/token" if ms is not None else "did not finish"), err=True)
    rows = []
    for (load, mode, build, pol), v in results.items():
        done = [x for x in v if x is not None]
        rows.append({"load": load, "mode": mode, "build": build, "policy": pol, "ms_per_token": v,
                     "median_ms": statistics.median(done) if done else None, "unfinished": len(v) - len(done)})
    click.echo("load    mode   build             policy   median ms/token   (repeats)")
    for r in rows:
        med = f"{r['median_ms']:10.2f}" if r["median_ms"] is not None else "   stuck"
        click.echo(f"{r['load']:6s}  {r['mode']:5s}  {r['build']:16s}  {r['policy']:7s} {med}        "
                   + " ".join("-" if x is None else f"{x:.1f}" for x in r["ms_per_token"]))
    if json_out:
        doc = {"command": " ".join(["python -m tools.thread_wait", *sys.argv[1:]]),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine.machine_info(), "cpu_model": cpu, "threads": threads, "n_predict": n_predict,
               "model": model, "runner": "llama-bench" if tools_dirs else "sparq-cpp generate", "rows": rows}
        atomic_write(json_out, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))
        click.echo(f"wrote {json_out}", err=True)


if __name__ == "__main__":
    main()
