"""Bot workers in several processes on one conversation: its turns run one at a time.

Each "process" here is its own ``Store`` and its own ``Engine`` on one database, which is all
two worker processes share. The oracle is the database: the order of the stored messages,
and what the second turn's prompt held.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chatctx import ChatSession, ClosedError, ConfigError, Engine
from chatctx.store import Store, _turn_claim
from tests.conftest import DATABASES, any_db_url

GREEDY = {"max_tokens": 24, "temperature": 0.0, "repeat_penalty": 1.0}


@pytest.fixture(params=DATABASES)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return any_db_url(request, tmp_path)


@pytest.fixture(scope="module")
def second_engine(tiny_llama3_path: Path) -> Iterator[Engine]:
    """The other worker's engine: its own slots, as in another process."""
    with Engine.load(tiny_llama3_path, n_ctx=2048, n_seq_max=2) as engine:
        yield engine


def stored(url: str, conversation: str) -> list[tuple[str, str]]:
    with Store(url) as store:
        return [(m.role, m.content) for m in store.messages(conversation)]


def in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_a_second_workers_turn_waits_for_the_first_and_sees_its_reply(
    url: str,
    llama3_engine: Engine,
    second_engine: Engine,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A short claim life: the first turn outlasts it many times, so only renewal keeps it.
    monkeypatch.setattr(_turn_claim, "CLAIM_TTL_S", 1.5)
    first_store, second_store = Store(url), Store(url)
    first = ChatSession.open(
        first_store, conversation_id="cust", model=llama3_engine, settings=GREEDY
    )
    second = ChatSession.open(
        second_store, conversation_id="cust", model=second_engine, settings=GREEDY
    )
    try:
        stream = first.stream("where is my order 1234?")
        chunks = [next(stream)]  # its user message is stored and its reply under way
        thread, out = in_thread(lambda: second.send("and when will it arrive?"))
        time.sleep(4.0)  # over two claim lives
        assert stored(url, "cust") == [("user", "where is my order 1234?")]
        chunks += list(stream)
        thread.join(60)
        assert not thread.is_alive() and not isinstance(out[0], BaseException), out
        history = stored(url, "cust")
        first_reply = "".join(chunks)
        assert history == [
            ("user", "where is my order 1234?"),
            ("assistant", first_reply),
            ("user", "and when will it arrive?"),
            ("assistant", out[0].text),
        ]
        assert second.last_build is not None
        sent = second.last_build.messages
        assert {"role": "assistant", "content": first_reply} in sent
        with Store(url) as store:
            assert store.turn_claim("cust") is None  # both let go
    finally:
        first.close()
        second.close()
        first_store.close()
        second_store.close()


def other_process_here() -> int:
    """The id of a process that ran here and has ended (and was reaped)."""
    child = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(child.stdout)


def owner(pid: int, space: str | None = None) -> str:
    return f"{socket.gethostname()}:{pid}:{space or _turn_claim._PID_SPACE}:0123456789ab"


def test_a_claim_whose_process_is_gone_is_taken_over_at_once(
    url: str, llama3_engine: Engine
) -> None:
    assert _turn_claim._PID_SPACE != "-"  # this machine can tell a gone process
    dead = owner(other_process_here())
    db_url = url
    with Store(db_url) as store:
        assert store.claim_turn("cust", dead, 600.0)  # a worker killed mid-turn
        with ChatSession.open(
            store, conversation_id="cust", model=llama3_engine, settings=GREEDY
        ) as chat:
            thread, out = in_thread(lambda: chat.send("hello again"))
            thread.join(30)  # the claim would hold for ten minutes
            assert not thread.is_alive() and not isinstance(out[0], BaseException), out
        assert [role for role, _ in stored(db_url, "cust")] == ["user", "assistant"]
        assert store.turn_claim("cust") is None


@pytest.mark.parametrize("holder", ["live process here", "other machine", "other pid space"])
def test_a_live_or_unknown_claim_is_waited_out(
    db_url: str, llama3_engine: Engine, holder: str
) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        if holder == "live process here":
            held_by = owner(sleeper.pid)
        elif holder == "other machine":
            held_by = f"elsewhere-{socket.gethostname()}:{other_process_here()}:x:nonce"
        else:
            held_by = owner(other_process_here(), space="0" * 12)
        with Store(db_url) as store:
            with ChatSession.open(
                store, conversation_id="cust", model=llama3_engine, settings=GREEDY
            ) as chat:
                assert store.claim_turn("cust", held_by, 5.0)
                thread, out = in_thread(lambda: chat.send("are you there?"))
                time.sleep(1.0)
                assert stored(db_url, "cust") == []  # still waiting for the claim
                thread.join(30)  # it runs out after 5 s
                assert not thread.is_alive() and not isinstance(out[0], BaseException), out
            assert [role for role, _ in stored(db_url, "cust")] == ["user", "assistant"]
    finally:
        sleeper.kill()
        sleeper.wait()


def test_closing_a_session_while_its_turn_waits_for_the_claim_stores_nothing(
    db_url: str, llama3_engine: Engine
) -> None:
    with Store(db_url) as store:
        assert store.claim_turn("cust", "another worker", 600.0)
        chat = ChatSession.open(store, conversation_id="cust", model=llama3_engine, settings=GREEDY)
        thread, out = in_thread(lambda: chat.send("hello?"))
        time.sleep(0.5)
        chat.close()
        thread.join(10)
        assert not thread.is_alive() and isinstance(out[0], ClosedError), out
        assert stored(db_url, "cust") == []
        claim = store.turn_claim("cust")
        assert claim is not None and claim[0] == "another worker"  # left as it was


def test_without_claims_a_session_does_not_wait(db_url: str, llama3_engine: Engine) -> None:
    """``claim_turns=False`` (serve claims its turns itself; a replay is the only writer)."""
    with Store(db_url) as store:
        assert store.claim_turn("cust", "another worker", 600.0)
        with ChatSession.open(
            store,
            conversation_id="cust",
            model=llama3_engine,
            settings=GREEDY,
            claim_turns=False,
        ) as chat:
            chat.send("hello")
        assert [role for role, _ in stored(db_url, "cust")] == ["user", "assistant"]


def test_a_second_turn_in_the_thread_whose_turn_holds_the_claim_is_refused(
    db_url: str, llama3_engine: Engine
) -> None:
    """It would wait for itself forever; the first turn is unharmed."""
    with Store(db_url) as store, Store(db_url) as other:
        first = ChatSession.open(
            store, conversation_id="cust", model=llama3_engine, settings=GREEDY
        )
        second = ChatSession.open(other, conversation_id="cust", model=llama3_engine)
        with first, second:
            stream = first.stream("first")
            chunks = [next(stream)]
            with pytest.raises(ConfigError, match="turn in flight in this thread"):
                second.send("second")
            chunks += list(stream)
        assert stored(db_url, "cust") == [("user", "first"), ("assistant", "".join(chunks))]
