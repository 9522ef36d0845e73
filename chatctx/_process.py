"""Whether a process of this machine (this pid namespace) still runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def running(pid: int) -> bool | None:
    """True while process ``pid`` runs, False once it has ended (a zombie, killed and not yet
    reaped by its parent, has ended), None where this cannot be told (Windows, where
    ``os.kill`` would end the process)."""
    if sys.platform == "win32":
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")
