"""The codec of a llama-server backend: the local GGUF's template and tokenizer.

tiktoken mirrors the vocabulary where it can (checked against the server's ``/tokenize`` at
start); a vocabulary it cannot mirror is counted by the server's own ``/tokenize``.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from chatctx.errors import ModelError
from chatctx.model.codec import LlamaCodec, PromptCodec, open_codec, tiktoken_encoding
from chatctx.model.gguf import read_metadata
from chatctx.model.template import template_for

logger = logging.getLogger("chatctx.backends.llama_server")

_SPECIAL_TYPES = (3, 4)  # GGUF token types: control, user-defined


def server_codec(
    model: Path,
    tokenize: Callable[[str, bool], list[int]],
    *,
    chat_template: str | None = None,
    chat_format: str | None = None,
) -> PromptCodec:
    """The prompt codec for ``model``; ``tokenize(text, parse_special)`` is the server's."""
    try:
        return open_codec(
            model, chat_template=chat_template, chat_format=chat_format, fallback=tokenize
        )
    except ModelError as exc:
        logger.info("counting with the server's /tokenize: %s", exc)
    _, _, meta, fingerprint = tiktoken_encoding(model)
    full = read_metadata(model, arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    tokens = full.get("tokenizer.ggml.tokens") or []
    types = full.get("tokenizer.ggml.token_type") or []
    specials = {
        t: i for i, (t, k) in enumerate(zip(tokens, types, strict=False)) if k in _SPECIAL_TYPES
    }
    chat = template_for(meta, chat_template=chat_template, chat_format=chat_format, path=str(model))
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return LlamaCodec(
        tokenize,
        chat,
        specials=specials,
        bos=bos if isinstance(bos, int) else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        fingerprint=f"server-{fingerprint}-{hashlib.sha256(chat.source.encode()).hexdigest()[:8]}",
    )
