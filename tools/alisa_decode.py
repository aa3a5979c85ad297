"""ALISA against dense attention in llama.cpp: the latency of a decode step, and of the prompt, at S positions.

For each S, an ALISA context and a dense one (flash attention, f16 cache) of the same model take the same
S-token prompt, timed: ALISA attends to the prompt without flash attention, since its softmax weights seed the
window. Then decode steps alternate between the two contexts (the same token in each), so a disturbance of the
machine hits both; the medians and the ratio of the medians are reported, beside the bytes each step reads (the
model's weights, and the attention's KV data and window sums by sparq_cpp.transfer) and the read bandwidth
measured here. The first decode step after the prompt is timed apart (it is a step users pay for), and so are
steps right after removing the last token (a rewind, as prompt reuse and regenerate do), alternating likewise.

    python -m tools.alisa_decode --model smollm2-135m --depths 2k,4k,8k --c 0.125 --threads 1 \\
        --json docs/alisa-decode-smollm2.json
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import click
import numpy as np

from sparq_cpp import transfer
from sparq_cpp.attention import ALISA, Dense
from sparq_cpp.bench import machine
from sparq_cpp.errors import SparqError
from sparq_cpp.llm import open_model
from sparq_cpp.outfile import atomic_write
from sparq_cpp.real_models import fetch

SCHEMA = "sparq-cpp-alisa-decode/1"


def parse_depths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            n = int(part[:-1] if part.endswith("k") else part) * mult
        except ValueError:
            raise SparqError(f"--depths: {part!r} is not a number of positions (e.g. 2k or 2048)") from None
        if n < 16:
            raise SparqError(f"--depths: {part!r} is below 16 positions")
        out.append(n)
    return out


def _timed(llm, toks) -> float:
    t0 = time.perf_counter()
    llm.eval(toks)
    return time.perf_counter() - t0


def run_depth(path, S: int, c: float, steps: int, threads: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    n_ctx = S + steps + 2
    contexts = {}
    for name, att in (("alisa", ALISA(c=c)), ("dense", Dense())):
        llm, summary = open_model(path, attention=att, n_ctx=n_ctx, n_threads=threads, cache_type="f16",
                                  flash_attn=True)
        vocab = llm.n_vocab()
        contexts[name] = llm
    prompt = rng.integers(100, vocab - 100, S).tolist()
    tokens = rng.integers(100, vocab - 100, steps + 1).tolist()
    res = {"S": S, "prompt_s": {}, "first_step_ms": {}, "step_ms": {}}
    for name, llm in contexts.items():
        res["prompt_s"][name] = _timed(llm, prompt)
        res["first_step_ms"][name] = 1e3 * _timed(llm, tokens[:1])
    times = {name: [] for name in contexts}
    for tok in tokens[1:]:
        for name, llm in contexts.items():
            times[name].append(1e3 * _timed(llm, [tok]))
    for name in contexts:
        res["step_ms"][name] = statistics.median(times[name])
    # a step right after removing the last token (llama_cpp's eval removes the cells >= n_tokens first)
    rewind = {name: [] for name in contexts}
    for tok in tokens[1:]:
        for name, llm in contexts.items():
            llm.n_tokens -= 1
            rewind[name].append(1e3 * _timed(llm, [tok]))
    res["rewind_step_ms"] = {name: statistics.median(rewind[name]) for name in contexts}
    res["speedup"] = res["step_ms"]["dense"] / res["step_ms"]["alisa"]
    res["steps"] = steps
    heads = summary.n_layer * summary.n_head_kv
    n = S + steps // 2
    res["attention_bytes"] = {"alisa": transfer.alisa_bytes(n, summary.head_dim, c) * heads,
                              "dense": transfer.dense_bytes(n, summary.head_dim) * heads}
    for llm in contexts.values():
        llm.close()
    return res, summary


@click.command()
@click.option("--model", "model", default="smollm2-135m", show_default=True,
              help="A GGUF file, or the name of a real model the project fetches (sparq_cpp.real_models).")
@click.option("--depths", default="2k,4k,8k", show_default=True, help="Comma-separated S values (k = 1024).")
@click.option("--c", "c", type=float, default=0.125, show_default=True, help="ALISA's caching ratio.")
@click.option("--steps", type=int, default=31, show_default=True, help="Timed decode steps per context and S.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the results here.")
def main(model, depths, c, steps, threads, seed, json_path):
    path = Path(model)
    if not path.is_file():
        path = Path(fetch(model))
    if steps < 3:
        raise SparqError(f"--steps must be >= 3, got {steps}")
    weights = path.stat().st_size
    bw = machine.measure_bandwidth(threads)
    click.echo(f"model {path.name} ({weights / 1e6:.0f} MB), c = {c}, {threads} thread(s), "
               f"read bandwidth {bw['best_gbs']:.1f} GB/s (best), {bw['median_gbs']:.1f} (median)")
    rows = []
    for S in parse_depths(depths):
        res, summary = run_depth(path, S, c, steps, threads, seed)
        ab, db = res["attention_bytes"]["alisa"], res["attention_bytes"]["dense"]
        res["bytes_per_step"] = {"alisa": weights + ab, "dense": weights + db}
        res["bound_speedup"] = (weights + db) / (weights + ab)
        rows.append(res)
        click.echo(f"S={S:6d}  step dense {res['step_ms']['dense']:7.2f} ms  alisa {res['step_ms']['alisa']:7.2f} ms  "
                   f"x{res['speedup']:.2f} (bytes allow x{res['bound_speedup']:.2f})  first step dense "
                   f"{res['first_step_ms']['dense']:.1f} alisa {res['first_step_ms']['alisa']:.1f} ms  prompt dense "
                   f"{res['prompt_s']['dense']:.1f} s alisa {res['prompt_s']['alisa']:.1f} s  after a rewind dense "
                   f"{res['rewind_step_ms']['dense']:.1f} alisa {res['rewind_step_ms']['alisa']:.1f} ms")
    doc = {"schema": SCHEMA, "model": path.name, "c": c, "threads": threads, "steps": steps,
           "model_bytes": weights, "bandwidth": bw, "machine": machine.machine_info(),
           "n_layer": summary.n_layer, "n_head_kv": summary.n_head_kv, "head_dim": summary.head_dim,
           "results": rows}
    if json_path:
        atomic_write(json_path, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1)), "the results")
        click.echo(f"json: {json_path}")


if __name__ == "__main__":
    main()
