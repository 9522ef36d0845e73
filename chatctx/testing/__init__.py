"""Test helpers shipped with chatctx: a tiny random-weight Llama 3 GGUF with the real tokenizer.

The model has Llama 3's exact vocabulary (128,256 tokens, bos 128000, eot 128009), merges and
Meta's Llama 3 Instruct chat template, and a few megabytes of random weights: it proves token
accounting, template rendering and KV behaviour; its text is noise. The vocabulary comes from
``vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf`` in the llama-cpp-python sdist that
chatctx pins, fetched with pip (``pip download --no-binary``) and cached.

Needs the ``dev`` extra (``gguf``, ``numpy``).

``ThrowawayPostgres`` runs a fresh PostgreSQL cluster for a test session or a benchmark
(needs the server binaries and the ``postgres`` extra).
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from chatctx.environment import variable
from chatctx.errors import ModelError
from chatctx.model.gguf import read_metadata
from chatctx.model.template import LLAMA3_TEMPLATE
from chatctx.settings import default_home
from chatctx.testing._postgres import ThrowawayPostgres as ThrowawayPostgres
from chatctx.testing._postgres import create_database as create_database
from chatctx.testing._postgres import drop_database as drop_database
from chatctx.testing._postgres import find_postgres_bindir as find_postgres_bindir

# Llama 3.1's prompt format for custom tools (Meta's documentation), as a compact template:
# the tools as JSON in the system turn, calls as {"name", "parameters"}, results as ipython.
LLAMA31_TOOLS_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}{{- '<|start_header_id|>system<|end_header_id|>\n\n' }}"
    "{{- 'Environment: ipython\nYou have these functions:\n' }}"
    "{%- for t in tools %}{{- t | tojson(indent=4) + '\n' }}{%- endfor %}{{- '<|eot_id|>' }}"
    "{%- endif %}{%- for m in messages %}"
    "{%- if m['role'] == 'tool' %}{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' }}"
    "{{- m['content'] + '<|eot_id|>' }}"
    "{%- elif m.get('tool_calls') %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- for c in m['tool_calls'] %}{{- '{\"name\": \"' + c['function']['name'] + "
    "'\", \"parameters\": ' + c['function']['arguments'] | tojson + '}' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}{%- else %}"
    "{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] + "
    "'<|eot_id|>' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)

LLAMA_CPP_SDIST = "llama-cpp-python==0.3.36"
VOCAB_MEMBER = "vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"
ASSET_FILES = (VOCAB_MEMBER, VOCAB_MEMBER + ".inp", VOCAB_MEMBER + ".out")

LLAMA3_BOS = 128000
LLAMA3_EOT = 128009


def assets_dir() -> Path:
    """Where fetched test assets are cached (``CHATCTX_ASSETS`` or ``$CHATCTX_HOME/assets``)."""
    return Path(variable("CHATCTX_ASSETS") or default_home() / "assets")


def llama3_vocab_path() -> Path:
    """The Llama 3 BPE vocabulary GGUF, fetched from the llama-cpp-python sdist once."""
    target = assets_dir() / Path(VOCAB_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                # Only this package as an sdist: ":all:" would also build its build
                # dependencies (cmake, ninja) from source on a machine with no pip cache.
                "--no-binary",
                "llama-cpp-python",
                LLAMA_CPP_SDIST,
                "-d",
                tmp,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if result.returncode != 0 or not sdists:
            raise ModelError(
                f"could not fetch the {LLAMA_CPP_SDIST} sdist for the Llama 3 "
                f"vocabulary: {result.stderr.strip()[-500:]}"
            )
        with tarfile.open(sdists[0]) as archive:
            root = archive.getnames()[0].split("/")[0]
            for member in ASSET_FILES:
                source = archive.extractfile(f"{root}/{member}")
                if source is None:
                    raise ModelError(f"{member} missing from {sdists[0].name}")
                partial = target.parent / (Path(member).name + ".part")
                partial.write_bytes(source.read())
                partial.replace(target.parent / Path(member).name)
    return target


def write_tiny_llama3(
    path: Path,
    *,
    n_embd: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    n_ctx_train: int = 8192,
    seed: int = 0,
    chat_template: str | None = LLAMA3_TEMPLATE,
    tokenizer_pre: str = "llama-bpe",
    weight_type: str = "f32",
    share_layers: bool = False,
) -> Path:
    """Write a random-weight Llama-architecture GGUF with the real Llama 3 tokenizer.

    ``weight_type`` ("f32" or "f16") is the layers' matrix type. ``share_layers`` writes the
    same random matrices into every layer: a large shape (Llama-3-8B's, for speed checks) is
    then generated in seconds and held in memory once; its speed is a real model's.
    """
    import gguf
    import numpy as np

    vocab = read_metadata(
        llama3_vocab_path(),
        arrays=("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"),
    )
    tokens: list[str] = vocab["tokenizer.ggml.tokens"]
    n_vocab = len(tokens)
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    if weight_type not in ("f32", "f16"):
        raise ValueError(f"weight_type must be f32 or f16, not {weight_type!r}")
    dtype = np.float16 if weight_type == "f16" else np.float32
    shared: dict[tuple[int, ...], np.ndarray] = {}

    def weight(*shape: int) -> np.ndarray:
        if share_layers and shape in shared:
            return shared[shape]
        value = (rng.standard_normal(shape) * 0.02).astype(dtype)
        if share_layers:
            shared[shape] = value
        return value

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama3-random")
    writer.add_block_count(n_layer)
    writer.add_context_length(n_ctx_train)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer_pre)
    writer.add_token_list(tokens)
    writer.add_token_types(vocab["tokenizer.ggml.token_type"])
    writer.add_token_merges(vocab["tokenizer.ggml.merges"])
    writer.add_bos_token_id(LLAMA3_BOS)
    writer.add_eos_token_id(LLAMA3_EOT)
    writer.add_add_bos_token(True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    for i in range(n_layer):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_q.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.attn_k.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_v.weight", weight(n_head_kv * head_dim, n_embd))
        writer.add_tensor(f"blk.{i}.attn_output.weight", weight(n_embd, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weight(n_ff, n_embd))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weight(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def serve_customers(
    engine: Any,
    customers: dict[str, list[str]],
    *,
    together: bool,
    settings: dict[str, Any],
    context: dict[str, Any],
) -> dict[tuple[str, int], str]:
    """Every customer's replies, served one customer after another (``together=False``) or
    all at once from a thread each, as a support bot does. Returns (customer, turn) -> reply.

    What "a reply does not depend on load" is checked with (tests and bench/
    load_independence.py): the same engine settings either way, greedy sampling.
    """
    import threading

    from chatctx.session import ChatSession
    from chatctx.store import Store

    replies: dict[tuple[str, int], str] = {}
    errors: list[BaseException] = []
    with Store("sqlite://") as store:

        def serve(cid: str) -> None:
            try:
                with ChatSession.open(
                    store, conversation_id=cid, model=engine, settings=settings, context=context
                ) as chat:
                    for turn, text in enumerate(customers[cid]):
                        replies[cid, turn] = chat.send(text).text
            except BaseException as exc:
                errors.append(exc)

        if together:
            threads = [threading.Thread(target=serve, args=(cid,)) for cid in customers]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        else:
            for cid in customers:
                serve(cid)
    if errors:
        raise errors[0]
    return replies


def support_customers(count: int, turns: int) -> dict[str, list[str]]:
    """``count`` customers' first ``turns`` messages from the synthetic support chats."""
    from chatctx.synthetic import support_conversation

    out = {}
    for n in range(count):
        chat = support_conversation(turns=max(turns, 12), seed=100 + n)
        out[f"customer-{n}"] = [m["content"] for m in chat["messages"] if m["role"] == "user"][
            :turns
        ]
    return out
