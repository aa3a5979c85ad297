"""The engine's sources, the patch series and the developers' patched tree.

`patches/series` lists the patch files (made by `git format-patch`) in order, each one concern that builds on the
ones before it (`make check-series`): a patch adds a new file in the form it needs and a later one extends it, as
upstream would take them. A patched llama.cpp is `vendor/llama.cpp` of the pinned sdist with the series applied
(`patch_tree`). `engine/` mirrors the files the series adds (kernels, the sparse attention code of libllama), at
their paths in the llama.cpp tree and as the whole series leaves them, so that they can be read, searched and
tested here; `engine/FILES` names the patch that introduces each. A patched tree whose added files differ from
engine/ is an error. Developers edit neither by hand:

    python -m sparq_cpp.pyext.patchtree init  [DIR]   # git tree: upstream commit + one commit per patch
    ... edit, build, `git commit` (one concern per commit) in DIR ...
    python -m sparq_cpp.pyext.patchtree export [DIR]  # rewrite patches/ and engine/ from DIR's commits
    python -m sparq_cpp.pyext.patchtree export-upstream OUT [DIR]  # the series as mail for upstream
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

ENGINE_DIR = REPO_ROOT / "engine"
DEFAULT_TREE = REPO_ROOT / ".sparq-build" / "tree"
UPSTREAM_TAG = "upstream"
_GIT_ID = ["-c", "user.name=sparq-cpp", "-c", "user.email=sparq-cpp@users.noreply.github.com"]
_FILES_HEADER = (
    "# The files the patch series adds to llama.cpp, at their paths in its tree, and the patch (subject) that\n"
    "# introduces each. Written by `python -m sparq_cpp.pyext.patchtree export`; edit the files, not this list.\n"
)
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


def engine_files(engine_dir: Path = ENGINE_DIR) -> dict[str, str]:
    """engine/FILES: each file the series adds (its path in the llama.cpp tree) -> the subject of the patch
    that introduces it. A listed file that is missing is an error."""
    out = {}
    manifest = engine_dir / "FILES"
    if not manifest.is_file():
        return out
    for line in manifest.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        path, sep, subject = line.partition("\t")
        if not sep or not subject.strip():
            raise SparqError(f"engine/FILES: expected 'PATH<TAB>patch subject', got {line!r}")
        if not (engine_dir / path).is_file():
            raise SparqError(f"engine/FILES lists {path}, which does not exist in {engine_dir}")
        out[path] = subject.strip()
    return out


def series_hash(patches_dir: Path = PATCHES_DIR, engine_dir: Path = ENGINE_DIR) -> str:
    """Hash of the series, the bindings' series and the engine's files: names, order and every byte."""
    h = hashlib.sha256()
    for p in series(patches_dir) + bindings_series(patches_dir):
        h.update(p.parent.name.encode() + b"/" + p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    for path in sorted(engine_files(engine_dir)):
        h.update(b"engine/" + path.encode() + b"\0" + (engine_dir / path).read_bytes() + b"\0")
    return h.hexdigest()


def check_engine(llama_dir: Path, engine_dir: Path = ENGINE_DIR) -> None:
    """The engine/ mirror and the files the series added to a patched tree are the same, byte for byte."""
    for path in engine_files(engine_dir):
        got = Path(llama_dir) / path
        if not got.is_file() or got.read_bytes() != (engine_dir / path).read_bytes():
            raise SparqError(f"engine/{path} differs from the file the patch series makes: edit it in the patched "
                             "tree (`make tree`), commit, and `make export`")


def patch_tree(llama_dir: Path, patches_dir: Path = PATCHES_DIR, engine_dir: Path = ENGINE_DIR) -> None:
    """A plain llama.cpp tree patched: the series applied, checked against the engine/ mirror."""
    apply_series(llama_dir, series(patches_dir))
    check_engine(llama_dir, engine_dir)


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


def init_tree(tree: Path = DEFAULT_TREE, patches_dir: Path = PATCHES_DIR, log=print,
              engine_dir: Path = ENGINE_DIR) -> Path:
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
    check_engine(tree, engine_dir)
    files = engine_files(engine_dir)
    log(f"patched tree ready: {tree} ({len(series(patches_dir))} patches on tag '{UPSTREAM_TAG}', "
        f"{len(files)} engine files)")
    return tree


def tree_commits(tree: Path) -> list[tuple[str, str]]:
    """(hash, subject) of the tree's commits after the upstream tag, oldest first."""
    out = _git(["log", "--reverse", "--format=%H%x09%s", f"{UPSTREAM_TAG}..HEAD"], tree).stdout
    return [tuple(line.split("\t", 1)) for line in out.splitlines() if line.strip()]


def checkout(tree: Path, commit: str) -> None:
    _git(["checkout", "-q", "--detach", commit], tree)


def _new_files(tree: Path) -> dict[str, str]:
    """The files the tree's commits add to upstream -> the subject of the commit that adds each."""
    out = {}
    log = _git(["log", "--reverse", "--diff-filter=A", "--name-only", "--format=%x00%s", f"{UPSTREAM_TAG}..HEAD"], tree).stdout
    for chunk in log.split("\0")[1:]:
        lines = [ln for ln in chunk.splitlines() if ln.strip()]
        for path in lines[1:]:
            out.setdefault(path, lines[0])
    # a file added, then deleted again is not new
    return {p: s for p, s in out.items() if (tree / p).is_file()}


def export_tree(tree: Path = DEFAULT_TREE, patches_dir: Path = PATCHES_DIR, log=print,
                engine_dir: Path = ENGINE_DIR) -> list[Path]:
    """Rewrite patches/*.patch and patches/series from the tree's commits after the upstream tag, and the
    engine/ mirror with the files they add (as they are at HEAD) and engine/FILES."""
    if not (tree / ".git").exists():
        raise SparqError(f"{tree} is not a patched tree (make one with `init`)")
    if _git(["status", "--porcelain", "--untracked-files=no"], tree).stdout.strip():
        raise SparqError(f"{tree} has uncommitted changes; commit them (one concern per commit) first")
    new = _new_files(tree)
    with tempfile.TemporaryDirectory() as tmp:
        # --zero-commit and --full-index keep the files stable across re-exports of the same commits.
        _git(["format-patch", "-q", "--zero-commit", "--full-index", "--no-signature",
              "-o", tmp, f"{UPSTREAM_TAG}..HEAD"], tree)
        made = sorted(Path(tmp).glob("*.patch"))
        for old in patches_dir.glob("*.patch"):
            old.unlink()
        for p in made:
            shutil.copyfile(p, patches_dir / p.name)
    names = [p.name for p in made]
    tmp_series = patches_dir / "series.tmp"
    tmp_series.write_text(_SERIES_HEADER + "".join(n + "\n" for n in names))
    os.replace(tmp_series, patches_dir / "series")
    # engine/: the new files as they are at HEAD, nothing else
    for path in engine_files(engine_dir) if (engine_dir / "FILES").is_file() else {}:
        if path not in new:
            (engine_dir / path).unlink()
    for path in sorted(new):
        dst = engine_dir / path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(tree / path, dst)
    (engine_dir / "FILES").write_text(_FILES_HEADER + "".join(f"{p}\t{s}\n" for p, s in sorted(new.items())))
    log(f"exported {len(names)} patches to {patches_dir} and {len(new)} files to {engine_dir}")
    return [patches_dir / n for n in names]


def _check_tree(tree: Path) -> None:
    if not (tree / ".git").exists():
        raise SparqError(f"{tree} is not a patched tree: make one with `make tree` "
                         "(python -m sparq_cpp.pyext.patchtree init [DIR])")


def export_upstream(out: Path, tree: Path = DEFAULT_TREE, log=print) -> list[Path]:
    """The series as upstream would take it: one patch per commit, the new files included."""
    _check_tree(tree)
    if out.exists() and any(out.iterdir()):
        raise SparqError(f"{out} is not empty")
    out.mkdir(parents=True, exist_ok=True)
    _git(["format-patch", "-q", "--zero-commit", "--full-index", "--no-signature", "-o", str(out.resolve()),
          f"{UPSTREAM_TAG}..HEAD"], tree)
    made = sorted(out.glob("*.patch"))
    log(f"exported {len(made)} patches (new files included) to {out}")
    return made


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
    """Regenerate patches/ and engine/ from the tree's commits."""
    export_tree(tree)


@main.command("export-upstream")
@click.argument("out", type=click.Path(path_type=Path))
@click.argument("tree", type=click.Path(path_type=Path), default=DEFAULT_TREE)
def _export_upstream(out, tree):
    """Write the series for upstream (new files included) into OUT, from the tree's commits."""
    export_upstream(out, tree)


if __name__ == "__main__":
    try:
        main()
    except SparqError as e:
        raise SystemExit(f"error: {e}")
