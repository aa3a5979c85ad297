"""Speculative decoding in llama-server with sparse attention: generation speed with and without a draft model,
dense against SparQ (or Loki), and whether the draft changes the text.

For each depth S and each attention setting, llama-server starts twice, with and without `--model-draft`
(the same server build, one slot, flash attention, an f16 cache); the draft's context runs the same sparse
setting (llama-server's --sparse-attn applies to the draft model too), except Loki's: its basis is the
target's, so a Loki server's draft attends densely. Each server takes the same
S-token prompt (prose from the evaluation's text generator), then `--repeats` requests generate `--n-predict`
tokens at temperature 0 from it (the prompt is reused from the cache: only the generation is timed, by the
server's own `predicted_ms`; the reused prompt's last token is evaluated again as a decode step, so these
texts may differ from the first request's). With a draft, a step drafts up to `--draft-max` tokens and the target checks
them in one batch, which attends sparsely (a verification batch); rejected tokens are removed from the cache.
At temperature 0 the text with a draft must equal the text without one.

    python -m tools.spec_decode --model smollm2-135m --draft smollm2-135m --depths 4k,8000 \\
        --attention sparq:r=8,k=128 --threads 2 --json docs/spec-decode-smollm2.json
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
import urllib.error
from pathlib import Path

import click

from sparq_cpp.bench.server_process import ServerProcess
from sparq_cpp.errors import SparqError
from sparq_cpp.evaluation import textgen
from sparq_cpp.outfile import atomic_write
from sparq_cpp.pyext.build import tool_path
from sparq_cpp.real_models import fetch
from tools.alisa_decode import parse_depths

SCHEMA = "sparq-cpp-spec-decode/1"


class _Server(ServerProcess):
    """llama-server with one slot, flash attention and an f16 cache, with or without a draft model."""

    def __init__(self, model: Path, draft: Path | None, n_ctx: int, threads: int, attention: str | None,
                 draft_max: int, log_dir: Path):
        def argv(port):
            args = [tool_path("llama-server"), "-m", model, "-c", n_ctx, "-fa", "on", "-t", threads, "-tb", threads,
                    "--parallel", 1, "--port", port, "-ctk", "f16", "-ctv", "f16"]
            if draft is not None:
                args += ["--model-draft", draft, "--spec-type", "draft-simple", "--spec-draft-n-max", draft_max]
            if attention:
                args += ["--sparse-attn", attention]
            return args

        env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SPARSE_ATTN", "LLAMA_ARG_SPARSE_ATTN")}
        super().__init__(argv, env=env, log_dir=log_dir, timeout_s=120, request_timeout_s=1800)

    def post(self, path, body):
        try:
            return super().post(path, body)
        except urllib.error.HTTPError as e:
            raise SparqError(f"llama-server answered {path} with {e.code}: {e.read().decode(errors='replace')[:500]}") from None


def _prompt_tokens(server: _Server, depth: int, seed: int) -> list[int]:
    toks = server.post("/tokenize", {"content": textgen.prose(8 * depth, seed)})["tokens"]
    if len(toks) < depth:
        raise SparqError(f"the prose gave {len(toks)} tokens, fewer than the depth {depth}")
    return toks[:depth]


def run_config(model, draft, depth: int, attention: str | None, n_predict: int, repeats: int, threads: int,
               draft_max: int, seed: int, log_dir: Path) -> dict:
    srv = _Server(model, draft, depth + n_predict + 64, threads, attention, draft_max, log_dir)
    try:
        prompt = _prompt_tokens(srv, depth, seed)
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0, "cache_prompt": True}
        t0 = time.perf_counter()
        first = srv.post("/completion", body)  # processes the prompt; its generation is timed too
        prompt_s = time.perf_counter() - t0
        runs = [first] + [srv.post("/completion", body) for _ in range(repeats)]
    finally:
        srv.close()
    timed = runs[1:]
    per_token = [r["timings"]["predicted_ms"] / max(1, r["timings"]["predicted_n"]) for r in timed]
    rec = {"depth": depth, "attention": attention or "dense", "draft": str(draft) if draft else None,
           "prompt_s": prompt_s, "ms_per_token": per_token, "median_ms_per_token": statistics.median(per_token),
           "texts": [r["content"] for r in runs]}
    if draft:
        n = sum(r["timings"].get("draft_n", 0) for r in timed)
        acc = sum(r["timings"].get("draft_n_accepted", 0) for r in timed)
        rec.update({"draft_n": n, "draft_n_accepted": acc, "acceptance": acc / n if n else None})
    return rec


def _resolve(name: str) -> Path:
    p = Path(name)
    if p.is_file():
        return p
    try:
        return Path(fetch(name))
    except Exception as e:
        raise SparqError(f"{name!r} is neither a GGUF file nor a known model name ({e})") from None


@click.command()
@click.option("--model", required=True, help="Target GGUF, or a known model name (e.g. smollm2-135m).")
@click.option("--draft", required=True, help="Draft GGUF with the target's vocabulary, or a known model name.")
@click.option("--depths", default="4k,8k", show_default=True, help="Prompt lengths (k = 1024).")
@click.option("--attention", "attentions", multiple=True, default=["sparq:r=8,k=128"], show_default=True,
              help="a --sparse-attn setting to compare with dense (repeatable).")
@click.option("--n-predict", default=64, show_default=True, help="Tokens generated per request.")
@click.option("--repeats", default=3, show_default=True, help="Timed requests per configuration.")
@click.option("--draft-max", default=3, show_default=True, help="Tokens drafted per step (--spec-draft-n-max).")
@click.option("--threads", default=2, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write the results here.")
def main(model, draft, depths, attentions, n_predict, repeats, draft_max, threads, seed, json_path):
    """llama-server's generation speed with and without a draft model, dense against sparse attention."""
    model, draft = _resolve(model), _resolve(draft)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth in parse_depths(depths):
            for att in (None, *attentions):
                for d in (None, draft):
                    rec = run_config(model, d, depth, att, n_predict, repeats, threads, draft_max, seed, Path(tmp))
                    results.append(rec)
                    acc = f", draft accepted {100 * rec['acceptance']:.0f}%" if d and rec.get("acceptance") is not None else ""
                    click.echo(f"S={depth:>6} {rec['attention']:<22} {'draft' if d else 'no draft':<8} "
                               f"{rec['median_ms_per_token']:7.1f} ms/token{acc}")
    for depth in sorted({r["depth"] for r in results}):
        here = [r for r in results if r["depth"] == depth]
        for att in {r["attention"] for r in here}:
            pair = {bool(r["draft"]): r for r in here if r["attention"] == att}
            same = pair[True]["texts"] == pair[False]["texts"]
            pair[True]["same_text_as_no_draft"] = same
            click.echo(f"S={depth:>6} {att:<22} text with the draft {'equals' if same else 'DIFFERS FROM'} "
                       f"the text without")
    doc = {"schema": SCHEMA, "model": str(model), "draft": str(draft), "n_predict": n_predict,
           "repeats": repeats, "draft_max": draft_max, "threads": threads, "results": results}
    if json_path:
        atomic_write(json_path, lambda tmp: Path(tmp).write_text(json.dumps(doc, indent=1)), "the results")
        click.echo(f"json: {json_path}")


if __name__ == "__main__":
    main()
