"""Build every prefix of the patch series: each patch must build on the ones before it.

A series that only builds whole cannot be bisected, reviewed patch by patch or sent upstream in parts. This check
makes the patched tree (`patchtree.init_tree`: upstream, then one commit per patch), checks out each commit in turn
and builds the same targets as `pyext.build` in one CMake build folder, so each step recompiles only what the patch
changed (ccache keeps repeated runs cheap). It stops at the first patch that does not build and names it.

    python -m sparq_cpp.pyext.seriescheck [--from N] [--keep-going]      # or: make check-series
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click

from sparq_cpp.errors import SparqError
from sparq_cpp.pyext.build import BuildOptions
from sparq_cpp.pyext.patchtree import checkout, init_tree, series, tree_commits
from sparq_cpp.pyext.upstream import REPO_ROOT, cache_root

CHECK_DIR = REPO_ROOT / ".sparq-build" / "series-check"
# whether it builds, not how fast it runs: unoptimized code compiles about twice as fast
CHECK_CMAKE_ARGS = ["-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_C_FLAGS_RELEASE=-O0", "-DCMAKE_CXX_FLAGS_RELEASE=-O0"]


def _errors(log_text: str, limit: int = 12) -> list[str]:
    """The compiler's and linker's error lines of a failed build, first ones first."""
    keys = ("error:", "error ", "undefined reference", "FAILED:", "CMake Error")
    lines = [ln for ln in log_text.splitlines() if any(k in ln for k in keys)]
    return lines[:limit]


def _build_env(root: Path) -> dict:
    env = dict(os.environ)
    env.setdefault("CCACHE_BASEDIR", str(root))
    env.setdefault("CCACHE_DIR", str(cache_root() / "ccache"))
    env.setdefault("CCACHE_NOHASHDIR", "1")
    return env


def check_series(root: Path = CHECK_DIR, start: int = 1, keep_going: bool = False, jobs: int | None = None,
                 log=None) -> dict:
    """Build the tree after each patch from the `start`-th on. Returns the report (also written to
    root/report.json); raises SparqError naming the first patch that does not build unless keep_going."""
    log = log or (lambda msg: print(msg, flush=True))
    opts = BuildOptions()
    tree = root / "src" / "vendor" / "llama.cpp"  # the layout of pyext.build's folders, so ccache hits carry over
    if tree.exists():
        shutil.rmtree(tree)
    tree.parent.mkdir(parents=True, exist_ok=True)
    init_tree(tree, log=lambda *a: None)
    commits = tree_commits(tree)
    names = [p.name for p in series()]
    if len(commits) != len(names):
        raise SparqError(f"the tree has {len(commits)} commits for {len(names)} patches")
    build_dir = root / "cmake-build"
    env = _build_env(root)
    jobs = jobs or os.cpu_count() or 2
    report = {"cpu": platform.processor() or platform.machine(), "jobs": jobs, "targets": opts.targets(),
              "cmake_args": opts.cmake_args(), "patches": []}
    failed = []
    t_all = time.time()
    for i, ((sha, subject), name) in enumerate(zip(commits, names), start=1):
        if i < start:
            continue
        checkout(tree, sha)
        t0 = time.time()
        log_path = root / f"build-{i:04d}.log"
        with open(log_path, "wb") as out:
            steps = []
            if not (build_dir / "CMakeCache.txt").exists():
                steps.append(["cmake", "-S", str(tree), "-B", str(build_dir), "-G", "Ninja",
                              *CHECK_CMAKE_ARGS, *opts.cmake_args()])
            # -k 0: every error of the patch, not the first one
            steps.append(["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *opts.targets(), "--", "-k", "0"])
            rc = 0
            for cmd in steps:
                rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode
                if rc != 0:
                    break
        seconds = round(time.time() - t0, 1)
        entry = {"n": i, "patch": name, "subject": subject, "built": rc == 0, "seconds": seconds}
        report["patches"].append(entry)
        log(f"[{i:2d}/{len(names)}] {'ok  ' if rc == 0 else 'FAIL'} {seconds:7.1f} s  {name}")
        if rc != 0:
            entry["errors"] = _errors(log_path.read_text(errors="replace"))
            entry["log"] = str(log_path)
            failed.append(entry)
            if not keep_going:
                break
        else:
            log_path.unlink()
    report["seconds"] = round(time.time() - t_all, 1)
    report["first_failure"] = failed[0]["patch"] if failed else None
    (root / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if failed:
        first = failed[0]
        raise SparqError(f"patch {first['n']} ({first['patch']}) does not build on the ones before it; "
                         f"log: {first['log']}\n" + "\n".join(first["errors"]))
    log(f"every prefix of the series builds ({len(report['patches'])} patches, {report['seconds']:.0f} s)")
    return report


@click.command()
@click.option("--from", "start", type=click.IntRange(min=1), default=1, show_default=True,
              help="Start at this patch (the ones before it are applied, not built).")
@click.option("--keep-going", is_flag=True, help="Build every prefix and list every one that fails.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, help="Parallel compile jobs (all CPUs).")
def main(start, keep_going, jobs):
    """Build the patched tree after every patch of the series; name the first that does not build."""
    try:
        check_series(start=start, keep_going=keep_going, jobs=jobs)
    except SparqError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
