"""`sparq-cpp dequantize`: an f32 copy of a GGUF model."""
from __future__ import annotations

import click
from tqdm import tqdm

from sparq_cpp.cli.options import progress_enabled, progress_option
from sparq_cpp.dequantize import dequantize_gguf
from sparq_cpp.gguf_check import check_gguf


@click.command("dequantize")
@click.argument("gguf_path", metavar="MODEL.gguf")
@click.option("--out", "-o", required=True, metavar="PATH", help="The f32 GGUF to write.")
@progress_option
def command(gguf_path, out, progress):
    """Write an f32 copy of a GGUF model (every tensor dequantized, metadata kept), e.g. to check
    llama.cpp's sparse attention against the reference without weight-quantization rounding.
    The copy is a different file: Loki projections must be calibrated for it."""
    bar, show = None, progress_enabled(progress)

    def step(i, n):  # the bar starts with the first tensor, after the checks
        nonlocal bar
        if not show:
            return
        bar = bar or tqdm(total=n, desc="tensors", unit="tensor", leave=False)
        bar.update(1)

    try:
        path = dequantize_gguf(gguf_path, out, step)
    finally:
        if bar:
            bar.close()
    s = check_gguf(path)
    click.echo(f"{path}  {path.stat().st_size / 1024**2:.1f} MiB  ({s.name}: all tensors f32)")
