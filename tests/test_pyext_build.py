"""The pinned, patched, cached build and the developers' patch workflow."""
from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext import build as pbuild
from sparq_cpp.pyext import patchtree
from sparq_cpp.pyext.upstream import PATCHES_DIR, Pin, fetch_sdist, unpack_sdist, verify_sdist

THROWAWAY_FILE = "README.md"
ENGINE_FILE = "src/llama-sparse-attn.h"


@pytest.fixture
def patches_copy(tmp_path):
    dst = tmp_path / "patches"
    shutil.copytree(PATCHES_DIR, dst)
    return dst


@pytest.fixture
def engine_copy(tmp_path):
    dst = tmp_path / "engine"
    shutil.copytree(patchtree.ENGINE_DIR, dst)
    return dst


def test_engine_mirrors_the_files_the_series_adds():
    """engine/ holds each file the series adds, as the whole series leaves it, listed in engine/FILES with the
    patch that adds it; the series itself carries them (a patch adds a file, a later one may extend it)."""
    files = patchtree.engine_files()
    assert {"ggml/src/ggml-cpu/sparse-attn.cpp", "ggml/src/ggml-cuda/sparse-attn.cu", "src/llama-kv-cache-sparse.cpp",
            "src/llama-graph-sparse.cpp", "src/llama-sparse-attn.cpp"} <= set(files)
    added = {}
    for p in patchtree.series():
        text = p.read_text(errors="replace")
        subject = email.message_from_string(text)["Subject"]
        subject = " ".join(subject.split("] ", 1)[1].split())  # unfolded, without "[PATCH n/m]"
        for m in re.finditer(r"^diff --git a/(\S+) b/\S+\nnew file mode", text, flags=re.M):
            added.setdefault(m.group(1), subject)
    assert added == files


def test_an_edited_engine_mirror_is_refused(tmp_path, engine_copy):
    """The build checks the patched tree against engine/: an edit made in engine/ instead of the tree is named."""
    tree = tmp_path / "llama.cpp"
    for path in patchtree.engine_files(engine_copy):
        (tree / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(engine_copy / path, tree / path)
    patchtree.check_engine(tree, engine_copy)
    (engine_copy / ENGINE_FILE).write_text((engine_copy / ENGINE_FILE).read_text() + "// edited here\n")
    with pytest.raises(SparqError, match=f"engine/{ENGINE_FILE} differs from the file the patch series makes"):
        patchtree.check_engine(tree, engine_copy)


def test_pin_names_the_sdist():
    pin = Pin.load()
    assert pin.package == "llama-cpp-python" and pin.version == "0.3.36"
    assert len(pin.sha256) == 64


def test_key_changes_with_one_patch_byte(patches_copy):
    opts = pbuild.BuildOptions()
    p = patches_copy / "9999-throwaway.patch"
    p.write_text("From 0 Mon Sep 17 00:00:00 2001\nSubject: x\n\n")
    with open(patches_copy / "series", "a") as f:
        f.write(p.name + "\n")
    k1 = pbuild.build_key(opts, patches_dir=patches_copy)
    assert k1 == pbuild.build_key(opts, patches_dir=patches_copy)  # stable
    p.write_bytes(p.read_bytes().replace(b"x", b"y"))
    assert pbuild.build_key(opts, patches_dir=patches_copy) != k1
    cuda = pbuild.BuildOptions(cuda_args=("-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"))
    assert pbuild.build_key(cuda, patches_dir=patches_copy) != pbuild.build_key(opts, patches_dir=patches_copy)


def test_series_lists_missing_patch(patches_copy):
    (patches_copy / "series").write_text("0001-missing.patch\n")
    with pytest.raises(SparqError, match="0001-missing.patch"):
        patchtree.series(patches_copy)


def test_corrupted_sdist_is_refused(tmp_path):
    pin = Pin.load()
    bad = tmp_path / pin.sdist
    bad.write_bytes(b"not the sdist")
    with pytest.raises(SparqError, match="hash mismatch"):
        verify_sdist(bad, pin)
    # and through the build command: one line, non-zero exit, no traceback
    (tmp_path / "cache" / "sdist").mkdir(parents=True)
    shutil.copy(bad, tmp_path / "cache" / "sdist" / pin.sdist)
    env = dict(os.environ, SPARQ_CPP_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-m", "sparq_cpp.pyext.build", "--no-install"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert "hash mismatch" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


@pytest.mark.build
def test_nothing_changed_means_no_rebuild():
    """With the inputs unchanged, `build` finds the cached build at once (the installed build's options: the
    default, or --portable)."""
    installed = pbuild.installed_build()
    opts = pbuild.BuildOptions(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in (installed or {}).get("options", {}).items()})
    if installed is None or installed["key"] != pbuild.build_key(opts):
        pytest.fail("the build for this checkout is not installed; run `make setup` first")
    t0 = time.time()
    b = pbuild.build(opts, log=lambda *_: pytest.fail("build() wanted to rebuild with unchanged inputs"))
    assert time.time() - t0 < 30
    assert b.wheel.exists()
    for name in pbuild.TOOLS:
        assert Path(b.tools[name]).is_file(), name
    proc = subprocess.run([sys.executable, "-m", "sparq_cpp.pyext.build", *(["--portable"] if opts.portable else [])],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "already installed" in proc.stdout


@pytest.mark.build
def test_tools_run():
    bench = pbuild.tool_path("llama-bench")
    proc = subprocess.run([str(bench), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage" in (proc.stdout + proc.stderr).lower()


def test_patch_workflow_round_trip(tmp_path, patches_copy, engine_copy):
    """init -> commit throwaway changes (an upstream file, an engine file, a new file) -> export -> a fresh tree
    and a plain unpack both carry them; the patch carries every change, engine/ mirrors the files."""
    quiet = dict(log=lambda *_: None)
    tree = tmp_path / "tree"
    patchtree.init_tree(tree, patches_copy, engine_dir=engine_copy, **quiet)
    assert (tree / ENGINE_FILE).read_bytes() == (engine_copy / ENGINE_FILE).read_bytes()
    n_before = len(patchtree.series(patches_copy))
    target = tree / THROWAWAY_FILE
    target.write_text(target.read_text() + "\nthrowaway line from the sparq-cpp test\n")
    (tree / ENGINE_FILE).write_text((tree / ENGINE_FILE).read_text() + "// throwaway engine line\n")
    (tree / "src" / "llama-throwaway.cpp").write_text("// a throwaway new file\n")
    subprocess.run(["git", *patchtree._GIT_ID, "add", "-A"], cwd=tree, check=True)
    subprocess.run(["git", *patchtree._GIT_ID, "commit", "-q", "-m", "test: throwaway patch"], cwd=tree, check=True)
    exported = patchtree.export_tree(tree, patches_copy, engine_dir=engine_copy, **quiet)
    assert len(exported) == n_before + 1
    assert exported[-1].name.endswith("test-throwaway-patch.patch")
    text = exported[-1].read_text()
    assert "throwaway line" in text and "throwaway engine line" in text and "llama-throwaway" in text
    assert "throwaway engine line" in (engine_copy / ENGINE_FILE).read_text()
    assert patchtree.engine_files(engine_copy)["src/llama-throwaway.cpp"] == "test: throwaway patch"
    assert patchtree.series(patches_copy) == exported
    # exporting the same commits again changes nothing, byte for byte
    before = {p.name: p.read_bytes() for p in exported}
    patchtree.export_tree(tree, patches_copy, engine_dir=engine_copy, **quiet)
    assert {p.name: p.read_bytes() for p in patchtree.series(patches_copy)} == before

    tree2 = tmp_path / "tree2"
    patchtree.init_tree(tree2, patches_copy, engine_dir=engine_copy, **quiet)
    assert "throwaway line" in (tree2 / THROWAWAY_FILE).read_text()
    assert "throwaway engine line" in (tree2 / ENGINE_FILE).read_text()
    log = subprocess.run(["git", "log", "--format=%s", "--", "src/llama-throwaway.cpp"], cwd=tree2, capture_output=True,
                         text=True, check=True).stdout.split("\n")
    assert log[0] == "test: throwaway patch"  # a new file comes in with the patch that introduces it

    top = unpack_sdist(fetch_sdist(**quiet), tmp_path / "plain")
    patchtree.patch_tree(top / "vendor" / "llama.cpp", patches_copy, engine_copy)
    assert "throwaway line" in (top / "vendor" / "llama.cpp" / THROWAWAY_FILE).read_text()
    assert (top / "vendor" / "llama.cpp" / "src" / "llama-throwaway.cpp").is_file()
    # applying again fails, naming the patch that does not apply
    with pytest.raises(SparqError, match="throwaway"):
        patchtree.apply_series(top / "vendor" / "llama.cpp", exported[-1:])

    # the series for upstream: every commit, its new files included
    up = patchtree.export_upstream(tmp_path / "upstream", tree, **quiet)
    assert len(up) == len(exported)
    assert any("new file mode" in p.read_text(errors="replace") and "sparse-attn.cpp" in p.read_text(errors="replace")
               for p in up)


def test_export_refuses_dirty_tree(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    subprocess.run(["git", "init", "-q"], cwd=tree, check=True)
    (tree / "a").write_text("1")
    subprocess.run(["git", *patchtree._GIT_ID, "add", "a"], cwd=tree, check=True)
    subprocess.run(["git", *patchtree._GIT_ID, "commit", "-qm", "u"], cwd=tree, check=True)
    (tree / "a").write_text("2")
    with pytest.raises(SparqError, match="uncommitted"):
        patchtree.export_tree(tree, tmp_path)


def test_export_upstream_without_a_tree_says_how_to_make_one(tmp_path):
    from sparq_cpp.pyext.patchtree import export_upstream

    with pytest.raises(SparqError, match="is not a patched tree: make one with `make tree`"):
        export_upstream(tmp_path / "out", tmp_path / "no-tree")
