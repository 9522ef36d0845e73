"""Test oracle: an independent pure-numpy all-MiniLM-L6-v2 (sentence-transformers), read
straight from the wheel's safetensors and vocab.txt; no llama.cpp, no GGUF.

Pipeline: BERT uncased WordPiece tokenization -> 6-layer BERT encoder ->
mean pooling over all tokens -> L2 normalization.

Computation is done in float64 (for an accurate oracle); the result is cast to float32.

API:
    tokenize(text) -> list[int]        ids including [CLS] ... [SEP], truncated to 256
    embed(texts)   -> np.ndarray       float32 [n, 384], rows L2-normalized
"""

import json
import math
import os
import struct
import unicodedata

import numpy as np

MODEL_DIR = ""  # set by the test: the installed wheel's model folder
MAX_SEQ_LEN = 256  # sentence_bert_config.json: max_seq_length
MAX_CHARS_PER_WORD = 100  # WordPiece: longer words become [UNK]
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

# ----------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------

_vocab = None


def _load_vocab():
    global _vocab
    if _vocab is None:
        with open(os.path.join(MODEL_DIR, "vocab.txt"), encoding="utf-8") as f:
            _vocab = {line.rstrip("\n"): i for i, line in enumerate(f)}
    return _vocab


def _is_whitespace(ch):
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def _is_control(ch):
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch):
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_chinese_char(cp):
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def _clean_text(text):
    out = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        out.append(" " if _is_whitespace(ch) else ch)
    return "".join(out)


def _tokenize_chinese_chars(text):
    out = []
    for ch in text:
        if _is_chinese_char(ord(ch)):
            out.extend((" ", ch, " "))
        else:
            out.append(ch)
    return "".join(out)


def _strip_accents(text):
    return "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")


def _split_on_punc(word):
    pieces, cur = [], []
    for ch in word:
        if _is_punctuation(ch):
            if cur:
                pieces.append("".join(cur))
                cur = []
            pieces.append(ch)
        else:
            cur.append(ch)
    if cur:
        pieces.append("".join(cur))
    return pieces


def basic_tokenize(text):
    """HF BasicTokenizer(do_lower_case=True, tokenize_chinese_chars=True)."""
    text = _clean_text(text)
    text = _tokenize_chinese_chars(text)
    words = []
    for tok in text.split():
        tok = _strip_accents(tok.lower())
        words.extend(_split_on_punc(tok))
    return [w for w in words if w]


def wordpiece(word, vocab):
    """Greedy longest-match-first WordPiece. Returns list of token strings."""
    if len(word) > MAX_CHARS_PER_WORD:
        return ["[UNK]"]
    pieces, start = [], 0
    while start < len(word):
        end, found = len(word), None
        while start < end:
            sub = word[start:end]
            if start > 0:
                sub = "##" + sub
            if sub in vocab:
                found = sub
                break
            end -= 1
        if found is None:
            return ["[UNK]"]
        pieces.append(found)
        start = end
    return pieces


def _split_special(text):
    """Special tokens written literally in the input (e.g. "[SEP]") are kept
    whole, as HF tokenizers do for added special tokens (case-sensitive,
    matched on the raw text)."""
    segs = [(text, False)]
    for sp in SPECIAL_TOKENS:
        new = []
        for s, is_sp in segs:
            if is_sp or sp not in s:
                new.append((s, is_sp))
                continue
            parts = s.split(sp)
            for i, p in enumerate(parts):
                if i:
                    new.append((sp, True))
                if p:
                    new.append((p, False))
        segs = new
    return segs


def tokenize_to_tokens(text):
    vocab = _load_vocab()
    toks = []
    for seg, is_sp in _split_special(text):
        if is_sp:
            toks.append(seg)
            continue
        for w in basic_tokenize(seg):
            toks.extend(wordpiece(w, vocab))
    toks = toks[: MAX_SEQ_LEN - 2]
    return ["[CLS]", *toks, "[SEP]"]


def tokenize(text):
    vocab = _load_vocab()
    return [vocab[t] for t in tokenize_to_tokens(text)]


# ----------------------------------------------------------------------------
# Weights (hand-parsed safetensors)
# ----------------------------------------------------------------------------

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
}
_weights = None
_config = None


def _load_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(data[a:b], dtype=np.dtype(_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def _load():
    global _weights, _config
    if _weights is None:
        with open(os.path.join(MODEL_DIR, "config.json")) as f:
            _config = json.load(f)
        raw = _load_safetensors(os.path.join(MODEL_DIR, "model.safetensors"))
        # strip optional "bert." prefix; compute in float64
        _weights = {}
        for k, v in raw.items():
            if k.startswith("bert."):
                k = k[len("bert.") :]
            _weights[k] = v.astype(np.float64) if v.dtype.kind == "f" else v
    return _weights, _config


# ----------------------------------------------------------------------------
# BERT forward
# ----------------------------------------------------------------------------

_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x):
    """Exact (erf) GELU, as HF 'gelu'."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def layer_norm(x, g, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)  # biased variance
    return (x - mu) / np.sqrt(var + eps) * g + b


def linear(x, W, b):
    return x @ W.T + b  # torch Linear stores W as [out, in]


def softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def bert_forward(ids):
    """ids: list[int] for ONE unpadded sequence -> hidden states [T, H] (float64)."""
    W, cfg = _load()
    eps = cfg["layer_norm_eps"]
    H = cfg["hidden_size"]
    nh = cfg["num_attention_heads"]
    dh = H // nh
    T = len(ids)

    ids = np.asarray(ids, dtype=np.int64)
    x = (
        W["embeddings.word_embeddings.weight"][ids]
        + W["embeddings.position_embeddings.weight"][np.arange(T)]
        + W["embeddings.token_type_embeddings.weight"][0]
    )
    x = layer_norm(x, W["embeddings.LayerNorm.weight"], W["embeddings.LayerNorm.bias"], eps)

    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q = linear(x, W[p + "attention.self.query.weight"], W[p + "attention.self.query.bias"])
        k = linear(x, W[p + "attention.self.key.weight"], W[p + "attention.self.key.bias"])
        v = linear(x, W[p + "attention.self.value.weight"], W[p + "attention.self.value.bias"])
        # [T, H] -> [nh, T, dh]
        q = q.reshape(T, nh, dh).transpose(1, 0, 2)
        k = k.reshape(T, nh, dh).transpose(1, 0, 2)
        v = v.reshape(T, nh, dh).transpose(1, 0, 2)
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(dh)  # [nh, T, T]
        ctx = softmax(scores) @ v  # [nh, T, dh]
        ctx = ctx.transpose(1, 0, 2).reshape(T, H)
        attn = linear(
            ctx, W[p + "attention.output.dense.weight"], W[p + "attention.output.dense.bias"]
        )
        x = layer_norm(
            attn + x,
            W[p + "attention.output.LayerNorm.weight"],
            W[p + "attention.output.LayerNorm.bias"],
            eps,
        )
        h = gelu(linear(x, W[p + "intermediate.dense.weight"], W[p + "intermediate.dense.bias"]))
        h = linear(h, W[p + "output.dense.weight"], W[p + "output.dense.bias"])
        x = layer_norm(h + x, W[p + "output.LayerNorm.weight"], W[p + "output.LayerNorm.bias"], eps)
    return x


def embed_one(text):
    hidden = bert_forward(tokenize(text))
    v = hidden.mean(0)  # mean pooling, mask all ones
    v = v / max(np.linalg.norm(v), 1e-12)  # Normalize module (F.normalize)
    return v


def embed(texts):
    if isinstance(texts, str):
        texts = [texts]
    if len(texts) == 0:
        return np.zeros((0, 384), dtype=np.float32)
    return np.stack([embed_one(t) for t in texts]).astype(np.float32)
