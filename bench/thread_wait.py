"""How llama.cpp's threads wait, on a quiet and on a busy machine: decode ms/token of `sparq-cpp generate`
for each OpenMP wait policy (default: what sparq-cpp chooses; gomp: GNU OpenMP's default, spin a while then
sleep; active: spin; passive: sleep; spinN: GOMP_SPINCOUNT=N, spin N times then sleep), dense and sparse, with the other cores idle and with one busy process per core (what a machine
shared with other work looks like).

    python -m sparq_cpp.bench.thread_wait -m smollm2-135m --json docs/thread-wait.json

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
              timeout: float) -> float | None:
    """ms per decoded token of one `generate` run (None: it did not finish within timeout)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    if policy.startswith("spin"):  # spinN: GNU OpenMP spins N times at a barrier, then sleeps
        env["GOMP_SPINCOUNT"] = policy[len("spin"):]
    elif policy == "gomp":
        env["GOMP_SPINCOUNT"] = "300000"
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = policy
    cmd = [sys.executable, "-m", "sparq_cpp.cli.main", "generate", "-m", model, "--no-chat", "--no-display-prompt",
           "-p", prompt, "-n", str(n_predict), "--temp", "0", "--ignore-eos", "-t", str(threads), *attention]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    m = _DECODE.search(proc.stderr)
    if proc.returncode != 0 or not m:
        raise click.ClickException(f"generate failed ({proc.returncode}): {proc.stderr[-800:]}")
    return 1000 * float(m.group(2)) / int(m.group(1))


@click.command()
@click.option("-m", "--model", default="smollm2-135m", show_default=True)
@click.option("--threads", "-t", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--n-predict", type=int, default=32, show_default=True)
@click.option("--prompt-words", type=int, default=600, show_default=True,
              help="Prompt length (words of filler text), so that the sparse step has a cache to select from.")
@click.option("--policies", default=",".join(POLICIES), show_default=True,
              help="default, gomp, active, passive, or spinN (GOMP_SPINCOUNT=N), comma-separated.")
@click.option("--timeout", type=float, default=240, show_default=True, help="Seconds per run before it counts as stuck.")
@click.option("--json", "json_out", default=None, metavar="FILE")
def main(model, threads, repeats, n_predict, prompt_words, policies, timeout, json_out):
    """Decode speed per OpenMP wait policy, quiet and loaded, dense and SparQ."""
    model = str(resolve_model(model))
    prompt = " ".join(["the quiet house stood by the river and the people came and went all day"] * (prompt_words // 15))
    modes = {"dense": [], "sparq": ["--sparq-r", "16", "--sparse-k", "64"]}
    pols = [p.strip() for p in policies.split(",")]
    cpu = machine.cpu_model()
    results = {}
    for load in ("quiet", "loaded"):
        n_burn = 0 if load == "quiet" else (os.cpu_count() or 1)
        for rep in range(repeats):
            with Load(n_burn):
                for mode, args in modes.items():
                    for pol in pols:
                        ms = decode_ms(model, args, pol, threads, n_predict, prompt, timeout)
                        results.setdefault((load, mode, pol), []).append(ms)
                        click.echo(f"{load:6s} {mode:5s} {pol:7s} repeat {rep + 1}: "
                                   + (f"{ms:8.2f} ms/token" if ms is not None else "did not finish"), err=True)
    rows = []
    for (load, mode, pol), v in results.items():
        done = [x for x in v if x is not None]
        rows.append({"load": load, "mode": mode, "policy": pol, "ms_per_token": v,
                     "median_ms": statistics.median(done) if done else None, "unfinished": len(v) - len(done)})
    click.echo("load    mode   policy   median ms/token   (repeats)")
    for r in rows:
        med = f"{r['median_ms']:10.2f}" if r["median_ms"] is not None else "   stuck"
        click.echo(f"{r['load']:6s}  {r['mode']:5s}  {r['policy']:7s} {med}        "
                   + " ".join("-" if x is None else f"{x:.1f}" for x in r["ms_per_token"]))
    if json_out:
        doc = {"command": " ".join(["python -m sparq_cpp.bench.thread_wait", *sys.argv[1:]]),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine.machine_info(), "cpu_model": cpu, "threads": threads, "n_predict": n_predict,
               "model": model, "rows": rows}
        atomic_write(json_out, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))
        click.echo(f"wrote {json_out}", err=True)


if __name__ == "__main__":
    main()
