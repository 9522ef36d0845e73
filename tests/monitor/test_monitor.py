import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from click.testing import CliRunner

from chatctx import ChatSession, Engine, Store, Turn
from chatctx.cli import cli
from chatctx.monitor import percentile, prometheus_text, totals
from tests.llama_counters import counted, prime_counters


def decoded_replies(turn: Turn) -> int:
    """Generated tokens fed back to llama.cpp: all but a last one sampled at the limit."""
    cut = turn.stop_reason in ("length", "context_full")
    return turn.generated_tokens - 1 if cut else turn.generated_tokens


@dataclass
class Recording:
    turns: list[Turn] = field(default_factory=list)  # as the on_turn hook saw them
    evaluated: list[int] = field(default_factory=list)  # prefill tokens llama.cpp counted
    cells: list[int] = field(default_factory=list)  # llama.cpp's positions in seq 0
    evicted: list[bool] = field(default_factory=list)  # the replies' own plans


@pytest.fixture
def recording(db_url: str, tiny_llama3_path: Path) -> Recording:
    rec = Recording()
    with Engine.load(tiny_llama3_path, n_ctx=512, n_seq_max=2, n_threads=1) as engine:
        prime_counters(engine)
        seen = [counted(engine)]

        def hook(turn: Turn) -> None:
            now = counted(engine)
            rec.turns.append(turn)
            rec.evaluated.append(now - seen[-1] - decoded_replies(turn))
            rec.cells.append(engine.context.seq_pos_max(0) + 1)
            seen.append(now)

        with ChatSession.open(
            db_url,
            conversation_id="m",
            model=engine,
            system_prompt="Support.",
            settings={"max_tokens": 6, "temperature": 0.0},
            context={"budget": 300},
            on_turn=hook,
        ) as chat:
            for i in range(16):
                reply = chat.send(f"Order NH-{7000 + i}: the router AX{i}00 reboots, case {i}.")
                rec.evicted.append(reply.plan.evicted)
    return rec


@pytest.fixture
def recorded(recording: Recording) -> list[Turn]:
    return recording.turns


def test_every_turn_is_recorded_and_hooked(recording: Recording, db_url: str) -> None:
    with Store(db_url) as store:
        stored = store.turns("m")
    assert [t.id for t in recording.turns] == [t.id for t in stored]
    # The figures stored are llama.cpp's: the tokens it evaluated (its own counters) and
    # the cells it holds for the chat (the prompt, then each generated token but the last).
    assert [t.evaluated_tokens for t in stored] == recording.evaluated
    assert [t.prompt_tokens + decoded_replies(t) for t in stored] == recording.cells
    assert [t.cells_used for t in stored] == [{"0": c, "1": 0} for c in recording.cells]
    assert [bool(t.plan and t.plan["evicted"]) for t in stored] == recording.evicted
    for t in stored:
        assert t.n_ctx == 512 and t.eviction_policy == "shift"
        assert t.ttft_ms is not None and t.prefill_ms > 0
    # The first prompt is all new.
    assert stored[0].new_tokens == stored[0].prompt_tokens == stored[0].evaluated_tokens
    assert any(t.shifted_tokens for t in stored) and any(t.evicted_tokens for t in stored)
    evictions = [t for t in stored if t.plan and t.plan["evicted"]]
    assert evictions and all(t.summary_ms is not None for t in evictions)


def test_totals(recording: Recording) -> None:
    t = totals(recording.turns)
    assert t.turns == 16
    # Recounted from what llama.cpp evaluated and what the replies' plans said.
    assert t.evaluated_tokens == sum(recording.evaluated)
    assert t.evictions == sum(recording.evicted)
    assert t.shift_count == sum(bool(turn.shifted_tokens) for turn in recording.turns)
    assert t.cache_hit_ratio == pytest.approx(t.reused_tokens / t.prompt_tokens)
    assert t.prefill_amplification == pytest.approx(t.evaluated_tokens / t.new_tokens)
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
