import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx import ChatSession, Engine, Store, Turn
from chatctx.cli import cli
from chatctx.monitor import percentile, prometheus_text, totals


@pytest.fixture
def recorded(db_url: str, tiny_llama3_path: Path) -> list[Turn]:
    seen: list[Turn] = []
    with (
        Engine.load(tiny_llama3_path, n_ctx=512, n_seq_max=2) as engine,
        ChatSession.open(
            db_url,
            conversation_id="m",
            model=engine,
            system_prompt="Support.",
            settings={"max_tokens": 6, "temperature": 0.0},
            context={"budget": 300},
            on_turn=seen.append,
        ) as chat,
    ):
        for i in range(16):
            chat.send(f"Order NH-{7000 + i}: the router AX{i}00 reboots, case {i}.")
    return seen


def test_every_turn_is_recorded_and_hooked(recorded: list[Turn], db_url: str) -> None:
    with Store(db_url) as store:
        stored = store.turns("m")
    assert [t.id for t in recorded] == [t.id for t in stored]
    for t in stored:
        assert t.prompt_tokens == t.reused_tokens + t.evaluated_tokens
        assert t.n_ctx == 512 and t.eviction_policy == "shift"
        assert t.cells_used is not None and set(t.cells_used) == {"0", "1"}
        assert t.new_tokens and t.new_tokens > 0
        assert t.ttft_ms is not None and t.prefill_ms > 0
    assert any(t.shifted_tokens for t in stored) and any(t.evicted_tokens for t in stored)
    evictions = [t for t in stored if t.plan and t.plan["evicted"]]
    assert evictions and all(t.summary_ms is not None for t in evictions)


def test_totals(recorded: list[Turn]) -> None:
    t = totals(recorded)
    assert t.turns == 16
    assert t.cache_hit_ratio == pytest.approx(t.reused_tokens / t.prompt_tokens)
    assert t.prefill_amplification == pytest.approx(t.evaluated_tokens / t.new_tokens)
    assert t.evictions >= 1 and t.shift_count >= 1
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 50) is None


def test_prometheus_exposition(recorded: list[Turn]) -> None:
    text = prometheus_text({'m"x': recorded}, live_cells={0: 120, 1: 0}, n_ctx=512)
    assert "# TYPE chatctx_turns_total counter" in text
    assert 'chatctx_turns_total{conversation="m\\"x"} 16' in text
    assert 'chatctx_kv_live_cells_used{seq="0"} 120' in text
    assert "chatctx_kv_cells_total 512" in text
    assert "chatctx_kv_usage_ratio 0.234375" in text
    assert 'chatctx_ttft_seconds{conversation="m\\"x",quantile="0.5"}' in text
    for line in text.splitlines():
        assert line.startswith("#") or len(line.rsplit(" ", 1)) == 2


def test_stats_cli(recorded: list[Turn], db_url: str) -> None:
    runner = CliRunner()
    result = runner.invoke(cli, ["stats", "m", "--db", db_url, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert len(report["turns"]) == 16
    assert report["totals"]["prefill_amplification"] == pytest.approx(
        totals(recorded).prefill_amplification
    )
    table = runner.invoke(cli, ["stats", "m", "--db", db_url])
    assert "prefill amplification" in table.output and "cache hit ratio" in table.output
    prom = runner.invoke(cli, ["stats", "--prometheus", "--db", db_url])
    assert 'chatctx_turns_total{conversation="m"} 16' in prom.output
    missing = runner.invoke(cli, ["stats", "nope", "--db", db_url])
    assert missing.exit_code == 1 and "no conversation" in missing.output
