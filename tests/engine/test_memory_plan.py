"""The memory planner against hand arithmetic, the gguf package, and llama.cpp's own log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from chatctx.backends.engine import Engine
from chatctx.backends.engine._native import NativeContext, NativeModel
from chatctx.backends.engine._native_info import capture_llama_log, measure_allocations
from chatctx.errors import ConfigError, ModelError
from chatctx.model.gguf import TensorInfo
from chatctx.model.memory import (
    GGML_TYPES,
    ModelShape,
    kv_cells,
    parse_allocations,
    parse_size,
    plan_memory,
    resolve_flash_attn,
)
from chatctx.settings import EngineConfig
from chatctx.testing import write_tiny_llama3


@pytest.fixture(scope="module")
def tiny32_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama 3 whose heads hold 32 values: one q8_0/q4_0 block per head.

    The session's tiny model has 16-value heads, which no quantized KV type can store.
    """
    return write_tiny_llama3(
        tmp_path_factory.mktemp("models") / "tiny32.gguf",
        n_embd=128,
        n_head=4,
        n_head_kv=2,
        n_ff=256,
        n_ctx_train=1024,
    )


def measured(path: Path, **options: object) -> tuple[int, dict[str, object]]:
    shape = ModelShape.from_gguf(path)
    plan = plan_memory(shape, **options)  # type: ignore[arg-type]
    lines = measure_allocations(
        path,
        n_ctx=plan.n_ctx_param,
        n_seq_max=plan.n_seq_max,
        kv_unified=plan.unified,
        type_k=plan.type_k,
        type_v=plan.type_v,
        flash_attn=plan.flash_attn,
        n_ubatch=plan.n_ubatch,
    )
    return plan.kv_bytes, parse_allocations(lines)


def test_type_table_matches_gguf_package() -> None:
    gguf = pytest.importorskip("gguf")
    for type_id, (name, block, size) in GGML_TYPES.items():
        if name == "q8_1":  # gguf-py lists float d and s (40); ggml's block has two halves (36)
            continue
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)] == (block, size)


def test_kv_cells_rule() -> None:
    assert kv_cells(1000, 3, True) == 3072  # pad256(3000)
    assert kv_cells(1000, 3, True, summary_room=200) == 3328  # pad256(3200)
    assert kv_cells(1000, 3, False) == 4 * 1024  # 3 slots + 1 summary stream of pad256(1000)
    assert kv_cells(4096) == 4096
    with pytest.raises(ConfigError):
        kv_cells(0)


def test_smollm2_kv_by_hand(smollm2_path: Path) -> None:
    shape = ModelShape.from_gguf(smollm2_path)
    # 30 layers, 3 KV heads of 64 values for K and for V
    f16 = plan_memory(shape, n_ctx=4096)
    assert f16.kv_bytes == 4096 * 30 * (3 * 64 * 2) * 2
    # q8_0: 192 values = 6 blocks of 34 bytes, for K and for V
    q8 = plan_memory(shape, n_ctx=4096, type_k="q8_0", type_v="q8_0")
    assert q8.kv_bytes == 4096 * 30 * (6 * 34) * 2 and q8.flash_attn is True
    # 2 slots of 1000 in split streams: 3 streams of 1024 cells; q4_0 = 6 blocks of 18 bytes
    q4 = plan_memory(shape, n_ctx=1000, slots=2, unified=False, type_k="q4_0", type_v="q4_0")
    assert q4.kv_cells == 3 * 1024 and q4.kv_bytes == 3 * 1024 * 30 * (6 * 18) * 2


@pytest.mark.slow
def test_smollm2_weights_match_gguf_reader(smollm2_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(smollm2_path))
    expected = sum(int(t.n_bytes) for t in reader.tensors)
    assert plan_memory(ModelShape.from_gguf(smollm2_path), n_ctx=512).weights_bytes == expected


def within(planned: int, actual: int, share: float = 0.10) -> bool:
    return abs(planned - actual) <= share * actual


@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
@pytest.mark.parametrize(("n_ctx", "slots", "unified"), [(2048, 1, True), (700, 3, False)])
def test_tiny_llama3_planned_vs_llama_cpp(
    tiny32_path: Path, kv: str, n_ctx: int, slots: int, unified: bool
) -> None:
    planned, alloc = measured(
        tiny32_path, n_ctx=n_ctx, slots=slots, unified=unified, type_k=kv, type_v=kv
    )
    assert alloc["kv_bytes"], "llama.cpp logged no KV buffer"
    assert within(planned, int(alloc["kv_bytes"])), (planned, alloc["kv_bytes"])  # type: ignore[call-overload]


def test_session_tiny_llama3_f16_planned_vs_llama_cpp(tiny_llama3_path: Path) -> None:
    planned, alloc = measured(tiny_llama3_path, n_ctx=4096, slots=2)
    assert within(planned, int(alloc["kv_bytes"]))  # type: ignore[call-overload]
    # Its 16-value heads cannot hold 32-value blocks: refused before llama.cpp aborts on it.
    with pytest.raises(ConfigError, match="blocks of 32"):
        plan_memory(ModelShape.from_gguf(tiny_llama3_path), n_ctx=512, type_k="q8_0")


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0"])
def test_smollm2_planned_vs_llama_cpp(smollm2_path: Path, kv: str) -> None:
    planned, alloc = measured(smollm2_path, n_ctx=2048, slots=2, type_k=kv, type_v=kv)
    assert within(planned, int(alloc["kv_bytes"])), (planned, alloc["kv_bytes"])  # type: ignore[call-overload]
    weights = plan_memory(ModelShape.from_gguf(smollm2_path), n_ctx=512).weights_bytes
    assert within(weights, int(alloc["model_bytes"]))  # type: ignore[call-overload]


def test_parse_allocations_reads_llama_cpp_lines() -> None:
    lines = [
        "load_tensors: offloaded 31/31 layers to GPU",
        "load_tensors:   CPU_Mapped model buffer size =    98.30 MiB",
        "llama_kv_cache:        CPU KV buffer size =    90.00 MiB",
        "llama_context:        CPU  output buffer size =     0.19 MiB",
        "llama_context:        CPU compute buffer size =   108.76 MiB",
    ]
    alloc = parse_allocations(lines)
    assert alloc["kv_bytes"] == 90 * 2**20
    assert alloc["model_bytes"] == round(98.30 * 2**20)
    assert alloc["offloaded"] == 31 and alloc["offloadable"] == 31
    assert parse_size("1.5G") == 3 * 2**29 and parse_size("512MiB") == 512 * 2**20


def test_quantized_v_needs_flash_attention(tiny32_path: Path) -> None:
    assert resolve_flash_attn("f16", "q8_0", None) is True
    assert resolve_flash_attn("q8_0", "f16", None) is None  # quantized K alone needs nothing
    config = EngineConfig(model_path=tiny32_path, type_v="q4_0")
    assert config.flash_attn is True
    assert EngineConfig(model_path=tiny32_path, flash_attn="auto").flash_attn is None  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="flash_attn is off"):
        EngineConfig(model_path=tiny32_path, type_v="q8_0", flash_attn=False)
    with pytest.raises(ConfigError, match="not a KV cache type"):
        EngineConfig(model_path=tiny32_path, type_k="q3_k")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="flash_attn is off"):
        Engine.load(tiny32_path, n_ctx=256, type_v="q8_0", flash_attn=False)
    with pytest.raises(ConfigError, match="flash_attn is off"):
        plan_memory(ModelShape.from_gguf(tiny32_path), n_ctx=256, type_v="q8_0", flash_attn=False)


def test_quantized_kv_engine_generates(tiny32_path: Path) -> None:
    with Engine.load(tiny32_path, n_ctx=256, type_k="q8_0", type_v="q8_0") as engine:
        assert engine.config.flash_attn is True
        assert engine.n_ctx == 256


def _context(path: Path, **rope: Any) -> list[str]:
    with capture_llama_log() as lines:
        model = NativeModel(path)
        try:
            NativeContext(
                model,
                n_ctx=2048,
                n_batch=64,
                n_ubatch=64,
                n_seq_max=1,
                kv_unified=True,
                flash_attn=None,
                type_k="f16",
                type_v="f16",
                n_threads=1,
                **rope,
            ).close()
        finally:
            model.close()
    return list(lines)


def test_rope_settings_reach_llama_cpp_and_overflow_warns(
    tiny32_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # tiny32 was trained on 1,024 positions
    with caplog.at_level(logging.WARNING, logger="chatctx.backends.engine"):
        lines = _context(tiny32_path)
    assert any("exceeds the model's trained context 1024" in r.message for r in caplog.records)
    assert any("freq_scale" in m and m.rstrip().endswith("= 1") for m in lines)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="chatctx.backends.engine"):
        lines = _context(
            tiny32_path, rope_scaling="linear", rope_freq_scale=0.5, rope_freq_base=10000.0
        )
    assert not any("exceeds the model's trained context" in r.message for r in caplog.records)
    # llama.cpp's own report of the context it made
    context = [m for m in lines if m.startswith("llama_context:")]
    assert any("freq_scale" in m and "0.5" in m for m in context), context
    assert any("freq_base" in m and "10000.0" in m for m in context), context


def test_block_rule_is_llama_cpps_own(
    tiny_llama3_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without chatctx's check, llama.cpp refuses the same q8_0 cache on 16-value heads."""
    import chatctx.model.memory as memory

    monkeypatch.setattr(memory, "check_kv_types", lambda *args: None)
    model = NativeModel(tiny_llama3_path)
    try:
        with pytest.raises(ModelError, match="does not divide"):
            NativeContext(
                model,
                n_ctx=256,
                n_batch=32,
                n_ubatch=32,
                n_seq_max=1,
                kv_unified=True,
                flash_attn=True,
                type_k="q8_0",
                type_v="f16",
                n_threads=1,
            )
    finally:
        model.close()


# llama.cpp's own weight buffers for bench/gpu_check.py's 8B-shaped random model (tied head,
# f16 matrices) with every layer offloaded on an NVIDIA H200: CUDA build of llama-cpp-python
# 0.3.36, `python bench/gpu_check.py --shape 8b` on 2026-12-04 (bench/README.md, "On a GPU").
H200_8B_MODEL_BUFFERS = {"CPU_Mapped": 1_050_673_152, "CUDA0": 15_010_386_412}


def llama3_8b_header(*, head: bool) -> tuple[dict[str, Any], list[TensorInfo]]:
    """The tensor table bench/gpu_check.py's 8B shape writes, by hand (f16 = 1, f32 = 0)."""
    n_embd, n_layer, n_kv, n_ff, n_vocab, head_dim = 4096, 32, 8, 14336, 128256, 128
    tensors = [
        TensorInfo("token_embd.weight", (n_embd, n_vocab), 1),
        TensorInfo("output_norm.weight", (n_embd,), 0),
    ]
    if head:
        tensors.append(TensorInfo("output.weight", (n_embd, n_vocab), 1))
    for i in range(n_layer):
        matrices = {
            "attn_q": (n_embd, n_embd),
            "attn_k": (n_embd, n_kv * head_dim),
            "attn_v": (n_embd, n_kv * head_dim),
            "attn_output": (n_embd, n_embd),
            "ffn_gate": (n_embd, n_ff),
            "ffn_up": (n_embd, n_ff),
            "ffn_down": (n_ff, n_embd),
        }
        tensors += [
            TensorInfo(f"blk.{i}.{name}.weight", dims, 1) for name, dims in matrices.items()
        ]
        tensors += [
            TensorInfo(f"blk.{i}.{n}.weight", (n_embd,), 0) for n in ("attn_norm", "ffn_norm")
        ]
    meta = {
        "general.architecture": "llama",
        "llama.block_count": n_layer,
        "llama.embedding_length": n_embd,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": n_kv,
        "llama.feed_forward_length": n_ff,
        "llama.context_length": 8192,
    }
    return meta, tensors


def test_a_tied_head_offloaded_is_a_second_copy_on_the_gpu() -> None:
    # Without output.weight llama.cpp loads token_embd again as the head, with the output
    # layer: on the GPU once offloaded, while the input copy stays in the CPU mapping.
    shape = ModelShape.from_header(*llama3_8b_header(head=False))
    assert shape.tied_head
    plan = plan_memory(shape, n_ctx=8192, gpu=True)
    assert within(plan.weights_gpu_bytes, H200_8B_MODEL_BUFFERS["CUDA0"], 0.001)
    on_cpu = plan.weights_bytes - plan.weights_gpu_bytes
    assert within(on_cpu, H200_8B_MODEL_BUFFERS["CPU_Mapped"], 0.001)
    # On the CPU alone both names share the file's mapping: the weights are the file's tensors.
    cpu_only = plan_memory(shape, n_ctx=8192, gpu=False)
    assert cpu_only.weights_bytes == shape.input_bytes + shape.output_bytes + sum(shape.layer_bytes)
    assert cpu_only.weights_gpu_bytes == 0


def test_a_separate_head_is_loaded_once() -> None:
    shape = ModelShape.from_header(*llama3_8b_header(head=True))
    assert not shape.tied_head
    plan = plan_memory(shape, n_ctx=8192, gpu=True)
    # A head of its own takes the GPU room the tied head's copy took: the H200's CUDA0 buffer.
    assert within(plan.weights_gpu_bytes, H200_8B_MODEL_BUFFERS["CUDA0"], 0.001)
    assert plan.weights_bytes - plan.weights_gpu_bytes == shape.input_bytes
    assert plan.weights_bytes == shape.input_bytes + shape.output_bytes + sum(shape.layer_bytes)
