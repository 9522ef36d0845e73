"""Install llama-cpp-python, built from source with CPU flags that suit this machine.

Why not a plain ``pip install``: llama.cpp's default build uses ``-march=native``, which compiles
in the AMX kernels on a Xeon that reports AMX; on some cloud VMs the guest cannot use them and
the process dies with SIGILL in ``ggml_backend_amx_mul_mat`` (llama.cpp issues 28328, 28756).
This script turns native off and names the instruction sets explicitly (AVX2, and AVX-512 where
the CPU has all of F/CD/BW/DQ/VL), never AMX.

pip caches a wheel built from an sdist by the sdist's hash, not by ``CMAKE_ARGS``, so a wheel
built once with other flags would be reused silently. This script builds with pip's cache off
and keeps its own wheel cache keyed by the flags, the Python tag and the platform.

Usage: ``python scripts/install_llama.py PYTHON`` where PYTHON is the venv's interpreter.
Environment: ``CHATCTX_LLAMA_BUILD=portable`` (default) or ``native`` (llama.cpp's own
``-march=native``: fastest, AMX included); ``CMAKE_ARGS`` is appended (e.g. ``-DGGML_CUDA=on``);
``CHATCTX_WHEEL_CACHE`` overrides the cache folder; ``--print-args`` only prints the flags.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Each ggml option and the /proc/cpuinfo flags it needs (all of them).
X86_FEATURES: list[tuple[str, tuple[str, ...]]] = [
    ("GGML_SSE42", ("sse4_2",)),
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512_vbmi")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
]
NEVER = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def pinned_requirement() -> str:
    """The exact llama-cpp-python requirement from pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        if requirement.replace(" ", "").startswith("llama-cpp-python=="):
            return str(requirement).replace(" ", "")
    raise SystemExit("pyproject.toml does not pin llama-cpp-python==X.Y.Z")


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cmake_args(mode: str, flags: set[str], machine: str) -> list[str]:
    """The CMake flags for a build mode on a CPU with these /proc/cpuinfo flags."""
    if mode == "native":
        args = ["-DGGML_NATIVE=ON"]
    elif machine not in ("x86_64", "amd64") or not flags:
        # Other architectures have no AMX trap; llama.cpp's defaults are right there.
        args = []
    else:
        args = ["-DGGML_NATIVE=OFF"]
        for option, needs in X86_FEATURES:
            args.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
        args += [f"-D{option}=OFF" for option in NEVER]
    extra = os.environ.get("CMAKE_ARGS", "").split()
    return args + extra


def main(argv: list[str]) -> int:
    mode = os.environ.get("CHATCTX_LLAMA_BUILD", "portable")
    if mode not in ("portable", "native"):
        raise SystemExit(f"CHATCTX_LLAMA_BUILD={mode!r}: use 'portable' or 'native'")
    args = cmake_args(mode, cpu_flags(), platform.machine().lower())
    if "--print-args" in argv:
        print(" ".join(args))
        return 0
    if len(argv) != 1:
        raise SystemExit(__doc__)
    python = argv[0]
    requirement = pinned_requirement()
    tag = subprocess.run(
        [
            python,
            "-c",
            "import sys, sysconfig; print(sys.implementation.cache_tag, sysconfig.get_platform())",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    key = hashlib.sha256(json.dumps([requirement, args, tag]).encode()).hexdigest()[:16]
    cache_root = Path(
        os.environ.get("CHATCTX_WHEEL_CACHE")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chatctx" / "wheels"
    )
    folder = cache_root / key
    wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
    if not wheels:
        print(
            f"building {requirement} from source ({mode}: {' '.join(args) or 'defaults'});"
            " about 5 minutes on 2 cores",
            flush=True,
        )
        folder.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CMAKE_ARGS=" ".join(args), PIP_NO_CACHE_DIR="1")
        subprocess.run(
            [
                python,
                "-m",
                "pip",
                "wheel",
                "--quiet",
                "--no-deps",
                "--no-cache-dir",
                "--no-binary",
                "llama-cpp-python",
                requirement,
                "-w",
                str(folder),
            ],
            check=True,
            env=env,
        )
        wheels = sorted(folder.glob("llama_cpp_python-*.whl"))
        (folder / "build.json").write_text(
            json.dumps(
                {"requirement": requirement, "mode": mode, "cmake_args": args, "python": tag},
                indent=2,
            )
            + "\n"
        )
    else:
        print(f"llama-cpp-python: using the wheel built with these flags in {folder}")
    # Installed without dependencies: the project's own install brings them from pyproject.
    subprocess.run(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--force-reinstall",
            str(wheels[-1]),
        ],
        check=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
