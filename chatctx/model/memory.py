"""Memory planning from GGUF metadata alone: weights, KV cache, compute buffers. No weights load.

Everything here is a pure function of the GGUF header (key/values and tensor infos) and the
requested settings, so ``chatctx plan`` answers in milliseconds and the engine can import the
same rules (``kv_cells``, ``resolve_flash_attn``) to size and validate what it creates.

How the KV cache is sized for ``slots`` conversations of ``n_ctx`` tokens each (``kv_cells``):

- ``unified=True`` (default): one pool shared by every sequence,
  ``cells = pad256(slots * n_ctx + summary_room)``;
- ``unified=False``: one stream per sequence, ``slots + 1`` sequences (one reserved for
  summaries), ``cells = (slots + 1) * pad256(n_ctx)``.

A cell holds one token's keys and values in every layer: ``n_head_kv * key_length`` K values and
``n_head_kv * value_length`` V values per layer (GQA), stored as the cache type's blocks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chatctx.errors import ConfigError
from chatctx.model.gguf import TensorInfo, model_facts, read_tensor_infos

__all__ = [
    "DEFAULT_SUMMARY_ROOM",
    "GGML_TYPES",
    "KV_TYPE_IDS",
    "QUANTIZED_KV_TYPES",
    "MemoryPlan",
    "ModelShape",
    "alternatives",
    "check_kv_types",
    "compute_bytes_estimate",
    "kv_cells",
    "kv_context_size",
    "pad256",
    "parse_allocations",
    "parse_size",
    "plan_memory",
    "resolve_flash_attn",
    "rope_warning",
    "summary_room_for",
    "tensor_bytes",
]

# ggml type id -> (name, values per block, bytes per block), as in ggml's type traits.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 1, 4),
    1: ("f16", 1, 2),
    2: ("q4_0", 32, 18),
    3: ("q4_1", 32, 20),
    6: ("q5_0", 32, 22),
    7: ("q5_1", 32, 24),
    8: ("q8_0", 32, 34),
    9: ("q8_1", 32, 36),
    10: ("q2_k", 256, 84),
    11: ("q3_k", 256, 110),
    12: ("q4_k", 256, 144),
    13: ("q5_k", 256, 176),
    14: ("q6_k", 256, 210),
    15: ("q8_k", 256, 292),
    16: ("iq2_xxs", 256, 66),
    17: ("iq2_xs", 256, 74),
    18: ("iq3_xxs", 256, 98),
    19: ("iq1_s", 256, 50),
    20: ("iq4_nl", 32, 18),
    21: ("iq3_s", 256, 110),
    22: ("iq2_s", 256, 82),
    23: ("iq4_xs", 256, 136),
    24: ("i8", 1, 1),
    25: ("i16", 1, 2),
    26: ("i32", 1, 4),
    27: ("i64", 1, 8),
    28: ("f64", 1, 8),
    29: ("iq1_m", 256, 56),
    30: ("bf16", 1, 2),
    34: ("tq1_0", 256, 54),
    35: ("tq2_0", 256, 66),
    39: ("mxfp4", 32, 17),
}
# The KV cache types chatctx accepts, by ggml type id (what llama_context_params.type_k takes).
KV_TYPE_IDS: dict[str, int] = {
    "f32": 0,
    "f16": 1,
    "q4_0": 2,
    "q4_1": 3,
    "q5_0": 6,
    "q5_1": 7,
    "q8_0": 8,
    "bf16": 30,
}
QUANTIZED_KV_TYPES = frozenset({"q4_0", "q4_1", "q5_0", "q5_1", "q8_0"})
MIB = 1024 * 1024


def pad256(n: int) -> int:
    """``n`` rounded up to a multiple of 256, as llama.cpp rounds context sizes."""
    return -(-n // 256) * 256


DEFAULT_SUMMARY_ROOM = 1792  # a 1,024-token chunk of evicted turns, a summary, instructions


def summary_room_for(n_ctx: int, room: int | None = None) -> int:
    """Cells the summary sequence gets in a unified pool (``room`` None: the default)."""
    return min(pad256(n_ctx), DEFAULT_SUMMARY_ROOM if room is None else room)


def kv_cells(n_ctx: int, slots: int = 1, unified: bool = True, summary_room: int = 0) -> int:
    """KV cells for ``slots`` conversations of ``n_ctx`` tokens each (see the module doc)."""
    if n_ctx < 1 or slots < 1 or summary_room < 0:
        raise ConfigError(
            f"n_ctx ({n_ctx}) and slots ({slots}) must be positive, summary_room ({summary_room})"
            " not negative"
        )
    if unified:
        return pad256(slots * n_ctx + summary_room)
    return (slots + 1) * pad256(n_ctx)


def kv_context_size(
    n_ctx: int, slots: int = 1, unified: bool = True, summary_room: int = 0
) -> tuple[int, int]:
    """``(n_ctx, n_seq_max)`` for llama.cpp's context params so it allocates ``kv_cells``.

    Split streams: llama.cpp gives each of ``n_seq_max`` sequences ``pad256(n_ctx / n_seq_max)``
    cells, so the total passed is ``(slots + 1) * pad256(n_ctx)``.
    """
    return kv_cells(n_ctx, slots, unified, summary_room), slots + 1


def tensor_bytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes of a tensor of ``shape`` (ggml order: rows first) and ggml type ``ggml_type``."""
    if ggml_type not in GGML_TYPES:
        raise ConfigError(f"unknown ggml tensor type {ggml_type}")
    _, block, size = GGML_TYPES[ggml_type]
    n = 1
    for dim in shape:
        n *= dim
    return -(-n // block) * size


def _kv_row_bytes(type_name: str, n_values: int) -> int:
    return tensor_bytes(KV_TYPE_IDS[type_name], (n_values,))


def resolve_flash_attn(type_k: str, type_v: str, flash_attn: bool | None) -> bool | None:
    """Validate the KV cache types; return the flash attention setting to use.

    A quantized V cache needs flash attention: ``None`` (auto) turns it on, ``False`` is a
    ``ConfigError`` naming it. Types outside ``KV_TYPE_IDS`` are a ``ConfigError``.
    """
    for name, value in (("type_k", type_k), ("type_v", type_v)):
        if value not in KV_TYPE_IDS:
            raise ConfigError(
                f"{name}={value!r} is not a KV cache type this build supports "
                f"({', '.join(KV_TYPE_IDS)})"
            )
    if type_v in QUANTIZED_KV_TYPES:
        if flash_attn is False:
            raise ConfigError(
                f"type_v={type_v} (a quantized V cache) needs flash attention, but flash_attn is "
                "off: turn it on (or leave it on auto), or use type_v=f16"
            )
        return True
    return flash_attn


def check_kv_types(type_k: str, type_v: str, key_length: int, value_length: int) -> None:
    """A quantized cache stores whole blocks per head: the head size must be a multiple."""
    for name, value, length in (("type_k", type_k, key_length), ("type_v", type_v, value_length)):
        _, block, _ = GGML_TYPES[KV_TYPE_IDS[value]]
        if length % block:
            raise ConfigError(
                f"{name}={value} stores blocks of {block} values, but this model's heads have "
                f"{length}; use f16 or bf16"
            )


def rope_warning(
    n_ctx: int,
    n_ctx_train: int | None,
    *,
    rope_scaling: str | None = None,
    rope_freq_scale: float | None = None,
    model_scaling: str | None = None,
) -> str | None:
    """A warning when one sequence may hold more positions than the model was trained on."""
    if not n_ctx_train or n_ctx <= n_ctx_train:
        return None
    scaled = (
        rope_scaling in ("linear", "yarn")
        or (rope_freq_scale not in (None, 0.0, 1.0))
        or (rope_scaling is None and model_scaling not in (None, "none"))
    )
    if scaled:
        return None
    return (
        f"n_ctx {n_ctx} exceeds the model's trained context {n_ctx_train} with no RoPE scaling: "
        "quality degrades past the trained length; set rope_scaling (linear or yarn) or a "
        "smaller n_ctx"
    )


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the planner needs from a GGUF: dimensions and per-layer weight bytes."""

    architecture: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    key_length: int
    value_length: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int | None
    layer_bytes: tuple[int, ...]  # repeating layer i's weights (blk.i.*)
    input_bytes: int  # token embeddings: always on the CPU
    output_bytes: int  # output norm and head: on the GPU when any layer is offloaded
    rope: dict[str, Any] = field(default_factory=dict)
    # No ``output.weight``: the head is the token embeddings, which llama.cpp loads a second
    # time into the output layer's buffer. On the CPU both share the file's mapping; offloaded,
    # the copy is GPU memory (1,002 MiB for an 8B-shaped model, measured on an H200).
    tied_head: bool = False

    @classmethod
    def from_gguf(cls, path: Path | str) -> ModelShape:
        meta, tensors = read_tensor_infos(path)
        return cls.from_header(meta, tensors)

    @classmethod
    def from_header(cls, meta: Mapping[str, Any], tensors: Iterable[TensorInfo]) -> ModelShape:
        facts = model_facts(dict(meta))
        n_layer = facts["n_layer"]
        if not (n_layer and facts["n_embd"] and facts["n_head"]):
            raise ConfigError(
                f"the GGUF lacks the dimensions the planner needs "
                f"(architecture {facts['architecture']!r})"
            )
        layers = [0] * n_layer
        input_bytes = output_bytes = 0
        n_vocab = facts["vocab_size"] or 0
        tied_head = True
        for t in tensors:
            tied_head = tied_head and t.name != "output.weight"
            size = tensor_bytes(t.ggml_type, t.shape)
            match = re.match(r"blk\.(\d+)\.", t.name)
            if match and int(match.group(1)) < n_layer:
                layers[int(match.group(1))] += size
            elif t.name.startswith("token_embd"):
                input_bytes += size
                n_vocab = n_vocab or (t.shape[1] if len(t.shape) > 1 else 0)
            else:
                output_bytes += size
        return cls(
            architecture=facts["architecture"],
            n_layer=n_layer,
            n_embd=facts["n_embd"],
            n_head=facts["n_head"],
            n_head_kv=facts["n_head_kv"] or facts["n_head"],
            key_length=facts["key_length"],
            value_length=facts["value_length"],
            n_ff=facts["n_ff"] or 4 * facts["n_embd"],
            n_vocab=n_vocab,
            n_ctx_train=facts["n_ctx_train"],
            layer_bytes=tuple(layers),
            input_bytes=input_bytes,
            output_bytes=output_bytes,
            rope={
                "freq_base": facts["rope_freq_base"],
                "scaling": facts["rope_scaling"],
                "scaling_factor": facts["rope_scaling_factor"],
                "orig_ctx": facts["rope_orig_ctx"],
            },
            tied_head=tied_head,
        )

    def kv_bytes_per_cell_layer(self, type_k: str, type_v: str) -> int:
        """One cell's K and V bytes in one layer."""
        return _kv_row_bytes(type_k, self.n_head_kv * self.key_length) + _kv_row_bytes(
            type_v, self.n_head_kv * self.value_length
        )


def compute_bytes_estimate(
    shape: ModelShape, *, cells: int, n_ubatch: int, n_batch: int, flash_attn: bool
) -> int:
    """Peak of llama.cpp's worst-case graph (the one it reserves): an estimate, not a bound.

    The reserved graph evaluates ``min(cells, n_ubatch)`` tokens against all ``cells``. The live
    set at its peak is either a layer's (the attention mask, the residual stream, and the larger
    of the attention scores, ``cells x tokens x heads`` floats, softmax in place, none with
    flash attention, and the feed-forward activations) or, at the end, the logits of every
    output row. Checked against llama.cpp's "compute buffer size" on CPU.
    """
    tokens = min(cells, n_ubatch)
    outputs = min(tokens, n_batch)
    f32 = 4
    mask = cells * tokens * (2 if flash_attn else f32)
    residual = 4 * shape.n_embd * tokens * f32
    attention = (
        shape.n_head * shape.value_length * tokens * f32 * 2
        if flash_attn
        else cells * tokens * shape.n_head * f32
    )
    ffn = 3 * shape.n_ff * tokens * f32
    # The logits are computed last, once the mask and the layers' activations are released.
    logits = shape.n_vocab * outputs * f32 + 2 * shape.n_embd * outputs * f32
    return max(mask + residual + max(attention, ffn), logits)


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """What a configuration would allocate, split between GPU and CPU, and whether it fits."""

    n_ctx: int
    slots: int
    unified: bool
    summary_room: int
    kv_cells: int
    n_ctx_param: int  # what llama.cpp's context params get
    n_seq_max: int
    type_k: str
    type_v: str
    flash_attn: bool | None
    n_ubatch: int
    n_gpu_layers: int  # layers llama.cpp would offload, output layer included
    kv_bytes_per_token: int  # all layers, one cell
    kv_bytes: int
    kv_gpu_bytes: int
    weights_bytes: int
    weights_gpu_bytes: int
    compute_bytes: int
    output_bytes: int  # host buffer for the logits of each sequence
    gpu_bytes: int
    cpu_bytes: int
    vram: int | None
    ram: int | None
    fits: bool | None  # None when no limit was given
    n_ctx_train: int | None
    warnings: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["warnings"] = list(self.warnings)
        return out


def plan_memory(
    shape: ModelShape,
    *,
    n_ctx: int,
    slots: int = 1,
    unified: bool = True,
    summary_room: int = 0,
    type_k: str = "f16",
    type_v: str = "f16",
    flash_attn: bool | None = None,
    n_gpu_layers: int = -1,
    gpu: bool = False,
    n_ubatch: int = 512,
    n_batch: int = 512,
    vram: int | None = None,
    ram: int | None = None,
    rope_scaling: str | None = None,
    rope_freq_scale: float | None = None,
) -> MemoryPlan:
    """Size weights, KV cache and compute buffers for one configuration.

    ``gpu`` says whether the build can offload (``llama_supports_gpu_offload``); without it
    every layer stays on the CPU whatever ``n_gpu_layers`` says. llama.cpp offloads the *last*
    ``n_gpu_layers - 1`` repeating layers and the output layer; token embeddings stay on the
    CPU; a layer's KV cache lives with the layer. A tied head (``ModelShape.tied_head``) is
    loaded again with the output layer: offloaded, that copy is GPU memory.
    """
    flash = resolve_flash_attn(type_k, type_v, flash_attn)
    check_kv_types(type_k, type_v, shape.key_length, shape.value_length)
    cells = kv_cells(n_ctx, slots, unified, summary_room)
    n_ctx_param, n_seq_max = kv_context_size(n_ctx, slots, unified, summary_room)
    n_layer = shape.n_layer
    requested = n_layer + 1 if n_gpu_layers < 0 else n_gpu_layers
    offloaded = min(requested, n_layer + 1) if gpu else 0
    gpu_repeating = max(0, min(n_layer, offloaded - 1))
    gpu_layers = range(n_layer - gpu_repeating, n_layer)
    per_layer_kv = cells * shape.kv_bytes_per_cell_layer(type_k, type_v)
    kv_total = per_layer_kv * n_layer
    kv_gpu = per_layer_kv * gpu_repeating
    head_copy = shape.input_bytes if shape.tied_head and offloaded else 0
    weights = shape.input_bytes + shape.output_bytes + sum(shape.layer_bytes) + head_copy
    weights_gpu = sum(shape.layer_bytes[i] for i in gpu_layers) + (
        shape.output_bytes + head_copy if offloaded else 0
    )
    # llama.cpp's "auto" turns flash attention on wherever the device supports it (CPU does).
    compute = compute_bytes_estimate(
        shape, cells=cells, n_ubatch=n_ubatch, n_batch=n_batch, flash_attn=flash is not False
    )
    output = shape.n_vocab * 4 * n_seq_max
    gpu_bytes = kv_gpu + weights_gpu + (compute if offloaded else 0)
    cpu_bytes = (kv_total - kv_gpu) + (weights - weights_gpu) + output
    cpu_bytes += 0 if offloaded else compute
    fits: bool | None = None
    if vram is not None or ram is not None:
        fits = (vram is None or gpu_bytes <= vram) and (ram is None or cpu_bytes <= ram)
    warning = rope_warning(
        n_ctx,
        shape.n_ctx_train,
        rope_scaling=rope_scaling,
        rope_freq_scale=rope_freq_scale,
        model_scaling=shape.rope.get("scaling"),
    )
    return MemoryPlan(
        n_ctx=n_ctx,
        slots=slots,
        unified=unified,
        summary_room=summary_room,
        kv_cells=cells,
        n_ctx_param=n_ctx_param,
        n_seq_max=n_seq_max,
        type_k=type_k,
        type_v=type_v,
        flash_attn=flash,
        n_ubatch=n_ubatch,
        n_gpu_layers=offloaded,
        kv_bytes_per_token=per_layer_kv // cells * n_layer,
        kv_bytes=kv_total,
        kv_gpu_bytes=kv_gpu,
        weights_bytes=weights,
        weights_gpu_bytes=weights_gpu,
        compute_bytes=compute,
        output_bytes=output,
        gpu_bytes=gpu_bytes,
        cpu_bytes=cpu_bytes,
        vram=vram,
        ram=ram,
        fits=fits,
        n_ctx_train=shape.n_ctx_train,
        warnings=(warning,) if warning else (),
    )


def alternatives(
    shape: ModelShape, plan: MemoryPlan, options: Mapping[str, Any]
) -> list[tuple[str, MemoryPlan]]:
    """Changes that would make ``plan`` fit: smaller context, q8_0/q4_0 KV, fewer slots, a
    smaller micro-batch, fewer GPU layers. Each is the largest setting that fits; changes that
    cannot fit are left out."""
    out: list[tuple[str, MemoryPlan]] = []

    def again(**changes: Any) -> MemoryPlan | None:
        try:
            return plan_memory(shape, **(dict(options) | changes))
        except ConfigError:
            return None

    n_ctx = plan.n_ctx
    while n_ctx > 256:
        n_ctx = max(256, pad256(n_ctx // 2)) if n_ctx > 512 else 256
        candidate = again(n_ctx=n_ctx)
        if candidate and candidate.fits:
            out.append((f"--n-ctx {n_ctx}", candidate))
            break
    for kv in ("q8_0", "q4_0"):
        if (plan.type_k, plan.type_v) != (kv, kv):
            candidate = again(type_k=kv, type_v=kv, flash_attn=None)
            if candidate and candidate.fits:
                out.append((f"--type-k {kv} --type-v {kv}", candidate))
                break
    for slots in range(plan.slots - 1, 0, -1):
        candidate = again(slots=slots)
        if candidate and candidate.fits:
            out.append((f"--slots {slots}", candidate))
            break
    n_ubatch = plan.n_ubatch
    while n_ubatch > 32:
        n_ubatch //= 2
        candidate = again(n_ubatch=n_ubatch, n_batch=max(n_ubatch, 1))
        if candidate and candidate.fits:
            out.append((f"--n-ubatch {n_ubatch}", candidate))
            break
    for layers in range(plan.n_gpu_layers - 1, -1, -1):
        candidate = again(n_gpu_layers=layers)
        if candidate and candidate.fits:
            out.append((f"--n-gpu-layers {layers}", candidate))
            break
    return out


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": MIB, "g": 1024 * MIB, "t": 1024 * 1024 * MIB}


def parse_size(text: str) -> int:
    """``"24G"``, ``"512MiB"``, ``"1.5GB"`` or a byte count -> bytes (powers of 1024)."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"not a size: {text!r} (e.g. 24G, 512M, 1.5GiB)")
    unit = (match.group(2) or "").lower()[:1]
    return int(float(match.group(1)) * _UNITS[unit])


_BUFFER_LINE = re.compile(
    r"^\S*:\s*(?P<buft>\S+)\s+(?P<kind>KV|compute|model|output)\s+buffer size\s*=\s*"
    r"(?P<mib>[0-9.]+) MiB"
)
_OFFLOAD_LINE = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


def parse_allocations(lines: Iterable[str]) -> dict[str, Any]:
    """What llama.cpp says it allocated, from its load log ("KV buffer size = X MiB", ...).

    Returns bytes per kind (``kv``, ``compute``, ``model``, ``output``), the buffers by name,
    and ``offloaded``/``offloadable`` layers where the log has them. Sizes are printed in MiB
    with two decimals, so each is exact to about 5 KiB.
    """
    totals = {"kv": 0, "compute": 0, "model": 0, "output": 0}
    buffers: list[dict[str, Any]] = []
    offload: tuple[int, int] | None = None
    for line in lines:
        match = _BUFFER_LINE.search(line.strip())
        if match:
            size = round(float(match.group("mib")) * MIB)
            kind = match.group("kind").lower()
            totals[kind] += size
            buffers.append({"kind": kind, "buffer": match.group("buft"), "bytes": size})
            continue
        found = _OFFLOAD_LINE.search(line)
        if found:
            offload = (int(found.group(1)), int(found.group(2)))
    return {
        **{f"{k}_bytes": v for k, v in totals.items()},
        "buffers": buffers,
        "offloaded": offload[0] if offload else None,
        "offloadable": offload[1] if offload else None,
    }
