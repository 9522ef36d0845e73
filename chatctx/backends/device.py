"""Device memory: this process's resident set, and the GPU's used/free memory through NVML.

NVML comes from the maintained binding ``nvidia-ml-py`` (the ``gpu`` extra). Without it, or
without a GPU or driver, the GPU figures are ``None``: never an error.
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import threading
from pathlib import Path
from typing import Any

from chatctx.backends.base import MemorySnapshot

logger = logging.getLogger("chatctx.monitor")

__all__ = ["MemorySnapshot", "gpu_memory", "memory_snapshot", "rss_bytes"]


def rss_bytes() -> int:
    """Resident set size now: ``/proc/self/statm``, else the peak from ``getrusage``."""
    try:
        fields = Path("/proc/self/statm").read_text().split()
        return int(fields[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # ru_maxrss: kilobytes on Linux, bytes on macOS; a peak, the best there is here.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if os.uname().sysname == "Darwin" else peak * 1024)


_nvml_lock = threading.Lock()
_nvml: Any = None  # the pynvml module once initialised; False when unavailable


def _nvml_module() -> Any:
    global _nvml
    with _nvml_lock:
        if _nvml is None:
            try:
                # Imported by name: an optional dependency (the ``gpu`` extra), no type stubs.
                pynvml = importlib.import_module("pynvml")
                pynvml.nvmlInit()
                _nvml = pynvml
            except Exception as exc:  # ImportError, NVMLError (no driver, no GPU) and kin
                logger.debug("NVML unavailable: %s", exc)
                _nvml = False
        return _nvml or None


def gpu_memory(index: int = 0) -> tuple[int | None, int | None]:
    """(used, free) bytes of GPU ``index``, or (None, None) without NVML or that GPU."""
    nvml = _nvml_module()
    if nvml is None:
        return None, None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.used), int(info.free)
    except Exception as exc:  # NVMLError: GPU lost, index out of range
        logger.debug("NVML query failed: %s", exc)
        return None, None


def memory_snapshot() -> MemorySnapshot:
    """RSS of this process and the first GPU's used and free memory."""
    used, free = gpu_memory()
    return MemorySnapshot(rss_bytes=rss_bytes(), gpu_used_bytes=used, gpu_free_bytes=free)
