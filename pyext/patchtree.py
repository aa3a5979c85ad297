"""The patch series and the developers' patched tree.

`patches/series` lists the patch files (made by `git format-patch`) in order. They apply to
`vendor/llama.cpp` of the pinned sdist. Developers never edit the .patch files:

    python -m sparq_cpp.pyext.patchtree init  [DIR]   # git tree: upstream commit + one commit per patch
    ... edit, build, `git commit` (one concern per commit) in DIR ...
    python -m sparq_cpp.pyext.patchtree export [DIR]  # rewrite patches/ from DIR's commits
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import click

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext.upstream import PATCHES_DIR, REPO_ROOT, fetch_sdist, unpack_sdist

DEFAULT_TREE = REPO_ROOT / ".sparq-build" / "tree"
UPSTREAM_TAG = "upstream"
_GIT_ID = ["-c", "user.name=sparq-cpp", "-c", "user.email=sparq-cpp@users.noreply.github.com"]
_SERIES_HEADER = (
    "# Patches against vendor/llama.cpp of the pinned sdist, applied in this order (git format-patch files).\n"
    "# Regenerate with `python -m sparq_cpp.pyext.patchtree export`; never edit the .patch files by hand.\n"
)


def series(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    """The patch files in application order; a listed file that is missing is an error."""
    listed = []
    for line in (patches_dir / "series").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            path = patches_dir / line
            if not path.is_file():
                raise SparqError(f"patches/series lists {line}, which does not exist")
            listed.append(path)
    return listed


def bindings_series(patches_dir: Path = PATCHES_DIR) -> list[Path]:
    """The patches of llama-cpp-python's own Python files (patches/bindings), applied at the sdist's root."""
    return series(patches_dir / "bindings") if (patches_dir / "bindings" / "series").is_file() else []


def series_hash(patches_dir: Path = PATCHES_DIR) -> str:
    """Hash of the series and the bindings' series: names, order and every byte of every patch."""
    h = hashlib.sha256()
    for p in series(patches_dir) + bindings_series(patches_dir):
        h.update(p.parent.name.encode() + b"/" + p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def _git(args: list[str], cwd: Path, check=True) -> subprocess.CompletedProcess:
    proc = subprocess.run(["git", *_GIT_ID, *args], cwd=cwd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise SparqError(f"git {args[0]} failed in {cwd}: {(proc.stderr or proc.stdout).strip()}")
    return proc


def apply_series(llama_dir: Path, patches: list[Path]) -> None:
    """Apply each patch to a plain (non-git) tree; a hunk that does not apply stops with the patch's name."""
    # Stop git from finding an enclosing repository: inside one, `git apply` skips paths silently.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(Path(llama_dir).resolve().parent))
    for p in patches:
        proc = subprocess.run(["git", "apply", "--check", "-p1", str(p)], cwd=llama_dir,
                              capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["?"])[0]
            raise SparqError(f"patch {p.name} does not apply to the pinned upstream: {first}")
        subprocess.run(["git", "apply", "-p1", str(p)], cwd=llama_dir, check=True, env=env)


def init_tree(tree: Path = DEFAULT_TREE, patches_dir: Path = PATCHES_DIR, log=print) -> Path:
    """A git repo of the pinned llama.cpp: one upstream commit (tagged), then one commit per patch."""
    if tree.exists():
        raise SparqError(f"{tree} exists already; remove it first (its commits are not in patches/ until exported)")
    with tempfile.TemporaryDirectory(dir=tree.parent if tree.parent.exists() else None) as tmp:
        top = unpack_sdist(fetch_sdist(log=log), Path(tmp) / "sdist")
        tree.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(top / "vendor" / "llama.cpp"), tree)
    _git(["init", "-q", "-b", "main"], tree)
    _git(["add", "-A", "-f"], tree)
    _git(["commit", "-q", "-m", "upstream: llama.cpp vendored in the pinned llama-cpp-python sdist"], tree)
    _git(["tag", UPSTREAM_TAG], tree)
    for p in series(patches_dir):
        proc = _git(["am", "-q", "--committer-date-is-author-date", str(p)], tree, check=False)
        if proc.returncode != 0:
            _git(["am", "--abort"], tree, check=False)
            raise SparqError(f"patch {p.name} does not apply in {tree}: {proc.stderr.strip()[:300]}")
    log(f"patched tree ready: {tree} ({len(series(patches_dir))} patches on tag '{UPSTREAM_TAG}')")
    return tree


def export_tree(tree: Path = DEFAULT_TREE, patches_dir: Path = PATCHES_DIR, log=print) -> list[Path]:
    """Rewrite patches/*.patch and patches/series from the tree's commits after the upstream tag."""
    if not (tree / ".git").exists():
        raise SparqError(f"{tree} is not a patched tree (make one with `init`)")
    if _git(["status", "--porcelain", "--untracked-files=no"], tree).stdout.strip():
        raise SparqError(f"{tree} has uncommitted changes; commit them (one concern per commit) first")
    with tempfile.TemporaryDirectory() as tmp:
        # --zero-commit and --full-index keep the files stable across re-exports of the same commits.
        _git(["format-patch", "-q", "--zero-commit", "--full-index", "--no-signature",
              "-o", tmp, f"{UPSTREAM_TAG}..HEAD"], tree)
        new = sorted(Path(tmp).glob("*.patch"))
        for old in patches_dir.glob("*.patch"):
            old.unlink()
        for p in new:
            shutil.copyfile(p, patches_dir / p.name)
    names = [p.name for p in new]
    tmp_series = patches_dir / "series.tmp"
    tmp_series.write_text(_SERIES_HEADER + "".join(n + "\n" for n in names))
    os.replace(tmp_series, patches_dir / "series")
    log(f"exported {len(names)} patches to {patches_dir}")
    return [patches_dir / n for n in names]


@click.group()
def main():
    """Keep the patched llama.cpp tree and patches/ in step."""


@main.command("init")
@click.argument("tree", type=click.Path(path_type=Path), default=DEFAULT_TREE)
def _init(tree):
    """Make an editable patched tree (upstream commit + one commit per patch)."""
    init_tree(tree)


@main.command("export")
@click.argument("tree", type=click.Path(path_type=Path), default=DEFAULT_TREE)
def _export(tree):
    """Regenerate patches/ from the tree's commits."""
    export_tree(tree)


if __name__ == "__main__":
    try:
        main()
    except SparqError as e:
        raise SystemExit(f"error: {e}")
