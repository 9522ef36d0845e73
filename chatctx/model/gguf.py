"""A small GGUF metadata reader: header key/values only, no tensors, no llama.cpp.

Large arrays (tokens, merges) are skipped unless asked for, so reading a Llama 3 header takes
milliseconds; reading its 128k tokens and 280k merges takes a fraction of a second.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from chatctx.errors import ModelError

MAGIC = b"GGUF"
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class SkippedArray:
    """Stands for an array that was not read; ``length`` is its element count."""

    def __init__(self, length: int) -> None:
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __repr__(self) -> str:
        return f"<array of {self.length}>"


def _read(f: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise EOFError
    return struct.unpack(fmt, data)[0]


def _string(f: IO[bytes]) -> str:
    n = _read(f, "<Q")
    return f.read(n).decode("utf-8", errors="replace")


def _skip_strings(f: IO[bytes], count: int) -> None:
    for _ in range(count):
        f.seek(_read(f, "<Q"), 1)


def _value(f: IO[bytes], vtype: int, *, want: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype = _read(f, "<I")
        count = _read(f, "<Q")
        if etype in _SCALARS:
            fmt = _SCALARS[etype]
            size = struct.calcsize(fmt)
            if not want:
                f.seek(size * count, 1)
                return SkippedArray(count)
            data = f.read(size * count)
            return list(struct.unpack(f"<{count}{fmt[1:]}", data))
        if etype == _STRING:
            if not want:
                _skip_strings(f, count)
                return SkippedArray(count)
            return [_string(f) for _ in range(count)]
        return [_value(f, etype, want=want) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {vtype}")


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's entry in the GGUF header: name, shape (ggml order) and ggml type id."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int


def _read_header(
    path: Path, wanted: set[str], *, tensors: bool
) -> tuple[dict[str, Any], list[TensorInfo]]:
    if not path.is_file():
        raise ModelError(f"model file not found: {path}", path=str(path))
    try:
        with path.open("rb") as f:
            if f.read(4) != MAGIC:
                raise ModelError(f"not a GGUF file (bad magic): {path}", path=str(path))
            version = _read(f, "<I")
            if version not in (2, 3):
                raise ModelError(f"unsupported GGUF version {version}: {path}", path=str(path))
            n_tensors = _read(f, "<Q")
            n_kv = _read(f, "<Q")
            meta: dict[str, Any] = {"GGUF.version": version}
            for _ in range(n_kv):
                key = _string(f)
                meta[key] = _value(f, _read(f, "<I"), want=key in wanted)
            infos: list[TensorInfo] = []
            for _ in range(n_tensors if tensors else 0):
                name = _string(f)
                n_dims = _read(f, "<I")
                shape = tuple(_read(f, "<Q") for _ in range(n_dims))
                ggml_type = _read(f, "<I")
                _offset = _read(f, "<Q")
                infos.append(TensorInfo(name, shape, ggml_type))
            return meta, infos
    except (EOFError, ValueError, struct.error, UnicodeDecodeError, OverflowError) as exc:
        raise ModelError(f"corrupt GGUF header in {path}: {exc}", path=str(path)) from exc


def read_metadata(path: Path | str, *, arrays: Iterable[str] = ()) -> dict[str, Any]:
    """The GGUF header's key/values. Arrays named in ``arrays`` are read, others skipped.

    Raises ``ModelError`` when the file is missing or is not a GGUF.
    """
    return _read_header(Path(path), set(arrays), tensors=False)[0]


def read_tensor_infos(path: Path | str) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The header's key/values (arrays skipped) and every tensor's name, shape and type.

    No tensor data is read: this is what the memory planner sizes weights from.
    """
    return _read_header(Path(path), set(), tensors=True)


def model_facts(meta: dict[str, Any]) -> dict[str, Any]:
    """Architecture figures a user asks about, including KV bytes per token at f16."""
    arch = str(meta.get("general.architecture", "unknown"))

    def arch_int(name: str) -> int | None:
        value = meta.get(f"{arch}.{name}")
        if isinstance(value, list):  # per-layer arrays: take the first layer's value
            value = value[0] if value else None
        return int(value) if isinstance(value, int | float) else None

    n_layer = arch_int("block_count")
    n_embd = arch_int("embedding_length")
    n_head = arch_int("attention.head_count")
    n_head_kv = arch_int("attention.head_count_kv") or n_head
    key_len = arch_int("attention.key_length")
    value_len = arch_int("attention.value_length")
    head_dim = n_embd // n_head if n_embd and n_head else None
    kv_bytes = None
    if n_layer and n_head_kv and (key_len or head_dim) and (value_len or head_dim):
        per_layer = n_head_kv * ((key_len or head_dim or 0) + (value_len or head_dim or 0))
        kv_bytes = 2 * n_layer * per_layer  # f16 = 2 bytes
    tokens = meta.get("tokenizer.ggml.tokens")
    return {
        "architecture": arch,
        "name": meta.get("general.name"),
        "n_layer": n_layer,
        "n_embd": n_embd,
        "n_head": n_head,
        "n_head_kv": n_head_kv,
        "n_ctx_train": arch_int("context_length"),
        "vocab_size": len(tokens) if tokens is not None else None,
        "tokenizer_model": meta.get("tokenizer.ggml.model"),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "chat_template": isinstance(meta.get("tokenizer.chat_template"), str),
        "kv_bytes_per_token_f16": kv_bytes,
        "file_type": meta.get("general.file_type"),
        "n_ff": arch_int("feed_forward_length"),
        "key_length": key_len or head_dim,
        "value_length": value_len or head_dim,
        # RoPE as trained; llama.cpp uses these unless the context params override them.
        "rope_freq_base": _number(meta.get(f"{arch}.rope.freq_base")),
        "rope_scaling": meta.get(f"{arch}.rope.scaling.type"),
        "rope_scaling_factor": _number(meta.get(f"{arch}.rope.scaling.factor")),
        "rope_orig_ctx": arch_int("rope.scaling.original_context_length"),
    }


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
