"""Turn claims: one owner at a time per conversation, across processes (SQLite and PostgreSQL).

Oracles: which of several racing processes won (counted from their own answers, each in a
process of its own), the row read back, and expiry measured against the clock (on
PostgreSQL against the database's, with this process's clock moved an hour).
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

from chatctx.store import Store
from chatctx.store import _claims as claims_module
from chatctx.store._turn_claim import TurnClaim, new_owner, try_claim


def test_one_owner_at_a_time_until_it_lets_go_or_expires(db_url: str) -> None:
    with Store(db_url) as store:
        assert store.turn_claim("c") is None
        assert store.claim_turn("c", "a", 30)  # before the conversation exists: no key needed
        assert not store.claim_turn("c", "b", 30)
        assert store.claim_turn("c", "a", 30)  # a renewal
        owner, until = store.turn_claim("c") or ("", None)
        assert owner == "a" and until is not None
        store.release_turn("c", "b")  # not b's to let go
        assert store.turn_claim("c") is not None and not store.claim_turn("c", "b", 30)
        store.release_turn("c", "a")
        assert store.turn_claim("c") is None
        assert store.claim_turn("c", "b", 0.3)
        assert not store.claim_turn("c", "a", 30)
        time.sleep(0.5)  # b's claim ran out (its process died, say): a takes it over
        assert store.claim_turn("c", "a", 30)
        store.release_turn("c", "b")  # b, back too late, cannot free what a holds now
        assert (store.turn_claim("c") or ("",))[0] == "a"
        assert store.claim_turn("other", "b", 30)  # conversations are claimed apart


def test_a_renewal_extends_only_a_claim_its_owner_still_holds(db_url: str) -> None:
    with Store(db_url) as store:
        assert not store.renew_turn("c", "a", 30)  # nothing to renew: nothing is claimed
        assert store.turn_claim("c") is None
        assert store.claim_turn("c", "a", 0.5)
        before = (store.turn_claim("c") or ("", None))[1]
        assert store.renew_turn("c", "a", 30) and not store.renew_turn("c", "b", 30)
        owner, after = store.turn_claim("c") or ("", None)
        assert owner == "a" and before is not None and after is not None
        assert after - before > timedelta(seconds=20)
        store.release_turn("c", "a")
        assert not store.renew_turn("c", "a", 30)  # landed after the release: still free
        assert store.turn_claim("c") is None


def test_a_renewal_on_its_way_when_the_turn_ends_leaves_the_conversation_free(
    db_url: str,
) -> None:
    with Store(db_url) as store:
        renewing = threading.Event()

        def slow(real: Any) -> Any:
            def call(*args: Any) -> Any:
                if threading.current_thread().name == "chatctx-turn-claim":
                    renewing.set()
                    time.sleep(0.5)  # a busy database: the statement lands after the release
                return real(*args)

            return call

        # Whichever statement the renewal uses is the slow one.
        store.claim_turn = slow(store.claim_turn)  # type: ignore[method-assign]
        store.renew_turn = slow(store.renew_turn)  # type: ignore[method-assign]
        claim = TurnClaim(store, "conv", ttl_s=1.5)  # renewed every 0.5 s
        claim.take(lambda: None)
        assert renewing.wait(10)
        claim.release()
        time.sleep(0.8)
        assert store.turn_claim("conv") is None
        assert try_claim(store, "conv", new_owner(), 30)  # the next turn gets in at once


def _race(url: str, owner: str, start: float, won: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    with Store(url) as store:
        time.sleep(max(0.0, start - time.time()))
        won.put((owner, store.claim_turn("race", owner, 30)))


def test_processes_racing_for_one_conversation_one_wins(db_url: str) -> None:
    Store(db_url).close()  # migrated once, here
    ctx = multiprocessing.get_context("spawn")
    won: multiprocessing.Queue = ctx.Queue()  # type: ignore[type-arg]
    start = time.time() + 3.0
    racers = [ctx.Process(target=_race, args=(db_url, f"p{i}", start, won)) for i in range(6)]
    for p in racers:
        p.start()
    for p in racers:
        p.join(60)
    results = dict(won.get(timeout=5) for _ in racers)
    winners = [owner for owner, ok in results.items() if ok]
    assert len(results) == 6 and len(winners) == 1
    with Store(db_url) as store:
        assert (store.turn_claim("race") or ("",))[0] == winners[0]


@pytest.mark.parametrize("skew_s", [3600.0, -3600.0])
def test_on_postgresql_a_claim_runs_out_by_the_database_clock(
    pg_url: str, monkeypatch: pytest.MonkeyPatch, skew_s: float
) -> None:
    """Two bot machines, one an hour off: neither steals the other's live claim, and an
    expired one is still taken over. Oracle: the claims' answers against real elapsed time,
    with this process's clock moved by ``skew_s`` for one owner only."""
    real = claims_module.utcnow
    with Store(pg_url) as store:
        monkeypatch.setattr(claims_module, "utcnow", lambda: real() + timedelta(seconds=skew_s))
        assert store.claim_turn("c", "skewed", 30)
        monkeypatch.setattr(claims_module, "utcnow", real)
        assert not store.claim_turn("c", "true", 30)  # 30 s left, whatever the writer's clock
        store.release_turn("c", "skewed")
        assert store.claim_turn("c", "true", 0.3)
        monkeypatch.setattr(claims_module, "utcnow", lambda: real() + timedelta(seconds=skew_s))
        assert not store.claim_turn("c", "skewed", 30)  # 0.3 s are not over yet
        time.sleep(0.5)
        assert store.claim_turn("c", "skewed", 30)  # now they are
