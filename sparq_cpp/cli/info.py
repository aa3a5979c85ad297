"""`sparq-cpp info`: which patched llama.cpp build is in use, and what it can run on."""
from __future__ import annotations

from pathlib import Path

import click

from sparq_cpp import lazy
from sparq_cpp.bindings.cpu_backend import backend_names, cpu_library, variants
from sparq_cpp.errors import SparqError
from sparq_cpp.pyext.build import installed_build
from sparq_cpp.pyext.patchtree import series, series_hash
from sparq_cpp.pyext.upstream import Pin


@click.command("info")
def command():
    """Print the pin, the patch series, the backends and CPU features of the build in use."""
    pin = Pin.load()
    click.echo(f"upstream      {pin.package} {pin.version} (sdist sha256 {pin.sha256[:16]}...)")
    click.echo(f"patch series  {len(series())} patches, sha256 {series_hash()[:16]} (this checkout)")
    rec = installed_build()
    if rec is None:
        raise SparqError("no patched llama.cpp build is installed in this environment; run `make setup`")
    stale = "" if rec["series_hash"] == series_hash() else "  ** differs from this checkout: run `make setup` **"
    click.echo(f"build in use  {rec['key']}: series sha256 {rec['series_hash'][:16]}{stale}")
    click.echo(f"build options {rec['options']}")
    llama_cpp = lazy.llama_cpp()
    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    click.echo(f"library       {lib_dir}")
    click.echo(f"backends      {', '.join(backend_names())}")
    try:
        cpu_lib, variant = cpu_library(lib_dir)
    except FileNotFoundError as e:
        raise SparqError(str(e)) from None
    if variant is None:
        built_for = "this CPU (-march=native)" if rec["options"].get("native") else "ggml's baseline"
        click.echo(f"cpu backend   {cpu_lib.name} (one variant, built for {built_for})")
    else:
        scores = variants(lib_dir)
        click.echo(f"cpu backend   {variant} ({cpu_lib.name}; chosen at run time from {len(scores)} variants, "
                   f"{sum(s > 0 for s in scores.values())} of which run on this CPU)")
    click.echo(f"cpu features  {llama_cpp.llama_print_system_info().decode().strip()}")
    click.echo(f"tools         {Path(rec['tools']['llama-bench']).parent}")
