"""The machine a benchmark ran on: CPU, cores, memory, and its measured read bandwidth.

Read bandwidth is what bounds batch-1 decoding on a CPU, so the end-to-end bench measures it with
the same thread count as the decode: each thread sums its own contiguous slice of one buffer
(default 1 GiB of f32, written first so every page is resident) with four independent SIMD
accumulators, so the loop is bound by memory reads, not by add latency. The result is
bytes / wall time of the whole parallel pass, the best of a few passes (the least disturbed one on
a shared machine), plus their median. The loop is a few lines of C compiled with the system `cc`
(-O2 -march=native, GCC vector extensions); without a compiler, numpy sums the slices in threads
(numpy releases the GIL in reductions), which reads slower on some machines and says so.
"""
from __future__ import annotations

import ctypes
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from sparq_cpp.system import cpu_busy_seconds, mem_available, meminfo  # noqa: F401 (re-exported for the bench)

_BW_SRC = r"""
#include <pthread.h>
#include <stddef.h>
#include <time.h>
typedef float v16 __attribute__((vector_size(64)));
typedef struct { const float * p; size_t n; float s; } job_t;
static void * run(void * a) {
    job_t * j = (job_t *) a;
    const v16 * p = (const v16 *) j->p;
    size_t n = j->n / 16;
    v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
    size_t i = 0;
    for (; i + 4 <= n; i += 4) { s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3]; }
    for (; i < n; ++i) s0 += p[i];
    v16 s = s0 + s1 + s2 + s3;
    float t = 0; for (int k = 0; k < 16; ++k) t += s[k];
    j->s = t;
    return 0;
}
/* one parallel pass over buf (n floats, 64-byte aligned) with nth threads; returns seconds */
double bw_pass(const float * buf, size_t n, int nth, float * sum) {
    pthread_t t[256]; job_t j[256];
    if (nth > 256) nth = 256;
    size_t per = (n / nth) & ~(size_t) 63;
    struct timespec a, b; clock_gettime(CLOCK_MONOTONIC, &a);
    for (int k = 0; k < nth; ++k) { j[k].p = buf + k * per; j[k].n = per; pthread_create(&t[k], 0, run, &j[k]); }
    float s = 0;
    for (int k = 0; k < nth; ++k) { pthread_join(t[k], 0); s += j[k].s; }
    clock_gettime(CLOCK_MONOTONIC, &b);
    *sum = s;
    return (b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec);
}
"""


def _compile_loop():
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    try:
        d = Path(tempfile.mkdtemp(prefix="sparq-bw-"))
        src, so = d / "bw.c", d / "bw.so"
        src.write_text(_BW_SRC)
        r = subprocess.run([cc, "-O2", "-march=native", "-shared", "-fPIC", "-pthread", str(src), "-o", str(so)],
                           capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            return None
        lib = ctypes.CDLL(str(so))
        shutil.rmtree(d, ignore_errors=True)  # the library stays mapped
    except (OSError, subprocess.SubprocessError):
        return None
    f = lib.bw_pass
    f.restype = ctypes.c_double
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_float)]
    return f


def measure_bandwidth(n_threads: int, nbytes: int = 1 << 30, passes: int = 9) -> dict:
    """Read bandwidth in GB/s (1e9 bytes/s): {'best_gbs', 'median_gbs', 'passes_gbs', 'method', ...}."""
    n = nbytes // 4 // 64 * 64
    raw = np.empty(n + 16, np.float32)
    off = (-raw.ctypes.data % 64) // 4
    buf = raw[off:off + n]
    buf.fill(1.0)  # touch every page before timing
    per = (n // n_threads) // 64 * 64
    read = per * n_threads * 4
    f = _compile_loop()
    gbs = []
    if f is not None:
        method = f"C loop (cc -O2 -march=native, 4 SIMD accumulators), {n_threads} threads"
        s = ctypes.c_float()
        f(buf.ctypes.data, n, n_threads, ctypes.byref(s))  # warm-up pass
        for _ in range(passes):
            gbs.append(read / f(buf.ctypes.data, n, n_threads, ctypes.byref(s)) / 1e9)
    else:
        method = f"numpy float32 sum of per-thread slices, {n_threads} threads (no C compiler found)"
        slices = [buf[k * per:(k + 1) * per] for k in range(n_threads)]
        with ThreadPoolExecutor(n_threads) as ex:
            list(ex.map(np.sum, slices))
            for _ in range(passes):
                t0 = time.perf_counter()
                list(ex.map(np.sum, slices))
                gbs.append(read / (time.perf_counter() - t0) / 1e9)
    del buf, raw
    return {"best_gbs": max(gbs), "median_gbs": statistics.median(gbs), "passes_gbs": gbs,
            "method": method, "buffer_bytes": read, "threads": n_threads}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    mi = meminfo()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {"cpu_model": cpu_model(), "machine": platform.machine(), "cores_usable": cores,
            "cores_total": os.cpu_count(), "mem_total_bytes": mi.get("MemTotal"),
            "mem_available_bytes": mi.get("MemAvailable"), "loadavg_at_start": load,
            "platform": platform.platform(), "python": platform.python_version()}


_cpu_busy_seconds = cpu_busy_seconds


class CpuMonitor:
    """How much of the machine's CPU other processes used while we ran: on a shared machine this
    says whether a timing was disturbed. share = (machine busy time - our CPU time) / (wall * cores)."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.busy0 = _cpu_busy_seconds()
        t = os.times()
        self.own0 = t.user + t.system

    # the kernel counts CPU time in ticks of 10 ms (USER_HZ 100): a shorter window says nothing either way
    MIN_WALL_S = 0.1

    def foreign_share(self) -> float | None:
        """None where /proc/stat is missing or the window was shorter than MIN_WALL_S."""
        busy = _cpu_busy_seconds()
        wall = time.perf_counter() - self.t0
        if busy is None or self.busy0 is None or wall < self.MIN_WALL_S:
            return None
        t = os.times()
        own = t.user + t.system - self.own0
        cores = os.cpu_count() or 1
        return max(0.0, (busy - self.busy0 - own) / max(wall * cores, 1e-9))


def run_queue_wait_ns() -> int | None:
    """Nanoseconds the threads of this process have spent runnable but waiting for a CPU
    (/proc/self/task/*/schedstat, second field). Its increase over a timed step says whether
    another process took our cores during it: with OpenMP, one delayed thread stalls all of
    them at the next barrier, so a busy neighbour can slow a 2-thread decode several times."""
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    found = False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
                found = True
        except (OSError, IndexError, ValueError):
            continue
    return total if found else None


def wait_quiet(limit_s: float, window_s: float = 2.0, threshold: float = 0.05) -> float:
    """Wait until other processes use under `threshold` of the CPU over a `window_s` window, at
    most `limit_s` seconds; returns the seconds waited."""
    t0 = time.perf_counter()
    while True:
        mon = CpuMonitor()
        time.sleep(window_s)
        share = mon.foreign_share()
        if share is None or share < threshold or time.perf_counter() - t0 >= limit_s:
            return max(0.0, time.perf_counter() - t0 - window_s)
