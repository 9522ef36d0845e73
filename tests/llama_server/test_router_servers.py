"""The router over real llama-servers: routing, restart, and kill -9 while replies stream.

Oracles: each server's own counters (``/metrics``: prompt tokens it evaluated, tokens it
predicted, requests it took), its ``/slots``, and the store read back after the fact.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from chatctx import BackendUnavailable, ChatSession, DeadlineExceeded
from chatctx.backends.llama_server import LlamaServerBackend, LlamaServerProcess
from chatctx.backends.router import Router
from chatctx.settings import GenerationSettings
from chatctx.store import Store
from tests.llama_server.conftest import start_server

pytestmark = pytest.mark.slow

SHORT = GenerationSettings(max_tokens=3, temperature=0.0)
LONG = GenerationSettings(max_tokens=400, temperature=0.0, repeat_penalty=1.0)


def metrics(url: str) -> dict[str, float]:
    """llama-server's own counters (``--metrics``)."""
    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("llamacpp:") and " " in line:
            name, value = line.split()[:2]
            values[name.removeprefix("llamacpp:")] = float(value)
    return values


@pytest.fixture(scope="module")
def three_servers(
    llama_server_binary: Path, smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[LlamaServerProcess]]:
    folder = tmp_path_factory.mktemp("three")
    servers = [
        start_server(llama_server_binary, smollm2_path, folder / str(i), slots=4, n_ctx=512)
        for i in range(3)
    ]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop()


def _router(servers: list[LlamaServerProcess], model: Path, store: Store) -> Router:
    backends = [LlamaServerBackend(s.url, model=model) for s in servers]
    return Router(backends, store=store, own=True, health_interval=None)


def _each_says(store: Store, router: Router, ids: list[str], text: str) -> None:
    """One short turn of each conversation, in order."""
    for cid in ids:
        with ChatSession.open(store, conversation_id=cid, model=router, settings=SHORT) as chat:
            chat.send(text)


def test_64_conversations_over_3_servers_each_on_one(
    three_servers: list[LlamaServerProcess], smollm2_path: Path, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'bot.db'}"
    ids = [f"cust-{i:02d}" for i in range(64)]
    before = {s.url: metrics(s.url) for s in three_servers}
    with Store(url) as store, _router(three_servers, smollm2_path, store) as router:
        for turn in range(2):
            for cid in ids:
                with ChatSession.open(
                    store, conversation_id=cid, model=router, settings=SHORT
                ) as chat:
                    chat.send(f"hello, this is {cid}, message {turn}")
        placed = {cid: router.placement(cid) for cid in ids}
    counts = Counter(placed.values())
    assert set(counts) == {s.url for s in three_servers}
    assert max(counts.values()) <= math.ceil(1.25 * 64 / 3)  # the load bound
    with Store(url) as store:
        turns = {cid: store.turns(cid) for cid in ids}
    for cid in ids:
        assert {t.backend for t in turns[cid]} == {placed[cid]}, cid
    # Each server's own counters: the prompt tokens it evaluated and the requests it served
    # are exactly those of the turns recorded as its own (a turn sent elsewhere than
    # recorded would show on the wrong server).
    for server in three_servers:
        mine = [t for cid in ids for t in turns[cid] if t.backend == server.url]
        now = metrics(server.url)
        evaluated = now["prompt_tokens_total"] - before[server.url]["prompt_tokens_total"]
        predicted = now["tokens_predicted_total"] - before[server.url]["tokens_predicted_total"]
        assert evaluated == sum(t.evaluated_tokens for t in mine), server.url
        assert predicted >= sum(t.generated_tokens for t in mine), server.url
    # A restarted bot process (new store connection, new router, servers listed in another
    # order) routes every conversation the same way.
    with Store(url) as store, _router(three_servers[::-1], smollm2_path, store) as router:
        assert {cid: router.placement(cid) for cid in ids} == placed
        for cid in ids[:6]:
            with ChatSession.open(store, conversation_id=cid, model=router, settings=SHORT) as chat:
                chat.send("one more question")
            assert store.turns(cid)[-1].backend == placed[cid]


def test_kill_9_of_a_server_while_8_replies_stream(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    # Six slots each: five for customers (the load bound puts at most ceil(1.25 * 8 / 2) = 5
    # conversations on one server, so all eight stream at once) and the summary slot.
    servers = [
        start_server(llama_server_binary, smollm2_path, tmp_path / name, slots=6, n_ctx=1024)
        for name in ("a", "b")
    ]
    url = f"sqlite:///{tmp_path / 'bot.db'}"
    ids = [f"c{i}" for i in range(8)]
    try:
        with Store(url) as store, _router(servers, smollm2_path, store) as router:
            for cid in ids:
                with ChatSession.open(
                    store, conversation_id=cid, model=router, settings=SHORT
                ) as chat:
                    chat.send("my order number is 4471")
            by_server = Counter(router.placement(cid) for cid in ids)
            victim_url = by_server.most_common(1)[0][0]
            victim = next(s for s in servers if s.url == victim_url)
            survivor = next(s for s in servers if s.url != victim_url)
            on_victim = [cid for cid in ids if router.placement(cid) == victim_url]
            assert 0 < len(on_victim) < len(ids)

            started = threading.Barrier(len(ids) + 1, timeout=300)
            outcome: dict[str, str] = {}

            def customer(cid: str) -> None:
                chat = ChatSession.open(store, conversation_id=cid, model=router, settings=LONG)
                try:
                    seen = False
                    try:
                        for _ in chat.stream("Write a long story about my parcel, please."):
                            if not seen:
                                seen = True
                                started.wait()
                        outcome[cid] = "complete"
                    except BackendUnavailable:
                        outcome[cid] = "cut"
                    if not seen:
                        started.wait()
                finally:
                    chat.close()

            threads = [threading.Thread(target=customer, args=(cid,)) for cid in ids]
            for thread in threads:
                thread.start()
            started.wait()  # every reply has streamed its first text
            victim.kill()  # kill -9
            for thread in threads:
                thread.join(timeout=600)
            assert all(not t.is_alive() for t in threads)
            cut = {cid for cid, how in outcome.items() if how == "cut"}
            # The victim's replies were cut (one that ended before the kill is complete);
            # the survivor's all finished.
            assert cut and cut <= set(on_victim), outcome
            assert len(outcome) == len(ids)
            # Every conversation's next turn answers, from the server still up.
            for cid in ids:
                with ChatSession.open(
                    store, conversation_id=cid, model=router, settings=SHORT
                ) as chat:
                    reply = chat.send("what was my order number?")
                assert reply.text and reply.stop_reason in ("eog", "length")
                assert router.placement(cid) == survivor.url
        with Store(url) as store:
            for cid in ids:
                messages = store.messages(cid)
                users = [m for m in messages if m.role == "user"]
                assert len(users) == 3, cid  # no user message lost
                replies = [m for m in messages if m.role == "assistant"]
                assert len(replies) == 3, cid
                turns = store.turns(cid)
                if cid in cut:
                    assert replies[1].status == "partial" and replies[1].content
                else:
                    assert replies[1].status == "complete"
                if cid in on_victim:
                    assert turns[-1].backend == survivor.url
                    assert turns[-1].reprefill_reason is not None
                    assert turns[-1].reprefill_reason.startswith("failover")
                assert [m.status for m in (replies[0], replies[2])] == ["complete"] * 2
            assert store.placement_counts() == {survivor.url: len(ids)}
    finally:
        for server in servers:
            server.stop()


def test_drain_moves_conversations_with_their_cache_through_a_shared_slot_save_path(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    # Two servers sharing one --slot-save-path: draining one saves each conversation's slot
    # there and restores it on the other, whose own counter (timings.cache_n) shows the next
    # turn reusing it instead of prefilling.
    shared = tmp_path / "slots"
    servers = [
        LlamaServerProcess(
            smollm2_path,
            slots=4,
            n_ctx=1024,
            slot_save_path=shared,
            threads=1,
            extra_args=("--cache-ram", "0"),
            binary=llama_server_binary,
            log_path=tmp_path / f"{name}.log",
        ).start()
        for name in ("a", "b")
    ]
    url = f"sqlite:///{tmp_path / 'bot.db'}"
    try:
        backends = [
            LlamaServerBackend(s.url, model=smollm2_path, slot_save_path=shared) for s in servers
        ]
        with (
            Store(url) as store,
            Router(backends, store=store, own=True, health_interval=None) as router,
        ):
            ids = [f"d{i}" for i in range(4)]
            _each_says(store, router, ids, "my order number is 4471 and it has not arrived yet")
            source = Counter(router.placement(c) for c in ids).most_common(1)[0][0]
            assert source is not None
            moving = [c for c in ids if router.placement(c) == source]
            target = next(s.url for s in servers if s.url != source)
            before = metrics(target)["prompt_tokens_total"]
            moved = router.drain(source)
            assert moved == {"moved": len(moving), "with_state": len(moving)}
            for cid in moving:
                first = store.turns(cid)[0]
                with ChatSession.open(
                    store, conversation_id=cid, model=router, settings=SHORT
                ) as chat:
                    chat.send("what was my order number?")
                last = store.turns(cid)[-1]
                assert last.backend == target
                # The restored slot held the first turn's prompt: the server reused it.
                assert last.reused_tokens >= first.prompt_tokens - 1
                assert last.reprefill_reason is None
            evaluated = metrics(target)["prompt_tokens_total"] - before
            assert evaluated == sum(store.turns(c)[-1].evaluated_tokens for c in moving)
    finally:
        for server in servers:
            server.stop()


def test_a_busy_server_that_times_out_a_turn_keeps_its_conversations(
    llama_server_binary: Path, smollm2_path: Path, tmp_path: Path
) -> None:
    # Two servers of one conversation slot each (and a summary slot).
    servers = [
        start_server(llama_server_binary, smollm2_path, tmp_path / str(i), slots=2, n_ctx=1024)
        for i in range(2)
    ]
    try:
        backends = [LlamaServerBackend(s.url, model=smollm2_path, timeout=1.0) for s in servers]
        with (
            Store(f"sqlite:///{tmp_path / 'bot.db'}") as store,
            Router(backends, store=store, own=True, health_interval=None) as router,
        ):
            ids = [f"b{i}" for i in range(4)]
            _each_says(store, router, ids, "hello, my parcel is late")
            busy = router.placement(ids[0])
            assert busy is not None
            placed = {cid: router.placement(cid) for cid in ids}
            # Another client keeps the busy server's only conversation slot for seconds.
            hog = threading.Thread(
                target=httpx.post,
                args=(f"{busy}/completion",),
                kwargs={
                    # All 200 tokens: a reply that ended early at EOS freed the slot before
                    # the turn's 1 s ran out (seen once in CI).
                    "json": {
                        "prompt": "Count: 1, 2, 3,",
                        "n_predict": 200,
                        "id_slot": 0,
                        "ignore_eos": True,
                    },
                    "timeout": 120,
                },
            )
            hog.start()
            try:
                deadline = time.monotonic() + 30
                while not httpx.get(f"{busy}/slots", timeout=10).json()[0]["is_processing"]:
                    assert time.monotonic() < deadline, "the other client never got the slot"
                    time.sleep(0.05)
                with (
                    ChatSession.open(
                        store, conversation_id=ids[0], model=router, settings=SHORT
                    ) as chat,
                    pytest.raises(DeadlineExceeded),
                ):
                    chat.send("any news?")  # queued behind the other client: 1 s passes
                # Busy, not down: nothing moved, and the server still takes conversations.
                assert {cid: router.placement(cid) for cid in ids} == placed
                assert all(row["down_reason"] is None for row in router.stats())
            finally:
                hog.join()
            with ChatSession.open(
                store, conversation_id=ids[0], model=router, settings=SHORT
            ) as chat:
                chat.send("any news now?")
            assert store.turns(ids[0])[-1].backend == busy
    finally:
        for server in servers:
            server.stop()
