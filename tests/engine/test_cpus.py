"""The default thread count: physical cores this process may use, at most its CPU quota.

Oracles: util-linux's ``lscpu`` on this machine, and hand-counted made-up sysfs trees (a VM
with two hyperthreads per core, a container held to some CPUs or to a quota).
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

from chatctx.model.cpus import default_threads


def test_this_machine_matches_lscpu() -> None:
    out = subprocess.run(
        ["lscpu", "-p=CPU,CORE,SOCKET"], check=True, capture_output=True, text=True
    ).stdout
    allowed = os.sched_getaffinity(0)
    cores = {
        tuple(line.split(",")[1:])
        for line in out.splitlines()
        if not line.startswith("#") and int(line.split(",")[0]) in allowed
    }
    quota = _quota_here()
    expected = len(cores) if quota is None else max(1, min(len(cores), math.floor(quota)))
    assert default_threads() == expected


def _quota_here() -> float | None:
    path = Path("/sys/fs/cgroup/cpu.max")  # read by hand (a cgroup namespace's root)
    if not path.exists():
        return None
    quota, period = path.read_text().split()
    return None if quota == "max" else int(quota) / int(period)


def machine(root: Path, siblings: dict[int, str], cpu_max: str | None = None) -> Path:
    for cpu, group in siblings.items():
        topology = root / f"sys/devices/system/cpu/cpu{cpu}/topology"
        topology.mkdir(parents=True)
        (topology / "thread_siblings_list").write_text(group + "\n")
    if cpu_max is not None:
        cgroup = root / "sys/fs/cgroup/bot"
        cgroup.mkdir(parents=True)
        (cgroup / "cpu.max").write_text(cpu_max + "\n")
    return root


# 4 cores, 2 hyperthreads each: cpu n and n+4 share a core (how Linux numbers them on x86 VMs)
SMT = {n: f"{n % 4},{n % 4 + 4}" for n in range(8)}


def test_two_hyperthreads_a_core_count_once(tmp_path: Path) -> None:
    root = machine(tmp_path, SMT)
    assert default_threads(root, cpus=range(8), cgroup="/") == 4
    assert default_threads(root, cpus=[0, 4, 1], cgroup="/") == 2  # affinity: cores 0 and 1


def test_a_cpu_quota_caps_the_threads(tmp_path: Path) -> None:
    root = machine(tmp_path, SMT, cpu_max="250000 100000")  # 2.5 CPUs
    assert default_threads(root, cpus=range(8), cgroup="/bot") == 2
    (root / "sys/fs/cgroup/bot/cpu.max").write_text("max 100000\n")
    assert default_threads(root, cpus=range(8), cgroup="/bot") == 4
    (root / "sys/fs/cgroup/bot/cpu.max").write_text("50000 100000\n")  # half a CPU
    assert default_threads(root, cpus=range(8), cgroup="/bot") == 1


def test_cpus_without_a_topology_count_alone(tmp_path: Path) -> None:
    assert default_threads(tmp_path, cpus=[0, 1, 2], cgroup="/") == 3
