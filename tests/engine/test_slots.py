"""Many customers on one model: the slot pool, KV swap and continuous batching.

Oracles: the same conversation served alone on a fresh engine (token for token), llama.cpp's
own view of each sequence (positions, cell counts, state bytes) and its logits.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from chatctx import ChatSession
from chatctx.backends.engine import Engine
from chatctx.errors import ConfigError
from chatctx.settings import GenerationSettings
from chatctx.store import Store

GREEDY = {"temperature": 0.0, "max_tokens": 12, "repeat_penalty": 1.0}
WORDS = [
    *("order", "parcel", "refund", "invoice", "shipping", "address", "courier", "tracking"),
    *("warehouse", "label", "payment", "card", "delay", "box", "damaged", "colour", "size"),
    *("exchange", "voucher", "account", "password"),
]


def script(n: int, turns: int) -> list[str]:
    """User messages of conversation ``n``: long enough that the budget evicts turns."""
    rng = random.Random(n)
    return [
        f"Customer {n} turn {t}: my order {1000 + 17 * n + t} "
        + " ".join(rng.choice(WORDS) for _ in range(18 + rng.randrange(12)))
        + ("?" if t % 2 else ".")
        for t in range(turns)
    ]


CONTEXT = {"budget": 160, "reserve": 16, "summarizer": "extractive", "low": 0.5}


def engine_options(slots: int) -> dict[str, Any]:
    return {"n_ctx": 256, "slots": slots, "kv_unified": False, "n_batch": 256, "n_ubatch": 256}


def serve(engine: Engine, store: Store, cid: str, messages: list[str]) -> list[tuple[int, ...]]:
    with ChatSession.open(
        store, conversation_id=cid, model=engine, settings=GREEDY, context=CONTEXT
    ) as chat:
        out = []
        for text in messages:
            reply = chat.send(text)
            out.append(tuple(chat.engine.codec().encode(reply.text)))
        return out


def solo(model: Path, cid: str, messages: list[str], tmp: Path) -> list[tuple[int, ...]]:
    with (
        Engine.load(model, **engine_options(4), swap_dir=tmp / f"solo-{cid}") as engine,
        Store("sqlite://") as store,
    ):
        return serve(engine, store, cid, messages)


def test_twelve_customers_on_four_slots_match_solo_runs(
    tiny_llama3_path: Path, tmp_path: Path
) -> None:
    conversations = {f"c{n}": script(n, 5) for n in range(12)}
    replies: dict[str, list[tuple[int, ...]]] = {}
    errors: list[BaseException] = []
    with (
        Engine.load(tiny_llama3_path, **engine_options(4), swap_dir=tmp_path / "kv") as engine,
        Store(f"sqlite:///{tmp_path / 'bot.db'}") as store,
    ):
        start = threading.Barrier(len(conversations))

        def customer(cid: str) -> None:
            try:
                start.wait()
                replies[cid] = serve(engine, store, cid, conversations[cid])
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=customer, args=(c,)) for c in conversations]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        turns = [t for c in conversations for t in store.turns(c)]
        counters = engine.slot_table()["counters"]
        assert engine.batch_counters.max_sequences >= 2  # streams really shared decodes
    # The run really exercised the pool: swaps, evictions, changed summaries.
    assert counters["swap_out"] > 0 and counters["swap_in_ram"] > 0
    assert any(t.swap_in == "ram" for t in turns)
    assert any((t.evicted_tokens or 0) > 0 for t in turns)
    assert sum(1 for t in turns if (t.plan or {}).get("summary_changed")) > 0
    for cid, messages in conversations.items():
        assert replies[cid] == solo(tiny_llama3_path, cid, messages, tmp_path), cid


def snapshot(engine: Engine, seq: int) -> tuple[int, int, bytes]:
    """llama.cpp's own view of a sequence: positions and its state bytes."""
    ctx = engine.context
    with engine._lock:
        data = ctx.state_seq_get(seq) if ctx.seq_pos_max(seq) >= 0 else b""
        return ctx.seq_pos_min(seq), ctx.seq_pos_max(seq), data


def test_random_customers_never_touch_each_others_cells(
    tiny_llama3_path: Path, tmp_path: Path
) -> None:
    rng = random.Random(7)
    scripts = {f"r{n}": script(100 + n, 8) for n in range(5)}
    progress = dict.fromkeys(scripts, 0)
    with (
        Engine.load(
            tiny_llama3_path, n_ctx=256, slots=3, kv_unified=True, swap_dir=tmp_path / "kv"
        ) as engine,
        Store("sqlite://") as store,
    ):
        sessions = {
            cid: ChatSession.open(
                store, conversation_id=cid, model=engine, settings=GREEDY, context=CONTEXT
            )
            for cid in scripts
        }
        for _ in range(24):
            cid = rng.choice([c for c in scripts if progress[c] < len(scripts[c])])
            before = {seq: snapshot(engine, seq) for seq in range(engine.slots)}
            owners = {seq: engine.pool.owner_of(seq) for seq in range(engine.slots)}
            chat = sessions[cid]
            chat.send(scripts[cid][progress[cid]])
            progress[cid] += 1
            mine = chat.seq_id
            assert mine is not None
            for seq in range(engine.config.n_seq_max):
                cached = engine.cached_tokens(seq)
                lo, hi, _ = snapshot(engine, seq)
                # The mirror is what llama.cpp holds: positions 0..n-1, n cells.
                assert (lo, hi) == ((0, len(cached) - 1) if cached else (-1, -1)), seq
                assert engine.kv_cells(seq) == len(cached)
            for seq in range(engine.slots, engine.config.n_seq_max):
                assert engine.kv_cells(seq) == 0  # reserved: empty between turns
            # The turn's prompt is what its slot now starts with (builder's tokens).
            assert chat.last_build is not None
            prompt = chat.last_build.tokens
            assert engine.cached_tokens(mine)[: len(prompt)] == tuple(prompt)
            for seq in range(engine.slots):
                if seq == mine:
                    continue
                if owners[seq] == engine.pool.owner_of(seq):
                    # Another customer's slot: not one byte changed.
                    assert snapshot(engine, seq) == before[seq], seq
        for chat in sessions.values():
            chat.close()


def last_logits(engine: Engine, seq: int) -> list[float]:
    """Next-token logits of ``seq``: its last cached token decoded again (mirror unchanged)."""
    ctx = engine.context
    with engine._lock:
        tokens = engine._mirror[seq]
        ctx.seq_rm(seq, len(tokens) - 1, -1)
        index = ctx.decode(seq, [tokens[-1]], len(tokens) - 1, want_last_logits=True)
        return ctx.logits(index)


@pytest.mark.parametrize("ram_mb", [256, 0], ids=["ram", "disk"])
def test_swap_out_and_in_keeps_the_logits(
    tiny_llama3_path: Path, tmp_path: Path, ram_mb: int
) -> None:
    options: dict[str, Any] = {
        "n_ctx": 256,
        "slots": 1,
        "swap_ram_mb": ram_mb,
        "swap_dir": tmp_path / "kv",
    }
    prompt_a = list(range(1000, 1150))
    with Engine.load(tiny_llama3_path, **options) as engine:
        lease = engine.lease("a")
        engine.prefill(prompt_a, seq_id=lease.seq_id)
        before = last_logits(engine, lease.seq_id)
        engine.release(lease)
        other = engine.lease("b")  # takes a's slot: a is swapped out
        assert other.seq_id == lease.seq_id and engine.cached_tokens(other.seq_id) == ()
        engine.prefill(list(range(2000, 2100)), seq_id=other.seq_id)
        engine.release(other)
        back = engine.lease("a")
        assert back.swap_in == ("ram" if ram_mb else "disk")
        assert back.swap_in_bytes and back.swap_in_bytes > 0
        assert engine.cached_tokens(back.seq_id) == tuple(prompt_a)
        assert last_logits(engine, back.seq_id) == before
        # The restored cache is reused: only the new tail is evaluated.
        result = engine.prefill([*prompt_a, 7, 8, 9], seq_id=back.seq_id)
        assert result.usage.reused_tokens == len(prompt_a)
        kept = last_logits(engine, back.seq_id)
        engine.release(back)
    # After a restart, a is on disk (kept at close) and restored, not re-prefilled.
    with Engine.load(tiny_llama3_path, **options) as engine:
        again = engine.lease("a")
        assert again.swap_in == "disk" and again.reprefill_reason is None
        assert engine.cached_tokens(again.seq_id) == (*prompt_a, 7, 8, 9)
        assert last_logits(engine, again.seq_id) == kept
        engine.release(again)
    # Another layout (n_ctx) cannot use the state: re-prefill, with the reason.
    with Engine.load(tiny_llama3_path, **(options | {"n_ctx": 512})) as engine:
        lease = engine.lease("a")
        assert lease.swap_in is None
        assert lease.reprefill_reason and "n_ctx 256 != 512" in lease.reprefill_reason
        assert engine.cached_tokens(lease.seq_id) == ()


def test_threads_on_one_engine_get_their_own_tokens(tiny_llama3_path: Path) -> None:
    prompts = [[128000, *range(3000 + 50 * i, 3000 + 50 * i + 20 + 3 * i)] for i in range(8)]
    settings = GenerationSettings(**(GREEDY | {"max_tokens": 24}))
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        alone = [engine.generate(p, seq_id=0, settings=settings).wait().tokens for p in prompts]
        engine.clear(0)
    got: dict[int, tuple[int, ...]] = {}
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=8, kv_unified=False) as engine:
        start = threading.Barrier(len(prompts))

        def run(i: int) -> None:
            start.wait()
            got[i] = engine.generate(prompts[i], seq_id=i, settings=settings).wait().tokens

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert engine.batch_counters.max_sequences >= 2
    assert [got[i] for i in range(len(prompts))] == alone


def test_closing_the_engine_ends_running_streams(tiny_llama3_path: Path) -> None:
    # Long replies (about 8 s each here): 200 tokens took 0.8 s, and once, in CI, all four
    # had ended on their own before close() came.
    settings = GenerationSettings(temperature=0.0, max_tokens=2000)
    results: list[Any] = []
    errors: list[BaseException] = []
    engine = Engine.load(tiny_llama3_path, n_ctx=2048, slots=4)
    started = threading.Barrier(5)

    def run(i: int) -> None:
        try:
            generation = engine.generate([128000, 4000 + i, 17, 23], seq_id=i, settings=settings)
            chunks = iter(generation)
            next(chunks)
            started.wait()
            for _ in chunks:
                pass
            results.append(generation.result)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait()
    engine.close()
    for t in threads:
        t.join(30)
    assert not errors and len(results) == 4
    assert {r.stop_reason for r in results} <= {"closed", "eog", "length"}
    assert any(r.stop_reason == "closed" for r in results)


def test_seq_id_never_aliases_a_reserved_or_leased_slot(tiny_llama3_path: Path) -> None:
    with (
        Engine.load(tiny_llama3_path, n_ctx=256, slots=2) as engine,
        Store("sqlite://") as store,
    ):
        with pytest.raises(ConfigError, match="reserved"):
            ChatSession.open(store, conversation_id="x", model=engine, seq_id=2)
        with ChatSession.open(store, conversation_id="y", model=engine, seq_id=1):
            with pytest.raises(ConfigError, match="held by conversation 'y'"):
                ChatSession.open(store, conversation_id="z", model=engine, seq_id=1)
            # A leasing session never gets the pinned slot.
            with ChatSession.open(
                store, conversation_id="w", model=engine, settings=GREEDY
            ) as chat:
                chat.send("hello there")
                assert chat.seq_id == 0


def test_async_turns_match_sync_ones(tiny_llama3_path: Path) -> None:
    messages = {f"a{n}": script(200 + n, 2) for n in range(4)}
    with Engine.load(tiny_llama3_path, n_ctx=256, slots=2) as engine, Store("sqlite://") as store:
        expected = {cid: serve(engine, store, f"sync-{cid}", m) for cid, m in messages.items()}

        async def customer(cid: str) -> list[tuple[int, ...]]:
            with ChatSession.open(
                store, conversation_id=cid, model=engine, settings=GREEDY, context=CONTEXT
            ) as chat:
                out = []
                for i, text in enumerate(messages[cid]):
                    if i % 2:
                        reply = await chat.asend(text)
                        out.append(tuple(engine.codec().encode(reply.text)))
                    else:
                        chunks = [c async for c in chat.astream(text)]
                        out.append(tuple(engine.codec().encode("".join(chunks))))
                return out

        async def main() -> list[list[tuple[int, ...]]]:
            return await asyncio.gather(*(customer(c) for c in messages))

        got = dict(zip(messages, asyncio.run(main()), strict=True))
    assert got == expected


def test_a_long_prefill_does_not_stall_running_streams(tiny_llama3_path: Path) -> None:
    from chatctx.backends.engine._scheduler import PREFILL_CHUNK

    settings = GenerationSettings(temperature=0.0, max_tokens=400, repeat_penalty=1.0)
    with Engine.load(tiny_llama3_path, n_ctx=1024, slots=2, n_batch=1024) as engine:
        # What llama.cpp is asked to decode, call by call: sequence -> tokens in that call.
        calls: list[dict[int, int]] = []
        decode_many = engine.context.decode_many

        def recording(parts: Any) -> list[int]:
            calls.append({seq: len(tokens) for seq, tokens, _, _ in parts})
            return decode_many(parts)

        engine.context.decode_many = recording  # type: ignore[method-assign]
        running = engine.generate([128000, 5, 6, 7], seq_id=0, settings=settings)
        stream = iter(running)
        next(stream)  # decoding now
        long_prompt = [128000, *range(1000, 1000 + 3 * PREFILL_CHUNK)]
        newcomer = engine.generate(long_prompt, seq_id=1, settings=GenerationSettings(max_tokens=2))
        seen: list[str] = []
        waiter = threading.Thread(target=lambda: seen.extend(stream))
        waiter.start()
        newcomer.wait()
        running.close()
        waiter.join()
        # The calls that evaluated the long prompt, and where each lies among all calls.
        prefill = [(i, c[1]) for i, c in enumerate(calls) if 1 in c][: 3 + 1]
        sizes = [n for _, n in prefill]
        # In chunks ending at multiples of PREFILL_CHUNK (the first 768 tokens from position
        # 0, then the last one), each decoded alone: a prompt chunk's logits depend on the
        # tokens decoded beside it, and a reply must not depend on load.
        assert sizes == [PREFILL_CHUNK, PREFILL_CHUNK, PREFILL_CHUNK, 1]
        assert all(len(calls[i]) == 1 for i, _ in prefill)
        # The stream went on between the chunks: one token per step, never stalled longer.
        for (a, _), (b, _) in itertools.pairwise(prefill):
            assert [calls[k] for k in range(a + 1, b)] == [{0: 1}]
        assert newcomer.result is not None and newcomer.result.batch_max == 2


def test_no_state_is_saved_between_a_shift_and_the_next_decode(tiny_llama3_path: Path) -> None:
    from chatctx.errors import KVCacheError

    with Engine.load(tiny_llama3_path, n_ctx=256, slots=1) as engine:
        engine.prefill(list(range(1000, 1100)), seq_id=0)
        with engine._lock:
            engine.context.seq_rm(0, 0, 10)
            engine.context.seq_add(0, 10, -1, -10)
            with pytest.raises(KVCacheError, match="between a shift and the next decode"):
                engine.context.state_seq_get(0)


def test_states_in_ram_survive_a_restart(tiny_llama3_path: Path, tmp_path: Path) -> None:
    options: dict[str, Any] = {"n_ctx": 256, "slots": 1, "swap_dir": tmp_path / "kv"}
    with Engine.load(tiny_llama3_path, **options) as engine:
        for cid, base in (("a", 1000), ("b", 2000)):  # b takes a's slot: a goes to RAM
            lease = engine.lease(cid)
            engine.prefill(list(range(base, base + 80)), seq_id=lease.seq_id)
            engine.release(lease)
        where = {row["conversation"]: row["where"] for row in engine.slot_table()["swapped"]}
        assert where == {"a": "ram"}
    with Engine.load(tiny_llama3_path, **options) as engine:
        for cid, base in (("a", 1000), ("b", 2000)):
            lease = engine.lease(cid)
            assert lease.swap_in == "disk", cid
            assert engine.cached_tokens(lease.seq_id) == tuple(range(base, base + 80))
            assert engine.kv_cells(lease.seq_id) == 80  # llama.cpp's own count
            engine.release(lease)


def test_the_prefill_chunk_is_a_setting(tiny_llama3_path: Path) -> None:
    from chatctx.backends.engine._scheduler import PREFILL_CHUNK

    # No GPU here: unset, it is the CPU's 256; set, prompts go in chunks ending at its
    # multiples, and never more than n_batch.
    with Engine.load(tiny_llama3_path, n_ctx=1024) as engine:
        assert not engine.gpu_offload and engine.prefill_chunk == PREFILL_CHUNK == 256
    with Engine.load(tiny_llama3_path, n_ctx=1024, n_batch=96, prefill_chunk=500) as engine:
        assert engine.prefill_chunk == 96
    with Engine.load(tiny_llama3_path, n_ctx=1024, prefill_chunk=100) as engine:
        sizes: list[int] = []
        decode_many = engine.context.decode_many

        def recording(parts: Any) -> list[int]:
            sizes.extend(len(tokens) for _, tokens, _, _ in parts)
            return decode_many(parts)

        engine.context.decode_many = recording  # type: ignore[method-assign]
        engine.prefill([128000, *range(1000, 1130)])  # 131 tokens from position 0
        engine.prefill([128000, *range(1000, 1350)])  # 351: the first 131 are kept
        assert sizes == [100, 31, 69, 100, 51]
