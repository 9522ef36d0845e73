"""The router over in-process engines: conversations stay where their cache is.

Oracles: each engine's own slot pool and llama.cpp's evaluated-token counters (which engine
holds a conversation's cells, what was prefilled), the store's rows read back by a second
router, and hand-computed load bounds.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from chatctx import (
    BackendUnavailable,
    ChatSession,
    ConfigError,
    DeadlineExceeded,
    Engine,
    GenerationError,
    GenerationSettings,
)
from chatctx.backends.router import SEQ_STRIDE, Router
from chatctx.store import Store
from tests.llama_counters import counted, prime_counters

GREEDY = GenerationSettings(max_tokens=4, temperature=0.0)


def _engine(path: Path, swap_dir: Path | None = None) -> Engine:
    return Engine.load(path, n_ctx=512, slots=3, swap_ram_mb=64, swap_dir=swap_dir)


@pytest.fixture
def engines(tiny_llama3_path: Path, tmp_path: Path) -> Iterator[dict[str, Engine]]:
    # Swap directories of their own, as on separate machines: no engine adopts another's.
    built = {name: _engine(tiny_llama3_path, tmp_path / name) for name in ("a", "b", "c")}
    try:
        yield built
    finally:
        for engine in built.values():
            engine.close()


def _talk(store: Store, router: Router, conversation: str, text: str) -> None:
    with ChatSession.open(
        store, conversation_id=conversation, model=router, settings=GREEDY
    ) as session:
        session.send(text)


def test_conversations_stay_on_one_engine_within_the_load_bound(
    engines: dict[str, Engine], db_url: str
) -> None:
    with Store(db_url) as store, Router(engines, store=store, health_interval=None) as router:
        ids = [f"customer-{i}" for i in range(12)]
        for turn in range(2):
            for cid in ids:
                _talk(store, router, cid, f"hello number {turn} from {cid}")
        placed = {cid: router.placement(cid) for cid in ids}
        bound = math.ceil(1.25 * 12 / 3)
        counts = Counter(placed.values())
        assert set(counts) <= set(engines) and max(counts.values()) <= bound
        for cid in ids:
            backends = {t.backend for t in store.turns(cid)}
            assert backends == {placed[cid]}, cid
            # The engine's own pool holds the conversation (in a slot or swapped out), and
            # no other engine has ever seen it.
            for name, engine in engines.items():
                holds = engine.pool.slot_of(cid) is not None or any(
                    row["conversation"] == cid for row in engine.kv_slots.swap.listing()
                )
                assert holds == (name == placed[cid]), (cid, name)
        # The second turn of each conversation reused its first: it ran where its cache was.
        for cid in ids:
            _, second = store.turns(cid)
            assert second.reused_tokens > 0 and second.slot is not None
            assert second.seq_id is not None and second.seq_id >= 0


def test_placement_survives_a_restart_of_the_bot_process(
    engines: dict[str, Engine], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'bot.db'}"
    ids = [f"c{i}" for i in range(6)]
    with Store(url) as store, Router(engines, store=store, health_interval=None) as router:
        for cid in ids:
            _talk(store, router, cid, "first message")
        before = {cid: router.placement(cid) for cid in ids}
    # A new process: a new store connection, a new router, the engines listed in another
    # order (names, not positions, are what placements keep).
    reordered = dict(reversed(list(engines.items())))
    with Store(url) as store, Router(reordered, store=store, health_interval=None) as router:
        for cid in ids:
            _talk(store, router, cid, "second message")
        for cid in ids:
            assert router.placement(cid) == before[cid]
            assert [t.backend for t in store.turns(cid)] == [before[cid]] * 2
            assert store.turns(cid)[1].reused_tokens > 0  # its cache was still there


def test_drain_moves_each_conversation_with_its_cache(
    engines: dict[str, Engine], db_url: str
) -> None:
    with Store(db_url) as store, Router(engines, store=store, health_interval=None) as router:
        ids = [f"d{i}" for i in range(6)]
        for cid in ids:
            _talk(store, router, cid, "tell me about the weather on the coast")
        source = Counter(router.placement(c) for c in ids).most_common(1)[0][0]
        assert source is not None
        on_source = [c for c in ids if router.placement(c) == source]
        moved = router.drain(source)
        assert moved == {"moved": len(on_source), "with_state": len(on_source)}
        for cid in on_source:
            target = router.placement(cid)
            assert target not in (None, source)
            engine = engines[target]
            prime_counters(engine, seq_id=engine.config.n_seq_max - 1)
            before_turn = counted(engine)
            _talk(store, router, cid, "and tomorrow?")
            last = store.turns(cid)[-1]
            assert last.backend == target and last.swap_in == "ram"
            assert last.reprefill_reason is None
            # llama.cpp evaluated only the new tokens and the reply: the cache came along.
            evaluated = counted(engine) - before_turn
            assert last.reused_tokens > 0
            assert evaluated <= last.prompt_tokens - last.reused_tokens + last.generated_tokens
            assert engines[source].pool.slot_of(cid) is None
        # The drained engine takes no new conversation until it is undrained.
        _talk(store, router, "newcomer", "hi")
        assert router.placement("newcomer") != source
        router.undrain(source)
        assert {s["backend"]: s["state"] for s in router.stats()}[source] == "up"


def test_a_closed_engine_fails_its_conversations_over(
    engines: dict[str, Engine], db_url: str
) -> None:
    with Store(db_url) as store, Router(engines, store=store, health_interval=None) as router:
        ids = [f"f{i}" for i in range(9)]
        for cid in ids:
            _talk(store, router, cid, "my order number is 4471")
        victim = Counter(router.placement(c) for c in ids).most_common(1)[0][0]
        assert victim is not None
        lost = [c for c in ids if router.placement(c) == victim]
        engines[victim].close()  # the backend is gone; the router learns it at next use
        for cid in ids:
            _talk(store, router, cid, "what was my order number?")
        for cid in ids:
            turns = store.turns(cid)
            users = [m for m in store.messages(cid) if m.role == "user"]
            assert len(users) == 2  # nothing the customer said is lost
            assert turns[-1].backend != victim
            if cid in lost:
                assert turns[-1].reprefill_reason is not None
                assert turns[-1].reprefill_reason.startswith("failover: moved from")
                assert turns[-1].reused_tokens == 0
            else:
                assert turns[-1].backend == turns[0].backend
        state = {s["backend"]: s for s in router.stats()}[victim]
        assert state["state"] == "down" and state["conversations"] == 0
        assert store.placement_counts().get(victim) is None


def test_a_moved_conversation_that_waits_out_its_first_lease_still_says_why(
    engines: dict[str, Engine], db_url: str
) -> None:
    # No store behind the router: the reason of a move lives in the router alone.
    with Store(db_url) as store, Router(engines, health_interval=None) as router:
        ids = [f"w{i}" for i in range(6)]
        for cid in ids:
            _talk(store, router, cid, "my order number is 4471")
        victim = Counter(router.placement(c) for c in ids).most_common(1)[0][0]
        assert victim is not None
        moved = next(c for c in ids if router.placement(c) == victim)
        engines[victim].close()
        router.check()  # the health check finds it down: its conversations move
        target = router.placement(moved)
        assert target is not None and target != victim
        held = [engines[target].lease(f"hold{i}") for i in range(3)]  # every slot busy
        with pytest.raises(DeadlineExceeded):
            router.lease(moved, timeout=0.2)
        for lease in held:
            engines[target].release(lease)
        _talk(store, router, moved, "what was my order number?")
        reason = store.turns(moved)[-1].reprefill_reason
        assert reason is not None and reason.startswith(f"failover: moved from {victim}")


def test_a_health_check_that_fails_oddly_does_not_stop_the_round(
    engines: dict[str, Engine],
) -> None:
    def refused() -> None:  # a proxy in front of the server answers 403, say
        raise GenerationError("health check refused (403)")

    with Router(engines, health_interval=None) as router:
        engines["a"].health = refused  # type: ignore[attr-defined]
        engines["c"].close()
        router.check()
        states = {row["backend"]: row["state"] for row in router.stats()}
        assert states == {"a": "down", "b": "up", "c": "down"}


def test_router_sequence_ids_name_their_backend(engines: dict[str, Engine]) -> None:
    with Router(engines, health_interval=None) as router:
        lease = router.lease("x")
        index = router.names.index(lease.backend or "")
        assert lease.seq_id // SEQ_STRIDE == index
        assert engines[lease.backend or ""].pool.slot_of("x") is not None
        router.release(lease)


def test_router_refuses_backends_of_different_models(
    tiny_llama3_path: Path, smol_engine: Engine
) -> None:
    with _engine(tiny_llama3_path) as tiny, pytest.raises(ConfigError, match="one model"):
        Router([tiny, smol_engine], health_interval=None)


class _Cut:
    """An engine behind a link that can be cut: once ``cut``, its health check and every
    generation fail the way a llama-server that went away does (before the first token)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cut = False
        self.name = "flaky"

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def health(self) -> None:
        if self.cut:
            raise BackendUnavailable("connection refused", backend=self.name, reason="refused")

    def generate(self, prompt: object, **options: object) -> object:
        stream = self.engine.generate(prompt, **options)  # type: ignore[arg-type]
        if not self.cut:
            return stream
        stream.close()
        raise BackendUnavailable("connection refused", backend=self.name, reason="refused")


def test_a_turn_whose_backend_fails_before_its_first_token_runs_on_another(
    engines: dict[str, Engine], db_url: str
) -> None:
    flaky = _Cut(engines["a"])
    with (
        Store(db_url) as store,
        Router([flaky, engines["b"]], store=store, health_interval=None) as router,
    ):
        ids = [f"r{i}" for i in range(8)]
        for cid in ids:
            _talk(store, router, cid, "my order number is 4471")
        on_flaky = [c for c in ids if router.placement(c) == "flaky"]
        assert on_flaky, "rendezvous put nothing on the flaky backend"
        flaky.cut = True
        cid = on_flaky[0]
        with ChatSession.open(store, conversation_id=cid, model=router, settings=GREEDY) as chat:
            reply = chat.send("what was my order number?")
        assert reply.stop_reason in ("eog", "length")
        messages = store.messages(cid)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert all(m.status == "complete" for m in messages)
        last = store.turns(cid)[-1]
        assert last.backend == router.names[1]
        assert last.reprefill_reason is not None and "flaky" in last.reprefill_reason
        assert last.reused_tokens == 0  # b never held this conversation: all prefilled
        # The router took the backend out and moved all of its conversations.
        assert {s["backend"]: s["state"] for s in router.stats()}["flaky"] == "down"
        assert all(router.placement(c) == router.names[1] for c in on_flaky)
        # It comes back (health check passes): it takes new conversations again.
        flaky.cut = False
        router.check()
        assert {s["backend"]: s["state"] for s in router.stats()}["flaky"] == "up"


def test_calls_made_on_a_backend_lost_before_their_results_are_answered_on_another(
    engines: dict[str, Engine], db_url: str
) -> None:
    # An agent's turn is open across the loss: the calls were stored with their turn, and
    # the results continue it on the backend the router moves the conversation to.
    from tests.tool_schemas import LOOKUP

    sampling = {"max_tokens": 120, "seed": 4}
    with (
        Store(db_url) as store,
        Router(engines, store=store, health_interval=None) as router,
        ChatSession.open(store, conversation_id="agent", model=router, settings=sampling) as chat,
    ):
        # The tiny model's plain template: the generic call format, held by its grammar.
        reply = chat.send(
            "Where is A-1?", tools=[LOOKUP], tool_choice="required", parallel_tool_calls=False
        )
        assert len(reply.tool_calls) == 1, reply.text
        first = router.placement("agent")
        assert first is not None
        engines[first].close()
        final = chat.submit_tool_results(
            {c.id: "shipped" for c in reply.tool_calls}, tool_choice="none"
        )
        turns = store.turns("agent")
        assert turns[-1].backend not in (None, first)
        assert turns[-1].reprefill_reason is not None
        assert turns[-1].reprefill_reason.startswith("failover: moved from")
        roles = [m.role for m in store.messages("agent")]
        assert roles[:2] == ["user", "assistant"] and roles.count("tool") == len(reply.tool_calls)
        assert final.message_id is not None and chat.waiting_tool_calls() == []
