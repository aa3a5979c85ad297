"""`sparq-cpp convert`: a Hugging Face Llama/Mistral checkpoint directory -> GGUF (f32, f16, q8_0)."""
from __future__ import annotations

import click

from sparq_cpp.convert import OUTTYPES, convert
from sparq_cpp.gguf_check import check_gguf


@click.command("convert")
@click.argument("model_dir", metavar="MODEL_DIR")
@click.option("--outtype", default="f16", show_default=True,
              help=f"Type of the matrix weights: {', '.join(OUTTYPES)} (norms stay f32).")
@click.option("--out", "-o", default=None, metavar="PATH",
              help="GGUF file to write (default: MODEL_DIR/<dir name>-<outtype>.gguf).")
def command(model_dir, outtype, out):
    """Convert a Hugging Face Llama-family checkpoint (config.json, *.safetensors, tokenizer.model)
    to a GGUF that llama.cpp loads."""
    path = convert(model_dir, out, outtype)
    s = check_gguf(path)
    click.echo(f"{path}  {path.stat().st_size / 1024**2:.1f} MiB")
    click.echo(f"{s.name}: {outtype}, n_layer {s.n_layer}, n_embd {s.n_embd}, n_head {s.n_head}, "
               f"n_head_kv {s.n_head_kv}, head_dim {s.head_dim}, n_vocab {s.n_vocab}, n_ctx_train {s.n_ctx_train}")
