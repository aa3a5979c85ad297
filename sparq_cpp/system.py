"""What this machine has: memory available to this process (for estimates made before allocating)."""
from __future__ import annotations

import os
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
