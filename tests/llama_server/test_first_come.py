"""First come, first served: 12 conversations on 2 slots start their turns in arrival order.

On the in-process engine and on a 2-slot llama-server alike. The oracle is the arrival log:
each customer is in the slot pool's line before the next one asks, so the order they asked in
is known; the order turns start is the order the pool granted their slots: each lease's
ticket, numbered under the pool's lock as the slot is taken. (``lease`` returns after the
slot's previous owner is swapped out, outside that lock, so two grants a moment apart can
return in either order: timing the returns made this test flaky.) Each turn record's
``queue_ms`` is checked against the test's own clock: no customer can start before the test
gives the slots back, and each asked before it was seen in line. There is no cache-warm
exception here: every conversation is new.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatctx import ChatSession, Engine, Store
from chatctx.backends.base import Lease
from chatctx.backends.llama_server import LlamaServerBackend
from chatctx.serve._service import warm_up
from tests.llama_server.conftest import start_server

CUSTOMERS = 12
SETTINGS = {"temperature": 0.0, "max_tokens": 6}


@pytest.fixture(params=["engine", "llama-server"])
def two_slots(
    request: pytest.FixtureRequest, tiny_llama3_path: Path, smollm2_path: Path, tmp_path: Path
) -> Iterator[Any]:
    if request.param == "engine":
        with Engine.load(tiny_llama3_path, n_ctx=512, slots=2, n_threads=1) as engine:
            yield engine
        return
    binary = request.getfixturevalue("llama_server_binary")
    server = start_server(binary, smollm2_path, tmp_path / "server", slots=2, n_ctx=512)
    try:
        with LlamaServerBackend(
            server.url,
            model=smollm2_path,
            slot_save_path=server.slot_save_path,
            summary_slot=False,
        ) as backend:
            yield backend
    finally:
        server.stop()


def _wait_for_line(backend: Any, length: int) -> None:
    deadline = time.monotonic() + 10
    while len(backend.pool._line) < length:
        assert time.monotonic() < deadline, "a customer never got in line"
        time.sleep(0.005)


def test_turns_start_in_the_order_customers_asked(
    two_slots: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = two_slots
    started: list[tuple[int, str]] = []
    record = threading.Lock()
    lease = backend.lease

    def recording(conversation: str, *, timeout: float | None = None) -> Lease:
        got = lease(conversation, timeout=timeout)
        with record:
            started.append((got.ticket, conversation))
        return got

    # What a server builds before it reports ready (``warm_up``): a turn builds its context
    # while in line, and a first build that loads these would keep that customer away long
    # enough for a freed slot to go to the next one (one away holds no one up).
    warm_up(backend)
    holders = [backend.lease(f"holder-{n}") for n in range(2)]  # the slots, taken
    monkeypatch.setattr(backend, "lease", recording)
    queue_ms: dict[str, float | None] = {}
    errors: list[BaseException] = []
    seen_in_line: dict[str, float] = {}

    with Store("sqlite://") as store:

        def customer(cid: str) -> None:
            try:
                with ChatSession.open(store, conversation_id=cid, model=backend) as chat:
                    reply = chat.send(
                        f"Hello, this is {cid}. Where is my order?", settings=SETTINGS
                    )
                    assert reply.turn is not None
                    queue_ms[cid] = reply.turn.queue_ms
            except BaseException as exc:
                errors.append(exc)

        arrived = [f"customer-{n:02d}" for n in range(CUSTOMERS)]
        threads = []
        for n, cid in enumerate(arrived):
            thread = threading.Thread(target=customer, args=(cid,), daemon=True)
            thread.start()
            threads.append(thread)
            _wait_for_line(backend, n + 1)
            seen_in_line[cid] = time.perf_counter()
            time.sleep(0.1)  # arrivals span several lease polls of the first customers
        time.sleep(0.6)  # longer than a session's lease poll: every waiter polls again
        given_back = time.perf_counter()
        backend.release(holders[0])
        time.sleep(0.05)
        backend.release(holders[1])
        for thread in threads:
            thread.join(120)
        assert not errors, errors
        assert all(not t.is_alive() for t in threads)

    order = [cid for _, cid in sorted(started)]
    assert order == arrived
    for cid in arrived:
        waited = queue_ms[cid]
        assert waited is not None
        # It asked before it was seen in line and started after the slots were given back.
        assert waited >= (given_back - seen_in_line[cid]) * 1000
