from pathlib import Path

import numpy as np
import pytest

from chatctx.backends.base import GenerationResult
from chatctx.backends.engine import Engine
from chatctx.errors import ConfigError, KVCacheError, ModelError
from chatctx.settings import GenerationSettings
from chatctx.testing import write_tiny_llama3
from tests.llama_counters import counted, prime_counters

GREEDY = GenerationSettings(max_tokens=8, temperature=0.0)


def assert_mirror_matches_kv(engine: Engine, seq_id: int = 0) -> None:
    cached = engine.cached_tokens(seq_id)
    assert engine.kv_cells(seq_id) == len(cached)
    if cached:
        assert engine.context.seq_pos_min(seq_id) == 0
        assert engine.context.seq_pos_max(seq_id) == len(cached) - 1


def last_logits(engine: Engine) -> np.ndarray:
    """The next-token logits the last decode left (its one batch row with logits)."""
    ctx = engine.context
    return np.asarray(ctx.logits(next(i for i in range(ctx.n_batch) if ctx.has_logits(i))))


def decoded_replies(result: GenerationResult) -> int:
    """Generated tokens fed back to llama.cpp: all but one sampled last (never needed)."""
    cut = result.stop_reason in ("length", "context_full")
    return len(result.tokens) - 1 if cut else len(result.tokens)


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


def test_prefix_is_reused_and_the_cache_holds_the_prompt(llama3_engine: Engine) -> None:
    engine = llama3_engine
    prime_counters(engine)
    messages = [{"role": "user", "content": "First question about order 77"}]
    first_prompt = engine.prompt_tokens(messages)
    before = counted(engine)
    first = engine.generate(first_prompt, settings=GREEDY).wait()
    # llama.cpp evaluated the whole prompt, then each generated token but the last.
    assert counted(engine) - before == len(first_prompt) + decoded_replies(first)
    assert first.usage.evaluated_tokens == len(first_prompt) and first.usage.reused_tokens == 0
    messages += [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "And a second one"},
    ]
    prompt = engine.prompt_tokens(messages)
    before = counted(engine)
    second = engine.prefill(prompt)
    evaluated = counted(engine) - before
    assert second.usage.evaluated_tokens == evaluated
    # The second prompt extends the first: at least all of it came from the cache.
    assert len(prompt) - evaluated >= len(first_prompt)
    # llama.cpp holds exactly the prompt: its positions, and its content (the next-token
    # logits equal a recompute of the prompt on the other, fresh sequence).
    assert engine.context.seq_pos_min(0) == 0 and engine.context.seq_pos_max(0) == len(prompt) - 1
    got = last_logits(engine)
    engine.clear(1)
    engine.prefill(prompt, seq_id=1)
    want = last_logits(engine)
    engine.clear(1)
    # Both sequences share one unified cache: the cells sit at other places, so the sums
    # run in another order; F32 accumulation keeps that difference below 1e-3.
    assert float(np.abs(got - want).max()) < 1e-3
    assert int(got.argmax()) == int(want.argmax())


def test_same_prompt_twice_evaluates_one_token(llama3_engine: Engine) -> None:
    engine = llama3_engine
    prime_counters(engine)
    prompt = engine.prompt_tokens([{"role": "user", "content": "repeat me"}])
    engine.generate(prompt, settings=GREEDY).wait()
    before = counted(engine)
    again = engine.prefill(prompt)
    # llama.cpp evaluated one token: the last, whose logits choose the reply.
    assert counted(engine) - before == again.usage.evaluated_tokens == 1
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
    # No summary room: the two sequences share 256 cells. Once seq 0 holds 200, 100 more
    # for seq 1 cannot fit.
    with Engine.load(
        tiny_llama3_path, n_ctx=256, n_seq_max=2, kv_unified=True, summary_room=0
    ) as engine:
        assert engine.info().kv_cells == 256
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


@pytest.mark.slow
def test_smollm2_generates_text(smol_engine: Engine) -> None:
    prime_counters(smol_engine)
    prompt = smol_engine.prompt_tokens([{"role": "user", "content": "Say hello."}])
    before = counted(smol_engine)
    result = smol_engine.generate(prompt, settings=GenerationSettings(max_tokens=16, seed=1)).wait()
    assert result.text.strip()
    assert counted(smol_engine) - before == len(prompt) + decoded_replies(result)
    assert result.usage.generated_tokens == len(result.tokens)
    assert result.text == smol_engine.detokenize(result.tokens)
