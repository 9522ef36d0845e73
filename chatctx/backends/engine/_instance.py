"""What one engine keeps on disk, apart from every other engine under the same home.

Two bot processes with the same ``$CHATCTX_HOME`` (gunicorn workers, say) each run an
engine; each must find its own swapped KV states and write its own slot table. Every engine
gets a directory of its own, ``<root>/<pid>-<random>/`` (``root`` is ``swap_dir`` or
``$CHATCTX_HOME/engines``), holding ``kv/`` (its swap files), ``slots.json`` (its slot
table) and ``lock``, on which it holds an exclusive ``flock`` for as long as it runs.

A directory whose lock can be taken belongs to an engine that is gone (closed, or killed):
its states are adopted by whichever engine asks for one of its conversations first (the file
is renamed into the asker's directory under that lock, so two engines never both take it),
which is how a customer who returns after a restart gets a restore. A live engine's files
are never touched by another. Files of the older layout (``$CHATCTX_HOME/kv/*.kv``) are
adopted the same way.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO

logger = logging.getLogger("chatctx.backends.engine")

LOCK = "lock"


class EngineDirectory:
    """This engine's directory under ``root``, locked while the engine runs."""

    def __init__(self, root: Path, *, legacy: Path | None = None) -> None:
        self.root = root
        self.legacy = legacy  # a directory of swap files in the older, shared layout
        self.name = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path = root / self.name
        self.kv = self.path / "kv"
        self.slot_table = self.path / "slots.json"
        self.kv.mkdir(parents=True, exist_ok=True)
        self._lock: IO[bytes] | None = (self.path / LOCK).open("ab")
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX)

    def close(self) -> None:
        """Let go of the lock: the states left in ``kv/`` are adoptable from now on."""
        if self._lock is None:
            return
        empty = not any(self.kv.glob("*.kv"))
        fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)
        self._lock.close()
        self._lock = None
        if empty:  # nothing for a later engine: leave no directory behind
            shutil.rmtree(self.path, ignore_errors=True)

    def adopt(self, filename: str) -> Path | None:
        """Move the swap file ``filename`` of an engine that is gone into this engine's
        ``kv/``; None when no gone engine has it. Live engines' files are left alone."""
        target = self.kv / filename
        for directory in self._others():
            source = directory / "kv" / filename
            if not source.is_file():
                continue
            with _locked_if_free(directory / LOCK) as free:
                if free and source.is_file():
                    os.replace(source, target)
                    _remove_if_empty(directory)
                    return target
        if self.legacy is not None:
            source = self.legacy / filename
            if source.is_file():
                with _locked_if_free(self.legacy / ".adopt.lock") as free:
                    if free and source.is_file():
                        os.replace(source, target)
                        return target
        return None

    def _others(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for entry in self.root.iterdir():
            if entry.is_dir() and entry.name != self.name and (entry / LOCK).exists():
                yield entry


def live_directories(root: Path) -> list[Path]:
    """The directories under ``root`` of engines still running (their lock is held)."""
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        if not (entry.is_dir() and (entry / LOCK).exists()):
            continue
        with _locked_if_free(entry / LOCK, shared=True) as free:
            if not free:
                out.append(entry)
    return out


@contextlib.contextmanager
def _locked_if_free(path: Path, *, shared: bool = False) -> Iterator[bool]:
    """Hold ``path``'s lock in this block if nobody holds it (yields whether it was free)."""
    try:
        handle = path.open("ab")
    except OSError:
        yield False
        return
    with handle:
        try:
            fcntl.flock(
                handle.fileno(), (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB
            )
        except OSError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _remove_if_empty(directory: Path) -> None:
    # Called under the directory's lock: a gone engine's directory with no state left.
    if not any((directory / "kv").glob("*.kv")):
        shutil.rmtree(directory, ignore_errors=True)
