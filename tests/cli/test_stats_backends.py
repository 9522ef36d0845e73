"""``chatctx stats --backends``: per-backend figures from placements and turns.

Every expected number is worked out by hand from the rows written here.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from chatctx.cli import cli
from chatctx.store import Store

TURN = {
    "n_ctx": 1024,
    "generated_tokens": 5,
    "prefill_ms": 12.5,
    "total_ms": 30.0,
    "stop_reason": "eog",
}
FAILOVER = "failover: moved from http://a:8080, down (refused: connection refused)"


@pytest.fixture
def db(db_url: str) -> str:
    a, b = "http://a:8080", "http://b:8080"
    drained = "drained: moved from http://c:8080"
    # conversation, backend, prompt, reused, evaluated, re-prefill reason, TTFT, swapped in
    rows = [
        ("c1", a, 100, 0, 100, None, 50.0, None),
        ("c1", a, 120, 90, 30, None, 20.0, "disk"),
        ("c2", a, 80, 0, 80, None, 40.0, None),
        ("c2", b, 100, 0, 100, FAILOVER, 60.0, None),
        ("c3", b, 60, 0, 60, drained, 30.0, None),
        ("c3", None, 90, 60, 30, None, None, "ram"),  # run without a router
    ]
    with Store(db_url) as store:
        for cid in ("c1", "c2", "c3"):
            store.create_conversation(cid)
        store.claim_placement("c1", a)
        store.claim_placement("c2", a)
        store.claim_placement("c3", b)
        store.move_placement("c2", from_backend=a, to_backend=b, reason=FAILOVER)
        for cid, backend, prompt, reused, evaluated, reason, ttft, swap_in in rows:
            store.add_turn(
                cid,
                backend=backend,
                prompt_tokens=prompt,
                reused_tokens=reused,
                evaluated_tokens=evaluated,
                reprefill_reason=reason,
                ttft_ms=ttft,
                swap_in=swap_in,
                **TURN,
            )
    return db_url


def test_backends_json(db: str) -> None:
    result = CliRunner().invoke(cli, ["stats", "--backends", "--json", "--db", db])
    assert result.exit_code == 0, result.output
    rows = {r["backend"]: r for r in json.loads(result.output)["backends"]}
    assert set(rows) == {"http://a:8080", "http://b:8080"}
    a, b = rows["http://a:8080"], rows["http://b:8080"]
    assert (a["conversations"], b["conversations"]) == (1, 2)  # c2 moved to b
    assert (a["turns"], b["turns"]) == (3, 2)  # the turn without a backend is left out
    assert a["cache_hit_ratio"] == pytest.approx(90 / 300)
    assert b["cache_hit_ratio"] == 0.0
    assert (a["failovers"], b["failovers"]) == (0, 1)
    assert (a["swap_ins"], b["swap_ins"]) == (1, 0)  # c3's swap-in ran without a router
    assert b["reprefills"] == 2 and b["reprefill_reasons"] == {"drained": 1, "failover": 1}
    assert a["ttft_p50_ms"] == 40.0 and a["ttft_p95_ms"] == 50.0


def test_backends_for_one_conversation(db: str) -> None:
    result = CliRunner().invoke(cli, ["stats", "c2", "--backends", "--json", "--db", db])
    assert result.exit_code == 0, result.output
    rows = {r["backend"]: r for r in json.loads(result.output)["backends"]}
    assert rows["http://b:8080"]["conversations"] == 1
    assert rows["http://a:8080"]["conversations"] == 0
    assert (rows["http://a:8080"]["turns"], rows["http://b:8080"]["turns"]) == (1, 1)


def test_backends_text_and_prometheus(db: str) -> None:
    text = CliRunner().invoke(cli, ["stats", "--backends", "--db", db])
    assert text.exit_code == 0, text.output
    assert "http://a:8080" in text.output and "re-prefilled: failover · 1 turns" in text.output
    prom = CliRunner().invoke(cli, ["stats", "--backends", "--prometheus", "--db", db])
    assert prom.exit_code == 0, prom.output
    lines = prom.output.splitlines()
    assert 'chatctx_backend_conversations{backend="http://b:8080"} 2' in lines
    assert 'chatctx_backend_failovers_total{backend="http://b:8080"} 1' in lines
    assert 'chatctx_backend_swap_ins_total{backend="http://a:8080"} 1' in lines
    assert 'chatctx_backend_cache_hit_ratio{backend="http://a:8080"} 0.3' in lines
    assert 'chatctx_backend_reprefills_total{backend="http://b:8080",reason="drained"} 1' in lines
