"""What this machine has: memory available to this process (for estimates made before allocating)."""
from __future__ import annotations

import os
import time
from pathlib import Path


def meminfo() -> dict:
    """/proc/meminfo in bytes (MemTotal, MemAvailable, ...); {} where there is none."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    except OSError:
        pass
    return out


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still allocate, where it has a limit."""
    try:
        rel = Path("/proc/self/cgroup").read_text().strip().splitlines()[0].split(":", 2)[2]
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text().strip()))
    except (OSError, IndexError, ValueError):
        return None


def mem_available() -> int:
    """Bytes that can be allocated without swapping: MemAvailable, or the cgroup's room if smaller."""
    info = meminfo()
    if "MemAvailable" in info:
        avail = info["MemAvailable"]
    else:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            avail = 0
    room = _cgroup_room()
    return min(avail, room) if room is not None and avail else (room or avail)


def cpu_busy_seconds() -> float | None:
    """Busy CPU time of the whole machine so far (all cores), from /proc/stat; None where there is none."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    vals = [int(x) for x in fields]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)  # idle + iowait
    busy = sum(vals[:8]) - idle  # user nice system idle iowait irq softirq steal (guest is inside user)
    return busy / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """CPU time a process (all its threads) has used so far, from /proc; None where there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


class LoadWatch:
    """Notices other processes starting to hold the CPU while a llama.cpp process (pid) runs with threads that
    spin while they wait (choose_thread_wait decided at its start, when the machine was quiet): the share of the
    machine's CPU used by everything but that process, per window of `seconds`; busy() is true once two windows
    in a row reach BUSY_SHARE."""

    def __init__(self, pid: int, seconds: float = 10.0):
        self.pid, self.seconds, self.streak = pid, seconds, 0
        self.last = (time.monotonic(), cpu_busy_seconds(), process_cpu_seconds(pid))
        self.share: float | None = None

    def busy(self) -> bool:
        now = time.monotonic()
        if now - self.last[0] < self.seconds:
            return False
        cur = (now, cpu_busy_seconds(), process_cpu_seconds(self.pid))
        if None in cur or None in self.last:
            return False
        others = (cur[1] - self.last[1]) - (cur[2] - self.last[2])
        self.share = max(0.0, others / ((cur[0] - self.last[0]) * (os.cpu_count() or 1)))
        self.last = cur
        self.streak = self.streak + 1 if self.share >= BUSY_SHARE else 0
        return self.streak >= 2


def foreign_cpu_share(seconds: float = 0.2) -> float | None:
    """The share of the machine's CPU that other processes use now: busy time over `seconds` of sleep here,
    over all cores."""
    before = cpu_busy_seconds()
    t0 = time.perf_counter()
    time.sleep(seconds)
    after = cpu_busy_seconds()
    if before is None or after is None:
        return None
    return max(0.0, (after - before) / ((time.perf_counter() - t0) * (os.cpu_count() or 1)))


# Measured (docs/benchmarks.md, "Threads on a busy machine"): with one busy process per core, llama.cpp's OpenMP
# threads that spin at barriers (GNU OpenMP's default, or active) decode 100-500x slower, sporadically; sleeping
# (passive) holds at 2x the quiet speed but costs 3-4x when the machine is quiet. So passive only when busy.
BUSY_SHARE = 0.3
THREAD_WAIT_NOTE: str | None = None  # what choose_thread_wait decided, for the CLI to print


def choose_thread_wait(env=None, share=None) -> str | None:
    """Before llama.cpp's OpenMP runtime loads: OMP_WAIT_POLICY=passive when other processes hold the CPU now (and
    neither it nor GOMP_SPINCOUNT is set). Returns a line saying so, or None (quiet, or the user chose)."""
    global THREAD_WAIT_NOTE
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return None
    share = foreign_cpu_share() if share is None else share
    if share is None or share < BUSY_SHARE:
        return None
    env["OMP_WAIT_POLICY"] = "passive"
    THREAD_WAIT_NOTE = (f"other processes use {share:.0%} of the CPU: llama.cpp's threads sleep while they wait for "
                        "each other (OMP_WAIT_POLICY=passive; set OMP_WAIT_POLICY=active to spin)")
    return THREAD_WAIT_NOTE
