"""`python -m sparq_cpp.train`: fetch the corpus, train the demo model, evaluate a checkpoint.

    python -m sparq_cpp.train fetch                       # apt-get download r-cran-janeaustenr=1.0.0-1
    python -m sparq_cpp.train train --out build/austen    # from scratch; see models/README.md for the recipe
    sparq-cpp convert build/austen --outtype q8_0 --out models/austen.q8_0.gguf
    python -m sparq_cpp.train eval --gguf models/austen.q8_0.gguf --ckpt build/austen --card models/austen.json
"""
from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import click

from sparq_cpp import lazy
from sparq_cpp.cli.runner import run_standalone
from sparq_cpp.errors import SparqError
from sparq_cpp.train import corpus, domains, evaldata
from sparq_cpp.train.card import measure, write_card


@click.group()
def cli():
    """Train sparq-cpp's small Llama demo model (needs the `train` extra: torch, safetensors)."""


@cli.command()
@click.option("--deb", default=None, metavar="FILE", help="Use this r-cran-janeaustenr .deb instead of apt-get.")
def fetch(deb):
    """Fetch and check the training text (Jane Austen's novels, a Debian package)."""
    novels = corpus.load_novels(deb)
    for title, text in novels.items():
        click.echo(f"{title}: {len(text)} characters")
    click.echo(f"cached in {corpus.cache_dir()}")


@cli.command()
@click.option("--out", required=True, metavar="DIR", help="Checkpoint directory (Hugging Face layout).")
@click.option("--init", default=None, metavar="DIR|MODEL.gguf",
              help="Warm-start from this checkpoint or GGUF Llama model (dequantized); its geometry is kept (the flags below must agree), "
                   "except that a smaller --n-head-kv mean-pools its KV heads (GQA uptraining).")
@click.option("--n-vocab", type=int, default=None, help="[default: 2048]")
@click.option("--n-embd", type=int, default=None, help="[default: 256]")
@click.option("--n-head", type=int, default=None, help="[default: 2]")
@click.option("--n-head-kv", type=int, default=None, help="< n-head for GQA. [default: 2]")
@click.option("--n-layer", type=int, default=None, help="[default: 4]")
@click.option("--n-ff", type=int, default=None, help="[default: 768]")
@click.option("--ctx", type=int, default=2048, show_default=True, help="Training sequence length.")
@click.option("--batch", type=int, default=2, show_default=True, help="Sequences per step.")
@click.option("--steps", type=int, default=900, show_default=True)
@click.option("--lr", type=float, default=3e-3, show_default=True)
@click.option("--p-random", "p_rand", default="0", show_default=True, metavar="P|START:END",
              help="Fraction of sequences that are a passage of random words, repeated (induction training); "
                   "START:END changes it linearly over the steps (a curriculum within one phase).")
@click.option("--random-layout", "rand_layout", type=click.Choice(["repeat", "chunks", "mix", "text"]),
              default="repeat", show_default=True,
              help="How a random-word sequence repeats its passage: back to back; as runs from random places "
                   "(no fixed look-back distance works); half of each; or as copied passages in text.")
@click.option("--rand-vocab", default=None, metavar="N|LO:HI",
              help="Random-word passages draw from N distinct words (LO:HI: a size log-uniform in that range, "
                   "per passage) instead of all 232: repeated words force copying to match several words back.")
@click.option("--rand-text", is_flag=True,
              help="The --p-random sequences repeat passages of training text instead of random words (same layouts).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--threads", type=int, default=1, show_default=True, help="torch threads.")
@click.option("--bf16", is_flag=True, help="Matmuls in bfloat16 (autocast; weights and optimizer stay float32): "
              "2.6x faster steps on a CPU with AVX512-BF16; slow on one without.")
@click.option("--eval-every", type=int, default=200, show_default=True)
@click.option("--stop-at", type=click.IntRange(min=1), default=None, metavar="STEP",
              help="End after this step, with a checkpoint; the learning-rate and --p-random schedules "
                   "stay those of --steps (how a phase that was stopped early is reproduced).")
@click.option("--deb", default=None, metavar="FILE", help="Use this r-cran-janeaustenr .deb instead of apt-get.")
def train(out, deb, init, **kw):
    """Train from scratch or from --init; writes a checkpoint (with training.json) at every evaluation."""
    training = lazy.need("sparq_cpp.train.run", "training")  # torch
    kw.update(training.geometry({k: kw.pop(k) for k in training.GEOMETRY}, init))
    if kw["n_embd"] % kw["n_head"] or kw["n_head"] % kw["n_head_kv"]:
        raise SparqError("n-embd must divide by n-head, and n-head by n-head-kv")
    kw["p_rand"], kw["p_rand_end"] = training.parse_fraction_ramp(kw["p_rand"])
    kw["rand_vocab"] = training.parse_size_range(kw["rand_vocab"]) if kw["rand_vocab"] else None
    command = "python -m sparq_cpp.train " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    training.train(training.TrainArgs(out=out, init=init, **kw), command=command, deb=deb)


@cli.command("eval-data")
@click.option("--out", required=True, metavar="DIR",
              help="Directory for heldout.txt, needle.txt, kv.txt, calib.txt, and domains/ (the held-out domains).")
@click.option("--deb", default=None, metavar="FILE", help="Use this r-cran-janeaustenr .deb instead of apt-get.")
def eval_data(out, deb):
    """Task files for `sparq-cpp eval` from the held-out text (the last 5% of each novel), and
    calibration text for `sparq-cpp calibrate` from the training text; under domains/, each domain's held-out and
    calibration parts (prose, docs, code, chat: sparq_cpp.train.domains) and calib-mixed.txt, all four."""
    paths = evaldata.write(out, deb)
    calib = paths.pop("calib")
    manifest = domains.build(Path(out) / "domains", deb)
    click.echo("sparq-cpp eval " + " ".join(f"--data {task}={path}" for task, path in paths.items()))
    click.echo("sparq-cpp eval --tasks '' " + " ".join(f"--domain {d}={v['heldout']}"
                                                      for d, v in manifest["domains"].items()))
    click.echo(f"sparq-cpp calibrate --text {calib}   # Austen only")
    click.echo(f"sparq-cpp calibrate --text {manifest['mixed']}   # the four domains (calibrate's default)")


@cli.command("eval")
@click.option("--gguf", "gguf_path", required=True, metavar="MODEL", help="Converted model to measure.")
@click.option("--ckpt", default=None, metavar="DIR", help="Its checkpoint (for training.json in the card).")
@click.option("--ctx", type=int, default=2048, show_default=True, help="Sequence length of the eval sets.")
@click.option("--n", "n_eval", type=int, default=16, show_default=True, help="Sequences per eval set.")
@click.option("--threads", type=int, default=1, show_default=True)
@click.option("--card", default=None, metavar="JSON", help="Write a model card (JSON) with the results.")
@click.option("--deb", default=None, metavar="FILE", help="Use this r-cran-janeaustenr .deb instead of apt-get.")
def eval_(gguf_path, ckpt, ctx, n_eval, threads, card, deb):
    """Validation loss and long-range task accuracy of a GGUF, through llama.cpp (dense)."""
    result = measure(gguf_path, ctx=ctx, n_eval=n_eval, threads=threads, deb=deb)
    click.echo(json.dumps(result, indent=2))
    if card:
        write_card(card, gguf_path, result, ckpt)
        click.echo(f"wrote {card}", err=True)


def main():
    run_standalone(cli)


if __name__ == "__main__":
    main()
