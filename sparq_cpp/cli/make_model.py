"""`sparq-cpp make-model`: write a synthetic GGUF (random weights, working tokenizer) of one of the
architectures the factory knows (llama, qwen2, qwen3, phi3, gemma3, olmo2, granite: the preset picks)."""
from __future__ import annotations

import click

from sparq_cpp.cli.options import progress_enabled, progress_option
from sparq_cpp.modelfactory import PRESETS, WTYPES, resolve_geometry, write_model
from sparq_cpp.outfile import check_writable


def _size(n: int) -> str:
    if n < 1024**3:
        return f"{n / 1024**2:.1f} MiB"
    return f"{n / 1024**3:.2f} GiB"


@click.command("make-model")
@click.option("--preset", type=click.Choice(list(PRESETS)), default="tiny", show_default=True,
              help="Geometry to start from.")
@click.option("--layers", type=int, default=None, help="Number of layers (default: the preset's).")
@click.option("--wtype", type=click.Choice(list(WTYPES)), default="f32", show_default=True,
              help="Type of the matrix weights and the embedding; norms stay f32.")
@click.option("--seed", type=int, default=0, show_default=True, help="Same seed, same bytes.")
@click.option("--out", "out", type=click.Path(dir_okay=False), required=True, help="GGUF file to write.")
@click.option("--n-embd", type=int, default=None, help="Override the embedding size.")
@click.option("--n-head", type=int, default=None, help="Override the number of query heads.")
@click.option("--n-head-kv", type=int, default=None, help="Override the number of KV heads.")
@click.option("--n-ff", type=int, default=None, help="Override the feed-forward size.")
@click.option("--n-vocab", type=int, default=None, help="Override the vocabulary size.")
@click.option("--ctx", "n_ctx_train", type=int, default=None, help="Override the training context length.")
@click.option("--key-length", type=int, default=None,
              help="Head size, written as attention.key_length (default: n_embd / n_head, or the preset's).")
@progress_option
def command(preset, layers, wtype, seed, out, progress, **overrides):
    """Write a synthetic GGUF model to --out (the preset's architecture: tiny-qwen3 is a qwen3 model)."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    geo = resolve_geometry(preset, layers=layers, wtype=wtype, **overrides)
    check_writable(out, "--out")  # its directory must exist: a mistyped path is not created
    path = write_model(out, preset, layers=layers, wtype=wtype, seed=seed, progress=progress_enabled(progress),
                      **overrides)
    click.echo(f"{path}  {_size(path.stat().st_size)}")
    click.echo(f"preset {preset} ({geo.arch}), wtype {wtype}, seed {seed}: n_layer {geo.n_layer}, n_embd {geo.n_embd}, "
               f"n_head {geo.n_head}, n_head_kv {geo.n_head_kv}, head_dim {geo.head_dim}, "
               f"n_ff {geo.n_ff}, n_vocab {geo.n_vocab}, n_ctx_train {geo.n_ctx_train}, "
               f"rope_freq_base {geo.rope_freq_base:g}")
