"""In-place eviction: spans removed and positions shifted exactly as planned."""

from __future__ import annotations

from pathlib import Path

import pytest

from chatctx import ChatSession, Engine, Store
from chatctx.engine import plan_reuse
from chatctx.synthetic import support_conversation


def assert_mirror_matches_kv(engine: Engine, seq_id: int = 0) -> None:
    cached = engine.cached_tokens(seq_id)
    assert engine.kv_cells(seq_id) == len(cached)
    if cached:
        assert engine.context.seq_pos_min(seq_id) == 0
        assert engine.context.seq_pos_max(seq_id) == len(cached) - 1


@pytest.mark.slow
def test_200_turn_replay_keeps_the_mirror_exact(db_url: str, tiny_llama3_path: Path) -> None:
    conv = support_conversation(200, seed=11)
    messages = conv["messages"]
    shifted_turns = inserted_turns = 0
    with (
        Engine.load(tiny_llama3_path, n_ctx=640, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            conversation_id="r",
            model=engine,
            system_prompt=messages[0]["content"],
            context={"budget": 512, "reserve": 16, "eviction": "shift"},
        ) as chat,
    ):
        for user, reply in zip(messages[1::2], messages[2::2], strict=True):
            cached = list(engine.cached_tokens(0))
            built = chat.plan(user["content"])
            history_start = built.plan.history_start
            expected = plan_reuse(cached, built.tokens, history_start=history_start)
            result = chat.record_turn(user["content"], reply["content"])
            turn = result.turn
            assert turn is not None and result.plan is not None
            assert result.plan.prompt_tokens == len(built.tokens)
            # The engine did exactly what the plan says.
            assert turn.reused_tokens == expected.prefix + expected.chunk_len
            assert turn.evicted_tokens == len(cached) - expected.prefix - expected.chunk_len
            assert turn.shifted_tokens == (expected.chunk_len if expected.delta else 0)
            shifted_turns += bool(turn.shifted_tokens)
            inserted_turns += bool(expected.inserted and turn.shifted_tokens)
            # The mirror equals llama.cpp's KV cache and holds exactly the prompt.
            assert_mirror_matches_kv(engine, 0)
            assert engine.cached_tokens(0) == tuple(built.tokens)
            assert engine.kv_cells(1) == 0  # the spare sequence is left empty
    assert shifted_turns >= 5 and inserted_turns >= 1
    with Store(db_url) as store:
        assert len(store.turns("r")) == 200


@pytest.mark.parametrize("model", ["llama3", "smollm2"])
def test_logits_after_a_shift_stay_close_to_recompute(
    model: str, tiny_llama3_path: Path, smollm2_path: Path
) -> None:
    path = tiny_llama3_path if model == "llama3" else smollm2_path
    with Engine.load(path, n_ctx=1024) as engine:

        def turn(i: int) -> list[dict[str, str]]:
            return [
                {"role": "user", "content": f"Question {i}: my order NH-{4000 + i} is late."},
                {"role": "assistant", "content": f"Answer {i}: it ships on day {i}."},
            ]

        system = [{"role": "system", "content": "You are a helpful support agent."}]
        old = system + [m for i in range(6) for m in turn(i)]
        new = (
            system
            + [m for i in range(3, 6) for m in turn(i)]
            + [{"role": "user", "content": "And what about my refund?"}]
        )
        engine.prefill(engine.prompt_tokens(old, add_generation_prompt=False))
        prompt = engine.prompt_tokens(new)
        history_start = len(engine.prompt_tokens(system, add_generation_prompt=False))
        shifted = engine.prefill(prompt, eviction="shift", history_start=history_start)
        assert shifted.kv is not None and shifted.kv.shifted_tokens > 0
        logits_shift = engine.context.logits(-1)
        engine.clear()
        engine.prefill(prompt, eviction="recompute")
        logits_full = engine.context.logits(-1)
    # The kept turns' K/V were computed while the evicted turns were visible: an
    # approximation (bench/README.md measures it). Here, a deliberately repetitive chat, it
    # must stay bounded and the shifted choice must be one the full recompute ranks highly.
    diff = max(abs(a - b) for a, b in zip(logits_shift, logits_full, strict=True))
    scale = max(abs(v) for v in logits_full)
    assert diff < 0.25 * scale, (diff, scale)
    top5 = sorted(range(len(logits_full)), key=logits_full.__getitem__, reverse=True)[:5]
    assert max(range(len(logits_shift)), key=logits_shift.__getitem__) in top5


def test_shift_round_trip_restores_the_logits(tiny_llama3_path: Path) -> None:
    # The mechanics alone: moving cached keys by +64 positions and back re-ropes them twice;
    # the next-token logits must match a cache that never moved.
    with Engine.load(tiny_llama3_path, n_ctx=512) as engine:
        prompt = engine.prompt_tokens([{"role": "user", "content": "order NH-1 " * 30}])
        engine.prefill(prompt)
        before = engine.context.logits(-1)
        ctx = engine.context
        ctx.seq_add(0, 10, len(prompt), 64)
        ctx.seq_add(0, 74, len(prompt) + 64, -64)
        ctx.seq_rm(0, len(prompt) - 1, -1)  # evaluate the last token again over moved keys
        engine._mirror[0] = list(prompt[:-1])
        engine.prefill(prompt)
        after = engine.context.logits(-1)
        assert_mirror_matches_kv(engine)
    scale = max(abs(v) for v in before)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) < 0.01 * scale


@pytest.mark.slow
def test_generation_after_a_shift_is_coherent_on_smollm2(db_url: str, smollm2_path: Path) -> None:
    with (
        Engine.load(smollm2_path, n_ctx=768, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            conversation_id="g",
            model=engine,
            system_prompt="You are a support agent.",
            settings={"max_tokens": 32, "seed": 3},
            context={"budget": 400, "eviction": "shift"},
        ) as chat,
    ):
        replies = [
            chat.send(f"My router model AX{i}00 drops wifi, what should I try?") for i in range(12)
        ]
        assert_mirror_matches_kv(engine)
    # A turn's reply is generated right after its own prefill shifted the cache.
    after_shift = [r for r in replies if r.turn and r.turn.shifted_tokens]
    assert all(r.text.strip() for r in replies)
    assert after_shift and all(r.text.strip() for r in after_shift)


@pytest.mark.slow
def test_llm_summaries_run_on_the_side_sequence(db_url: str, smollm2_path: Path) -> None:
    conv = support_conversation(40, seed=5)
    messages = conv["messages"]
    with (
        Engine.load(smollm2_path, n_ctx=1536, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            conversation_id="s",
            model=engine,
            system_prompt=messages[0]["content"],
            context={"budget": 400, "reserve": 16, "summarizer": "llm", "summary_max_tokens": 48},
        ) as chat,
    ):
        evictions = []
        for user, reply in zip(messages[1::2], messages[2::2], strict=True):
            result = chat.record_turn(user["content"], reply["content"])
            if result.plan and result.plan.evicted:
                evictions.append(result)
            assert engine.kv_cells(1) == 0
            assert_mirror_matches_kv(engine, 0)
        system_tokens = evictions[0].plan.sections["system"] if evictions else 0
    assert evictions and any(r.plan.summary_changed for r in evictions)
    assert all(r.plan.summary_error is None for r in evictions)
    # Summarizing did not touch the chat's cache: the system prompt and the kept turns are
    # reused on the eviction turn right after the summary.
    for r in evictions:
        assert r.usage.reused_tokens >= system_tokens
    assert any(r.turn and r.turn.shifted_tokens for r in evictions)
