"""Running the unmodified llama.cpp tools in tests."""
import os
import subprocess


def assert_refused(args, env, needle, tries=4):
    """The tool must exit non-zero every time, and print `needle` at least once.

    Upstream's common_log writes from a worker thread and is leaked at exit (common/log.cpp,
    llama.cpp#22142), so an error logged just before `return 1` is sometimes never printed: the
    refusal is checked on every run, the message on any of a few.
    """
    seen = []
    for _ in range(tries):
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace",
                              env=dict(os.environ, **env), timeout=120, stdin=subprocess.DEVNULL)
        assert proc.returncode != 0, f"tool accepted {env}: {proc.stderr[-1000:]}"
        if needle in proc.stderr:
            return proc
        seen.append(proc.stderr[-500:])
    raise AssertionError(f"{needle!r} never printed in {tries} runs; last stderr tail: {seen[-1]}")
