"""The dry run's backend: the tokenizer and a simulated KV cache, no weights."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from chatctx import ChatSession, GenerationSettings
from chatctx.backends.base import Backend
from chatctx.errors import ConfigError, GenerationError
from chatctx.model.codec import open_codec
from chatctx.monitor import totals
from chatctx.replay import DryBackend, ReplayConfig, Replayer, parse_logged
from chatctx.store import Store
from chatctx.synthetic import support_conversation

P = list(range(1000, 1005))  # the system prompt
A = list(range(2000, 2020))  # a turn the builder will evict
B = list(range(3000, 3020))  # a kept turn
C = [4000, 4001, 4002]  # the new message


def prefill(backend: DryBackend, prompt: list[int], **kw: Any) -> Any:
    return backend.generate(prompt, seq_id=0, **kw).wait(first_token_only=True)


def test_dry_backend_accounts_as_the_engine_does(tiny_llama3_path: Path) -> None:
    codec = open_codec(tiny_llama3_path)
    with DryBackend(codec, n_ctx=400 + 16, model_path=tiny_llama3_path) as backend:
        assert isinstance(backend, Backend)
        assert (backend.n_ctx, backend.side_room) == (512, 0)  # padded to 256, as Engine's
        assert backend.model_name == tiny_llama3_path.name
        info = backend.info()
        assert (info.n_ctx, info.slots, info.n_seq_max, info.gpu_offload) == (512, 1, 2, False)
        assert info.n_vocab > 0 and info.architecture == "llama"
        lease = backend.lease("c1")
        assert lease.seq_id == 0
        first = prefill(backend, P + A + B)
        assert (first.usage.reused_tokens, first.usage.evaluated_tokens) == (0, 45)
        assert (first.text, first.usage.generated_tokens, first.timings.ttft_ms) == ("", 0, None)
        # The same prompt again: its last token is evaluated all the same.
        again = prefill(backend, P + A + B)
        assert (again.usage.reused_tokens, again.usage.evaluated_tokens) == (44, 1)
        # A evicted: B is shifted to where A was, the old tail removed, C evaluated.
        shifted = prefill(backend, P + B + C, history_start=len(P))
        assert shifted.kv is not None
        assert (shifted.usage.reused_tokens, shifted.usage.evaluated_tokens) == (25, 3)
        kv = shifted.kv
        assert (kv.evicted_tokens, kv.shifted_tokens, kv.shift_count, kv.fallback) == (
            20,
            20,
            1,
            None,
        )
        assert backend.kv_usage() == {0: 28, 1: 0}
        assert backend.cached_tokens(0) == tuple(P + B + C)
        # Closed before it started: the cache is left as it was.
        unstarted = backend.generate(P, seq_id=0)
        unstarted.close()
        with pytest.raises(GenerationError, match="closed before it started"):
            unstarted.wait()
        assert backend.kv_usage() == {0: 28, 1: 0}
        backend.release(lease)
        with pytest.raises(GenerationError, match="does not fit n_ctx=512"):
            backend.generate(list(range(512)))
        with pytest.raises(ConfigError, match="cannot generate"):
            backend.side_generate(P, settings=GenerationSettings())
    with DryBackend(codec, n_ctx=400) as backend:
        prefill(backend, P + A + B)
        recomputed = prefill(backend, P + B + C, eviction="recompute", history_start=len(P))
        assert recomputed.kv is not None
        assert recomputed.usage.reused_tokens == 5
        assert (recomputed.kv.evicted_tokens, recomputed.kv.shifted_tokens) == (40, 0)
        assert recomputed.kv.fallback == "eviction policy is recompute"


def test_a_dry_replay_stores_what_a_chat_session_on_the_dry_backend_stores(
    tiny_llama3_path: Path, db_url: str
) -> None:
    # The oracle: the same turns recorded by a ChatSession on a DryBackend and an ordinary
    # (file) Store, read back as `chatctx stats` reads them.
    conv = parse_logged(json.dumps(support_conversation(30, seed=8)), line=1)
    config = ReplayConfig(mode="dry", budget=300)
    with Replayer(config, model=tiny_llama3_path) as replayer:
        report = replayer.replay(conv)
    codec = open_codec(tiny_llama3_path)
    with (
        Store(db_url) as store,
        DryBackend(codec, n_ctx=300 + 16, model_path=tiny_llama3_path) as backend,
        ChatSession.open(
            store,
            conversation_id=conv.id,
            model=backend,
            system_prompt=conv.system_prompt,
            settings=GenerationSettings(max_tokens=config.max_tokens, temperature=0.0),
            context=config.session_context(),
        ) as chat,
    ):
        for user, logged in conv.turns():
            chat.record_turn(user, logged or [{"role": "assistant", "content": ""}])
        stored = store.turns(conv.id)
    assert len(stored) == len(report.turns) == 30
    assert any(t.shifted_tokens for t in stored)
    assert any(t.plan and t.plan["evicted"] for t in stored)
    figures = ("prompt_tokens", "reused_tokens", "evaluated_tokens", "evicted_tokens")
    assert [[getattr(t, f) for f in figures] for t in report.turns] == [
        [getattr(t, f) for f in figures] for t in stored
    ]
    assert [t.shifted_tokens for t in report.turns] == [t.shifted_tokens for t in stored]
    for t in stored:
        assert t.cells_used == {"0": t.prompt_tokens, "1": 0}
        assert (t.n_ctx, t.model, t.ttft_ms, t.generated_tokens) == (
            512,
            tiny_llama3_path.name,
            None,
            0,
        )
    # One set of totals: replay's summary holds `chatctx stats`'s for the same turns.
    summary = report.summary()
    for key, value in totals(stored).as_dict().items():
        if key not in ("summary_ms", "queue_p50_ms", "queue_p95_ms"):  # wall-clock times
            assert summary[key] == value, key


def test_dry_backend_keeps_what_llama_server_keeps(tiny_llama3_path: Path) -> None:
    # Hand-computed: deletions are stepped over, an insertion hides what follows it.
    codec = open_codec(tiny_llama3_path)
    with DryBackend(codec, n_ctx=400, cache_edits="deletions") as backend:
        assert backend.cache_edits == "deletions"
        backend.lease("c1")
        prefill(backend, P + A + B)
        deleted = prefill(backend, P + B + C)
        assert (deleted.usage.reused_tokens, deleted.usage.evaluated_tokens) == (25, 3)
        assert deleted.kv is not None and deleted.kv.shifted_tokens == 20
        inserted = prefill(backend, P + C + B + C)
        assert (inserted.usage.reused_tokens, inserted.usage.evaluated_tokens) == (5, 26)
    with DryBackend(codec, n_ctx=400, cache_edits="prefix") as backend:
        backend.lease("c1")
        prefill(backend, P + A + B)
        assert prefill(backend, P + B + C).usage.reused_tokens == 5
    with pytest.raises(ConfigError, match="cache_edits"):
        DryBackend(codec, n_ctx=400, cache_edits="shift")


def test_append_layout_survives_a_restart(tiny_llama3_path: Path, tmp_path: Path) -> None:
    # The same chat twice, once with the session (and its builder) opened again midway: the
    # summary's blocks come back from the store, so every prompt is the same token array,
    # and every turn evaluates what is new at the end of its prompt only: the messages the
    # previous prompt did not have (the dry cache holds exactly that prompt).
    from tests.walk import kept_in, server_walk

    codec = open_codec(tiny_llama3_path)
    chat = support_conversation(24, seed=3)["messages"]
    users = [m["content"] for m in chat if m["role"] == "user"]
    replies = [m["content"] for m in chat if m["role"] == "assistant"]
    runs: dict[str, list[list[int]]] = {}
    for mode in ("straight", "reopened"):
        url = f"sqlite:///{tmp_path / mode}.db"
        prompts: list[list[int]] = []
        previous: list[dict[str, Any]] = []
        evictions = 0
        with DryBackend(codec, n_ctx=512, cache_edits="deletions") as backend:
            context = {"budget": 300, "recall": False}
            session = ChatSession.open(url, conversation_id="c", backend=backend, context=context)
            for n, (user, reply) in enumerate(zip(users, replies, strict=False)):
                if mode == "reopened" and n == len(users) // 2:
                    session.close()
                    session = ChatSession.open(url, conversation_id="c", backend=backend)
                cached = list(backend.cached_tokens(0))
                result = session.record_turn(user, reply)
                built = session.last_build
                assert built is not None and built.plan.layout == "append"
                found = kept_in(built.messages, previous)
                k = found.index(None)
                assert set(found[k:]) == {None}  # kept in order, new text at the end only
                tail = len(built.tokens) - len(
                    codec.prompt_tokens(built.messages[:k], add_generation_prompt=False)
                )
                # llama-server's walk of the cache (the 4-token chunk LlamaServerBackend
                # sends), and what it may leave: the new end and kept runs under the chunk
                walked = server_walk(cached, built.tokens, 4)
                assert result.usage.evaluated_tokens == len(built.tokens) - walked
                kept = [j for j in found[:k] if j is not None]
                spans = 1 + sum(1 for a, b in itertools.pairwise(kept) if b != a + 1)
                if n:
                    assert result.usage.evaluated_tokens <= tail + 4 * spans
                evictions += built.plan.evicted and built.plan.summary_changed
                prompts.append(list(built.tokens))
                previous = [dict(m) for m in built.messages]
            session.close()
        assert evictions >= 2
        runs[mode] = prompts
    assert runs["reopened"] == runs["straight"]
