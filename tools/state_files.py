"""What saving and restoring a slot costs, and the share of it the state file's checksum takes.

A context of the model in the given mode is filled to --depth tokens, then sequence 0 is saved to a state file
(llama_state_seq_save_file: a temporary file flushed to the device and renamed over the path, with the checksum
trailer) and restored from it (llama_state_seq_load_file: the state read, its size and checksum checked), in
turns, --repeats times each. Beside the medians, tools/micro/state_checksum.c times the checksum alone over as
many bytes (the same code as the patch, built -O3 as libllama's Release build is): the part of a save or a
restore that the check adds.

    python -m tools.state_files -m smollm2-135m --depth 8000 --attn sparq:r=16,k=128 --json F
"""
from __future__ import annotations

import ctypes
import datetime as _dt
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from sparq_cpp import lazy
from sparq_cpp.attention import parse_attention
from sparq_cpp.bench import machine
from sparq_cpp.cli.options import resolve_model
from sparq_cpp.llm import open_model
from sparq_cpp.outfile import atomic_write

CHECKSUM_SRC = Path(__file__).with_name("micro") / "state_checksum.c"
_LINE = re.compile(r"([0-9.]+) ms, ([0-9.]+) GB/s")


def checksum_ms(n_bytes: int, workdir: Path) -> tuple[float, float]:
    """(ms, GB/s) of the state file checksum over n_bytes, alone (best of 7)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise click.ClickException("no C compiler (cc or gcc) to build state_checksum.c")
    exe = workdir / "state_checksum"
    r = subprocess.run([cc, "-O3", str(CHECKSUM_SRC), "-o", str(exe)], capture_output=True, text=True)
    if r.returncode != 0:
        raise click.ClickException(f"state_checksum.c did not build:\n{r.stderr.strip()}")
    out = subprocess.run([str(exe), str(n_bytes), "7"], capture_output=True, text=True, check=True).stdout
    m = _LINE.search(out)
    return float(m.group(1)), float(m.group(2))


@click.command()
@click.option("-m", "--model", default="smollm2-135m", show_default=True)
@click.option("--depth", type=int, default=8000, show_default=True, help="Tokens in the saved sequence.")
@click.option("--attn", "attn", default="sparq:r=16,k=128", show_default=True, help="The context's attention.")
@click.option("--threads", "-t", type=int, default=2, show_default=True)
@click.option("--repeats", type=int, default=5, show_default=True)
@click.option("--dir", "workdir", default=None, help="Folder of the state file (default: a temporary folder).")
@click.option("--json", "json_out", default=None, metavar="FILE")
def main(model, depth, attn, threads, repeats, workdir, json_out):
    """Save and restore a slot of --depth tokens; the checksum's share of each."""
    model = str(resolve_model(model))
    llm, _ = open_model(model, attention=parse_attention(attn), n_ctx=-(-(depth + 16) // 256) * 256,
                        n_threads=threads)
    words = "the quiet house stood by the river and the people came and went all day".split()
    text = " ".join(words[i % len(words)] for i in range(depth * 2))
    tokens = llm.tokenize(text.encode())[:depth]
    click.echo(f"filling {len(tokens)} tokens ({attn}) ...", err=True)
    llm.eval(tokens)
    C = lazy.llama_cpp()
    arr = (ctypes.c_int32 * len(tokens))(*tokens)
    out_tokens, n_out = (ctypes.c_int32 * (len(tokens) + 1))(), ctypes.c_size_t(0)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = Path(tmp) / "slot.bin"
        saves, loads = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            n = C.llama_state_seq_save_file(llm.ctx, str(path).encode(), 0, arr, len(tokens))
            saves.append(1e3 * (time.perf_counter() - t0))
            if not n:
                raise click.ClickException("the save failed (see the log)")
            t0 = time.perf_counter()
            ok = C.llama_state_seq_load_file(llm.ctx, str(path).encode(), 0, out_tokens, len(out_tokens),
                                             ctypes.byref(n_out))
            loads.append(1e3 * (time.perf_counter() - t0))
            if not ok:
                raise click.ClickException("the restore failed (see the log)")
        size = path.stat().st_size
        ck_ms, ck_gbs = checksum_ms(size, Path(tmp))
    save, load = statistics.median(saves), statistics.median(loads)
    row = {"attention": attn, "depth": len(tokens), "bytes": size, "save_ms": saves, "load_ms": loads,
           "save_median_ms": save, "load_median_ms": load, "checksum_ms": ck_ms, "checksum_gb_s": ck_gbs,
           "checksum_share_of_save": ck_ms / save, "checksum_share_of_load": ck_ms / load}
    click.echo(f"{size / 2**20:.1f} MiB slot: save {save:.1f} ms, restore {load:.1f} ms (medians of {repeats}); "
               f"the checksum alone {ck_ms:.1f} ms ({ck_gbs:.1f} GB/s): {100 * ck_ms / save:.0f}% of a save, "
               f"{100 * ck_ms / load:.0f}% of a restore")
    if json_out:
        doc = {"command": " ".join(["python -m tools.state_files", *sys.argv[1:]]),
               "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "machine": machine.machine_info(), "cpu_model": machine.cpu_model(), "model": model,
               "threads": threads, "rows": [row]}
        atomic_write(json_out, lambda t: t.write_text(json.dumps(doc, indent=1)))
        click.echo(f"wrote {json_out}", err=True)


if __name__ == "__main__":
    main()
