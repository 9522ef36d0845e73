"""Real llama-servers for the llama-server backend's tests, started once per session.

The binary is ``CHATCTX_LLAMA_SERVER`` (``make test`` sets it), else the one
``scripts/install_llama_server.py`` built for this machine's flags; a missing binary fails the
tests (never a silent skip): ``make setup`` builds it. Every server runs the embedded SmolLM2
on a free loopback port and is started with PR_SET_PDEATHSIG, so it dies with pytest.
``--cache-ram 0`` turns the server's host-RAM prompt cache off: what a slot reuses is then
exactly what that slot holds, the figure these tests check against their own oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess

ROOT = Path(__file__).resolve().parents[2]
SLOTS = 4  # three customers' slots and the summary slot
N_CTX = 1024  # tokens per slot
SERVER_ARGS = ("--cache-ram", "0")


@pytest.fixture(scope="session")
def llama_server_binary() -> Path:
    explicit = os.environ.get("CHATCTX_LLAMA_SERVER")
    if explicit:
        return Path(explicit)
    found = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "install_llama_server.py"), "--path"],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode != 0:
        pytest.fail(
            "llama-server is not built for this machine's flags: run `make setup` "
            f"(or python scripts/install_llama_server.py): {found.stderr.strip()}"
        )
    return Path(found.stdout.strip().splitlines()[-1])


def start_server(
    binary: Path,
    model: Path,
    folder: Path,
    *,
    slots: int = SLOTS,
    n_ctx: int = N_CTX,
    extra: tuple[str, ...] = SERVER_ARGS,
) -> LlamaServerProcess:
    folder.mkdir(parents=True, exist_ok=True)
    return LlamaServerProcess(
        model,
        slots=slots,
        n_ctx=n_ctx,
        slot_save_path=folder / "slots",
        metrics=True,
        threads=1,  # 2 spinning threads crawl on an oversubscribed machine (0.5 token/s seen)
        extra_args=extra,
        binary=binary,
        log_path=folder / "server.log",
    ).start()


@pytest.fixture(scope="session")
def server(
    llama_server_binary: Path, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LlamaServerProcess]:
    process = start_server(llama_server_binary, smollm2_path, tmp_path_factory.mktemp("server"))
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="session")
def backend(server: LlamaServerProcess, smollm2_path: Path) -> Iterator[LlamaServerBackend]:
    with LlamaServerBackend(
        server.url, model=smollm2_path, slot_save_path=server.slot_save_path
    ) as backend:
        yield backend
