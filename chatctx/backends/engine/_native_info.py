"""What the llama.cpp build is and what it allocates: system info, devices, load-log capture.

Used by ``chatctx doctor`` and ``chatctx plan --measure``; kept apart from the resource
wrappers in ``_native`` (this module only reads).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as ll

from chatctx.backends.engine._native import NativeContext, NativeModel, init_backend, logger


class _LogCapture(logging.Handler):
    """Keeps every line; passes on only those the caller's settings would have shown."""

    def __init__(self, forward_from: int) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self.forward_from = forward_from

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())
        if record.levelno >= self.forward_from and logger.parent is not None:
            logger.parent.handle(record)


def capture_llama_log() -> contextlib.AbstractContextManager[list[str]]:
    """A context manager collecting llama.cpp's log lines (its buffer sizes are only there).

    The callback formats a record only when ``chatctx.llama`` is enabled for the level, so the
    logger is set to DEBUG while the block runs; records the previous level would have let
    through still reach the usual handlers, the rest only the capture.
    """

    @contextlib.contextmanager
    def manager() -> Iterator[list[str]]:
        init_backend()
        handler = _LogCapture(logger.getEffectiveLevel())
        previous, propagate = logger.level, logger.propagate
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False  # the handler forwards what would have been shown anyway
        try:
            yield handler.lines
        finally:
            logger.removeHandler(handler)
            logger.setLevel(previous)
            logger.propagate = propagate

    return manager()


def measure_allocations(
    path: Path,
    *,
    n_ctx: int,
    n_seq_max: int,
    kv_unified: bool,
    type_k: str,
    type_v: str,
    flash_attn: bool | None,
    n_gpu_layers: int = -1,
    n_batch: int = 512,
    n_ubatch: int = 512,
    n_threads: int | None = None,
) -> list[str]:
    """Load ``path`` with these settings, free it, and return llama.cpp's load log lines.

    ``chatctx.model.memory.parse_allocations`` reads the buffer sizes out of them.
    """
    with capture_llama_log() as lines:
        model = NativeModel(path, n_gpu_layers=n_gpu_layers)
        try:
            context = NativeContext(
                model,
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=n_ubatch,
                n_seq_max=n_seq_max,
                kv_unified=kv_unified,
                flash_attn=flash_attn,
                type_k=type_k,
                type_v=type_v,
                n_threads=n_threads,
            )
            context.close()
        finally:
            model.close()
    return list(lines)


def system_info() -> str:
    """llama.cpp's build summary: CPU features compiled in and used ("AVX2 = 1 | ...")."""
    init_backend()
    raw = ll.llama_print_system_info()
    return raw.decode("utf-8", errors="replace").strip() if raw else ""


_DEVICE_TYPES = {0: "CPU", 1: "GPU", 2: "iGPU", 3: "accelerator"}


def backend_devices() -> list[dict[str, Any]]:
    """ggml's backend devices (name, type, memory), read from libggml directly.

    The Python bindings do not wrap ``ggml_backend_dev_*``; an empty list when the library or
    the symbols cannot be found.
    """
    init_backend()
    lib_dir = Path(ll.__file__).resolve().parent / "lib"
    candidates = [*sorted(lib_dir.glob("libggml.*")), *sorted(lib_dir.glob("ggml.*"))]
    for candidate in candidates:
        try:
            lib = ctypes.CDLL(str(candidate))
            count_fn = lib.ggml_backend_dev_count
        except (OSError, AttributeError):
            continue
        count_fn.restype = ctypes.c_size_t
        lib.ggml_backend_dev_get.restype = ctypes.c_void_p
        lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
        for fn in ("ggml_backend_dev_name", "ggml_backend_dev_description"):
            getattr(lib, fn).restype = ctypes.c_char_p
            getattr(lib, fn).argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_type.restype = ctypes.c_int
        lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_dev_memory.argtypes = [
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        ]
        devices = []
        for i in range(int(count_fn())):
            dev = lib.ggml_backend_dev_get(i)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
            devices.append(
                {
                    "name": (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                    "description": (lib.ggml_backend_dev_description(dev) or b"").decode(
                        errors="replace"
                    ),
                    "type": _DEVICE_TYPES.get(lib.ggml_backend_dev_type(dev), "other"),
                    "free_bytes": int(free.value),
                    "total_bytes": int(total.value),
                }
            )
        return devices
    return []
