"""Prompt codecs: render a chat with the model's template and count its tokens exactly.

``TiktokenCodec`` mirrors a GGUF's byte-level BPE vocabulary in tiktoken (ranks = token ids,
the pre-tokenizer's split pattern, control tokens as specials): several times faster than
llama.cpp's tokenizer and proven identical by the tests. Vocabularies it cannot mirror fall back
to ``LlamaCodec``, which asks llama.cpp itself. One known gap: tiktoken's Unicode tables
(16.0) are newer than llama.cpp's (15.1), so a text with one of Unicode 16's new letters
(U+13460, an Egyptian hieroglyph, say) can split into different tokens; chatctx evaluates its
own tokens, so only the count of such a text can differ from llama.cpp's tokenizer.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

import tiktoken

from chatctx.model.gguf import read_metadata
from chatctx.model.template import ChatTemplate, RenderedPrompt, template_for
from chatctx.model.tools import ToolFormat

logger = logging.getLogger("chatctx.codec")

# llama.cpp's pre-tokenizer patterns, by tokenizer.ggml.pre. SmolLM-style vocabularies split
# every digit first, then apply GPT-2's pattern to each piece between digits; folded into one
# pattern here, where a digit ends a piece: trailing whitespace before a digit stays one run
# ("\n  4" is "\n  " + "4", as in llama.cpp, not "\n " + " " + "4").
PATTERNS = {
    "llama-bpe": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "smollm": r"\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+",
}
PATTERNS["llama3"] = PATTERNS["llama-bpe"]
PATTERNS["starcoder"] = PATTERNS["smollm"]

# Token types in GGUF: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
_SPECIAL_TYPES = {3, 4}

# Texts whose tokenization must agree before tiktoken is trusted for a vocabulary.
PROBES = (
    "Hello world! It's 2024-05-01, order #A1234 costs $99.95.",
    "  leading spaces\n\n\ttabs\r\nwindows lines   trailing  ",
    "def f(x):\n    return x ** 2  # code\n",
    "한국어 텍스트와 emoji 🎉👍🏽 and ümlauts",
    "1234567890 3.14159 1e-10 0x7FFFFFFF",
    "<|im_start|>user\nhi<|im_end|><|eot_id|><|start_header_id|>",
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-ins for bytes, inverted."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = keep[:]
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


class PromptCodec:
    """Renders messages with a chat template and turns the text into token ids.

    ``encode_prompt`` returns exactly what the engine evaluates (BOS added when the model
    asks for it and the template did not write it). Only the template's own markup becomes
    control tokens: message content (summaries, imported logs and user text alike) is
    tokenized as text, so ``<|eot_id|>`` typed by a user stays characters.
    """

    def __init__(
        self,
        template: ChatTemplate,
        *,
        bos: int | None,
        add_bos: bool,
        fingerprint: str,
        specials: Mapping[str, int] | None = None,
    ) -> None:
        self.template = template
        self.bos = bos
        self.add_bos = add_bos
        self.fingerprint = fingerprint
        self.specials = dict(specials or {})
        self._special_re = (
            re.compile("|".join(re.escape(t) for t in sorted(self.specials, key=len, reverse=True)))
            if self.specials
            else None
        )
        template.protect(self.specials)  # no JSON it writes holds a control token's text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with special-token text parsed as control tokens."""
        raise NotImplementedError

    def encode_text(self, text: str) -> list[int]:
        """Token ids of ``text`` as plain text: special-token strings stay characters."""
        raise NotImplementedError

    def count(self, text: str) -> int:
        return len(self.encode_text(text))

    @property
    def tool_format(self) -> ToolFormat:
        """How the model writes tool calls, read from its chat template."""
        return self.template.tool_format

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> RenderedPrompt:
        return self.template.render(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )

    def encode_prompt(self, text: str) -> list[int]:
        """Tokens of a prompt; a ``RenderedPrompt``'s content is encoded as plain text."""
        if isinstance(text, RenderedPrompt):
            tokens = self._encode_rendered(text)
        else:
            tokens = self.encode(text)
        if self.add_bos and self.bos is not None and (not tokens or tokens[0] != self.bos):
            tokens.insert(0, self.bos)
        return tokens

    def prompt_tokens(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.encode_prompt(
            self.render(messages, add_generation_prompt=add_generation_prompt)
        )

    def _encode_rendered(self, prompt: RenderedPrompt) -> list[int]:
        # llama.cpp splits a prompt at special tokens and tokenizes the text between them on
        # its own; doing the same with specials found only in the markup gives identical ids
        # for ordinary content and plain-text ids for special-token text inside content.
        if self._special_re is None:
            return self.encode_text(str(prompt))
        text = str(prompt)
        spans: list[tuple[int, int]] = list(prompt.content_spans or ())
        if prompt.content_spans is None:
            # Content's place is unknown: special-token text that occurs in any content is
            # text wherever it appears.
            for content in prompt.contents:
                for m in self._special_re.finditer(content):
                    at = text.find(m.group())
                    while at >= 0:
                        spans.append((at, at + len(m.group())))
                        at = text.find(m.group(), at + 1)
            spans.sort()
        tokens: list[int] = []
        piece_start = 0
        markup_start = 0
        for start, end in [*spans, (len(text), len(text))]:
            for m in self._special_re.finditer(text, markup_start, start):
                tokens += self.encode_text(text[piece_start : m.start()])
                tokens.append(self.specials[m.group()])
                piece_start = m.end()
            markup_start = max(markup_start, end)
        tokens += self.encode_text(text[piece_start:])
        return tokens


class TiktokenCodec(PromptCodec):
    """Exact token counts through a tiktoken mirror of the GGUF vocabulary.

    Some vocabularies lack a few single bytes (SmolLM2 has no token for ``\x04``); llama.cpp
    silently drops such bytes. Text containing them goes to ``fallback`` (llama.cpp's own
    tokenizer) when one is given, else those characters are dropped before encoding.
    """

    def __init__(
        self,
        encoding: tiktoken.Encoding,
        template: ChatTemplate,
        *,
        bos: int | None,
        add_bos: bool,
        fingerprint: str,
        unencodable: re.Pattern[str] | None = None,
        fallback: Callable[[str, bool], list[int]] | None = None,
    ) -> None:
        super().__init__(
            template,
            bos=bos,
            add_bos=add_bos,
            fingerprint=fingerprint,
            specials={t: encoding.encode_single_token(t) for t in encoding.special_tokens_set},
        )
        self.encoding = encoding
        self._unencodable = unencodable
        self._fallback = fallback

    def encode(self, text: str) -> list[int]:
        if self._unencodable is not None and self._unencodable.search(text):
            if self._fallback is not None:
                return self._fallback(text, True)
            text = self._unencodable.sub("", text)
        return self.encoding.encode(text, allowed_special="all")

    def encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        if self._unencodable is not None and self._unencodable.search(text):
            if self._fallback is not None:
                return self._fallback(text, False)
            text = self._unencodable.sub("", text)
        return self.encoding.encode_ordinary(text)


class LlamaCodec(PromptCodec):
    """Token counts from llama.cpp's own tokenizer (the fallback).

    ``tokenize(text, parse_special)``; ``specials`` maps the vocabulary's control and
    user-defined token texts to ids.
    """

    def __init__(
        self,
        tokenize: Callable[[str, bool], list[int]],
        template: ChatTemplate,
        *,
        bos: int | None,
        add_bos: bool,
        fingerprint: str,
        specials: Mapping[str, int] | None = None,
    ) -> None:
        super().__init__(
            template, bos=bos, add_bos=add_bos, fingerprint=fingerprint, specials=specials
        )
        self._tokenize = tokenize

    def encode(self, text: str) -> list[int]:
        return self._tokenize(text, True)

    def encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        if self._special_re is None or not self._special_re.search(text):
            return self._tokenize(text, False)
        # llama.cpp matches user-defined tokens even without parse_special: cut each
        # special-token text in two so neither half can match.
        tokens: list[int] = []
        last = 0
        for m in self._special_re.finditer(text):
            middle = m.start() + max(1, len(m.group()) // 2)
            tokens += self._tokenize(text[last:middle], False)
            last = middle
        return tokens + self._tokenize(text[last:], False)


def vocab_fingerprint(meta: Mapping[str, Any], tokens: Sequence[str]) -> str:
    digest = hashlib.sha256()
    pre = str(meta.get("tokenizer.ggml.pre"))
    digest.update(pre.encode())
    # The split pattern too: counts cached under an older pattern must not be reused.
    digest.update(PATTERNS.get(pre, "").encode())
    for token in tokens:
        digest.update(token.encode("utf-8", errors="surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()[:16]


def _unencodable_chars(missing: set[int]) -> re.Pattern[str] | None:
    """A pattern of the characters whose UTF-8 form uses a byte the vocabulary lacks.

    Returns None when nothing is missing; raises ValueError when too much is (a continuation
    byte, or a lead byte of 2- or 3-byte sequences) to mirror the vocabulary at all.
    """
    missing = {b for b in missing if b not in (0xC0, 0xC1) and b < 0xF5}  # never in UTF-8
    if not missing:
        return None
    parts = []
    for b in sorted(missing):
        if b < 0x80:
            parts.append(re.escape(chr(b)))
        elif 0xF0 <= b <= 0xF4:
            lo = (b - 0xF0) << 18
            parts.append(f"{re.escape(chr(max(lo, 0x10000)))}-{re.escape(chr(lo + 0x3FFFF))}")
        else:
            raise ValueError(f"byte 0x{b:02x} has no token")
    return re.compile(f"[{''.join(parts)}]")


def tiktoken_encoding(
    path: Path | str,
) -> tuple[tiktoken.Encoding | None, re.Pattern[str] | None, dict[str, Any], str]:
    """A tiktoken Encoding mirroring the GGUF's vocabulary, or None when it cannot.

    Returns (encoding, unencodable characters, metadata, fingerprint).
    """
    meta = read_metadata(path, arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"))
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    fingerprint = vocab_fingerprint(meta, tokens)
    pre = str(meta.get("tokenizer.ggml.pre") or "")
    if meta.get("tokenizer.ggml.model") != "gpt2" or pre not in PATTERNS:
        return None, None, meta, fingerprint
    decoder = _byte_decoder()
    ranks: dict[bytes, int] = {}
    specials: dict[str, int] = {}
    for token_id, (text, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in _SPECIAL_TYPES:
            specials[text] = token_id
        elif kind == 1:
            try:
                ranks[bytes(decoder[ch] for ch in text)] = token_id
            except KeyError:
                return None, None, meta, fingerprint
    try:
        unencodable = _unencodable_chars({b for b in range(256) if bytes([b]) not in ranks})
        encoding = tiktoken.Encoding(
            name=f"gguf-{fingerprint}",
            pat_str=PATTERNS[pre],
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
    except ValueError as exc:
        logger.info("tiktoken cannot mirror %s: %s", path, exc)
        return None, None, meta, fingerprint
    return encoding, unencodable, meta, fingerprint


def open_codec(
    path: Path | str,
    *,
    chat_template: str | None = None,
    chat_format: str | None = None,
    fallback: Callable[[str, bool], list[int]] | None = None,
) -> TiktokenCodec:
    """A tiktoken codec for a GGUF, without loading llama.cpp (tokenizer and template only).

    Raises ``ModelError`` when tiktoken cannot mirror the vocabulary.
    """
    from chatctx.errors import ModelError

    encoding, unencodable, meta, fingerprint = tiktoken_encoding(path)
    if encoding is None:
        raise ModelError(
            f"tiktoken cannot mirror the vocabulary of {path}; use the engine's "
            "codec (llama.cpp tokenization)",
            path=str(path),
        )
    template = template_for(
        meta, chat_template=chat_template, chat_format=chat_format, path=str(path)
    )
    bos = meta.get("tokenizer.ggml.bos_token_id")
    template_hash = hashlib.sha256(template.source.encode()).hexdigest()[:8]
    return TiktokenCodec(
        encoding,
        template,
        bos=bos if isinstance(bos, int) else None,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        fingerprint=f"tt-{fingerprint}-{template_hash}",
        unencodable=unencodable,
        fallback=fallback,
    )
