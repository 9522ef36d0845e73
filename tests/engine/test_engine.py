from pathlib import Path

import pytest

from chatctx.config import GenerationSettings
from chatctx.engine import Engine
from chatctx.errors import ConfigError, KVCacheError, ModelError
from chatctx.testing import write_tiny_llama3

GREEDY = GenerationSettings(max_tokens=8, temperature=0.0)


def assert_mirror_matches_kv(engine: Engine, seq_id: int = 0) -> None:
    cached = engine.cached_tokens(seq_id)
    assert engine.kv_cells(seq_id) == len(cached)
    if cached:
        assert engine.context.seq_pos_min(seq_id) == 0
        assert engine.context.seq_pos_max(seq_id) == len(cached) - 1


def test_missing_model_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        Engine.load(tmp_path / "nope.gguf")


def test_file_that_is_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("hello, I am text")
    with pytest.raises(ModelError, match="not a GGUF"):
        Engine.load(path)


def test_gguf_without_chat_template_needs_a_format(tmp_path: Path) -> None:
    path = write_tiny_llama3(tmp_path / "no-template.gguf", chat_template=None)
    with pytest.raises(ModelError, match="has no chat template"):
        Engine.load(path, n_ctx=256)
    with Engine.load(path, n_ctx=256, chat_format="llama-3") as engine:
        assert engine.template.name == "llama-3"
        assert engine.prompt_tokens([{"role": "user", "content": "hi"}])[:2] == [128000, 128006]


def test_bad_engine_option_is_a_config_error(tiny_llama3_path: Path) -> None:
    with pytest.raises(ConfigError):
        Engine.load(tiny_llama3_path, n_ctx=-5)
    with pytest.raises(ConfigError):
        Engine.load(tiny_llama3_path, bogus=1)


def test_prefix_is_reused_and_mirror_matches_kv(llama3_engine: Engine) -> None:
    engine = llama3_engine
    engine.clear()
    messages = [{"role": "user", "content": "First question about order 77"}]
    first = engine.generate(engine.prompt_tokens(messages), settings=GREEDY).wait()
    assert first.usage.reused_tokens == 0
    assert_mirror_matches_kv(engine)
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And a second one"},
    ]
    prompt = engine.prompt_tokens(messages)
    second = engine.generate(prompt, settings=GREEDY).wait()
    # Everything up to the first reply's end is reused; the rest is evaluated.
    assert second.usage.reused_tokens >= first.usage.prompt_tokens
    assert second.usage.reused_tokens + second.usage.evaluated_tokens == len(prompt)
    assert_mirror_matches_kv(engine)
    assert engine.cached_tokens()[: len(prompt)] == tuple(prompt)


def test_same_prompt_twice_evaluates_one_token(llama3_engine: Engine) -> None:
    engine = llama3_engine
    prompt = engine.prompt_tokens([{"role": "user", "content": "repeat me"}])
    engine.generate(prompt, settings=GREEDY).wait()
    again = engine.generate(prompt, settings=GREEDY).wait()
    assert again.usage.evaluated_tokens == 1
    assert again.usage.reused_tokens == len(prompt) - 1


def test_interrupting_keeps_the_mirror_exact(llama3_engine: Engine) -> None:
    engine = llama3_engine
    engine.clear()
    generation = engine.generate(
        engine.prompt_tokens([{"role": "user", "content": "go"}]),
        settings=GenerationSettings(max_tokens=50, temperature=0.0),
    )
    next(iter(generation))
    generation.close()
    assert generation.result is not None
    assert generation.result.stop_reason == "interrupted"
    assert_mirror_matches_kv(engine)


def test_sequences_are_independent(llama3_engine: Engine) -> None:
    engine = llama3_engine
    engine.clear()
    a = engine.prompt_tokens([{"role": "user", "content": "sequence zero"}])
    b = engine.prompt_tokens([{"role": "user", "content": "sequence one, longer text"}])
    engine.generate(a, seq_id=0, settings=GREEDY).wait()
    engine.generate(b, seq_id=1, settings=GREEDY).wait()
    assert engine.cached_tokens(0)[: len(a)] == tuple(a)
    assert engine.cached_tokens(1)[: len(b)] == tuple(b)
    assert_mirror_matches_kv(engine, 0)
    assert_mirror_matches_kv(engine, 1)
    with pytest.raises(ConfigError):
        engine.generate(a, seq_id=2)


def test_full_kv_cache_is_a_kv_cache_error(tiny_llama3_path: Path) -> None:
    # Two sequences share 256 cells: once seq 0 holds 200, 100 more for seq 1 cannot fit.
    with Engine.load(tiny_llama3_path, n_ctx=256, n_seq_max=2, kv_unified=True) as engine:
        engine.generate(
            list(range(1000, 1200)), seq_id=0, settings=GenerationSettings(max_tokens=1)
        ).wait()
        with pytest.raises(KVCacheError, match="no KV cache slot") as info:
            engine.generate(
                list(range(2000, 2100)), seq_id=1, settings=GenerationSettings(max_tokens=1)
            ).wait()
        assert info.value.code == 1 and info.value.seq_id == 1
        assert_mirror_matches_kv(engine, 1)
        assert engine.cached_tokens(1) == ()


def test_smollm2_generates_text(smol_engine: Engine) -> None:
    prompt = smol_engine.prompt_tokens([{"role": "user", "content": "Say hello."}])
    result = smol_engine.generate(prompt, settings=GenerationSettings(max_tokens=16, seed=1)).wait()
    assert result.text.strip()
    assert result.timings.ttft_ms is not None and result.timings.ttft_ms > 0
    assert result.usage.generated_tokens > 0
