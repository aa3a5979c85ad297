"""Run a fresh build on this machine before it is installed.

A build can compile cleanly and still die at its first prompt on the machine it was built for (a
miscompiled instruction path such as ggml's AMX matmul under GCC 12). So before `make setup` installs a
build, each stage below runs in a child process against the build's own files (its wheel unpacked beside
it, its tools), on the demo model (q8_0 weights): a prompt batch long enough for the extra buffer types the CPU
backend offers q8_0 here (AMX tiles; Arm's repacked q8_0; x86 repacks only 4-bit types) and greedy decode steps
dense, SparQ, Loki and ALISA, then a stock tool.
A stage that dies or fails stops the install, naming the stage, the signal and what to try. A build that
passed is recorded in its folder (`smoke.json`) and not run again.

    python -m sparq_cpp.pyext.smoke STAGE   # one stage, in the current environment (what the children run)
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from sparq_cpp import llm
from sparq_cpp.errors import SparqError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO_ROOT / "models" / "austen.q8_0.gguf"
DEMO_PROJECTION = REPO_ROOT / "models" / "austen.loki.gguf"
SMOKE_VERSION = 1  # bump when the stages change, so that builds that passed the old ones run the new ones
# Long enough that the prompt's matrix multiplications take the batched paths (AMX tiles need more than a
# handful of rows), well inside the demo model's 2048-token context.
PROMPT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
          "want of a wife. However little known the feelings or views of such a man may be on his first entering "
          "a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
          "considered the rightful property of some one or other of their daughters. ") * 3
N_PREDICT = 8
# (stage name, what a person reads, the attention spec); k = 16 < the prompt's length, so decode is sparse
PY_STAGES = [
    ("dense", "prompt batch and decode, dense (Python bindings)", "dense"),
    ("sparq", "decode with SparQ (Python bindings)", "sparq:r=16,k=16"),
    ("loki", "decode with Loki (Python bindings)", f"loki:d=16,k=16,proj={DEMO_PROJECTION}"),
    ("alisa", "decode with ALISA (Python bindings)", "alisa:c=0.25"),
]
TOOL_STAGE = ("llama-completion", "prompt and decode with SparQ in llama-completion (stock tool)")
STAGE_TIMEOUT_S = 300


def _signal_name(rc: int) -> str:
    try:
        name = signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"
    what = {"SIGILL": "illegal instruction", "SIGSEGV": "segmentation fault", "SIGABRT": "abort",
            "SIGBUS": "bus error", "SIGFPE": "arithmetic exception"}.get(name)
    return f"{name} ({what})" if what else name


def run_stage(name: str) -> None:
    """One Python stage, in this process: the model loaded with the stage's attention, the prompt evaluated
    as one batch, N_PREDICT greedy tokens."""
    Llama = llm.llama_class()
    spec = dict((s, a) for s, _, a in PY_STAGES)[name]
    model = Llama(str(DEMO_MODEL), attention=spec, n_ctx=1024, n_batch=1024, n_threads=min(4, os.cpu_count() or 1))
    n_prompt = len(model.tokenize(PROMPT.encode()))
    out = model(PROMPT, max_tokens=N_PREDICT, temperature=0.0)
    n_out = out["usage"]["completion_tokens"]
    if n_out < 1:
        raise SystemExit(f"{name}: no token generated")
    print(f"{name}: prompt {n_prompt} tokens, {n_out} generated")


def _child_env(site: Path, extra_env: dict | None) -> dict:
    env = dict(os.environ)
    # the build's own llama_cpp (its wheel unpacked) before the one installed in this environment
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra_env or {})
    return env


def _unpacked_wheel(build) -> Path:
    site = Path(build.root) / "smoke-site"
    stamp = site / ".from"
    if not (stamp.is_file() and stamp.read_text() == str(build.wheel)):
        if site.exists():
            shutil.rmtree(site)
        with zipfile.ZipFile(build.wheel) as z:
            z.extractall(site)
        for lib in (site / "llama_cpp" / "lib").glob("*"):
            lib.chmod(0o755)  # zip extraction drops the mode bits
        stamp.write_text(str(build.wheel))
    return site


def _stage_commands(build, site: Path) -> list[tuple[str, str, list[str]]]:
    cmds = [(name, what, [sys.executable, "-m", "sparq_cpp.pyext.smoke", name]) for name, what, _ in PY_STAGES]
    tool = build.tools.get("llama-completion")
    if tool:
        cmds.append((TOOL_STAGE[0], TOOL_STAGE[1],
                     [tool, "-m", str(DEMO_MODEL), "-p", PROMPT, "-n", str(N_PREDICT), "-no-cnv", "--temp", "0",
                      "-c", "1024", "-b", "1024", "-fa", "on", "--sparse-attn", "sparq:r=16,k=16",
                      "-t", str(min(4, os.cpu_count() or 1))]))
    return cmds


def _failure(stage: str, what: str, rc: int | None, output: str, build, log_path: Path) -> SparqError:
    if rc is None:
        how = f"did not finish within {STAGE_TIMEOUT_S} s"
    elif rc < 0:
        how = f"died of {_signal_name(rc)}"
    else:
        how = f"failed (exit {rc})"
    tail = "\n".join(output.strip().splitlines()[-12:])
    portable = "" if not build.options.get("native", True) else (
        "; if a CPU path of the native build is at fault, try baseline AVX2 code (no AVX-512, no AMX): "
        "`make setup BUILD_ARGS=--no-native` (or `python -m sparq_cpp.pyext.build --no-native`)")
    return SparqError(
        f"the new build {build.key} was run here before installing it, and stage '{stage}' ({what}) {how}. "
        f"It was not installed (an earlier build, if any, stays installed){portable}. Output: {log_path}\n{tail}")


def passed(build) -> bool:
    rec = Path(build.root) / "smoke.json"
    try:
        d = json.loads(rec.read_text())
    except (OSError, ValueError):
        return False
    return d.get("version") == SMOKE_VERSION and d.get("passed") is True


def check(build, log=print, again: bool = False, extra_env: dict | None = None) -> None:
    """Run every stage of the smoke test on `build` (a pyext.build.Build), unless it passed here before.
    Raises SparqError naming the first stage that died or failed."""
    if passed(build) and not again:
        return
    if not DEMO_MODEL.is_file():
        raise SparqError(f"the smoke test's demo model {DEMO_MODEL} is missing from this checkout")
    (Path(build.root) / "smoke.json").unlink(missing_ok=True)  # passed only if this run passes
    site = _unpacked_wheel(build)
    env = _child_env(site, extra_env)
    log_path = Path(build.root) / "smoke.log"
    t0 = time.time()
    results = []
    with open(log_path, "w") as logf:
        for stage, what, cmd in _stage_commands(build, site):
            t = time.time()
            try:
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace",
                                      timeout=STAGE_TIMEOUT_S, cwd=build.root)
                rc, output = proc.returncode, proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as e:
                rc, output = None, "".join(x if isinstance(x, str) else (x or b"").decode(errors="replace")
                                           for x in (e.stdout, e.stderr))
            logf.write(f"=== {stage}: {what}: rc {rc}\n{output}\n")
            if rc != 0:
                logf.flush()
                raise _failure(stage, what, rc, output, build, log_path)
            results.append({"stage": stage, "seconds": round(time.time() - t, 2)})
    tmp = Path(build.root) / "smoke.json.tmp"
    tmp.write_text(json.dumps({"version": SMOKE_VERSION, "passed": True, "stages": results,
                               "seconds": round(time.time() - t0, 1)}, indent=2))
    os.replace(tmp, Path(build.root) / "smoke.json")
    log(f"smoke test passed on this machine ({len(results)} stages, {time.time() - t0:.0f} s): "
        + ", ".join(r["stage"] for r in results))


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in [s for s, _, _ in PY_STAGES]:
        sys.exit(f"usage: python -m sparq_cpp.pyext.smoke {{{','.join(s for s, _, _ in PY_STAGES)}}}")
    run_stage(sys.argv[1])
