"""How many threads llama.cpp runs by default: one per physical core this process may use.

``os.cpu_count()`` counts every logical CPU of the machine. On a cloud VM with two
hyperthreads per core, a thread per hyperthread decodes slower than a thread per core
(decoding is memory-bound, and llama.cpp's threads wait for each other at every step; its
own default, ``cpu_get_num_math``, counts cores too), and in a container held to some CPUs
(affinity) or to a CPU quota it would start threads that cannot all run at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["default_threads"]


def default_threads(
    root: Path = Path("/"), *, cpus: Iterable[int] | None = None, cgroup: str | None = None
) -> int:
    """Physical cores among the CPUs this process may run on, at most its CPU quota.

    ``root``, ``cpus`` (the affinity set) and ``cgroup`` (this process's cgroup path) are
    read from the system when not given; tests pass a made-up tree.
    """
    allowed = sorted(cpus if cpus is not None else _affinity())
    cores: set[str] = set()
    for cpu in allowed:
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        siblings = _read(topology / "core_cpus_list") or _read(topology / "thread_siblings_list")
        # The hyperthreads of one core share this list; unknown: the CPU counts alone.
        cores.add(siblings or f"cpu{cpu}")
    threads = max(1, len(cores))
    quota = _quota(root, _cgroup() if cgroup is None else cgroup)
    return threads if quota is None else max(1, min(threads, int(quota)))


def _affinity() -> Iterable[int]:
    if hasattr(os, "sched_getaffinity"):
        return os.sched_getaffinity(0)
    return range(os.cpu_count() or 1)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _cgroup() -> str:
    """This process's cgroup v2 path ("/" when unknown or inside a cgroup namespace)."""
    text = _read(Path("/proc/self/cgroup")) or ""
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:] or "/"
    return "/"


def _quota(root: Path, cgroup: str) -> float | None:
    """CPUs' worth of time the cgroup may use (``cpu.max``, v1's CFS files), None: no limit."""
    base = root / "sys/fs/cgroup"
    v2 = _read(base / cgroup.lstrip("/") / "cpu.max") or _read(base / "cpu.max")
    if v2 is not None:
        parts = v2.split()
        if len(parts) == 2 and parts[0] != "max":
            return _ratio(parts[0], parts[1])
        return None
    quota, period = _read(base / "cpu/cpu.cfs_quota_us"), _read(base / "cpu/cpu.cfs_period_us")
    if quota is None or period is None or quota.startswith("-"):
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        value = int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None
    return value if value > 0 else None
